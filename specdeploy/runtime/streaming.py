"""Text as tokens are committed: incremental detokenization that never shows a partial stop string."""

from __future__ import annotations

from collections.abc import Sequence

from .stops import StopStrings


class TextStream:
    """The text of one request's tokens, chunk by chunk. Each ``push`` returns the new text that is
    settled: tokens are detokenized incrementally (``tokenizers``' ``DecodeStream``: an incomplete UTF-8
    sequence waits for its next token), and a tail that may still become a stop string is held back
    until it is known not to. ``finish`` returns what is left of the final text; the chunks add up to it.
    """

    def __init__(self, tokenizer, stops: Sequence[str] = ()):
        from tokenizers.decoders import DecodeStream

        self.tokenizer, self.stops = tokenizer, StopStrings(stops, None)
        self.pieces = DecodeStream(skip_special_tokens=True)
        self.text = self.shown = ""

    def push(self, token_ids: Sequence[int]) -> str:
        for token in token_ids:
            piece = self.pieces.step(self.tokenizer, token)
            if piece:
                self.text += piece
        visible = self.stops.settled(self.text)
        delta, self.shown = visible[len(self.shown):], visible
        return delta

    def finish(self, final_text: str) -> str:
        delta, self.shown = final_text[len(self.shown):], final_text
        return delta
