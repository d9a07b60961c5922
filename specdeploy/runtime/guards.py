"""How the low-level API may be used, checked where it is called: a ``Generation`` is moved by one thread at a time,
and ``join``/``merge`` take what a batch can hold, refused otherwise with the package's own errors.

Two threads stepping one batch interleave its cycles on the same caches: wrong tokens, silently in most trials.
A lock taken without waiting makes the second caller fail at once, naming both calls, rather than queueing (the
cost is a lock a call, well under a microsecond). The same thread may re-enter (``step`` runs ``prefill``).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Sequence

import numpy as np

from .config import checked_token_ids
from .errors import ConcurrentUseError, ConfigError
from .rows import RowSettings


def one_thread(method):
    """Guard a ``Generation`` method: ConcurrentUseError while another thread is inside any guarded method."""

    @functools.wraps(method)
    def guarded(self, *args, **kwargs):
        lock = self.__dict__.get("_in_use")
        if lock is None:
            lock = self.__dict__.setdefault("_in_use", threading.Lock())  # setdefault: one lock, whichever thread wins
        me = threading.get_ident()
        if self.__dict__.get("_in_use_by") == me:  # re-entered by the thread inside
            return method(self, *args, **kwargs)
        if not lock.acquire(blocking=False):
            raise ConcurrentUseError(f"Generation.{method.__name__}: called while another thread is in "
                                     f"Generation.{self.__dict__.get('_in_use_in')}; a Generation is moved by one thread "
                                     "at a time (share the Pipeline; give each thread its own Generation)")
        self._in_use_by, self._in_use_in = me, method.__name__
        try:
            return method(self, *args, **kwargs)
        finally:
            self._in_use_by = None
            lock.release()

    return guarded


def checked_join(generation, prompts, request_ids, settings) -> list[np.ndarray]:
    """The prompts of a ``Generation.join`` as int64 id arrays, once its arguments agree; ConfigError naming the one
    that does not (a string for a prompt, ids outside the vocabulary, lists of other lengths)."""
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or not prompts:
        raise ConfigError(f"prompts: got {type(prompts).__name__}; expected a non-empty list of token-id arrays")
    vocab = generation.target.spec.vocab_size
    checked = [checked_token_ids(prompt, vocab, f"prompts[{i}]") for i, prompt in enumerate(prompts)]
    empty = next((i for i, prompt in enumerate(checked) if not prompt.size), None)
    if empty is not None:
        raise ConfigError(f"prompts[{empty}]: got no tokens; expected at least one")
    if isinstance(request_ids, (str, bytes)) or not isinstance(request_ids, Sequence) or \
            len(request_ids) != len(prompts) or not all(isinstance(r, str) for r in request_ids):
        raise ConfigError(f"request_ids: got {_described(request_ids)}; expected {len(prompts)} strings, one a prompt")
    if settings is not None and (not isinstance(settings, Sequence) or len(settings) != len(prompts)
                                 or not all(isinstance(s, RowSettings) for s in settings)):
        raise ConfigError(f"settings: got {_described(settings)}; expected None or {len(prompts)} RowSettings, one a prompt")
    return checked


def check_merge(generation, other) -> None:
    """Refuse a ``Generation.merge`` whose ``other`` this batch cannot take: not a Generation, itself, another
    pipeline's, unprefilled, of another capacity or speculation, or in use by another thread."""
    if type(other) is not type(generation):
        raise ConfigError(f"other: got {type(other).__name__}; expected a Generation")
    if other is generation:
        raise ConfigError("other: got this Generation itself; expected another batch (its rows are already here)")
    if other.target is not generation.target:
        raise ConfigError("other: a Generation of another pipeline's target engine; expected one this pipeline started")
    if other.prefill_seconds is None:
        raise ConfigError("other: not prefilled; expected a Generation whose prefill is done (call other.prefill())")
    if other.state.capacity != generation.state.capacity:
        raise ConfigError(f"other: capacity {other.state.capacity}; expected this batch's {generation.state.capacity} "
                          "(start it with capacity=...)")
    if (other.draft_cache is None) != (generation.draft_cache is None) or other.k != generation.k:
        raise ConfigError(f"other: speculation k={other.k} {'with' if other.draft_cache is not None else 'without'} a "
                          f"draft model; expected this batch's k={generation.k} "
                          f"{'with' if generation.draft_cache is not None else 'without'} one")
    lock = other.__dict__.get("_in_use")
    if lock is not None and lock.locked() and other.__dict__.get("_in_use_by") != threading.get_ident():
        raise ConcurrentUseError(f"Generation.merge: other is in Generation.{other.__dict__.get('_in_use_in')} in another "
                                 "thread; a Generation is moved by one thread at a time")


def _described(value) -> str:
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        return f"{type(value).__name__} of {len(value)}"
    return type(value).__name__
