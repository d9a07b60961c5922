"""A generation's rows coming and going: their prefill (all at once, or a chunk at a time in both models), joins,
merges, and a failed cycle re-run row by row."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from ..engines.base import prefill
from .cache import plan_capacity
from .config import GenerationConfig
from .policies import CycleOutcome
from .rows import RowSettings

if TYPE_CHECKING:
    from .decoder import Generation


def prefill_rows(generation: Generation, first: int, goal: list[int] | None = None) -> float:
    """Prefill rows ``first ..`` of the batch in the target (up to ``goal``: default, all but each prompt's last
    token); returns the seconds it took. If the batched prefill fails, each row is prefilled alone and only rows
    that fail alone leave (with finish_reason "error")."""
    began, state, cache = time.perf_counter(), generation.state, generation.cache
    goal = goal or [length - 1 for length in state.lengths[first:]]
    rows = cache.rows(first, state.batch)
    failed = []
    try:
        prefill(generation.target, rows, state.tokens[first:], goal)
        done = rows.past_len.tolist()
    except Exception:  # an engine fault: find the rows it belongs to
        done = []
        for b in range(first, state.batch):
            single = cache.rows(b, b + 1)  # from the batch's lengths: nothing of the failed call counts
            try:
                prefill(generation.target, single, state.tokens[b : b + 1], goal[b - first : b - first + 1])
            except Exception as exc:
                state.fail(b, exc)
                failed.append(b)
            done += single.past_len.tolist()
    cache.commit(cache.past_len.tolist()[:first] + done)
    ended = time.perf_counter()
    for index in state.active[first:]:
        state.rows[index].prefill_seconds, state.rows[index].decode_started = ended - began, ended
    if failed:
        generation.leave(failed)
    return ended - began


def prefill_chunk(generation: Generation, tokens: int, draft: bool | Callable[[], bool] = True) -> bool:
    """Prefill at most ``tokens`` more of each prompt, in the target and (``draft``) the draft; True once done.

    A server prefills requests that join a running batch this way, a chunk between two of its cycles, then
    ``merge``s them: running rows never wait for a whole long prompt, in either model. Without ``draft`` the
    draft has seen nothing of these rows: a cycle then judges whether that catch-up pays. A callable ``draft``
    is asked after the target's chunk, so that what happened meanwhile (requests that queued up) counts.
    """
    state, cache, draft_cache = generation.state, generation.cache, generation.draft_cache
    goal = [min(past + tokens, length - 1) for past, length in zip(cache.past_len.tolist(), state.lengths)]
    generation.prefill_spent += prefill_rows(generation, 0, goal)
    if generation.done:
        return True
    if draft_cache is not None and generation.k and (draft() if callable(draft) else draft):
        began, seen = time.perf_counter(), draft_cache.past_len.tolist()
        prefill(generation.drafter.engine, draft_cache, state.tokens, cache.past_len.tolist())
        spent = time.perf_counter() - began
        generation.prefill_spent += spent
        widest = max(now - before for now, before in zip(draft_cache.past_len.tolist(), seen))
        if widest:  # what the draft's catch-up costs: the policy weighs it before paying one
            generation.policy.observe(CycleOutcome(state.batch, first_call_seconds=spent, first_call_tokens=widest))
    if cache.past_len.tolist() != [length - 1 for length in state.lengths]:
        return False
    generation.prefill_seconds = generation.prefill_spent
    ended = time.perf_counter()
    for index in state.active:
        state.rows[index].prefill_seconds, state.rows[index].decode_started = generation.prefill_seconds, ended
    return True


def join(generation: Generation, prompts: list[np.ndarray], request_ids: list[str],
         settings: Sequence[RowSettings] | None = None) -> None:
    """Requests join the batch between cycles, as new rows at its end; once the batch is prefilled, theirs is done
    here. Each must fit the batch's capacity (prompt + max_new_tokens + k + 1)."""
    state = generation.state
    plan_rows(prompts, generation.config, settings, generation.k, state.capacity)
    first = state.batch
    state.join(prompts, request_ids, settings)
    generation.cache = generation.cache.extend(generation.target.allocate_cache(len(prompts), state.capacity))
    if generation.draft_cache is not None:
        joining = generation.drafter.engine.allocate_cache(len(prompts), state.capacity)
        generation.draft_cache = generation.draft_cache.extend(joining)
        generation.draft_caught_up = False  # the draft has seen nothing of them
    if generation.prefill_seconds is not None:
        prefill_rows(generation, first)


def merge(generation: Generation, other: Generation) -> None:
    """``other``'s rows (prefilled, with the same capacity and speculation) join ``generation``'s batch."""
    if other.state.capacity != generation.state.capacity:
        raise ValueError(f"merge: capacity {other.state.capacity} != {generation.state.capacity}")
    generation.state.merge(other.state)
    generation.cache = generation.cache.extend(other.cache)
    if generation.draft_cache is not None:
        generation.draft_cache = generation.draft_cache.extend(other.draft_cache)
        generation.draft_caught_up = False  # of the rows that joined, it may have seen nothing


def plan_rows(prompts: list[np.ndarray], config: GenerationConfig, settings: Sequence[RowSettings] | None, k: int,
              limit: int) -> int:
    """Cache slots the rows need (``plan_capacity``): each prompt with its own max_new_tokens."""
    news = [row.config.max_new_tokens for row in settings] if settings else [config.max_new_tokens] * len(prompts)
    return max(plan_capacity([len(prompt)], new, k, limit) for prompt, new in zip(prompts, news))


def isolate(generation: Generation) -> tuple[list, list[int]]:
    """Re-run a failed cycle for each row alone, on views of its slots of the batch buffers, so that a fault tied to
    one row fails that row alone (finish reason "error"); returns what ``Generation.cycle_rows`` returns."""
    state, committed, finished = generation.state, [], []
    for b in range(state.batch):
        single, cache = state.row(b), generation.cache.rows(b, b + 1)
        draft = None if generation.draft_cache is None else generation.draft_cache.rows(b, b + 1)
        generation.draft_caught_up = False  # what a row's cycle finds says nothing of the next row's draft
        try:
            new, done = generation.cycle_rows(single, cache, draft)
        except Exception as exc:
            state.fail(b, exc)
            committed.append((state.active[b], []))
            finished.append(b)
            continue
        state.lengths[b] = single.lengths[0]
        generation.cache.commit_row(b, cache.past_len.item(0))
        if draft is not None:
            generation.draft_cache.commit_row(b, draft.past_len.item(0))
        committed += new
        finished += [b] if done else []
    generation.draft_caught_up = False
    return committed, finished
