"""The decoder: a batch state and the cycle that moves it.

One cycle, for every active row b with L_b committed tokens x[0:L_b]: the policy says how many tokens to draft (by
the draft model, by prompt lookup or a suffix index), the drafter proposes d_1..d_K, the target runs
[x[L_b - 1], d_1..d_K] from past_len L_b - 1, acceptance keeps n_b drafts and emits one recovered or bonus token, the
state commits them; each cache's past_len moves to what it has seen of the new prefix (rollback moves a length).
Rows accept different numbers of tokens in the same call; finished rows leave the batch.

The words mean one thing each (docs/runtime.md's glossary has them all); those of this module:
- *request*: a prompt and its answer, one ``rows.Request`` record at its *request number* in ``requests``; ``results``
  lists their results (``RowResult``) by that number.
- *row* b: a request's place in the batch now (``active[b]``: its request number); ``batch``: how many rows.
- *committed length* L_b (``lengths``): a row's committed tokens, prompt included; a cache's ``past_len``: the prefix
  of them it holds (the target's L_b - 1 between cycles); the draft's *lag* (``Drafter.behind``): what it lacks.
- *k*: the most drafts a row may have (batch, row or policy); *drafted*: the drafts it had in a cycle.
- *emitted*: the n + 1 tokens acceptance gives a row; *committed*: those it keeps (cut at a stop).

Bookkeeping runs on Python ints: each distinct NumPy routine costs microseconds (``tools/bench_overhead.py``).
"""

from __future__ import annotations

import functools
import threading
import time
import warnings
from collections.abc import Callable, Sequence

import numpy as np

from ..engines.base import Engine, EngineOutput, KVCache
from .acceptance import accept_rows
from .answer_lengths import AnswerLengths
from .batching import RowCaches
from .cache import rows_slots
from .config import GenerationConfig
from .drafters import Drafter, Found, Proposal
from .errors import ConcurrentUseError
from .guards import check_merge, checked_join
from .policies import CycleOutcome, Policy
from .prefix_cache import PrefixCache
from .rows import Request, Roster, RowResult, RowSettings
from .telemetry import CycleRecord, FinalToken, FinishReason

# how an answer ends whose length tells how long answers run: by itself, or at its budget (not cancelled, not failed)
_ANSWERED = (FinishReason.EOS, FinishReason.STOP, FinishReason.LENGTH)
# () -> (rows about to join: a server's staged and queued requests, tokens the draft lacks of them, tokens to come)
Joining = Callable[[], tuple[int, int, float]]
# (logits [batch, K + 1, vocab] of a verification, (request number, tokens) each row committed), after the commit and
# before the next call reuses the buffer: token j of row b was drawn from logits[b, j]
Verified = Callable[[np.ndarray, list[tuple[int, list[int]]]], None]


class BatchState(Roster):
    """The batch a cycle moves: the ``Roster``'s token buffer, lengths and records, and what a cycle reads and
    changes of them (its budgets, the target's inputs, the commit); ``snapshot``/``restore`` undo a failed cycle."""

    batch = property(lambda self: len(self.active))

    def snapshot(self) -> tuple:
        """What a cycle changes before it commits: lengths, and the generators' states when sampling."""
        states = [rng.bit_generator.state for rng in self._rngs] if self.sampling else None
        return tuple(self.lengths), states

    def restore(self, snapshot: tuple) -> None:
        lengths, states = snapshot
        self.lengths = list(lengths)
        for rng, state in zip(self._rngs, states or []):
            rng.bit_generator.state = state

    def budgets(self) -> tuple[list[int], list[int]]:
        """Each active row's new tokens left to commit, and the most drafts it may have (its own k, and one fewer
        than the tokens left), in batch order; one pass over the rows, which every cycle makes."""
        left, caps = [], []
        for request in self.live:
            config = request.settings.config
            n = config.max_new_tokens - len(request.result.token_ids)
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
        finish reason is set. Returns (request number, committed tokens) per row and the rows that finished.
        """
        committed, finished = [], []
        for b, (number, request, n) in enumerate(zip(self.active, self.live, accepted)):
            at = self.lengths[b] + n  # the target has seen x[0:L] and n drafts; the next token follows them
            self.tokens[b, at] = emitted[b][n]
            self.lengths[b] = at + 1
            if request.noise:  # the noise of committed positions is spent
                request.noise = {position: noise for position, noise in request.noise.items() if position > at}
            row, new = request.result, _truncate(request, emitted[b][: n + 1], left[b])
            row.token_ids += new
            committed.append((number, new))
            if row.finish_reason:
                finished.append(b)
        return committed, finished


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
    """One batch of requests in flight: ``step()`` runs one cycle (after ``prefill()``) and reports what each row
    committed; the rows' caches (``caches``) follow the batch state's rows. A front end gives its policy and listeners
    at construction and uses ``step``, ``done``, ``results``, ``in_flight``, ``outlook``, ``prefill_chunk``, ``join``,
    ``merge``, ``cancel``, ``release`` and ``fail_all``; the next cycle asks whichever ``policy`` is set."""

    def __init__(self, target: Engine, drafter: Drafter, policy: Policy, config: GenerationConfig,
                 prompts: list[np.ndarray], request_ids: list[str], capacity: int | None = None,
                 settings: Sequence[RowSettings] | None = None, *, joining: Joining | None = None,
                 on_verified: Verified | None = None, prefixes: PrefixCache | None = None,
                 answers: AnswerLengths | None = None):
        """``config`` sets the batch's speculation and, unless ``settings`` gives each prompt its own, every row's
        settings. Listeners: ``joining`` (``Joining``; default: none join), ``on_verified`` (``Verified``).
        ``answers``: how long the pipeline's answers run, which the rows' finished lengths join and a catch-up is
        judged by (``to_come``; None: each row runs to its budget)."""
        self.target, self.drafter, self.policy, self.config = target, drafter, policy, config
        self.k = config.max_drafts
        if capacity is None:
            capacity = rows_slots(prompts, config, settings, self.k, target.spec.capacity)
        self.state = BatchState(config, capacity, set(target.spec.eos_token_ids))
        self.state.join(prompts, request_ids, settings)
        self.caches = RowCaches(target, drafter.engine if drafter.uses_model else None, len(prompts), capacity, prefixes)
        self.cycle = 0
        # the last cycle drafted every row by the model: no catch-up to judge, as asking is dear (docs/results/overhead)
        self.draft_caught_up = False
        self.prefill_seconds: float | None = None  # of the batch it started with; None until prefilled
        self.prefill_spent = 0.0  # by ``prefill_chunk`` calls so far
        self._draft_prefills: bool | None = None  # ``prefill_chunk(draft=None)``'s judgement, made once
        self.joining = joining or (lambda: (0, 0, 0))
        self.on_verified = on_verified
        self.answers = answers

    results = property(lambda self: self.state.results)  # list[RowResult], by request number (None once released)
    requests = property(lambda self: self.state.requests)  # list[Request], by request number (None once released)
    done = property(lambda self: not self.state.active)
    batch = property(lambda self: self.state.batch)  # rows in flight
    cache = property(lambda self: self.caches.cache)
    draft_cache = property(lambda self: self.caches.draft_cache)
    # the active requests, in batch order: (request number, result so far)
    in_flight = property(lambda self: [(i, request.result) for i, request in zip(self.state.active, self.state.live)])
    tokens = property(lambda self: self.state.tokens)  # these three: views of the state, for tests and tools
    lengths = property(lambda self: np.array(self.state.lengths, np.int64))
    active = property(lambda self: np.array(self.state.active, np.int64))

    def outlook(self) -> tuple[int, int, float]:
        """(rows, tokens the draft lacks of them: its lag, ``Drafter.behind``; their new tokens still to come, expected:
        ``to_come``)."""
        return self.state.batch, self.drafter.behind(self.state, self.draft_cache), self.to_come(self.state.budgets()[0])

    def to_come(self, left: list[int]) -> float:
        """The new tokens the active rows are expected to make still, ``left[b]`` at most for row b (``budgets``): as
        long as the pipeline's answers ran (``AnswerLengths.to_come``), or their budgets without ``answers``."""
        if self.answers is None:
            return sum(left)
        return sum(self.answers.to_come(len(request.result.token_ids), n) for request, n in zip(self.state.live, left))

    def release(self, number: int) -> None:
        """Forget finished request ``number`` once its result has been handed on (``BatchState.release``)."""
        self.state.release(number)

    @property
    def rows(self) -> list[RowResult | None]:
        """Deprecated since 0.5 (a row is a request's place in the batch, not its result): ``results``."""
        warnings.warn("Generation.rows is deprecated: use Generation.results", DeprecationWarning, stacklevel=2)
        return self.results

    def fail_all(self, exc: Exception) -> list[RowResult]:
        """Every active request ends with ``exc`` (a fault outside a cycle's own isolation); returns their results.
        The batch is spent."""
        for request in self.state.live:
            request.fail(exc)
        return [request.result for request in self.state.live]

    @one_thread
    def step(self) -> list[tuple[int, list[int]]]:
        """One cycle over the active rows (after the prefill, on the first call): (request number, committed tokens) per
        row. If an engine call fails, the cycle is rolled back (lengths only) and re-run row by row: a fault tied to one
        row fails that row alone (finish_reason "error", its message in ``error``), and the other rows go on."""
        if self.prefill_seconds is None:
            self.prefill()
            if self.done:
                return []
        state = self.state
        snapshot = state.snapshot()
        try:
            committed, finished = self.cycle_rows(state, self.caches.cache, self.caches.draft_cache)
        except Exception:  # an engine fault, whatever its type: find the rows it belongs to
            state.restore(snapshot)
            past_len = [length - 1 for length in state.lengths]  # what both models had seen: all but the last token
            self.caches.cache.commit(past_len)
            self.drafter.rollback(self.caches.draft_cache, past_len)
            committed, finished = self._isolate()
        self.cycle += 1
        if finished:
            self.leave(finished)
        return committed

    def cycle_rows(self, state: BatchState, cache: KVCache, draft_cache: KVCache | None):
        """One cycle, as the module's docstring has it; the policy hears what it cost and what it kept."""
        left, caps = state.budgets()
        past = max(state.lengths) - 1  # what the target has seen of the longest row: its calls attend over that
        self.policy.at_past(past)
        k, free_k = self._draft_lengths(state, draft_cache, left, caps)
        proposal = self._propose(state, draft_cache, k, free_k, caps) if k or free_k else Proposal.none(state.batch)
        # the target has seen all but each row's last token (prefill and commits keep it so): verify from its past_len
        verified = self.target.infer(state.verify_inputs(proposal.drafts), cache.past_len, cache,
                                     widths=[drafted + 1 for drafted in proposal.drafted])
        began = time.perf_counter()
        accepted, emitted = accept_rows(verified, proposal.drafts, proposal.drafted, proposal.q, state)
        accepted_at = time.perf_counter()
        past_len = [length + n for length, n in zip(state.lengths, accepted)]  # what the target has now seen
        cache.commit(past_len)
        self.drafter.rollback(draft_cache, past_len)
        self.draft_caught_up = proposal.first_call_tokens > 0 and not any(proposal.free)
        committed, finished = state.commit(accepted, emitted, left)
        if self.on_verified is not None:
            self.on_verified(verified.logits, committed)
        self.policy.observe(_outcome(proposal, accepted, verified, past))
        _record(state, self.cycle, proposal, accepted, committed, verified, accepted_at - began,
                time.perf_counter() - accepted_at)
        return committed, finished

    def _draft_lengths(self, state: BatchState, draft_cache: KVCache | None, left: list[int], caps: list[int]) -> tuple[int, int]:
        """This cycle's (model drafts, free drafts) a row, as the policy prices the sources the drafter has (index
        drafts by ``index_k``, prompt lookup's by ``next_k(lookup=True)``, the model's by ``next_k``), at most the rows'
        largest cap; the model drafts only where its catch-up pays (``_catchup_pays``)."""
        most = min(self.k, max(caps))
        if most <= 0:
            return 0, 0
        batch, drafter, policy = len(left), self.drafter, self.policy
        free = policy.index_k(batch) if drafter.uses_index else policy.next_k(batch, lookup=True) if drafter.finds_free else 0
        k = min(policy.next_k(batch), most) if drafter.uses_model else 0
        behind = drafter.behind(state, draft_cache) if k and not self.draft_caught_up else 0
        if behind and not self._catchup_pays(batch, behind, self.to_come(left)):
            k = 0
        return k, min(free, most)

    def _propose(self, state: BatchState, draft_cache: KVCache | None, k: int, free_k: int, caps: list[int]) -> Proposal:
        """The drafter's proposal of up to ``k`` model drafts and ``free_k`` free drafts a row: of a row's suffix-index
        drafts it verifies as many as the policy prices from their estimates (``Policy.free_drafts``; ``model``: the
        draft model drafts the other rows), and the model drafts the rows left without."""
        drafter, batch = self.drafter, state.batch
        found = drafter.find(state, free_k, caps) if free_k else Found.nothing(batch)
        if found.estimates is not None:
            price, model = self.policy.free_drafts, k > 0
            found = found.kept([price(batch, row, model) if len(row) else 0 for row in found.estimates])
        return drafter.propose(state, draft_cache, k, found, caps)

    def _catchup_pays(self, rows: int, lag: int, to_come: float) -> bool:
        """Does feeding the draft the ``lag`` tokens it lacks of ``rows`` rows (with ``to_come`` new tokens left) pay,
        in the batch they make with the rows about to join (``joining``)? The policy's call, made here alone: for a
        cycle's catch-up and for the draft's prefill of staged rows (``prefill_chunk(draft=None)``)."""
        joining, lacking, coming = self.joining()
        return self.policy.catchup_pays(rows + joining, lag + lacking, to_come + coming)

    @one_thread
    def prefill(self, first: int = 0, past_len: list[int] | None = None) -> float:
        """The target prefills rows ``first ..`` up to ``past_len`` (default: all but each prompt's last token, as each
        cycle starts from x[L - 1]); rows whose prefill fails alone leave, with finish_reason "error". Returns the
        seconds; the whole batch's (the default) are its ``prefill_seconds``, and the first ``step()`` runs it if need be."""
        state = self.state
        failed, seconds = self.caches.prefill(state.tokens, state.live,
                                              past_len or [length - 1 for length in state.lengths[first:]], first)
        if failed:
            self.leave(failed)
        if not first and past_len is None:
            self.prefill_seconds = seconds
        return seconds

    @one_thread
    def prefill_chunk(self, tokens: int, draft: bool | None = True) -> bool:
        """Prefill at most ``tokens`` more of each prompt, in the target and (``draft``) the draft; True once done.
        A server prefills joining requests so, a chunk between two cycles, then ``merge``s them: running rows never wait
        for a whole prompt. Without ``draft`` a cycle judges the draft's catch-up; ``draft=None``: the draft prefills if
        that pays in the batch they will make (``_catchup_pays``), judged once, after the target's first chunk: a
        burst's clients arrive ms apart, and the first judged alone would pay for a batch then decoded plainly."""
        state, caches = self.state, self.caches
        past_len = [min(past + tokens, length - 1) for past, length in zip(caches.cache.past_len.tolist(), state.lengths)]
        self.prefill_spent += self.prefill(0, past_len)
        if self.done:
            return True
        if draft is None and self._draft_prefills is None and caches.draft_cache is not None and self.k:
            lag = self.drafter.behind(state, caches.draft_cache)
            self._draft_prefills = not lag or self._catchup_pays(state.batch, lag, self.to_come(state.budgets()[0]))
        if caches.draft_cache is not None and self.k and (self._draft_prefills if draft is None else draft):
            spent, widest = caches.prefill_draft(state.tokens)
            self.prefill_spent += spent
            if widest:  # what the draft's catch-up costs: the policy weighs it before paying one
                self.policy.observe(CycleOutcome(state.batch, first_call_seconds=spent, first_call_tokens=widest,
                                                 past=max(state.lengths) - 1 - widest))
        if caches.cache.past_len.tolist() != [length - 1 for length in state.lengths]:
            return False
        self.prefill_seconds = self.prefill_spent
        ended = time.perf_counter()
        for request in state.live:
            request.result.prefill_seconds, request.result.decode_started = self.prefill_seconds, ended
        return True

    @one_thread
    def join(self, prompts: list[np.ndarray], request_ids: list[str], settings: Sequence[RowSettings] | None = None) -> None:
        """Requests join the batch between cycles, as new rows at its end; once the batch is prefilled, theirs is done
        here. Each must fit the batch's capacity (``cache.slots_needed``)."""
        state, prompts = self.state, checked_join(self, prompts, request_ids, settings)  # arguments: ``guards``
        rows_slots(prompts, self.config, settings, self.k, state.capacity)
        first = state.batch
        state.join(prompts, request_ids, settings)
        self.caches.add(len(prompts))
        self.draft_caught_up = False  # the draft has seen nothing of them
        if self.prefill_seconds is not None:
            self.prefill(first)

    @one_thread
    def merge(self, other: Generation) -> None:
        """Take ``other``'s rows (prefilled, with the same capacity and speculation) into this batch (``guards``)."""
        check_merge(self, other)
        self.caches.merge(other.caches)
        self.state.merge(other.state)
        self.draft_caught_up = False  # of the rows that joined, it may have seen nothing

    @one_thread
    def cancel(self, number: int) -> None:
        """Request ``number`` leaves the batch now (finish reason "cancelled"); its cache rows are freed."""
        if number in self.state.active:
            self.state.requests[number].result.finish_reason = FinishReason.CANCELLED
            self.leave([self.state.active.index(number)])

    @one_thread
    def leave(self, finished: list[int]) -> None:
        """Batch rows ``finished`` leave, with their cache rows; each one's text joins its scope's suffix index, and the
        length of an answer that ended (by itself or at its budget) joins ``answers``."""
        for b in finished:
            row = self.state.live[b].result
            if self.answers is not None and row.finish_reason in _ANSWERED:
                self.answers.add(len(row.token_ids), row.finish_reason != FinishReason.LENGTH)
            self.state.live[b].publish()
            self.caches.keep(b, self.state.tokens[b], self.state.live[b])
        self.caches.select(self.state.leave(finished))

    def _isolate(self) -> tuple[list, list[int]]:
        """Re-run a failed cycle for each row alone, on views of its slots of the batch buffers, so that a fault tied to
        one row fails that row alone (finish reason "error"); returns what ``cycle_rows`` returns."""
        state, committed, finished = self.state, [], []
        for b in range(state.batch):
            single, (cache, draft) = state.row(b), self.caches.alone(b)
            self.draft_caught_up = False  # what a row's cycle finds says nothing of the next row's draft
            try:
                new, done = self.cycle_rows(single, cache, draft)
            except Exception as exc:
                state.live[b].fail(exc)
                committed.append((state.active[b], []))
                finished.append(b)
                continue
            state.lengths[b] = single.lengths[0]
            self.caches.commit_alone(b, cache, draft)
            committed += new
            finished += [b] if done else []
        self.draft_caught_up = False
        return committed, finished


def _truncate(request: Request, new: list[int], left: int) -> list[int]:
    """``request``'s ``new`` tokens cut at a stop token, at ``left`` (what max_new_tokens leaves) or at a stop string;
    its result's finish reason says why it finished. Here, not on the record: the cycle reads in fewer modules."""
    row, stops = request.result, request.stops
    if not stops.isdisjoint(new):
        end = next(i for i, token in enumerate(new) if token in stops)
        new, row.finish_reason = new[: end + 1], FinishReason.EOS
    if len(new) >= left:
        del new[left:]
        row.finish_reason = row.finish_reason or FinishReason.LENGTH
    stop_check = request.settings.stop_check
    if stop_check is not None:
        keep = stop_check(row.token_ids, new)
        if keep is not None:
            new, row.finish_reason = new[:keep], FinishReason.STOP
    return new


def _outcome(proposal: Proposal, accepted: list[int], verified: EngineOutput, past: int) -> CycleOutcome:
    """What the policy hears of a cycle: the proposal's rows and draft calls, the drafts each row kept (``accepted``),
    and the target's call over K + 1 tokens a row (``verified``) after ``past`` tokens (the longest row's)."""
    return CycleOutcome(batch=len(proposal.drafted), drafted=proposal.drafted, accepted=accepted,
                        free=proposal.free, first_call_seconds=proposal.first_call_seconds,
                        first_call_tokens=proposal.first_call_tokens, later_call_seconds=proposal.later_call_seconds,
                        later_calls=proposal.later_calls, verify_seconds=verified.seconds,
                        verify_tokens=proposal.drafts.shape[1] + 1, estimates=proposal.estimates, past=past)


def _record(state: BatchState, cycle: int, proposal: Proposal, accepted: list[int], committed: list,
            verified: EngineOutput, accept_s: float, cache_s: float) -> None:
    """One record per row, with the drafts it had; the batched calls' seconds shared out equally among the rows
    (staging the target's K/V counts as cache work). Every ``CycleRecord`` is made here."""
    batch, now = len(accepted), time.perf_counter()
    draft_s, verify_s, accept_s = proposal.seconds / batch, verified.seconds / batch, accept_s / batch
    cache_s = (cache_s + verified.stage_seconds) / batch
    origins = proposal.origins or [None] * batch
    for drafted, n, free, origin, request, (_, new) in zip(proposal.drafted, accepted, proposal.free, origins,
                                                             state.live, committed):
        row = request.result
        row.decode_seconds = now - row.decode_started
        final = FinalToken.PLAIN if drafted == 0 else (FinalToken.BONUS if n == drafted else FinalToken.RECOVERED)
        row.records.append(CycleRecord(request_id=row.request_id, cycle=cycle, drafted=drafted, accepted=n,
                                       rejected_at=n + 1 if n < drafted else None, final=final, committed=len(new),
                                       draft_s=draft_s, verify_s=verify_s, accept_s=accept_s, cache_s=cache_s,
                                       batch_size=batch, free=free, drafted_from=origin))
