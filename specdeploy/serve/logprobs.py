"""Log-probabilities of the emitted tokens under the target's distribution, and their OpenAI shapes.

They come from the logits the target computed when it verified the tokens (``Generation.on_verified``):
no extra engine call. They are the model's own distribution (a log-softmax of the raw logits, before
temperature, top-k/p or a repetition penalty), as vLLM reports them by default.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class TokenLogprob(NamedTuple):
    token: int
    logprob: float
    top: list[tuple[int, float]]  # the most likely tokens at that position, most likely first, with their logprobs


class Logprobs:
    """The logprobs a server's requests asked for: it ``watch``es a request (``top`` alternatives a token), ``keep``s
    the logprobs of each watched request's committed tokens from a verification's logits (``Generation.on_verified``),
    and hands them over with the tokens (``take``); ``forget`` once the request ends. Nobody watching: nothing is done."""

    def __init__(self):
        self._top: dict[str, int] = {}  # request id -> alternatives listed with each token
        self._kept: dict[str, list[TokenLogprob]] = {}  # request id -> this cycle's, until its tokens are sent

    def watch(self, request_id: str, top: int | None) -> None:
        if top is not None:
            self._top[request_id] = top

    def forget(self, request_id: str) -> None:
        self._top.pop(request_id, None)
        self._kept.pop(request_id, None)

    def take(self, request_id: str) -> list[TokenLogprob] | None:
        return self._kept.pop(request_id, None)

    def keep(self, generation, logits: np.ndarray, committed: list[tuple[int, list[int]]]) -> None:
        """The logprobs of each committed token of the watched rows of ``generation``, from its verification's logits
        [batch, K + 1, vocab]; (request number, tokens) per row."""
        if not self._top:
            return
        requests = generation.requests
        for b, (number, new) in enumerate(committed):
            top = self._top.get(requests[number].result.request_id) if new else None
            if top is not None:
                self._kept[requests[number].result.request_id] = token_logprobs(logits[b, : len(new)], new, top)


def token_logprobs(logits: np.ndarray, tokens: list[int], top: int) -> list[TokenLogprob]:
    """``tokens[j]``'s logprob under ``logits[j]`` [len(tokens), vocab], with the ``top`` most likely tokens there."""
    shifted = logits - logits.max(axis=-1, keepdims=True)
    logprobs = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))  # [tokens, vocab]
    out = []
    for row, token in zip(logprobs, tokens):
        best: list[tuple[int, float]] = []
        if top:
            ids = np.argpartition(-row, top - 1)[:top]
            best = [(int(i), float(row[i])) for i in ids[np.argsort(-row[ids], kind="stable")]]
        out.append(TokenLogprob(int(token), float(row[token]), best))
    return out


class Formatter:
    """Token logprobs in the chat shape (``{"content": [...]}``) or the completions shape (``tokens``,
    ``token_logprobs``, ``top_logprobs``, ``text_offset``); token strings from the tokenizer, one token each."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def text(self, token: int) -> str:
        return self.tokenizer.decode([token], skip_special_tokens=False)

    def chat(self, entries: list[TokenLogprob]) -> dict:
        def item(token: int, logprob: float) -> dict:
            text = self.text(token)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

        return {"content": [{**item(e.token, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]} for e in entries],
                "refusal": None}

    def completion(self, entries: list[TokenLogprob], offset: int = 0) -> dict:
        """``offset``: characters of the completion before these tokens (``text_offset`` counts from the start)."""
        tokens = [self.text(e.token) for e in entries]
        offsets = np.cumsum([offset] + [len(t) for t in tokens[:-1]]).tolist() if tokens else []
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [{self.text(t): lp for t, lp in e.top} for e in entries], "text_offset": offsets}
