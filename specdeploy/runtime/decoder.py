"""The decoder: prefill, speculative cycles, stopping, and batches with ragged acceptance.

One cycle, for every active row b with L_b committed tokens x[0:L_b]:
  the drafter proposes d_1..d_K (written into the row's token buffer at L_b..),
  the target runs [x[L_b - 1], d_1..d_K] (K + 1 tokens) from past_len L_b - 1,
  acceptance keeps n_b drafts and emits one recovered or bonus token,
  the target's past_len moves to L_b + n_b, the draft's to what it has seen of the new prefix.
Rows accept different numbers of tokens in the same call; finished rows leave the batch.

Per-cycle bookkeeping (lengths, positions) runs on Python ints and builds arrays only where an
engine or a cache needs one. Batch 1 is the latency case, and after each engine call the CPU's
caches are cold: measured here, the first call of each distinct NumPy routine (a ufunc, a
reduction, an indexing path) then costs 1-2 us, three array constructions 1.7 us, three different
routines 3.5 us. ``tools/bench_overhead.py`` measures the whole cycle.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field

import numpy as np

from ..engines.base import Engine
from .acceptance import greedy_accept, greedy_accept_row, speculative_accept
from .cache import KVCache, plan_capacity
from .config import GenerationConfig
from .forward import forward_rows, prefill
from .policies import CycleOutcome
from .sampling import penalize_positions, probabilities
from .telemetry import CycleRecord


@dataclass
class RowResult:
    request_id: str
    prompt_ids: np.ndarray
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""
    records: list[CycleRecord] = field(default_factory=list)
    decode_seconds: float = 0.0  # wall time from the end of prefill to this row's last cycle
    error: str = ""  # why the row failed, when finish_reason is "error"


class Generation:
    """One batch of requests in flight; ``step()`` runs one cycle and reports what each row committed."""

    def __init__(self, target: Engine, drafter, policy, config: GenerationConfig, prompts: list[np.ndarray],
                 request_ids: list[str], stop_check=None, k_limit: int | None = None):
        self.target, self.drafter, self.policy, self.config = target, drafter, policy, config
        self.stop_check = stop_check  # (row result) -> number of tokens to keep, or None to go on
        self.policy_learns = getattr(policy, "learns", True)  # a policy without the attribute is told everything
        self.k_cap = config.k if config.speculative else 0
        limit = target.spec.capacity if k_limit is None else k_limit
        self.capacity = plan_capacity([len(p) for p in prompts], config.max_new_tokens, self.k_cap, limit)
        self.rows = [RowResult(rid, p) for rid, p in zip(request_ids, prompts)]
        batch = len(prompts)
        self.active = np.arange(batch)  # batch row -> request index
        self.tokens = np.zeros((batch, self.capacity), np.int64)  # [batch, capacity]
        self.lengths = np.array([len(p) for p in prompts], np.int64)  # [batch] committed tokens
        for b, p in enumerate(prompts):
            self.tokens[b, : len(p)] = p
        seeds = [None if config.seed is None else [config.seed, i] for i in range(batch)]
        self.rngs = [np.random.default_rng(s) for s in seeds]
        self.cache = KVCache(target.allocate_cache(batch, self.capacity))
        self.drafter.start(batch, self.capacity)
        self.eos = set(config.stop_token_ids) | (set() if config.ignore_eos else set(target.spec.eos_token_ids))
        self.cycle = 0
        self.prefill_seconds = self._prefill()
        if self.k_cap and hasattr(policy, "plan"):  # a policy that weighs the draft's catch-up on the prompt
            ratio = drafter.cost_ratio(target.spec)
            policy.plan(self.prefill_seconds * ratio, config.max_new_tokens, ratio)
        self.decode_started = time.perf_counter()

    @property
    def done(self) -> bool:
        return len(self.active) == 0

    def _prefill(self) -> float:
        """The target sees every prompt token but the last (each cycle starts from x[L - 1]).

        If the batched prefill fails, each row is prefilled alone and only rows that fail alone
        leave (with finish_reason "error").
        """
        began = time.perf_counter()
        try:
            prefill(self.target, self.cache, self.tokens, self.lengths - 1)
        except Exception:  # an engine fault: find the rows it belongs to
            failed = []
            for b, index in enumerate(self.active.tolist()):
                single = self.cache.view(b)
                single.commit(np.zeros(1, np.int64))
                try:
                    prefill(self.target, single, self.tokens[b : b + 1], self.lengths[b : b + 1] - 1)
                except Exception as exc:
                    self.rows[index].finish_reason = "error"
                    self.rows[index].error = f"{type(exc).__name__}: {exc}"
                    failed.append(b)
                self.cache.commit_row(b, int(single.past_len[0]))
            if failed:
                self._leave(failed)
        return time.perf_counter() - began

    def step(self) -> list[tuple[int, list[int]]]:
        """One cycle over the active rows. Returns (request index, newly committed token ids) per row.

        If an engine call fails, the cycle is rolled back (lengths only: nothing was committed) and
        re-run row by row, so that a fault tied to one row fails that row alone; a failed row ends
        with finish_reason "error" and its message in ``error``, and the other rows go on.
        """
        snapshot = self._snapshot()
        try:
            committed, finished = self._cycle()
        except Exception:  # an engine fault, whatever its type: find the rows it belongs to
            self._restore(snapshot)
            committed, finished = self._isolate()
        if finished:
            self._leave(finished)
        return committed

    def _snapshot(self):
        drafter_cache = getattr(self.drafter, "cache", None)
        # greedy decoding draws nothing, so only sampled runs need their generators' states
        states = None if self.config.greedy else [self.rngs[i].bit_generator.state for i in self.active]
        # past_len arrays are replaced, never written into (KVCache.commit), so holding them is a snapshot
        return (self.cache.past_len, None if drafter_cache is None else drafter_cache.past_len, states)

    def _restore(self, snapshot) -> None:
        target_past, draft_past, rng_states = snapshot
        self.cache.commit(target_past)
        if draft_past is not None:
            self.drafter.cache.commit(draft_past)
        for i, state in zip(self.active, rng_states or []):
            self.rngs[i].bit_generator.state = state

    def _isolate(self):
        """Re-run the failed cycle for each row alone, on views of its slots of the batch buffers."""
        committed, finished = [], []
        lengths = self.lengths.tolist()
        for b, index in enumerate(self.active.tolist()):
            row = copy.copy(self)
            row.active, row.tokens, row.lengths = self.active[b : b + 1], self.tokens[b : b + 1], self.lengths[b : b + 1].copy()
            row.cache, row.drafter = self.cache.view(b), self.drafter.view(b)
            try:
                new, done = row._cycle()
            except Exception as exc:
                self.rows[index].finish_reason = "error"
                self.rows[index].error = f"{type(exc).__name__}: {exc}"
                committed.append((index, []))
                finished.append(b)
                continue
            lengths[b] = int(row.lengths[0])
            self.cache.commit_row(b, int(row.cache.past_len[0]))
            self.drafter.adopt(b, row.drafter)
            committed += new
            finished += [b] if done else []
        self.lengths = np.array(lengths)  # a new array: a cache may hold the old one (KVCache.commit)
        self.cycle += 1
        return committed, finished

    def _cycle(self):
        config, batch, active = self.config, len(self.active), self.active.tolist()
        lengths = self.lengths.tolist()  # committed tokens per row; bookkeeping on Python ints (module docstring)
        remaining = [config.max_new_tokens - len(self.rows[i].token_ids) for i in active]
        k = min(self.policy.next_k() if self.k_cap else 0, self.k_cap, max(remaining) - 1)
        proposal = self.drafter.propose(self.tokens, self.lengths, k, config, None if config.greedy else self._rngs(),
                                        self.policy.confidence_threshold) if k > 0 else None
        k = proposal.drafts.shape[1] if proposal else 0
        drafts = proposal.drafts if proposal else np.zeros((batch, 0), np.int64)

        ends = np.array([length + k for length in lengths])  # [batch]
        logits, _, verify_s, cache_s = forward_rows(self.target, self.cache, self.tokens, ends)
        began = time.perf_counter()
        if config.repetition_penalty != 1.0:
            logits = np.stack([penalize_positions(logits[b], self.tokens[b, : self.lengths[b]], drafts[b],
                                                  config.repetition_penalty) for b in range(batch)])
        if config.greedy and batch == 1:  # the latency case: the same rule on Python ints
            target_row = logits.argmax(-1).tolist()[0]  # K + 1 ints
            accepted_rows, emitted_rows = [greedy_accept_row(target_row, drafts.tolist()[0])], [target_row]
        else:
            if config.greedy:
                accepted, emitted = greedy_accept(logits.argmax(-1), drafts)
            else:
                accepted, emitted = speculative_accept(probabilities(logits, config), proposal.q if proposal else None,
                                                       drafts, self._rngs())
            accepted_rows, emitted_rows = accepted.tolist(), emitted.tolist()  # row b emits emitted_rows[b][: n + 1]
        accept_s = time.perf_counter() - began

        began = time.perf_counter()
        # the target has now seen x[0:L] and the accepted drafts; the token after them is the recovered or bonus one
        seen = [length + n for length, n in zip(lengths, accepted_rows)]
        for b, (at, n) in enumerate(zip(seen, accepted_rows)):
            self.tokens[b, at] = emitted_rows[b][n]
        self.cache.commit(np.array(seen))
        self.drafter.commit(seen)
        self.lengths = np.array([at + 1 for at in seen])
        cache_s += time.perf_counter() - began

        draft_s = proposal.seconds if proposal else 0.0
        if self.policy_learns:
            self.policy.observe(CycleOutcome(k, accepted_rows, draft_s, proposal.steps if proposal else 0, verify_s,
                                             k + 1, proposal.catchup if proposal else 1))
        committed, finished = [], []
        now = time.perf_counter() - self.decode_started
        shares = draft_s / batch, verify_s / batch, accept_s / batch, cache_s / batch  # of the batch's calls
        for b, (index, n, tokens) in enumerate(zip(active, accepted_rows, emitted_rows)):
            row = self.rows[index]
            new = self._truncate(row, tokens[: n + 1], remaining[b])
            row.token_ids += new
            row.decode_seconds = now
            if row.finish_reason:
                finished.append(b)
            committed.append((index, new))
            final = "plain" if k == 0 else ("bonus" if n == k else "recovered")
            row.records.append(CycleRecord(row.request_id, self.cycle, k, n, n + 1 if n < k else None, final, len(new),
                                           *shares, batch))
        self.cycle += 1
        return committed, finished

    def _truncate(self, row: RowResult, new: list[int], remaining: int) -> list[int]:
        """Cut a row's new tokens at EOS, max_new_tokens or a stop string, and say why it finished."""
        if not self.eos.isdisjoint(new):
            end = next(i for i, token in enumerate(new) if token in self.eos)
            new, row.finish_reason = new[: end + 1], "eos"
        if len(new) >= remaining:
            del new[remaining:]
            row.finish_reason = row.finish_reason or "length"
        if self.stop_check is not None:
            keep = self.stop_check(row.token_ids, new)
            if keep is not None:
                new, row.finish_reason = new[:keep], "stop"
        return new

    def _leave(self, finished: list[int]) -> None:
        keep = np.setdiff1d(np.arange(len(self.active)), finished)
        self.active = self.active[keep]
        self.tokens = self.tokens[keep]
        self.lengths = self.lengths[keep]
        if len(keep):
            self.cache.select(keep)
            self.drafter.select(keep)

    def _rngs(self) -> list[np.random.Generator]:
        return [self.rngs[i] for i in self.active]
