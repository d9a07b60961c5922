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
    drafts: np.ndarray  # [batch, k] int64; may be a view of the token buffer (valid until the cycle commits)
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

    def commit(self, valid: list[int]) -> None:
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
        if len(lengths) == 1 and config.greedy and config.repetition_penalty == 1.0:
            return self._propose_greedy_row(tokens, lengths, k, threshold)
        return self._propose_rows(tokens, lengths, k, config, rngs, threshold)

    def _propose_rows(self, tokens, lengths, k, config: GenerationConfig, rngs, threshold=None) -> Proposal:
        """The general path: any batch, ragged lengths, sampling, repetition penalty."""
        began = time.perf_counter()
        batch = len(lengths)
        logits, start, _, _ = forward_rows(self.engine, self.cache, tokens, lengths)
        catchup = logits.shape[1]  # the call fed as many tokens as the row furthest behind needed
        last = logits[np.arange(batch), lengths - 1 - start][:, None]  # [batch, 1, vocab]
        columns, qs = [], []  # per draft position: [batch, 1] tokens, [batch, vocab] q
        for i in range(k):
            if config.repetition_penalty != 1.0:
                so_far = np.concatenate(columns, axis=1) if columns else np.zeros((batch, 0), np.int64)
                last = np.stack([penalize(last[b, 0], np.concatenate([tokens[b, : lengths[b]], so_far[b]]),
                                          config.repetition_penalty) for b in range(batch)])[:, None]
            if config.greedy:
                # greedy needs no distribution, only its top probability when a threshold asks for it
                if threshold is not None and _top_probability(last).max() < threshold:
                    break
                column = last.argmax(-1)  # [batch, 1], the next call's input as it is
            else:
                q = probabilities(last[:, 0], config)  # [batch, vocab]
                if threshold is not None and q.max(-1).max() < threshold:
                    break  # no row is confident enough to make another draft worth verifying
                column = np.array([[sample(q[b], rngs[b])] for b in range(batch)], np.int64)
                qs.append(q)
            columns.append(column)
            if i + 1 < k:
                last, _ = forward_one(self.engine, self.cache, column)
        drafts = np.concatenate(columns, axis=1) if columns else np.zeros((batch, 0), np.int64)  # [batch, made]
        made = drafts.shape[1]
        for b, at in enumerate(lengths.tolist()):  # the verify call reads them there
            tokens[b, at : at + made] = drafts[b]
        q_all = np.stack(qs, axis=1) if qs else None
        steps = 1 + min(made, k - 1)  # the catch-up call, then one call per draft but the last
        return Proposal(drafts, q_all, time.perf_counter() - began, steps, catchup)

    def _propose_greedy_row(self, tokens, lengths, k, threshold) -> Proposal:
        """``propose`` for one row under greedy decoding, the latency case, in fewer NumPy calls.

        The same engine calls with the same inputs as the general path (a test holds them equal), but
        each draft's argmax is written straight into ``tokens``, where the next draft call and the
        verify call read it, and positions are Python ints: after every engine call the CPU's caches
        are cold, and each NumPy call then costs microseconds.
        """
        began = time.perf_counter()
        cache, engine = self.cache, self.engine
        seen, at = cache.past_len.item(0), lengths.item(0)
        # every draft's slot in the token buffer and its call's past_len, made before the first call:
        # between calls then only an argmax and the staging copy run
        slots = [tokens[:, i : i + 1] for i in range(at, at + k)]  # [1, 1] views
        pasts = [np.array([i]) for i in range(at, at + k - 1)]
        out = engine.infer(tokens[:, seen:at], cache.past_len, cache.buffers)  # catch up on what it has not seen
        cache.stage_at(out.new_kv, seen)
        logits, made = out.logits[:, -1:], 0  # [1, 1, vocab]
        while made < k:
            if threshold is not None and _top_probability(logits).max() < threshold:
                break
            logits.argmax(-1, out=slots[made])
            made += 1
            if made < k:
                out = engine.infer(slots[made - 1], pasts[made - 1], cache.buffers)
                cache.stage_at(out.new_kv, at + made - 1)
                logits = out.logits
        steps = 1 + min(made, k - 1)  # the catch-up call, then one call per draft but the last
        cache.commit(np.array([at + steps - 1]))
        return Proposal(tokens[:, at : at + made], None, time.perf_counter() - began, steps, at - seen)

    def commit(self, valid: list[int]) -> None:
        """Tokens x[0:valid[b]] stand (the verified prefix); the draft's K/V beyond them is discarded."""
        self.cache.commit(np.array([min(seen, v) for seen, v in zip(self.cache.past_len.tolist(), valid)]))

    def select(self, rows: np.ndarray) -> None:
        self.cache.select(rows)

    def view(self, row: int) -> ModelDrafter:
        single = ModelDrafter(self.engine)
        single.cache = self.cache.view(row)
        return single

    def adopt(self, row: int, single: ModelDrafter) -> None:
        self.cache.commit_row(row, int(single.cache.past_len[0]))

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
        rows = lengths.tolist()
        found = [self._lookup(tokens[b, :length], k) for b, length in enumerate(rows)]
        made = max(len(f) for f in found)
        drafts = np.empty((len(rows), made), np.int64)
        for b, (length, cont) in enumerate(zip(rows, found)):
            drafts[b, : len(cont)] = cont
            if len(cont) < made:  # rows without a (long enough) match repeat their last token: any proposal is lossless
                drafts[b, len(cont) :] = cont[-1] if len(cont) else tokens[b, length - 1]
            tokens[b, length : length + made] = drafts[b]
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
