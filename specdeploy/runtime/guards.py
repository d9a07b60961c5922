"""What ``Generation.join`` and ``Generation.merge`` may be given, checked before the batch is touched: anything a
batch cannot take is refused with the package's own errors, naming the argument (``ConfigError``), instead of a
raw NumPy or attribute error from inside the batch (or, for ``merge(itself)``, rows decoded twice). That one thread
at a time moves a ``Generation`` is the decoder's own guard (``decoder.one_thread``).
"""

from __future__ import annotations

from collections.abc import Sequence
from threading import get_ident

import numpy as np

from .config import checked_token_ids
from .errors import ConcurrentUseError, ConfigError
from .rows import RowSettings


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
    pipeline's, unprefilled, of another capacity, speculation or mode (exact), or in use by another thread."""
    if type(other) is not type(generation):
        raise ConfigError(f"other: got {type(other).__name__}; expected a Generation")
    if other is generation:
        raise ConfigError("other: got this Generation itself; expected another batch (its rows are already here)")
    if other.config.exact != generation.config.exact:
        raise ConfigError(f"other: exact={other.config.exact}; expected this batch's exact={generation.config.exact} "
                          "(exact mode pads every target call of a batch)")
    if other.target is not generation.target:
        raise ConfigError("other: a Generation of another pipeline's target engine; expected one this pipeline started")
    if other.state.capacity != generation.state.capacity:
        raise ConfigError(f"merge: capacity {other.state.capacity} != {generation.state.capacity}: other has another "
                          "capacity than this batch (start it with capacity=...)")
    if other.prefill_seconds is None:
        raise ConfigError("other: not prefilled; expected a Generation whose prefill is done (call other.prefill())")
    if (other.draft_cache is None) != (generation.draft_cache is None) or other.k != generation.k:
        raise ConfigError(f"other: speculation k={other.k} {'with' if other.draft_cache is not None else 'without'} a "
                          f"draft model; expected this batch's k={generation.k} "
                          f"{'with' if generation.draft_cache is not None else 'without'} one")
    lock = other.__dict__.get("_in_use")
    if lock is not None and lock.locked() and other.__dict__.get("_in_use_by") != get_ident():
        raise ConcurrentUseError(f"Generation.merge: other is in Generation.{other.__dict__.get('_in_use_in')} in another "
                                 "thread; a Generation is moved by one thread at a time")


def _described(value) -> str:
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        return f"{type(value).__name__} of {len(value)}"
    return type(value).__name__
