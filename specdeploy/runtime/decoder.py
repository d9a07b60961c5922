"""The decoder: a batch state and the cycle that moves it.

One cycle, for every active row b with L_b committed tokens x[0:L_b]:
  the policy says how many tokens to draft, by the draft model and by prompt lookup,
  the drafter proposes d_1..d_K,
  the target runs [x[L_b - 1], d_1..d_K] (K + 1 tokens) from past_len L_b - 1,
  acceptance keeps n_b drafts and emits one recovered or bonus token,
  the state commits them; the target's past_len moves to L_b + n_b, the draft's to what it has
  seen of the new prefix (rollback moves a length).
Rows accept different numbers of tokens in the same call; finished rows leave the batch.

Row b of the batch serves request ``active[b]``. Bookkeeping runs on Python ints: a cycle touches a handful of
numbers per row, where each distinct NumPy routine costs microseconds (``tools/bench_overhead.py``).
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np

from ..engines.base import Engine, EngineOutput, KVCache
from .acceptance import greedy_accept_row, sampled_accept
from .batching import isolate, join, merge, plan_rows, prefill_chunk, prefill_rows
from .config import GenerationConfig
from .drafters import Drafter, Proposal
from .errors import ConcurrentUseError
from .guards import check_merge, checked_join
from .policies import Policy
from .rows import RowResult, RowSettings
from .sampling import keyed_noise, penalize_rows, row_probabilities, unseeded_generator
from .telemetry import CycleRecord, FinalToken, FinishReason


class BatchState:
    """Token buffer [batch, capacity], committed lengths, active rows and their generators. Requests ``join`` and
    ``leave`` between cycles; ``row`` gives one row alone, on this state's buffers (``batching.isolate`` takes back its
    length); ``snapshot``/``restore`` undo a failed cycle."""

    def __init__(self, config: GenerationConfig, capacity: int, eos: set[int]):
        # config: the batch's speculation (k, drafter, policy) and the settings of rows joined without their own;
        # eos: the model's EOS ids (each row adds its stop_token_ids, or drops them with ignore_eos)
        self.config, self.capacity, self.eos = config, capacity, eos
        self.greedy = True  # every row joined so far decodes greedily: acceptance and drafting need no distribution
        self.penalized = False  # some row has a repetition penalty
        self.sampling = False  # some row samples: its generator state is part of a snapshot
        self.keyed = False  # some row samples with a seed: its draws are keyed by its positions (``noise``)
        self.tokens = np.zeros((0, capacity), np.int64)  # [batch, capacity]
        self.lengths: list[int] = []  # [batch] committed tokens
        self.active: list[int] = []  # [batch] request index of each row
        self.rows: list[RowResult] = []  # by request index, finished ones included
        self.settings: list[RowSettings] = []  # by request index
        self.stops: list[set[int]] = []  # by request index: the token ids that end it
        self.generators: list[np.random.Generator] = []  # by request index
        self.noises: list[dict[int, np.ndarray] | None] = []  # by request index: a seeded sampled row's noise by position

    @property
    def batch(self) -> int:
        return len(self.active)

    def join(self, prompts: Sequence[np.ndarray], request_ids: Sequence[str],
             settings: Sequence[RowSettings] | None = None) -> None:
        """Add requests as new rows at the end of the batch, each with its own settings (``settings``; default:
        the batch's config without stop strings, prompt i drawing from seed stream i of the batch)."""
        if settings is None:
            settings = [RowSettings(self.config, None, len(self.rows) + i) for i in range(len(prompts))]
        added = np.zeros((len(prompts), self.capacity), np.int64)
        for b, prompt in enumerate(prompts):
            added[b, : len(prompt)] = prompt
        for prompt, request_id, row in zip(prompts, request_ids, settings):
            config = row.config
            self.active.append(len(self.rows))
            self.rows.append(RowResult(request_id, prompt))
            self.settings.append(row)
            self.stops.append(set(config.stop_token_ids) | (set() if config.ignore_eos else self.eos))
            seeded = config.seed is not None
            self.generators.append(np.random.default_rng([config.seed, row.seed_stream]) if seeded else unseeded_generator())
            keyed = not config.greedy and seeded
            self.noises.append({} if keyed else None)
            self.greedy &= config.greedy
            self.sampling |= not config.greedy
            self.keyed |= keyed
            self.penalized |= config.repetition_penalty != 1.0
            self.lengths.append(len(prompt))
        self.tokens = np.concatenate([self.tokens, added])

    def merge(self, other: BatchState) -> None:
        """Append ``other``'s active rows (same capacity), with their results, settings and generators. An empty
        batch starts afresh: the requests that left are forgotten, and so are their settings' needs."""
        if not self.active:
            self.rows, self.settings, self.stops, self.generators, self.noises = [], [], [], [], []
            self.greedy, self.sampling, self.penalized, self.keyed = True, False, False, False
        offset = len(self.rows)
        self.rows += [other.rows[i] for i in other.active]
        self.settings += [other.settings[i] for i in other.active]
        self.stops += [other.stops[i] for i in other.active]
        self.generators += [other.generators[i] for i in other.active]
        self.noises += [other.noises[i] for i in other.active]
        self.active += range(offset, offset + other.batch)
        self.lengths += other.lengths
        self.tokens = np.concatenate([self.tokens, other.tokens])
        self.greedy &= other.greedy
        self.sampling |= other.sampling
        self.penalized |= other.penalized
        self.keyed |= other.keyed

    def release(self, index: int) -> None:
        """Forget finished request ``index`` (its result has been handed on): a long-running batch that
        requests keep joining does not grow with the ones that left."""
        if index not in self.active:
            self.rows[index] = self.settings[index] = self.stops[index] = self.generators[index] = self.noises[index] = None

    def leave(self, rows: Sequence[int]) -> list[int]:
        """Drop batch rows ``rows``; returns the rows that stay, in order (caches keep the same ones)."""
        drop = set(rows)
        keep = [b for b in range(self.batch) if b not in drop]
        self.tokens = self.tokens[keep]
        self.lengths = [self.lengths[b] for b in keep]
        self.active = [self.active[b] for b in keep]
        return keep

    def row(self, b: int) -> BatchState:
        """Row ``b`` alone, on a view of this token buffer and the same results, settings and generators."""
        single = BatchState(self.config, self.capacity, self.eos)
        single.greedy, single.penalized, single.sampling, single.keyed = self.greedy, self.penalized, self.sampling, self.keyed
        single.rows, single.settings, single.stops, single.generators = self.rows, self.settings, self.stops, self.generators
        single.noises = self.noises
        single.tokens, single.lengths, single.active = self.tokens[b : b + 1], [self.lengths[b]], [self.active[b]]
        return single

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

    def is_keyed(self, b: int) -> bool:
        """Row b samples with a seed: its draws are keyed by position (``noise``)."""
        return self.keyed and self.noises[self.active[b]] is not None

    def noise(self, b: int, position: int, vocab: int) -> np.ndarray | None:
        """Row b's keyed noise [vocab] for its token at ``position`` (``sampling.keyed_noise``, made once); None for a
        row that is not seeded and sampled."""
        index = self.active[b]
        noises = self.noises[index]
        if noises is None:
            return None
        if position not in noises:
            row = self.settings[index]
            noises[position] = keyed_noise(row.config.seed, row.seed_stream, position, vocab)
        return noises[position]

    def configs(self) -> list[GenerationConfig]:
        """The active rows' settings, in batch order."""
        return [self.settings[i].config for i in self.active]

    def budgets(self) -> tuple[list[int], list[int]]:
        """Each active row's new tokens left to commit, and the most drafts it may have (its own k, and one fewer
        than the tokens left), in batch order; one pass over the rows, which every cycle makes."""
        left, caps = [], []
        for i in self.active:
            config = self.settings[i].config
            n = config.max_new_tokens - len(self.rows[i].token_ids)
            left.append(n)
            caps.append(max(0, min(config.k, n - 1)))
        return left, caps

    def verify_inputs(self, drafts: np.ndarray) -> np.ndarray:
        """Place ``drafts`` [batch, K] after each row's committed tokens; return the target's input_ids [batch, K + 1]:
        row b runs [x[L_b - 1], d_1..d_K] from past_len L_b - 1 (the target's cache: it has seen all but the last)."""
        k = drafts.shape[1]
        lengths = self.lengths
        for b, at in enumerate(lengths):
            self.tokens[b, at : at + k] = drafts[b]
        first = lengths[0] - 1
        if lengths.count(first + 1) == len(lengths):  # every row at the same position: a slice
            input_ids = self.tokens[:, first : first + k + 1]
        else:
            index = np.array(lengths)[:, None] - 1 + np.arange(k + 1)  # [batch, K + 1]
            input_ids = np.take_along_axis(self.tokens, index, axis=1)
        return input_ids

    def commit(self, accepted: list[int], emitted: list[list[int]], left: list[int]) -> tuple[list, list[int]]:
        """Row b keeps its first accepted[b] drafts and emits emitted[b][accepted[b]] after them.

        Tokens past EOS, ``max_new_tokens`` (``left[b]``) or a stop string are cut, and the row's
        finish reason is set. Returns (request index, new tokens) per row and the rows that finished.
        """
        committed, finished = [], []
        for b, (index, n) in enumerate(zip(self.active, accepted)):
            at = self.lengths[b] + n  # the target has seen x[0:L] and n drafts; the next token follows them
            self.tokens[b, at] = emitted[b][n]
            self.lengths[b] = at + 1
            row = self.rows[index]
            if self.noises[index]:  # the noise of committed positions is spent
                self.noises[index] = {at: noise for at, noise in self.noises[index].items() if at > self.lengths[b] - 1}
            new = self._truncate(index, emitted[b][: n + 1], left[b])
            row.token_ids += new
            committed.append((index, new))
            if row.finish_reason:
                finished.append(b)
        return committed, finished

    def _truncate(self, index: int, new: list[int], left: int) -> list[int]:
        """Cut request ``index``'s new tokens at EOS, max_new_tokens or a stop string, and say why it finished."""
        row, stops = self.rows[index], self.stops[index]
        if not stops.isdisjoint(new):
            end = next(i for i, token in enumerate(new) if token in stops)
            new, row.finish_reason = new[: end + 1], FinishReason.EOS
        if len(new) >= left:
            del new[left:]
            row.finish_reason = row.finish_reason or FinishReason.LENGTH
        stop_check = self.settings[index].stop_check
        if stop_check is not None:
            keep = stop_check(row.token_ids, new)
            if keep is not None:
                new, row.finish_reason = new[:keep], FinishReason.STOP
        return new

    def publish(self, rows: Sequence[int]) -> None:
        """Batch rows ``rows``' prompts and answers join their scope's suffix index (``RowSettings.index``), for the
        requests that follow: only committed tokens, never drafts; a failed request's are left out."""
        for b in rows:
            index = self.active[b]
            row, shared = self.rows[index], self.settings[index].index
            if shared is not None and row.finish_reason != FinishReason.ERROR:
                shared.add(row.request_id, [*row.prompt_ids.tolist(), *row.token_ids])

    def fail(self, b: int, exc: Exception) -> None:
        """Row ``b`` ends with an engine fault that is its own."""
        row = self.rows[self.active[b]]
        row.finish_reason, row.error = FinishReason.ERROR, f"{type(exc).__name__}: {exc}"


def one_thread(method):
    """A ``Generation`` method that a second thread may not enter while another is inside any such method: two
    threads stepping one batch interleave its cycles on the same caches (wrong tokens, silently in most trials). The
    second caller fails at once (ConcurrentUseError) rather than queueing; the thread inside may re-enter."""
    name = method.__name__

    @functools.wraps(method)
    def guarded(self, *args, **kwargs):
        held, me = self.__dict__, threading.get_ident()
        if held.get("_in_use_by") == me:  # re-entered by the thread inside (``step`` runs ``prefill``)
            return method(self, *args, **kwargs)
        lock = held.get("_in_use") or held.setdefault("_in_use", threading.Lock())  # one lock, whichever thread wins
        if not lock.acquire(False):
            raise ConcurrentUseError(f"Generation.{name}: called while another thread is in Generation."
                                     f"{held.get('_in_use_in')}; a Generation is moved by one thread at a time (share "
                                     "the Pipeline; give each thread its own Generation)")
        held["_in_use_by"], held["_in_use_in"] = me, name
        try:
            return method(self, *args, **kwargs)
        finally:
            held["_in_use_by"] = None
            lock.release()

    return guarded


class Generation:
    """One batch of requests in flight; ``step()`` runs one cycle and reports what each row committed. The target's
    cache and the draft model's (``draft_cache``; None for a drafter without a model) hold the batch's rows; requests
    join, leave and merge between cycles. ``prefill()`` runs first (``step()`` calls it if need be)."""

    def __init__(self, target: Engine, drafter: Drafter, policy: Policy, config: GenerationConfig,
                 prompts: list[np.ndarray], request_ids: list[str], capacity: int | None = None,
                 settings: Sequence[RowSettings] | None = None):
        """``config`` sets the batch's speculation (k, drafter, policy) and, unless ``settings`` gives each
        prompt its own, every row's sampling, length and stop settings."""
        self.target, self.drafter, self.policy, self.config = target, drafter, policy, config
        self.k = config.k if config.speculative else 0
        if capacity is None:
            capacity = plan_rows(prompts, config, settings, self.k, target.spec.capacity)
        self.state = BatchState(config, capacity, set(target.spec.eos_token_ids))
        self.state.join(prompts, request_ids, settings)
        self.cache = target.allocate_cache(len(prompts), capacity)
        self.draft_cache = drafter.engine.allocate_cache(len(prompts), capacity) if drafter.uses_model else None
        self.cycle = 0
        # the last cycle drafted every row by the model: the draft lacks no token ``Drafter.behind`` counts, so no catch-up
        # is judged (asking cost 2 us a cycle at batch 1); joins, merges and a failed cycle's rows run alone clear it
        self.draft_caught_up = False
        self.prefill_seconds: float | None = None  # of the batch it started with; None until prefilled
        self.prefill_spent = 0.0  # by ``prefill_chunk`` calls so far
        # rows about to join (a server's prefilling and queued requests): () -> (rows, prompt tokens the draft lacks,
        # tokens to come). A catch-up is judged for the batch they make: drafting there needs theirs too.
        self.joining: Callable[[], tuple[int, int, int]] = lambda: (0, 0, 0)
        # (logits [batch, K + 1, vocab] of a verification, (request index, tokens) each row committed from it), called
        # after the commit, before the next call reuses the logits' buffer: token j of a row was drawn from logits[b, j]
        # (a server's logprobs). None: nobody asks, and on a GPU the logits never leave it.
        self.on_verified: Callable[[np.ndarray, list[tuple[int, list[int]]]], None] | None = None

    rows = property(lambda self: self.state.rows)  # list[RowResult], by request index
    done = property(lambda self: not self.state.active)
    # views of the state, for tests and tools
    tokens = property(lambda self: self.state.tokens)
    lengths = property(lambda self: np.array(self.state.lengths, np.int64))
    active = property(lambda self: np.array(self.state.active, np.int64))

    @one_thread
    def step(self) -> list[tuple[int, list[int]]]:
        """One cycle over the active rows (after the prefill, on the first call): (request index, newly committed token
        ids) per row. If an engine call fails, the cycle is rolled back (lengths only: nothing was committed) and re-run
        row by row, so that a fault tied to one row fails that row alone; a failed row ends with finish_reason "error"
        and its message in ``error``, and the other rows go on."""
        if self.prefill_seconds is None:
            self.prefill()
            if self.done:
                return []
        state = self.state
        snapshot = state.snapshot()
        try:
            committed, finished = self.cycle_rows(state, self.cache, self.draft_cache)
        except Exception:  # an engine fault, whatever its type: find the rows it belongs to
            state.restore(snapshot)
            before = [length - 1 for length in state.lengths]  # what both models had seen: all but the last token
            self.cache.commit(before)
            self.drafter.rollback(self.draft_cache, before)
            committed, finished = isolate(self)
        self.cycle += 1
        if finished:
            self.leave(finished)
        return committed

    def cycle_rows(self, state: BatchState, cache: KVCache, draft_cache: KVCache | None):
        """One cycle, as the module's docstring has it; the policy hears what it cost and what it kept."""
        left, caps = state.budgets()
        k, lookup_k = self._draft_lengths(state, draft_cache, left, caps)
        if self.drafter.indexes:
            self.drafter.priced_by(self.policy.free_drafts)  # the policy of this cycle (a front end may swap it)
        proposal = (self.drafter.propose(state, draft_cache, k, lookup_k, caps) if k or lookup_k
                    else Proposal.none(state.batch))
        # the target has seen all but each row's last token (prefill and commits keep it so): verify from its past_len
        verified = self.target.infer(state.verify_inputs(proposal.drafts), cache.past_len, cache)
        began = time.perf_counter()
        accepted, emitted = self.accept(verified, proposal, state)
        accepted_at = time.perf_counter()
        seen = [length + n for length, n in zip(state.lengths, accepted)]  # what the target has now seen
        cache.commit(seen)
        self.drafter.rollback(draft_cache, seen)
        self.draft_caught_up = proposal.first_call_tokens > 0 and not any(proposal.lookup)
        committed, finished = state.commit(accepted, emitted, left)
        if self.on_verified is not None:
            self.on_verified(verified.logits, committed)
        self.policy.observe(proposal.outcome(accepted, verified.seconds))
        self._record(state, proposal, accepted, committed, verified, accepted_at - began, time.perf_counter() - accepted_at)
        return committed, finished

    def _draft_lengths(self, state: BatchState, draft_cache: KVCache | None, left: list[int],
                       caps: list[int]) -> tuple[int, int]:
        """Drafts this cycle makes by the draft model and by prompt lookup, as the policy prices them, at most the rows'
        largest cap. The model drafts only where its catch-up pays, judged with the rows about to join (``joining``)."""
        most = min(self.k, max(caps))
        if most <= 0:
            return 0, 0
        batch = len(left)
        free = (self.policy.index_k(batch) if self.drafter.indexes else
                self.policy.next_k(batch, lookup=True) if self.drafter.looks_up else 0)
        lookup_k = min(free, most)
        k = min(self.policy.next_k(batch), most) if self.drafter.uses_model else 0
        behind = self.drafter.behind(state, draft_cache) if k and not self.draft_caught_up else 0
        if behind:
            rows, lacking, to_come = self.joining()
            if not self.policy.catchup_pays(batch + rows, behind + lacking, sum(left) + to_come):
                k = 0
        return k, lookup_k

    def accept(self, verified: EngineOutput, proposal: Proposal, state: BatchState) -> tuple[list[int], list[list[int]]]:
        """(accepted drafts, emitted tokens) per row: greedy on Python ints while every row is greedy, from the
        target's argmax ids alone (on a GPU, K + 1 integers a row reach the host, not K + 1 rows of logits)."""
        logits = None if state.greedy and not state.penalized else verified.logits  # greedy alone: the ids suffice
        if state.penalized:
            logits = penalize_rows(logits, state.tokens, state.lengths, proposal.drafts, state.configs())
        if state.greedy:  # each row keeps the drafts equal to the target's argmax, then emits its own token
            target = (verified.ids if logits is None else logits.argmax(-1)).tolist()  # [batch][K + 1]
            drafts = proposal.drafts.tolist()
            return [min(greedy_accept_row(t, d), n) for t, d, n in zip(target, drafts, proposal.drafted)], target
        p = row_probabilities(logits, state.configs())  # [batch, K + 1, vocab]
        width, vocab = proposal.drafts.shape[1], p.shape[-1]
        noises = [[state.noise(b, at + j, vocab) for j in range(width + 1)] if state.is_keyed(b) else None
                  for b, at in enumerate(state.lengths)]  # seeded rows' draws keyed by position
        return sampled_accept(p, proposal.q, proposal.drafts, proposal.drafted, state.rngs(), noises)

    @one_thread
    def prefill(self) -> None:
        """The target sees every prompt token but the last (each cycle starts from x[L - 1]); the first
        ``step()`` calls this when nobody did."""
        self.prefill_seconds = prefill_rows(self, 0)

    @one_thread
    def prefill_chunk(self, tokens: int, draft: bool | Callable[[], bool] = True) -> bool:
        """Prefill at most ``tokens`` more of each prompt, in both models (``prefill.prefill_chunk``); True once done."""
        return prefill_chunk(self, tokens, draft)

    @one_thread
    def merge(self, other: Generation) -> None:
        """Take ``other``'s rows (prefilled, with the same capacity and speculation) into this batch (``guards``)."""
        check_merge(self, other)
        merge(self, other)

    @one_thread
    def join(self, prompts: list[np.ndarray], request_ids: list[str], settings: Sequence[RowSettings] | None = None) -> None:
        """Requests join the batch between cycles, as new rows at its end (``batching.join``; arguments: ``guards``)."""
        join(self, checked_join(self, prompts, request_ids, settings), request_ids, settings)

    @one_thread
    def cancel(self, index: int) -> None:
        """Request ``index`` leaves the batch now (finish reason "cancelled"); its cache rows are freed."""
        if index in self.state.active:
            self.state.rows[index].finish_reason = FinishReason.CANCELLED
            self.leave([self.state.active.index(index)])

    def _record(self, state: BatchState, proposal: Proposal, accepted: list[int], committed: list, verified,
                accept_s: float, cache_s: float) -> None:
        """One record per row, with the drafts it had; the batched calls' seconds shared out equally among the rows
        (staging the target's K/V counts as cache work)."""
        batch, now = len(accepted), time.perf_counter()
        draft_s, verify_s, accept_s = proposal.seconds / batch, verified.seconds / batch, accept_s / batch
        cache_s = (cache_s + verified.stage_seconds) / batch
        origins = proposal.origins or [None] * batch
        for k, n, lookup, origin, (index, new) in zip(proposal.drafted, accepted, proposal.lookup, origins, committed):
            row = state.rows[index]
            row.decode_seconds = now - row.decode_started
            final = FinalToken.PLAIN if k == 0 else (FinalToken.BONUS if n == k else FinalToken.RECOVERED)
            # made as the tuple it is, in CycleRecord's field order: the named constructor cost 1 us a cycle more
            row.records.append(tuple.__new__(CycleRecord, (row.request_id, self.cycle, k, n, n + 1 if n < k else None,
                                                           final, len(new), draft_s, verify_s, accept_s, cache_s, batch, lookup,
                                                           origin)))

    @one_thread
    def leave(self, finished: list[int]) -> None:
        """Batch rows ``finished`` leave, with their cache rows; each one's text joins its scope's suffix index."""
        self.state.publish(finished)
        keep = self.state.leave(finished)
        self.cache = self.cache.select(keep)
        if self.draft_cache is not None:
            self.draft_cache = self.draft_cache.select(keep)
