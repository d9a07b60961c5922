"""One Engine interface over every backend; the runtime never asks which backend it has.

``feed`` and ``prefill`` bring the rows of a cache up to date in as few calls as the interface allows,
whatever each row lags by: speculation-agnostic, they serve prefill, a draft's catch-up and replays.
"""

from __future__ import annotations

import time
import weakref
from abc import ABC, abstractmethod
from collections.abc import Sequence
from functools import cached_property
from typing import NamedTuple

import numpy as np

from ..contract import PREFILL_CHUNK, ModelSpec, StateSpec
from ..values import is_integer, short
from .memory import NUMPY_DTYPES, address, copy_prefixes, copy_states, describe, on_host, settle, write_states


class EngineInputError(ValueError):
    """An input that does not fit the engine's verify contract."""


class EngineClosedError(RuntimeError):
    """A call on an engine that was closed (``Engine.close``)."""


class EngineOutput:
    """One call's results. They may live in buffers the engine reuses: valid until the engine's next call on the same
    thread with the same batch and token count; copy what must outlive that.

    ``logits`` (next-token logits after each kept position, [batch, kept, vocab] float32) and ``ids`` (each kept
    position's argmax token, [batch, kept] int64) are host arrays; where the engine computes on a device they are
    copied to the host when first read, so a caller that needs only the argmax ids (greedy acceptance) moves
    [batch, kept] integers, not [batch, kept, vocab] floats.
    """

    def __init__(self, logits, new_kv, seconds: float, stage_seconds: float = 0.0, ids=None, new_states=()):
        self._computed = logits  # where the engine computed them: host or device (``__getattr__`` copies those)
        if isinstance(logits, np.ndarray):  # a field at once: the CPU's hot path reads them
            self.logits = logits
        self._ids = ids  # the graph's argmax output, host or device, where it has one
        # The new tokens' K/V as the graph returned them, already in the cache: [2 * layers, batch, kv_heads, tokens,
        # head_dim]; None where the graph writes the cache itself (the fused form)
        self.new_kv = new_kv
        # Each recurrent state's states of the call's last positions ([layers, batch, written, *shape] a state), already
        # in the cache: ``StateSpec``; () where the model has none or the graph writes them itself
        self.new_states = new_states
        self.seconds = seconds  # the backend's call, without input checks and K/V staging
        self.stage_seconds = stage_seconds  # writing the new K/V into the cache

    def __getattr__(self, name: str) -> np.ndarray:
        """Reached only for ``logits`` still on a device: copied to the host once, when first read."""
        if name != "logits" or "_computed" not in self.__dict__:
            raise AttributeError(name)
        self.logits = on_host(self._computed)
        return self.logits

    @property
    def ids(self) -> np.ndarray:
        """The graph's own ``ids`` output where it has one, else the argmax of the logits; in host memory."""
        ids = self._ids
        if ids is None:  # no ids output: the argmax of the logits, taken where they are
            ids = self._ids = self._computed.argmax(-1)
        if not isinstance(ids, np.ndarray):
            ids = self._ids = on_host(ids)
        return ids


class NewCache(NamedTuple):
    """What an explicit graph's call returns for its cache (``Engine.infer_impl``): the new tokens' K/V, [2 * kv layers,
    batch, kv_heads, tokens, head_dim], and each recurrent state's states of the call's last positions, [layers, batch,
    written, *shape] a state (``StateSpec.written``)."""

    kv: object
    states: tuple = ()


class KVCache:
    """The K/V buffers of one model for a batch, owned by the engine that computes on them, and
    each row's valid length ``past_len`` (slots at and beyond it are ignored, so rollback moves a length).

    One array [2 * layers, batch, kv_heads, capacity, head_dim] where the session computes (NumPy on the CPU, CuPy
    on a GPU; the engine binds each element to its session by address): element i is cache tensor i (``buffers``),
    and writing a call's new K/V into every layer is one copy. The handle reads like that array (``len``, iteration,
    indexing, ``shape``). Rows joining and leaving move where the array is; only ``past_len`` lives on the host.

    A hybrid model's recurrent states (``ModelSpec.states``) are cache too, one array a state kind, [layers, batch,
    slots, *shape] (``states``; each element bound as ``cache_{state}.{layer}``: ``state_buffers``): position p's state
    at slot p mod slots, where slots is the capacity (positional, as K/V) or a ring's length. Every slot a row's
    length can roll back to holds its state, so rollback is still a length; they move with the rows as K/V does.
    """

    def __init__(self, stacked: np.ndarray, rows_held: np.ndarray | None = None, states: Sequence = (),
                 states_held: Sequence | None = None):
        # ``rows_held``: the allocation these rows are the first of (rows that left keep their memory for the next
        # to join); each layer's rows stay one contiguous block, as the engines bind them. ``states_held``: the same
        # of each state array
        self.stacked = stacked
        self.on_host = isinstance(stacked, np.ndarray)  # else a device's: its copies must settle before a call reads it
        self.held = stacked if rows_held is None else rows_held
        self.buffers = list(stacked)  # [k0, v0, k1, v1, ...], each [batch, kv_heads, capacity, head_dim]
        self.states = tuple(states)
        self.states_held = self.states if states_held is None else tuple(states_held)
        self.state_buffers = [layer for group in self.states for layer in group]  # the state inputs' order
        self.commit(np.zeros(stacked.shape[1], dtype=np.int64))

    @property
    def shape(self) -> tuple[int, ...]:
        return self.stacked.shape

    @property
    def capacity(self) -> int:
        return self.stacked.shape[3]

    def __len__(self) -> int:
        return len(self.buffers)

    def __iter__(self):
        return iter(self.buffers)

    def __getitem__(self, index):
        return self.stacked[index]

    def commit(self, lengths) -> None:
        """Move each row's valid prefix to ``lengths`` [batch] (a new array: an earlier one is left as it was)."""
        self.past_len = np.array(lengths, dtype=np.int64)

    def commit_row(self, row: int, length: int) -> None:
        """Move one row's valid prefix to ``length``."""
        past = self.past_len.tolist()
        past[row] = length
        self.commit(past)

    def stage(self, new_kv, start: np.ndarray) -> None:
        """Write new K/V (2 * layers of [batch, kv_heads, T, head_dim]) at slots start[b] .. start[b] + T."""
        if isinstance(new_kv, (list, tuple)):  # engines may return a list; ONNX Runtime's engine one stacked array
            new_kv = np.stack(new_kv)  # NumPy's, or CuPy's for device arrays (NEP 18 dispatch)
        s = start.item(0)
        if len(start) == 1 or (start == s).all():
            self.stacked[:, :, :, s : s + new_kv.shape[3]] = new_kv  # every layer and row in one copy
        else:
            tokens = new_kv.shape[3]
            for b, s in enumerate(start.tolist()):
                self.stacked[:, b, :, s : s + tokens] = new_kv[:, b]
        if not self.on_host:  # asked here, not by a call to ``settle``: a cycle stages 5 times (1 us at batch 1)
            settle(self.stacked)

    def stage_states(self, new_states, start: np.ndarray, tokens: int) -> None:
        """Write each state's new states ([layers, batch, written, *shape], the call's last ``written`` positions of
        ``tokens``) at their slots: position p at p mod slots."""
        for group, new in zip(self.states, new_states):
            write_states(group, new, (start + (tokens - new.shape[2])).tolist())

    def select(self, rows) -> KVCache:
        """A cache of only ``rows`` (finished rows leave the batch; in order), lengths along, on the same memory (a new
        array would move the whole cache): the rows that stay move up over those that left, and this handle is spent.
        Only each row's valid prefix moves: a draft that has seen nothing of its rows moves nothing."""
        rows = [int(r) for r in rows]
        lengths = self.past_len[rows]
        in_place = rows == sorted(rows) and self._first_rows()
        to = self.stacked if in_place else np.zeros_like(self.stacked[:, : len(rows)])  # CuPy's for device arrays
        copy_prefixes(to, range(len(rows)), self.stacked, rows, lengths)
        states = [group if in_place else np.zeros_like(group[:, : len(rows)]) for group in self.states]
        for to_group, group in zip(states, self.states):
            copy_states(to_group, range(len(rows)), group, rows, lengths)
        if in_place:
            kept = KVCache(self.held[:, : len(rows)], self.held, [held[:, : len(rows)] for held in self.states_held],
                           self.states_held)
        else:
            kept = KVCache(to, states=states)
        kept.commit(lengths)
        return kept

    def _first_rows(self) -> bool:
        """Whether these rows are the first of their allocation, which the next rows may use."""
        return self.held is not None and (self.held is self.stacked or address(self.stacked) == address(self.held))

    def rows(self, start: int, stop: int) -> KVCache:
        """Rows start .. stop - 1 alone, on views of the batch buffers: what they write lands in the batch
        (their lengths are their own until committed back)."""
        part = KVCache(self.stacked[:, start:stop], states=[group[:, start:stop] for group in self.states])
        part.held = None  # a view into this batch: ``select`` and ``extend`` never write through it
        part.commit(self.past_len[start:stop])
        return part

    def extend(self, other: KVCache) -> KVCache:
        """A cache of these rows followed by ``other``'s (rows joining a batch; this handle is spent). They take
        the memory of rows that left (``select``) when there is enough; else all move to a new allocation."""
        batch, joining = self.stacked.shape[1], other.stacked.shape[1]
        if self._first_rows() and self.held.shape[1] >= batch + joining:
            joined = KVCache(self.held[:, : batch + joining], self.held,
                             [held[:, : batch + joining] for held in self.states_held], self.states_held)
        else:
            def grown(array):
                shape = list(array.shape)
                shape[1] = batch + joining
                return np.zeros_like(array, shape=shape)  # zeros: never-written slots hold no NaN

            joined = KVCache(grown(self.stacked), states=[grown(group) for group in self.states])
            copy_prefixes(joined.stacked, range(batch), self.stacked, range(batch), self.past_len)
            for to, group in zip(joined.states, self.states):
                copy_states(to, range(batch), group, range(batch), self.past_len)
        copy_prefixes(joined.stacked, range(batch, batch + joining), other.stacked, range(joining), other.past_len)
        for to, group in zip(joined.states, other.states):
            copy_states(to, range(batch, batch + joining), group, range(joining), other.past_len)
        joined.commit(np.concatenate([self.past_len, other.past_len]))
        return joined


class StagedCalls:
    """How a checked call runs and keeps the cache current where the graph returns the new tokens' K/V (our explicit
    form, an optimum import): the engine writes them into the cache at each row's past_len. Each engine chooses its
    way once (``call_form``)."""

    rows_alone = False  # a call of several rows runs as one

    @staticmethod
    def run(engine: Engine, input_ids: np.ndarray, past_len: np.ndarray, cache: KVCache, kept: int,
            widths: list[int] | None = None) -> EngineOutput:
        start = time.perf_counter()  # one call of all rows: a row's padding costs what its tokens do
        logits, new, ids = engine.infer_impl(input_ids, past_len, cache, kept)
        new_kv, new_states = (new.kv, new.states) if isinstance(new, NewCache) else (new, ())
        ran = time.perf_counter()
        cache.stage(new_kv, past_len)
        cache.stage_states(new_states, past_len, input_ids.shape[1])
        return EngineOutput(logits, new_kv, ran - start, time.perf_counter() - ran, ids, new_states)


class InPlaceCalls:
    """Where the graph writes the new tokens' K/V into the cache itself (our fused form, an onnxruntime-genai import),
    nothing to stage.
    GroupQueryAttention takes several new tokens after a past only at batch 1, so such calls at a larger batch run
    row by row, on views of the rows' buffers (each row of a layer's cache is one contiguous block)."""

    rows_alone = True  # a call of several rows and tokens runs row by row (``feed`` gives each row its own tokens)

    @staticmethod
    def run(engine: Engine, input_ids: np.ndarray, past_len: np.ndarray, cache: KVCache, kept: int,
            widths: list[int] | None = None) -> EngineOutput:
        start = time.perf_counter()
        batch, tokens = input_ids.shape
        if batch == 1 or tokens == 1:
            logits, _, ids = engine.infer_impl(input_ids, past_len, cache, kept)
            return EngineOutput(logits, None, time.perf_counter() - start, ids=ids)
        # row by row anyway, so each row runs only its own tokens (a verification's row with fewer drafts than the
        # widest: at batch 2 on a CPU, a row without drafts padded to 5 tokens cost 2.3 one-token calls)
        widths = widths if widths is not None and kept == tokens else [tokens] * batch
        logits = ids = None
        for b, width in enumerate(widths):
            row_logits, _, row_ids = engine.infer_impl(input_ids[b : b + 1, :width], past_len[b : b + 1],
                                                       cache.rows(b, b + 1), min(kept, width))
            if logits is None:  # where the rows' outputs are: host or device (CuPy's for device arrays); a shorter
                # row's padded positions read zeros
                logits = np.zeros_like(row_logits, shape=(batch, kept, *row_logits.shape[2:]))
                ids = None if row_ids is None else np.zeros_like(row_ids, shape=(batch, kept))
            logits[b, :width] = row_logits[0]
            if ids is not None:
                ids[b, :width] = row_ids[0]
        return EngineOutput(logits, None, time.perf_counter() - start, ids=ids)


class ClosedCalls:
    """An engine after ``close``: every call is refused."""

    rows_alone = False

    @staticmethod
    def run(engine: Engine, *args) -> EngineOutput:
        raise EngineClosedError(f"{engine.spec.role}: the engine is closed (Engine.close); load it again to run it")


class Engine(ABC):
    """A verify-v1 decoder. ``infer`` checks inputs, times the call and keeps the cache current;
    backends implement ``infer_impl``. ``close`` (or leaving ``with engine:``) releases what the backend holds."""

    spec: ModelSpec

    @property
    def cache_dtype(self) -> np.dtype:
        return np.dtype(NUMPY_DTYPES[self.spec.dtype])

    @property
    def rows_alike(self) -> bool:
        """Whether a position's logits and the K/V it writes are the same bits whichever call computes it (a one-token
        call, a verification's row j, a prefill chunk, at any batch): then greedy speculative output is plain output
        bit for bit with nothing padded (``runtime.exact``). False unless a backend's kernels were measured so."""
        return False

    @cached_property
    def call_form(self) -> StagedCalls | InPlaceCalls | ClosedCalls:
        """How this engine's calls run and write the cache, chosen once from its graph's form."""
        return InPlaceCalls() if self.spec.writes_cache else StagedCalls()

    def allocate_cache(self, batch: int, capacity: int) -> KVCache:
        """Zero-filled key/value buffers [k0, v0, k1, v1, ...], each [batch, kv_heads, capacity, head_dim], and each
        recurrent state's [layers, batch, slots, *shape], where this engine computes (host memory here)."""
        return allocated(self.spec, batch, capacity, self.cache_dtype, np.zeros)

    def infer(self, input_ids: np.ndarray, past_len: np.ndarray, cache: KVCache, last: int | None = None,
              widths: Sequence[int] | None = None) -> EngineOutput:
        """Run new tokens ``input_ids`` [batch, tokens] at ``past_len`` [batch] over ``cache``.

        The new tokens' K/V are written into the cache at slots past_len[b] .. past_len[b] + tokens;
        ``cache.past_len`` is the caller's to move. ``last``: only the logits after each row's last ``last`` tokens
        are wanted; a graph that can (``spec.trims_logits``) computes only those, [batch, last, vocab], the others
        all of them. ``widths``: where every position's logits are kept, the tokens of each row that matter (row b's
        first widths[b]; the rest pad a ragged batch, like a verification's row with fewer drafts): a form that runs
        rows alone runs each only that far, its padding's logits zeros and its K/V unwritten. Raises
        EngineInputError for inputs that do not fit the contract, EngineClosedError once closed.
        """
        self._check(input_ids, past_len, cache)
        kept = input_ids.shape[1]
        if last is not None:
            if last < 1:
                raise EngineInputError(f"{self.spec.role}: last | received {last}; expected at least 1 token's logits")
            if self.spec.trims_logits:
                kept = min(last, kept)
        return self.call_form.run(self, input_ids, past_len, cache, kept,
                                  None if widths is None else self._checked_widths(widths, *input_ids.shape))

    def _checked_widths(self, widths, batch: int, tokens: int) -> list[int]:
        # a sequence of integers only: a dict would give its keys, a bool would pass as width 1
        given = list(widths) if isinstance(widths, (list, tuple, np.ndarray)) and np.ndim(widths) == 1 else None
        if given is None or len(given) != batch or any(not is_integer(w) or not 1 <= w <= tokens for w in given):
            shown = (describe(widths) if isinstance(widths, np.ndarray) else f"{type(widths).__name__} {short(widths, 40)}"
                     if given is None else repr(given) if len(given) <= 16 else f"{len(given)} values")
            raise EngineInputError(f"{self.spec.role}: widths | received {shown}; expected {batch} integers in "
                                   f"[1, {tokens}] (each row's tokens that matter)")
        return [int(w) for w in given]

    @abstractmethod
    def infer_impl(self, input_ids, past_len, cache: KVCache, kept: int) -> tuple:
        """Run the backend on checked inputs; return (logits, new K/V, ids): the logits of each row's last ``kept``
        tokens (all of them unless ``spec.trims_logits``), the new K/V per layer (a ``NewCache`` where the model has
        recurrent states too; None where the graph writes them into the cache itself) and each kept position's argmax
        ids [batch, kept] (None where the graph does not compute them). Outputs may be device arrays (``EngineOutput``
        copies what is read to the host)."""

    def close(self) -> None:
        """Release what the backend holds (backends add their sessions and bound buffers); later calls raise
        EngineClosedError. Closing twice is harmless. Caches from ``allocate_cache`` stay their holders'."""
        self.call_form = ClosedCalls()
        self._checked_cache = None

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check(self, input_ids, past_len, cache) -> None:
        role = self.spec.role
        if not isinstance(input_ids, np.ndarray) or input_ids.dtype != np.int64 or input_ids.ndim != 2:
            raise EngineInputError(f"{role}: input tensor input_ids | received {describe(input_ids)}; expected int64 "
                                   "[batch, tokens]")
        batch, tokens = input_ids.shape
        if batch == 0 or tokens == 0:
            raise EngineInputError(f"{role}: input tensor input_ids | received empty shape {input_ids.shape}")
        if not isinstance(past_len, np.ndarray) or past_len.dtype != np.int64 or past_len.shape != (batch,):
            raise EngineInputError(f"{role}: input tensor past_len | received {describe(past_len)}; expected int64 ({batch},)")
        capacity = self._check_cache(cache, batch)
        # decode, draft and verify calls pass a handful of values: Python's min/max beat four NumPy reductions
        past = past_len.tolist()
        if min(past) < 0 or max(past) + tokens > capacity:
            raise EngineInputError(f"{role}: past_len {past} + {tokens} new tokens exceeds cache capacity {capacity}")
        if input_ids.size <= 64:
            ids = input_ids.ravel().tolist()
            low, high = min(ids), max(ids)
        else:
            low, high = int(input_ids.min()), int(input_ids.max())
        if low < 0 or high >= self.spec.vocab_size:
            raise EngineInputError(f"{role}: input_ids range [{low}, {high}] outside the vocabulary [0, {self.spec.vocab_size})")

    def _check_cache(self, cache, batch: int) -> int:
        """Check the cache handle and its tensors' count, shapes and dtype (each is bound on its own); return their
        capacity. A request passes the same cache on every call: the last that passed is not checked again while it is
        the one passed (by identity; 56 tensors on a 28-layer model)."""
        known = getattr(self, "_checked_cache", None)
        if known is not None and known() is cache and cache.stacked.shape[1] == batch:
            return cache.stacked.shape[3]
        role = self.spec.role
        if not isinstance(cache, KVCache):
            raise EngineInputError(f"{role}: cache | received {describe(cache)}; expected a KVCache (Engine.allocate_cache)")
        spec = self.spec
        if len(cache) != 2 * len(spec.kv_layers):
            raise EngineInputError(f"{role}: received {len(cache)} cache tensors; expected {2 * len(spec.kv_layers)}")
        if len(cache.state_buffers) != len(spec.state_inputs):
            raise EngineInputError(f"{role}: received {len(cache.state_buffers)} recurrent state tensors; expected "
                                   f"{len(spec.state_inputs)} ({', '.join(spec.state_inputs[:4]) or 'none'})")
        capacity = cache.stacked.shape[3] if cache.stacked.ndim == 5 else -1
        expected = spec.cache_shape(batch, capacity)
        for name, buf in zip(spec.cache_inputs, cache.buffers):
            if buf.shape != expected or buf.dtype != self.cache_dtype:
                raise EngineInputError(
                    f"{role}: input tensor {name} | received {describe(buf)}; expected {spec.dtype} {expected}")
        wanted = [state.buffer_shape(batch, capacity) for state in spec.states for _ in state.layers]
        for name, shape, buf in zip(spec.state_inputs, wanted, cache.state_buffers):
            if buf.shape != shape or buf.dtype != self.cache_dtype:
                raise EngineInputError(
                    f"{role}: input tensor {name} | received {describe(buf)}; expected {spec.dtype} {shape}")
        self._checked_cache = weakref.ref(cache)  # weak: a finished request's caches must go
        return capacity


def allocated(spec: ModelSpec, batch: int, capacity: int, dtype, zeros) -> KVCache:
    """A zero-filled cache of ``spec``'s K/V and recurrent states for ``batch`` rows of ``capacity`` slots, made by
    ``zeros(shape, dtype)`` (NumPy's, or an engine's memory's)."""
    kv = zeros((2 * len(spec.kv_layers), *spec.cache_shape(batch, capacity)), dtype)
    return KVCache(kv, states=[zeros((len(state.layers), *state.buffer_shape(batch, capacity)), dtype)
                               for state in spec.states])


def state_slots(state: StateSpec, past_len: np.ndarray, tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """The slots of ``state``'s buffers a call of ``tokens`` tokens at ``past_len`` [batch] reads and writes, as a fused
    graph takes them (``ModelSpec.takes_state_slots``): [batch, lookback] those of positions past_len - lookback ..
    past_len - 1, -1 for a position before 0 (its state is zeros), and [batch, written] those of the call's last
    ``state.written(tokens)`` positions. Position p sits at slot p mod slots (p itself where positional)."""
    reads = past_len[:, None] + np.arange(-state.lookback, 0)
    writes = past_len[:, None] + np.arange(tokens - state.written(tokens), tokens)
    if state.slots:
        return np.where(reads < 0, -1, reads % state.slots), writes % state.slots
    return np.maximum(reads, -1), writes


def feed(engine: Engine, cache: KVCache, tokens: np.ndarray, ends: list[int]) -> tuple[np.ndarray, int]:
    """Bring each row's cache up to ``ends[b]`` tokens of ``tokens`` [batch, width]; one engine call.

    Rows needing fewer new tokens than the longest re-feed tokens they already cached (their K/V is
    recomputed and overwritten with the same values), so one [batch, T] call serves a ragged
    batch. A row too short to start T tokens back is right-padded instead: its padding lands beyond
    ``ends[b]`` and is never committed. Commits past_len = ends.
    Returns the logits after each row's token ends[b] - 1, [batch, vocab] (a view of the engine's
    output), and T.
    """
    seen = cache.past_len.tolist()
    lags = [end - past for end, past in zip(ends, seen)]
    width = max(lags)
    if width > 1 and len(ends) > 1 and _rows_alone(engine, lags):
        return _feed_rows(engine, cache, tokens, ends), width
    if lags.count(width) == len(lags):  # every row lags alike (always at batch 1, a draft's catch-up each cycle):
        start, last = seen, None  # each row from its own past, its last fed token at the end
    else:
        start = [max(0, min(past, end - width)) for end, past in zip(ends, seen)]
        last = [end - 1 - s for end, s in zip(ends, start)]  # where each row's last fed token sits
    first = start[0]
    if start.count(first) == len(start):  # every row from the same slot (always at batch 1): a slice
        input_ids = tokens[:, first : first + width]
    else:
        index = np.minimum(np.array(start)[:, None] + np.arange(width), tokens.shape[1] - 1)
        input_ids = np.take_along_axis(tokens, index, axis=1)  # [batch, T]
    trailing = last is None or last.count(width - 1) == len(last)  # every row's at the end: one position's logits
    logits = engine.infer(input_ids, cache.past_len if start == seen else np.array(start), cache,
                          1 if trailing else None).logits
    cache.commit(ends)
    if trailing:
        return logits[:, -1], width
    return logits[np.arange(len(last)), last], width


def _rows_alone(engine: Engine, lags: list[int]) -> bool:
    """Whether rows that lag by ``lags`` tokens are fed one at a time: a fused graph runs such calls row by row anyway,
    and a ring of recurrent states (``ModelSpec.keeps_ring``) cannot take a batched ragged feed, which re-feeds some rows
    from further back than their ring reaches and pads others past the states they still need."""
    return engine.call_form.rows_alone or (engine.spec.keeps_ring and len(set(lags)) > 1)


def _feed_rows(engine: Engine, cache: KVCache, tokens: np.ndarray, ends: list[int]) -> np.ndarray:
    """``feed`` one row at a time, each row its own tokens: a graph that writes its cache itself runs such a
    call row by row anyway (``InPlaceCalls``), and padded to the longest row, a draft's catch-up
    of one joining row at a batch of 4 computed its prompt 4 times. A row with nothing new re-feeds its last
    token, for its logits; one brought to 0 tokens (a one-token prompt's prefill stops at length - 1 = 0) has no
    token to re-feed and no next-token distribution: it is not fed, its logits are NaN."""
    logits = np.empty((len(ends), engine.spec.vocab_size), np.float32)
    for b, (end, past) in enumerate(zip(ends, cache.past_len.tolist())):
        if end == 0:  # re-feeding "its last token" would move its length to -1 and feed an empty slice
            logits[b] = np.nan
            continue
        row = cache.rows(b, b + 1)
        row.commit([min(past, end - 1)])
        logits[b] = feed(engine, row, tokens[b : b + 1], [end])[0][0]
    cache.commit(ends)
    return logits


def prefill(engine: Engine, cache: KVCache, tokens: np.ndarray, goal: list[int]) -> None:
    """Bring each row's cache up to ``goal[b]`` tokens of ``tokens``, in calls of at most PREFILL_CHUNK tokens
    (a fused graph's rows each fed their own: ``_feed_rows``)."""
    seen = cache.past_len.tolist()
    if (len(goal) > 1 and any(past < end for past, end in zip(seen, goal))
            and _rows_alone(engine, [end - past for past, end in zip(seen, goal)])):
        # Row by row here, not chunk by chunk through ``feed``: there a row already at its goal would re-feed its last
        # token in every chunk the others still need, one wasted engine call each.
        for b, (past, end) in enumerate(zip(seen, goal)):
            if past < end:
                row = cache.rows(b, b + 1)
                prefill(engine, row, tokens[b : b + 1], [end])
        cache.commit(goal)  # as ``feed`` leaves it: a row past its goal is brought back to it
        return
    while True:
        seen = cache.past_len.tolist()
        if all(past >= end for past, end in zip(seen, goal)):
            return
        feed(engine, cache, tokens, [min(end, past + PREFILL_CHUNK) for past, end in zip(seen, goal)])
