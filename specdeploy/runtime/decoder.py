"""The decoder: a batch state and the cycle that moves it.

One cycle, for every active row b with L_b committed tokens x[0:L_b]:
  the policy says how many tokens to draft (k),
  the drafter proposes d_1..d_k,
  the target runs [x[L_b - 1], d_1..d_k] (k + 1 tokens) from past_len L_b - 1,
  acceptance keeps n_b drafts and emits one recovered or bonus token,
  the state commits them; the target's past_len moves to L_b + n_b, the draft's to what it has
  seen of the new prefix (rollback moves a length).
Rows accept different numbers of tokens in the same call; finished rows leave the batch.

Row b of the batch serves request ``active[b]``. Bookkeeping runs on Python ints: after each engine
call the CPU's caches are cold and every distinct NumPy routine costs microseconds, while a cycle
touches a handful of numbers per row (``tools/bench_overhead.py`` measures it).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from ..engines.base import Engine, KVCache, prefill
from .acceptance import greedy_accept_row, speculative_accept
from .cache import plan_capacity
from .config import GenerationConfig
from .drafters import Drafter, Proposal
from .policies import CycleOutcome, adopt
from .sampling import penalize_positions, row_probabilities
from .telemetry import CycleRecord, FinalToken, FinishReason


@dataclass
class RowResult:
    request_id: str
    prompt_ids: np.ndarray
    token_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | str = ""  # empty while the request runs
    records: list[CycleRecord] = field(default_factory=list)
    prefill_seconds: float = 0.0  # the prefill call(s) this request took part in
    decode_seconds: float = 0.0  # wall time from the end of its prefill to its last cycle
    decode_started: float = 0.0  # perf_counter() at the end of its prefill
    error: str = ""  # why the row failed, when finish_reason is "error"


# (tokens generated so far, new tokens) -> how many new tokens to keep (a stop string ends there), or None
StopCheck = Callable[[list[int], list[int]], "int | None"]


class RowSpec(NamedTuple):
    """What one request decodes with, whatever shares its batch."""

    config: GenerationConfig  # sampling, length, stop tokens, seed; ``k`` caps its drafts below the batch's
    stop_check: StopCheck | None = None
    stream: int = 0  # its generator is seeded with [seed, stream]: prompt i of one call draws from stream i


class BatchState:
    """Token buffer [batch, capacity], committed lengths, active rows and their generators.

    Requests ``join`` and ``leave`` between cycles; ``subset`` gives rows that share this state's
    buffers (what a row commits lands here); ``snapshot``/``restore`` undo a failed cycle.
    """

    def __init__(self, config: GenerationConfig, capacity: int, eos: set[int]):
        # config: the batch's speculation (k, drafter, policy) and the settings of rows joined without their own;
        # eos: the model's EOS ids (each row adds its stop_token_ids, or drops them with ignore_eos)
        self.config, self.capacity, self.eos = config, capacity, eos
        self.greedy = True  # every row joined so far decodes greedily: acceptance and drafting need no distribution
        self.penalized = False  # some row has a repetition penalty
        self.capped = False  # some row drafts fewer than the batch's k (its own num_speculative_tokens)
        self.sampling = False  # some row samples: its generator state is part of a snapshot
        self.tokens = np.zeros((0, capacity), np.int64)  # [batch, capacity]
        self.lengths: list[int] = []  # [batch] committed tokens
        self.active: list[int] = []  # [batch] request index of each row
        self.rows: list[RowResult] = []  # by request index, finished ones included
        self.specs: list[RowSpec] = []  # by request index
        self.stops: list[set[int]] = []  # by request index: the token ids that end it
        self.generators: list[np.random.Generator] = []  # by request index

    @property
    def batch(self) -> int:
        return len(self.active)

    def join(self, prompts: Sequence[np.ndarray], request_ids: Sequence[str], specs: Sequence[RowSpec] | None = None) -> None:
        """Add requests as new rows at the end of the batch, each with its own settings (``specs``; default:
        the batch's config without stop strings, prompt i drawing from seed stream i of the batch)."""
        if specs is None:
            specs = [RowSpec(self.config, None, len(self.rows) + i) for i in range(len(prompts))]
        added = np.zeros((len(prompts), self.capacity), np.int64)
        for b, prompt in enumerate(prompts):
            added[b, : len(prompt)] = prompt
        for prompt, request_id, spec in zip(prompts, request_ids, specs):
            config, index = spec.config, len(self.rows)
            self.rows.append(RowResult(request_id, prompt))
            self.specs.append(spec)
            self.stops.append(set(config.stop_token_ids) | (set() if config.ignore_eos else self.eos))
            seed = config.seed
            self.generators.append(np.random.default_rng(None if seed is None else [seed, spec.stream]))
            self.greedy &= config.greedy
            self.sampling |= not config.greedy
            self.penalized |= config.repetition_penalty != 1.0
            self.capped |= config.k < self.config.k
            self.active.append(index)
            self.lengths.append(len(prompt))
        self.tokens = np.concatenate([self.tokens, added])

    def merge(self, other: BatchState) -> None:
        """Append ``other``'s active rows (same capacity), with their results, settings and generators. An empty
        batch starts afresh: the requests that left are forgotten, and so are their settings' needs."""
        if not self.active:
            self.rows, self.specs, self.stops, self.generators = [], [], [], []
            self.greedy, self.sampling, self.penalized, self.capped = True, False, False, False
        offset = len(self.rows)
        self.rows += [other.rows[i] for i in other.active]
        self.specs += [other.specs[i] for i in other.active]
        self.stops += [other.stops[i] for i in other.active]
        self.generators += [other.generators[i] for i in other.active]
        self.active += range(offset, offset + other.batch)
        self.lengths += other.lengths
        self.tokens = np.concatenate([self.tokens, other.tokens])
        self.greedy &= other.greedy
        self.sampling |= other.sampling
        self.penalized |= other.penalized
        self.capped |= other.capped

    def release(self, index: int) -> None:
        """Forget finished request ``index`` (its result has been handed on): a long-running batch that
        requests keep joining does not grow with the ones that left."""
        if index not in self.active:
            self.rows[index] = self.specs[index] = self.stops[index] = self.generators[index] = None

    def leave(self, rows: Sequence[int]) -> list[int]:
        """Drop batch rows ``rows``; returns the rows that stay, in order (caches keep the same ones)."""
        drop = set(rows)
        keep = [b for b in range(self.batch) if b not in drop]
        self.tokens = self.tokens[keep]
        self.lengths = [self.lengths[b] for b in keep]
        self.active = [self.active[b] for b in keep]
        return keep

    def subset(self, b: int) -> BatchState:
        """Row ``b`` alone, on a view of this token buffer and the same results, settings and generators."""
        single = copy.copy(self)
        single.tokens = self.tokens[b : b + 1]
        single.lengths, single.active = [self.lengths[b]], [self.active[b]]
        return single

    def adopt(self, b: int, single: BatchState) -> None:
        """Take back the length a ``subset`` row committed."""
        self.lengths[b] = single.lengths[0]

    def snapshot(self) -> tuple:
        """What a cycle changes before it commits: lengths, and the generators' states when sampling."""
        states = [self.generators[i].bit_generator.state for i in self.active] if self.sampling else None
        return tuple(self.lengths), states

    def restore(self, snapshot: tuple) -> None:
        lengths, states = snapshot
        self.lengths = list(lengths)
        for i, state in zip(self.active, states or []):
            self.generators[i].bit_generator.state = state

    def rngs(self) -> list[np.random.Generator]:
        """The active rows' generators, in batch order."""
        return [self.generators[i] for i in self.active]

    def configs(self) -> list[GenerationConfig]:
        """The active rows' settings, in batch order."""
        return [self.specs[i].config for i in self.active]

    def remaining(self) -> list[int]:
        """New tokens each active row may still commit, in batch order."""
        return [self.specs[i].config.max_new_tokens - len(self.rows[i].token_ids) for i in self.active]

    def verify_inputs(self, drafts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Place ``drafts`` [batch, k] after each row's committed tokens; return the target's input.

        Row b runs [x[L_b - 1], d_1..d_k] from past_len L_b - 1: input_ids [batch, k + 1], past_len [batch].
        """
        k = drafts.shape[1]
        lengths = self.lengths
        for b, at in enumerate(lengths):
            self.tokens[b, at : at + k] = drafts[b]
        first = lengths[0] - 1
        if lengths.count(first + 1) == len(lengths):  # every row at the same position: a slice
            input_ids = self.tokens[:, first : first + k + 1]
        else:
            index = np.array(lengths)[:, None] - 1 + np.arange(k + 1)  # [batch, k + 1]
            input_ids = np.take_along_axis(self.tokens, index, axis=1)
        return input_ids, np.array([length - 1 for length in lengths])

    def commit(self, accepted: list[int], emitted: list[list[int]], remaining: list[int]) -> tuple[list, list[int]]:
        """Row b keeps its first accepted[b] drafts and emits emitted[b][accepted[b]] after them.

        Tokens past EOS, ``max_new_tokens`` (``remaining[b]``) or a stop string are cut, and the row's
        finish reason is set. Returns (request index, new tokens) per row and the rows that finished.
        """
        committed, finished = [], []
        for b, (index, n) in enumerate(zip(self.active, accepted)):
            at = self.lengths[b] + n  # the target has seen x[0:L] and n drafts; the next token follows them
            self.tokens[b, at] = emitted[b][n]
            self.lengths[b] = at + 1
            row = self.rows[index]
            new = self._truncate(index, emitted[b][: n + 1], remaining[b])
            row.token_ids += new
            committed.append((index, new))
            if row.finish_reason:
                finished.append(b)
        return committed, finished

    def _truncate(self, index: int, new: list[int], remaining: int) -> list[int]:
        """Cut request ``index``'s new tokens at EOS, max_new_tokens or a stop string, and say why it finished."""
        row, stops = self.rows[index], self.stops[index]
        if not stops.isdisjoint(new):
            end = next(i for i, token in enumerate(new) if token in stops)
            new, row.finish_reason = new[: end + 1], FinishReason.EOS
        if len(new) >= remaining:
            del new[remaining:]
            row.finish_reason = row.finish_reason or FinishReason.LENGTH
        stop_check = self.specs[index].stop_check
        if stop_check is not None:
            keep = stop_check(row.token_ids, new)
            if keep is not None:
                new, row.finish_reason = new[:keep], FinishReason.STOP
        return new

    def fail(self, b: int, exc: Exception) -> None:
        """Row ``b`` ends with an engine fault that is its own."""
        row = self.rows[self.active[b]]
        row.finish_reason, row.error = FinishReason.ERROR, f"{type(exc).__name__}: {exc}"


class Timer:
    """Times one ``with`` block: ``with timer: ...`` leaves its wall time in ``timer.seconds``."""

    __slots__ = ("seconds", "_began")

    def __enter__(self) -> Timer:
        self._began = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.seconds = time.perf_counter() - self._began


class Generation:
    """One batch of requests in flight; ``step()`` runs one cycle and reports what each row committed.

    ``prefill()`` runs first (the first ``step()`` calls it when nobody did). What depends only on the
    request is chosen once, here: the acceptance rule (greedy on Python ints, or sampled), and what the
    policy declares it needs (``learns``, ``plans``, its confidence threshold). There is one drafting
    path and one cycle for every batch size.
    """

    def __init__(self, target: Engine, drafter: Drafter, policy, config: GenerationConfig, prompts: list[np.ndarray],
                 request_ids: list[str], capacity: int | None = None, specs: Sequence[RowSpec] | None = None):
        """``config`` sets the batch's speculation (k, drafter, policy) and, unless ``specs`` gives each
        prompt its own, every row's sampling, length and stop settings."""
        self.target, self.drafter, self.policy, self.config = target, drafter, policy, config
        self.k_cap = config.k if config.speculative else 0
        if capacity is None:
            capacity = _plan(prompts, config, specs, self.k_cap, target.spec.capacity)
        self.state = BatchState(config, capacity, set(target.spec.eos_token_ids))
        self.state.join(prompts, request_ids, specs)
        self.cache = target.allocate_cache(len(prompts), capacity)
        drafter.start(len(prompts), capacity, config, self._policy.confidence_threshold)
        self.accept_timer, self.cache_timer = Timer(), Timer()
        self.cycle = 0
        self.prefill_seconds: float | None = None  # of the batch it started with; None until prefilled
        self._prefill_spent = 0.0  # by ``prefill_chunk`` calls so far
        # rows about to join (a server's prefilling and queued requests): () -> (rows, prompt tokens the draft lacks,
        # tokens to come). A catch-up is judged for the batch they make: drafting there needs theirs too. Asked
        # only when a catch-up is judged, not every cycle.
        self.joining: Callable[[], tuple[int, int, int]] = lambda: (0, 0, 0)
        # (logits [batch, k + 1, vocab] of a verification, what each row committed from it: (request index, tokens)):
        # called right after the commit, before the next engine call reuses the logits' buffer. Token j of a row's
        # committed tokens was drawn from logits[b, j] (a server's logprobs); None: nobody asks.
        self.on_verified: Callable[[np.ndarray, list[tuple[int, list[int]]]], None] | None = None

    def accept(self, logits: np.ndarray, proposal: Proposal, state: BatchState):
        """(accepted drafts, emitted tokens) per row: greedy on Python ints while every row is greedy."""
        if state.greedy:
            return self._accept_greedy(logits, proposal, state)
        return self._accept_sampled(logits, proposal, state)

    @property
    def policy(self):
        return self._policy

    @policy.setter
    def policy(self, policy) -> None:
        """Any object with ``next_k()`` and ``observe(outcome)``; its capabilities are read from here on."""
        self._policy = adopt(policy)

    @property
    def rows(self) -> list[RowResult]:
        return self.state.rows

    @property
    def done(self) -> bool:
        return self.state.batch == 0

    # views of the state, for tests and tools
    tokens = property(lambda self: self.state.tokens)
    lengths = property(lambda self: np.array(self.state.lengths, np.int64))
    active = property(lambda self: np.array(self.state.active, np.int64))

    def step(self) -> list[tuple[int, list[int]]]:
        """One cycle over the active rows (after the prefill, on the first call). Returns (request
        index, newly committed token ids) per row.

        If an engine call fails, the cycle is rolled back (lengths only: nothing was committed) and
        re-run row by row, so that a fault tied to one row fails that row alone; a failed row ends
        with finish_reason "error" and its message in ``error``, and the other rows go on.
        """
        if self.prefill_seconds is None:
            self.prefill()
            if self.done:
                return []
        state = self.state
        snapshot = state.snapshot()
        try:
            committed, finished = self._cycle(state, self.cache, self.drafter)
        except Exception:  # an engine fault, whatever its type: find the rows it belongs to
            state.restore(snapshot)
            before = [length - 1 for length in state.lengths]  # what both models had seen: all but the last token
            self.cache.commit(before)
            self.drafter.rollback(before)
            committed, finished = self._isolate()
        self.cycle += 1
        if finished:
            self._leave(finished)
        return committed

    def prefill(self) -> None:
        """The target sees every prompt token but the last (each cycle starts from x[L - 1]); the first
        ``step()`` calls this when nobody did. A policy that plans hears the draft's catch-up estimate."""
        self.prefill_seconds = self._prefill_rows(0)
        # weighs the draft's catch-up on the prompt before paying it; rows whose prefill failed have left
        if self.k_cap and self._policy.plans and self.state.batch:
            ratio = self.drafter.cost_ratio(self.target.spec)
            self._policy.plan(self.prefill_seconds * ratio, max(self.state.remaining()), ratio)

    def prefill_chunk(self, tokens: int, draft: bool | Callable[[], bool] = True) -> bool:
        """Prefill at most ``tokens`` more of each prompt, in the target and (``draft``) the draft; True once done.

        A server prefills requests that join a running batch this way, a chunk between two of its
        cycles, then ``merge``s them: running rows never wait for a whole long prompt, in either model.
        Without ``draft`` the draft has seen nothing of these rows: the policy decides whether a
        cycle pays for that catch-up (``weighs_catchup``) or stays plain. A callable ``draft`` is asked
        after the target's chunk, so that what happened meanwhile (requests that queued up) counts.
        """
        state = self.state
        goal = [min(past + tokens, length - 1) for past, length in zip(self.cache.past_len.tolist(), state.lengths)]
        self._prefill_spent += self._prefill_rows(0, goal)
        if self.done:
            return True
        if self.k_cap and (draft() if callable(draft) else draft):
            began = time.perf_counter()
            fed = self.drafter.warm(state, self.cache.past_len.tolist())  # the draft follows the target, chunk for chunk
            spent = time.perf_counter() - began
            self._prefill_spent += spent
            if self._policy.weighs_catchup:
                self._policy.observe_catchup(spent, fed)
        if self.cache.past_len.tolist() != [length - 1 for length in state.lengths]:
            return False
        self.prefill_seconds = self._prefill_spent
        ended = time.perf_counter()
        for index in state.active:
            state.rows[index].prefill_seconds, state.rows[index].decode_started = self.prefill_seconds, ended
        return True

    def merge(self, other: Generation) -> None:
        """Take ``other``'s rows (prefilled, with the same capacity and speculation) into this batch."""
        if other.state.capacity != self.state.capacity:
            raise ValueError(f"merge: capacity {other.state.capacity} != {self.state.capacity}")
        self.state.merge(other.state)
        self.cache = self.cache.extend(other.cache)
        self.drafter.merge(other.drafter)

    def join(self, prompts: list[np.ndarray], request_ids: list[str], specs: Sequence[RowSpec] | None = None) -> None:
        """Requests join the batch between cycles, as new rows at its end; once the batch is prefilled,
        theirs is done here. Each must fit the batch's capacity (prompt + max_new_tokens + k + 1)."""
        _plan(prompts, self.config, specs, self.k_cap, self.state.capacity)
        first = self.state.batch
        self.state.join(prompts, request_ids, specs)
        self.cache = self.cache.extend(self.target.allocate_cache(len(prompts), self.state.capacity))
        self.drafter.extend(len(prompts))
        if self.prefill_seconds is not None:
            self._prefill_rows(first)

    def cancel(self, index: int) -> None:
        """Request ``index`` leaves the batch now (finish reason "cancelled"); its cache rows are freed."""
        if index in self.state.active:
            self.state.rows[index].finish_reason = FinishReason.CANCELLED
            self._leave([self.state.active.index(index)])

    def _prefill_rows(self, first: int, goal: list[int] | None = None) -> float:
        """Prefill rows ``first ..`` of the batch (up to ``goal``: default, all but each prompt's last
        token); returns the seconds it took.

        If the batched prefill fails, each row is prefilled alone and only rows that fail alone
        leave (with finish_reason "error").
        """
        began, state = time.perf_counter(), self.state
        goal = goal or [length - 1 for length in state.lengths[first:]]
        rows = self.cache.rows(first, state.batch)
        failed = []
        try:
            prefill(self.target, rows, state.tokens[first:], goal)
            done = rows.past_len.tolist()
        except Exception:  # an engine fault: find the rows it belongs to
            done = []
            for b in range(first, state.batch):
                single = self.cache.rows(b, b + 1)  # from the batch's lengths: nothing of the failed call counts
                try:
                    prefill(self.target, single, state.tokens[b : b + 1], goal[b - first : b - first + 1])
                except Exception as exc:
                    state.fail(b, exc)
                    failed.append(b)
                done += single.past_len.tolist()
        self.cache.commit(self.cache.past_len.tolist()[:first] + done)
        ended = time.perf_counter()
        for index in state.active[first:]:
            state.rows[index].prefill_seconds, state.rows[index].decode_started = ended - began, ended
        if failed:
            self._leave(failed)
        return ended - began

    def _cycle(self, state: BatchState, cache: KVCache, drafter: Drafter):
        remaining = state.remaining()
        k = min(self._policy.next_k(), self.k_cap, max(remaining) - 1)
        # What drafts without the draft model where the policy finds the model not worth paying; a single
        # row only: from 2 rows on, verifying a row's drafts costs about what a plain step costs them all
        # (tools/load_test.py: lookup alone ran at 0.55x plain decoding with 8 clients)
        alone = None
        single = len(state.active) == 1
        sampled = 0.0  # seconds of a refused catch-up's sample (``Policy.catchup_sample``)
        if k > 0 and self._policy.weighs_catchup:
            behind = drafter.behind(state)
            if behind:
                rows, lacking, to_come = self.joining()
                if not self._policy.catchup_pays(len(state.active) + rows, behind + lacking, sum(remaining) + to_come):
                    sampled = self._sample_catchup(state, drafter)
                    alone = drafter.without_catchup() if single and not rows else None
                    k = k if alone else 0
        elif k == 0 and self.k_cap and single and max(remaining) > 1:
            alone = drafter.without_catchup()
            k = min(self.k_cap, max(remaining) - 1) if alone else 0
        drafter = alone or drafter
        budgets = None  # each row's own cap: its k and the tokens it has left (a sampled row's draws depend on it)
        if k > 0 and (state.capped or (state.sampling and min(remaining) <= k)):
            budgets = [max(0, min(k, config.k, left - 1)) for config, left in zip(state.configs(), remaining)]
        proposal = drafter.propose(state, k, budgets) if k > 0 else Proposal.none(len(state.active))
        if proposal.catchup_tokens > 2 and self._policy.weighs_catchup:  # the draft caught up after plain cycles
            self._policy.observe_catchup(proposal.catchup_seconds, proposal.catchup_tokens * len(state.active))
        k = proposal.drafts.shape[1]
        verified = self.target.infer(*state.verify_inputs(proposal.drafts), cache)  # logits [batch, k + 1, vocab]
        with self.accept_timer:
            accepted, emitted = self.accept(verified.logits, proposal, state)
        with self.cache_timer:
            seen = [length + n for length, n in zip(state.lengths, accepted)]  # what the target has now seen
            cache.commit(seen)
            drafter.rollback(seen)
            committed, finished = state.commit(accepted, emitted, remaining)
        if self.on_verified is not None:
            self.on_verified(verified.logits, committed)
        if self._policy.learns:  # the policy weighs the draft model: drafts made without it teach it a verification's cost alone
            without = proposal.without_model
            self._policy.observe(CycleOutcome(
                proposed=0 if without else k, accepted=[0] * len(accepted) if without else accepted,
                draft_seconds=proposal.seconds, draft_steps=proposal.steps,
                verify_seconds=verified.seconds, verify_tokens=k + 1, catchup_tokens=proposal.catchup_tokens,
                first_draft_seconds=proposal.catchup_seconds))
        self._record(state, k, proposal.limits, accepted, committed, proposal.seconds + sampled, verified.seconds,
                     self.cache_timer.seconds + verified.stage_seconds)  # staging the target's K/V is cache work
        return committed, finished

    def _sample_catchup(self, state: BatchState, drafter: Drafter) -> float:
        """Pay the sample of the draft's catch-up that the policy asks for after refusing it (none: 0); returns its seconds."""
        tokens = self._policy.catchup_sample()
        if not tokens:
            return 0.0
        began = time.perf_counter()
        catchup_seconds, fed, step_seconds = drafter.sample(state, tokens)
        self._policy.observe_sample(catchup_seconds, fed, step_seconds, len(state.active))
        return time.perf_counter() - began

    def _accept_greedy(self, logits: np.ndarray, proposal: Proposal, state: BatchState):
        """Each row keeps the drafts that equal the target's argmax, then emits the target's own token."""
        if state.penalized:
            logits = self._penalized(logits, proposal, state)
        target = logits.argmax(-1).tolist()  # [batch][k + 1]
        accepted = [greedy_accept_row(t, d) for t, d in zip(target, proposal.drafts.tolist())]
        if proposal.limits is not None:  # a row keeps no more drafts than it has; the target's token follows them
            accepted = [min(n, limit) for n, limit in zip(accepted, proposal.limits)]
        return accepted, target

    def _accept_sampled(self, logits: np.ndarray, proposal: Proposal, state: BatchState):
        configs = state.configs()
        if state.penalized:
            logits = self._penalized(logits, proposal, state)
        p = row_probabilities(logits, configs)  # [batch, k + 1, vocab]
        accepted, emitted = speculative_accept(p, proposal.q, proposal.drafts, state.rngs(), proposal.limits)
        return accepted.tolist(), emitted.tolist()

    def _penalized(self, logits: np.ndarray, proposal: Proposal, state: BatchState) -> np.ndarray:
        return np.stack([penalize_positions(logits[b], state.tokens[b, :at], proposal.drafts[b], config.repetition_penalty)
                         for b, (at, config) in enumerate(zip(state.lengths, state.configs()))])

    def _record(self, state: BatchState, k: int, limits: list[int] | None, accepted: list[int], committed: list,
                draft_s: float, verify_s: float, cache_s: float) -> None:
        """One record per row, with the drafts it had (``limits``, else k); the batched calls' seconds are
        shared out equally among the rows."""
        batch, now = len(state.active), time.perf_counter()
        for b, (n, (index, new)) in enumerate(zip(accepted, committed)):
            if limits is not None:
                k = limits[b]
            row = state.rows[index]
            row.decode_seconds = now - row.decode_started
            final = FinalToken.PLAIN if k == 0 else (FinalToken.BONUS if n == k else FinalToken.RECOVERED)
            row.records.append(CycleRecord(
                request_id=row.request_id, cycle=self.cycle, k=k, accepted=n, rejected_at=n + 1 if n < k else None,
                final=final, emitted=len(new), draft_s=draft_s / batch, verify_s=verify_s / batch,
                accept_s=self.accept_timer.seconds / batch, cache_s=cache_s / batch, batch_size=batch))

    def _isolate(self):
        """Re-run the failed cycle for each row alone, on views of its slots of the batch buffers."""
        state, committed, finished = self.state, [], []
        for b in range(state.batch):
            single, cache, drafter = state.subset(b), self.cache.rows(b, b + 1), self.drafter.row(b)
            try:
                new, done = self._cycle(single, cache, drafter)
            except Exception as exc:
                state.fail(b, exc)
                committed.append((state.active[b], []))
                finished.append(b)
                continue
            state.adopt(b, single)
            self.cache.commit_row(b, cache.past_len.item(0))
            self.drafter.adopt(b, drafter)
            committed += new
            finished += [b] if done else []
        return committed, finished

    def _leave(self, finished: list[int]) -> None:
        keep = self.state.leave(finished)
        self.cache = self.cache.select(keep)
        self.drafter.select(keep)


def _plan(prompts: list[np.ndarray], config: GenerationConfig, specs: Sequence[RowSpec] | None, k: int, limit: int) -> int:
    """Cache slots the rows need (``plan_capacity``): each prompt with its own max_new_tokens."""
    news = [spec.config.max_new_tokens for spec in specs] if specs else [config.max_new_tokens] * len(prompts)
    return max(plan_capacity([len(prompt)], new, k, limit) for prompt, new in zip(prompts, news))
