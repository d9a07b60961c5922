"""Drafters propose tokens for the target to verify: a draft model, prompt lookup, or none."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from ..engines.base import Engine
from .cache import KVCache
from .config import GenerationConfig
from .forward import forward_one, forward_rows
from .sampling import penalize, probabilities, sample


@dataclass
class Proposal:
    drafts: np.ndarray  # [batch, k] int64
    q: np.ndarray | None  # [batch, k, vocab] proposal distributions; None: deterministic (one-hot)
    seconds: float  # drafting time, engine calls and their bookkeeping
    steps: int  # draft engine calls
    catchup: int = 1  # tokens the first call fed (more than 2 after cycles that did not draft)


class NoDrafter:
    """Plain target decoding: the baseline."""

    name = "none"

    def start(self, batch: int, capacity: int) -> None:
        """Nothing to allocate."""

    def propose(self, tokens, lengths, k, config, rngs, threshold=None) -> Proposal:
        return Proposal(np.zeros((len(lengths), 0), np.int64), None, 0.0, 0)

    def commit(self, old_lengths: np.ndarray, accepted: np.ndarray) -> None:
        """Nothing to roll back."""

    def select(self, rows: np.ndarray) -> None:
        """Nothing per row."""

    def view(self, row: int):
        """This drafter for one row of the batch (stateless drafters serve any row)."""
        return self

    def cost_ratio(self, target_spec) -> float:
        """A draft step's cost relative to the target's (0: drafting needs no model)."""
        return 0.0

    def adopt(self, row: int, single) -> None:
        """Take back what a one-row view of this drafter committed."""


class ModelDrafter(NoDrafter):
    """A draft model: catches up on committed tokens it has not seen, then proposes one call a token."""

    name = "model"

    def __init__(self, engine: Engine):
        self.engine = engine
        self.cache: KVCache | None = None

    def start(self, batch: int, capacity: int) -> None:
        self.cache = KVCache(self.engine.allocate_cache(batch, capacity))

    def propose(self, tokens, lengths, k, config: GenerationConfig, rngs, threshold=None) -> Proposal:
        """Write drafts into ``tokens`` [batch, width] at lengths[b] .. and return them with q."""
        began = time.perf_counter()
        batch = len(lengths)
        drafts = np.zeros((batch, k), np.int64)
        qs = []
        catchup = int((lengths - self.cache.past_len).max())
        logits, start, _, _ = forward_rows(self.engine, self.cache, tokens, lengths)
        # batch 1 feeds exactly the tokens it had not seen, so its last logits are the call's last
        last = logits[:, -1] if batch == 1 else logits[np.arange(batch), lengths - 1 - start]  # [batch, vocab]
        steps, made = 1, 0
        for i in range(k):
            if config.repetition_penalty != 1.0:
                last = np.stack([penalize(last[b], np.concatenate([tokens[b, : lengths[b]], drafts[b, :i]]),
                                          config.repetition_penalty) for b in range(batch)])
            if config.greedy:
                # greedy needs no distribution, only its top probability when a threshold asks for it
                if threshold is not None and _top_probability(last).max() < threshold:
                    break
                drafts[:, i] = last.argmax(-1)
            else:
                q = probabilities(last, config)  # [batch, vocab]
                if threshold is not None and q.max(-1).max() < threshold:
                    break  # no row is confident enough to make another draft worth verifying
                drafts[:, i] = [sample(q[b], rngs[b]) for b in range(batch)]
                qs.append(q)
            made += 1
            if i + 1 < k:
                last, _ = forward_one(self.engine, self.cache, drafts[:, i])
                steps += 1
        drafts = drafts[:, :made]
        for b, length in enumerate(lengths.tolist()):  # the verify call reads them there
            tokens[b, length : length + made] = drafts[b]
        q_all = np.stack(qs, axis=1) if qs else None
        return Proposal(drafts, q_all, time.perf_counter() - began, steps, catchup)

    def commit(self, old_lengths: np.ndarray, accepted: np.ndarray) -> None:
        """The draft's K/V stays valid for committed tokens and the accepted drafts it has seen."""
        self.cache.commit(np.minimum(self.cache.past_len, old_lengths + accepted))

    def select(self, rows: np.ndarray) -> None:
        self.cache.select(rows)

    def view(self, row: int) -> ModelDrafter:
        single = ModelDrafter(self.engine)
        single.cache = self.cache.view(row)
        return single

    def adopt(self, row: int, single: ModelDrafter) -> None:
        self.cache.past_len[row] = single.cache.past_len[0]

    def cost_ratio(self, target_spec) -> float:
        """Parameters of the draft over the target's: what a token costs each, to a first estimate."""
        draft, target = self.engine.spec.parameters, target_spec.parameters
        return draft / target if draft > 0 and target > 0 else 0.0


def _top_probability(logits: np.ndarray) -> np.ndarray:
    """max softmax(logits) per row, without forming the distribution.  # [batch]"""
    return 1.0 / np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)


class PromptLookup(NoDrafter):
    """Prompt lookup (n-gram) drafting: continue the latest earlier match of the last n tokens.

    No model; like transformers' ``prompt_lookup_num_tokens``. Proposals are deterministic, so q is
    one-hot and sampling verification accepts a draft d with probability p(d).
    """

    name = "prompt-lookup"

    def __init__(self, max_ngram: int = 3):
        self.max_ngram = max_ngram

    def propose(self, tokens, lengths, k, config, rngs, threshold=None) -> Proposal:
        began = time.perf_counter()
        found = [self._lookup(tokens[b, : lengths[b]], k) for b in range(len(lengths))]
        made = max(len(f) for f in found)
        drafts = np.zeros((len(lengths), made), np.int64)
        for b, cont in enumerate(found):
            # rows without a (long enough) match repeat their last token: any proposal is lossless
            filler = cont[-1] if len(cont) else tokens[b, lengths[b] - 1]
            drafts[b] = np.concatenate([cont, np.full(made - len(cont), filler)])
            tokens[b, lengths[b] : lengths[b] + made] = drafts[b]
        return Proposal(drafts, None, time.perf_counter() - began, 0)

    def _lookup(self, seq: np.ndarray, k: int) -> np.ndarray:
        length = len(seq)
        for n in range(min(self.max_ngram, length - 1), 0, -1):
            # starts j < length - n where seq[j : j + n] equals the final n-gram
            match = seq[: length - n] == seq[length - n]
            for t in range(1, n):
                match &= seq[t : length - n + t] == seq[length - n + t]
            for hit in np.flatnonzero(match)[::-1]:  # latest match with a continuation first
                cont = seq[hit + n : hit + n + k]
                if len(cont):
                    return cont
        return seq[:0]
