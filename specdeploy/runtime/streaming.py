"""Text as tokens are committed: incremental detokenization that never shows a partial stop string."""

from __future__ import annotations

from collections.abc import Sequence

from .stops import StopScanner


class TextStream:
    """The text of one request's tokens, chunk by chunk. Each ``push`` returns the new text that is
    settled: tokens are detokenized incrementally (``tokenizers``' ``DecodeStream``: an incomplete UTF-8
    sequence waits for its next token), and a tail that may still become a stop string is held back
    until it is known not to. ``finish`` returns what is left of the final text; the chunks add up to it.

    A push costs time in proportion to its new text: only the text not shown yet is kept, and the stop strings
    are followed by a ``StopScanner``.
    """

    def __init__(self, tokenizer, stops: Sequence[str] = ()):
        from tokenizers.decoders import DecodeStream

        self.tokenizer, self.scanner = tokenizer, StopScanner(stops)
        self.pieces = DecodeStream(skip_special_tokens=True)
        self.pending = ""  # decoded, not shown yet
        self.shown = 0  # characters shown

    def push(self, token_ids: Sequence[int]) -> str:
        for token in token_ids:
            piece = self.pieces.step(self.tokenizer, token)
            if piece:
                self.pending += piece
                self.scanner.feed(piece)
        settled = self.scanner.settled - self.shown
        delta, self.pending = self.pending[:settled], self.pending[settled:]
        self.shown += len(delta)
        return delta

    def finish(self, final_text: str) -> str:
        delta = final_text[self.shown:]
        self.shown = len(final_text)
        return delta
