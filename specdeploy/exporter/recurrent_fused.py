"""The recurrent mixers (recurrent.py) in the fused form: standard ONNX ops, each state's buffer written in place.

A state's buffer [batch, slots, *shape] is a graph input (``cache_{state}.{layer}``) and, bound to the same memory,
an output (``present_{state}.{layer}``), as GroupQueryAttention's K/V are: ``GatherND`` reads the states at the
positions before the call, ``ScatterND`` writes the states of the call's last min(tokens, slots) positions at their
slots (ONNX Runtime's ScatterND copies its input to its output only when they are different buffers, so bound to the
same one it writes the new rows alone). The values written are computed from the values read, so the write runs
after the read even where the two touch the same slots (a prefill chunk longer than a ring). The arithmetic is the
explicit form's, node for node.

Which slots a call reads and writes come in as inputs the engine fills (``read_slots_{state}``, ``write_slots_{state}``:
``ModelSpec.takes_state_slots``), as GroupQueryAttention's ``seqlens_k`` does: computed in the graph from the lengths
and the call's shape, they were int64 nodes ONNX Runtime places on the CPU EP beside the CUDA kernels that read them,
each value copied to the device inside the call, which rules out CUDA-graph capture. What is left of the call's shape
(its token count, the rows) feeds only inputs a CUDA kernel reads on the host (Slice's starts, Range's bounds).
"""

from __future__ import annotations

import numpy as np

from .fused import FusedGraph
from .recurrent import Mamba2, ShortConv


def write_mixer(graph: FusedGraph, mixer, layer: int, h: str) -> str:
    """Layer ``layer``'s recurrent mixer on ``h`` [batch, tokens, hidden]; writes its states; returns its output."""
    return WRITERS[type(mixer)](graph, mixer, layer, h)


def _short_conv(graph: FusedGraph, conv: ShortConv, layer: int, h: str) -> str:
    at = f"layers.{layer}.conv"
    bcx = _linear(graph, h, conv.in_proj, conv.in_bias, f"{at}.in_proj")
    b, c, x = graph.node("Split", [bcx], 3, axis=-1, num_outputs=3)
    bx = graph.node("Mul", [b, x])[0]
    window = _window(graph, "conv", layer, bx)
    _write(graph, "conv", layer, window, conv.kernel - 1)
    out = _causal_conv(graph, window, conv.conv, conv.conv_bias, at)
    return _linear(graph, graph.node("Mul", [c, out])[0], conv.out_proj, conv.out_bias, f"{at}.out_proj")


def _mamba2(graph: FusedGraph, m: Mamba2, layer: int, h: str) -> str:
    at = f"layers.{layer}.mamba"
    sizes = graph.constant(f"{at}.split", np.array([m.inner, m.conv_dim, m.heads], np.int64))
    z, xbc, dt = graph.node("Split", [_linear(graph, h, m.in_proj, m.in_bias, f"{at}.in_proj"), sizes], 3, axis=-1)
    window = _window(graph, "conv", layer, xbc)
    _write(graph, "conv", layer, window, m.kernel - 1)
    conv = _causal_conv(graph, window, m.conv, m.conv_bias, at)
    conv = _silu(graph, conv)
    parts = graph.constant(f"{at}.xbc", np.array([m.inner, m.groups * m.d_state, m.groups * m.d_state], np.int64))
    x, b, c = graph.node("Split", [conv, parts], 3, axis=-1)
    x = _reshape(graph, x, [0, 0, m.heads, m.head_dim])  # [batch, T, heads, head_dim]
    b, c = (_heads(graph, t, m) for t in (b, c))  # [batch, heads, T, d_state]
    dt = graph.node("Add", [dt, graph.constant(f"{at}.dt_bias", m.dt_bias)])[0]
    dt = graph.node("Softplus", [dt])[0]
    limits = [graph.scalar(f"{at}.dt_{end}", v, np.float32) for end, v in zip(("min", "max"), m.limits)]
    dt = graph.node("Transpose", [graph.node("Clip", [dt, *limits])[0]], perm=[0, 2, 1])[0]  # [batch, heads, T]
    a = graph.constant(f"{at}.A", -np.exp(m.A_log.detach().numpy().astype(np.float64)).reshape(m.heads, 1))
    decay = graph.node("Mul", [dt, a])[0]  # log of each step's decay: [batch, heads, T]
    start = graph.node("Squeeze", [_read(graph, "ssm", layer), _axes(graph, [1])])[0]  # [batch, h, p, n]
    y, states = _ssd(graph, x, b, c, dt, decay, start, f"cache_ssm.{layer}", at)
    graph.node("ScatterND", [f"cache_ssm.{layer}", _slots_written(graph, "ssm"), states],
               [f"present_ssm.{layer}"], label=f"{at}.write_ssm")
    d = graph.constant(f"{at}.D", m.D.detach().numpy().reshape(m.heads, 1))
    y = graph.node("Add", [y, graph.node("Mul", [x, d])[0]])[0]
    y = graph.node("Mul", [_reshape(graph, y, [0, 0, m.inner]), _silu(graph, z)])[0]
    grouped = _reshape(graph, y, [0, 0, m.groups, m.inner // m.groups])
    ones = graph.constant(f"{at}.norm_unit", np.ones(m.inner // m.groups, np.float32))
    grouped = graph.node("SimplifiedLayerNormalization", [grouped, ones], axis=-1, epsilon=m.eps)[0]
    y = graph.node("Mul", [_reshape(graph, grouped, [0, 0, m.inner]), graph.constant(f"{at}.norm", m.norm)])[0]
    return _linear(graph, y, m.out_proj, m.out_bias, f"{at}.out_proj")


def _ssd(graph: FusedGraph, x, b, c, dt, decay, start, cache, at):
    """``recurrent.ssd`` as nodes: y [batch, T, heads, head_dim] and the states of the last min(T, slots) positions
    [batch, kept, heads, head_dim, d_state]."""
    tokens = _tokens(graph)
    rows = graph.node("Range", [graph.scalar("zero", 0), tokens, graph.scalar("one", 1)])[0]
    column, row = _unsqueeze(graph, rows, [0]), _unsqueeze(graph, rows, [1])
    below, on_or_below = graph.node("Greater", [row, column])[0], graph.node("GreaterOrEqual", [row, column])[0]
    zero = graph.scalar("zero_float", 0.0, np.float32)
    spread = graph.node("Where", [below, _unsqueeze(graph, decay, [3]), zero])[0]  # [batch, heads, T, T]
    summed = graph.node("CumSum", [spread, graph.constant("axis(-2)", np.array(-2, np.int64))])[0]
    minus_inf = graph.scalar("minus_inf_float", -np.inf, np.float32)
    between = graph.node("Exp", [graph.node("Where", [on_or_below, summed, minus_inf])[0]])[0]
    weights = graph.node("Mul", [between, _unsqueeze(graph, dt, [2])])[0]  # [batch, heads, t, s]
    scores = graph.node("Mul", [graph.node("MatMul", [c, graph.node("Transpose", [b], perm=[0, 1, 3, 2])[0]])[0],
                                weights])[0]
    xh = graph.node("Transpose", [x], perm=[0, 2, 1, 3])[0]  # [batch, heads, T, head_dim]
    from_start = graph.node("Exp", [graph.node("CumSum", [decay, graph.constant("axis(-1)", np.array(-1, np.int64))])[0]])[0]
    carried = graph.node("MatMul", [c, graph.node("Transpose", [start], perm=[0, 1, 3, 2])[0]])[0]  # [batch, h, T, p]
    y = graph.node("Add", [graph.node("MatMul", [scores, xh])[0],
                           graph.node("Mul", [_unsqueeze(graph, from_start, [3]), carried])[0]])[0]
    y = graph.node("Transpose", [y], perm=[0, 2, 1, 3])[0]
    kept_from = _kept_from(graph, cache)
    recent = _slice(graph, weights, kept_from, 2)  # [batch, heads, kept, T]
    xs = graph.node("Transpose", [x], perm=[0, 2, 3, 1])[0]  # [batch, heads, head_dim, T]
    spread = graph.node("Mul", [_unsqueeze(graph, recent, [3]), _unsqueeze(graph, xs, [2])])[0]
    states = graph.node("MatMul", [spread, _unsqueeze(graph, b, [2])])[0]  # [batch, heads, kept, p, n]
    decayed = _unsqueeze(graph, _slice(graph, from_start, kept_from, 2), [3, 4])
    states = graph.node("Add", [states, graph.node("Mul", [decayed, _unsqueeze(graph, start, [2])])[0]])[0]
    return y, graph.node("Transpose", [states], perm=[0, 2, 1, 3, 4])[0]


def _heads(graph: FusedGraph, t: str, m: Mamba2) -> str:
    """B or C [batch, T, groups * d_state] -> [batch, heads, T, d_state], each head its group's."""
    grouped = _reshape(graph, t, [0, 0, m.groups, 1, m.d_state])
    shape = graph.constant(f"heads_of_groups({m.heads},{m.groups})", np.array([1, 1, 1, m.heads // m.groups, 1], np.int64))
    heads = _reshape(graph, graph.node("Expand", [grouped, shape])[0], [0, 0, m.heads, m.d_state])
    return graph.node("Transpose", [heads], perm=[0, 2, 1, 3])[0]


def _window(graph: FusedGraph, state: str, layer: int, new: str) -> str:
    """The inputs of the ``lookback`` positions before the call, then the call's own: [batch, lookback + T, channels]."""
    return graph.node("Concat", [_read(graph, state, layer), new], axis=1)[0]


def _read(graph: FusedGraph, state: str, layer: int) -> str:
    """``recurrent.read_states``: the states of positions past_len - lookback .. past_len - 1 (zeros before 0) from
    layer ``layer``'s buffer of ``state``, at the slots the engine gives (``read_slots_{state}``).  # [batch, lookback,
    *shape]"""
    cache, shape = f"cache_{state}.{layer}", next(s.shape for s in graph.dims.states if s.name == state)
    index, valid = graph.shared(f"read_slots_{state}", lambda: _read_index(graph, state, cache, 2 + len(shape)))
    flat = _reshape(graph, cache, [-1, *shape])  # [batch * slots, *shape]: a view
    found = graph.node("Gather", [flat, index], axis=0)[0]  # [batch, lookback, *shape]
    return graph.node("Where", [valid, found, graph.scalar("zero_float", 0.0, np.float32)])[0]


def _read_index(graph: FusedGraph, state: str, cache: str, rank: int) -> tuple[str, str]:
    """Gather's indices [batch, lookback] into a buffer's rows flattened with its slots (row * slots + slot; slot 0
    where a position is before 0) and whether each position holds a state ([batch, lookback] and ``rank`` - 2 unit
    dims), shared by every layer of ``state``. Gather, not GatherND: ONNX Runtime's CUDA GatherND staged its strides
    from a host array freed after the call, which a captured CUDA graph re-reads at every replay (onnxruntime#32120).
    The rows' offsets are a Range whose bounds (batch x slots, slots) are read on the host."""
    slots, zero = f"read_slots_{state}", graph.scalar("zero", 0)
    batch = graph.node("Gather", [graph.node("Shape", ["input_ids"])[0], zero], axis=0)[0]
    size = _slots(graph, cache)
    offsets = graph.node("Range", [zero, graph.node("Mul", [batch, size])[0], size])[0]  # row * slots: [batch]
    index = graph.node("Add", [_unsqueeze(graph, offsets, [1]), graph.node("Max", [slots, zero])[0]])[0]
    valid = graph.node("GreaterOrEqual", [slots, zero])[0]  # -1: a position before the text
    return index, _unsqueeze(graph, valid, list(range(2, rank)))


def _write(graph: FusedGraph, state: str, layer: int, window: str, lookback: int) -> None:
    """Write the call's last min(T, slots) positions of ``window`` (the lookback's states, then the call's) into
    layer ``layer``'s buffer of ``state`` in place, as ``present_{state}.{layer}``."""
    cache = f"cache_{state}.{layer}"
    start = graph.node("Add", [_kept_from(graph, cache), graph.scalar(f"lookback({lookback})", lookback)])[0]
    updates = _slice(graph, window, start, 1)
    graph.node("ScatterND", [cache, _slots_written(graph, state), updates], [f"present_{state}.{layer}"],
               label=f"write({state}.{layer})")


def _slots_written(graph: FusedGraph, state: str) -> str:
    """ScatterND's indices [batch, kept, 2]: (row, ``write_slots_{state}[row, j]``) for j < kept, shared by every
    layer. The rows are a Range over the batch (its bounds read on the host, its values made on the device)."""
    def make() -> str:
        slot = f"write_slots_{state}"
        batch = graph.node("Gather", [graph.node("Shape", ["input_ids"])[0], graph.scalar("zero", 0)], axis=0)[0]
        rows = graph.node("Range", [graph.scalar("zero", 0), batch, graph.scalar("one", 1)])[0]
        rows = graph.node("Expand", [_unsqueeze(graph, rows, [1]), graph.node("Shape", [slot])[0]])[0]
        return graph.node("Concat", [_unsqueeze(graph, rows, [2]), _unsqueeze(graph, slot, [2])], axis=2)[0]

    return graph.shared(f"write_slots_{state}", make)


def _tokens(graph: FusedGraph) -> str:
    """The call's token count (an int64 scalar, on the host: it feeds Slice's starts and Range's bounds alone)."""
    return graph.shared("tokens", lambda: graph.node(
        "Gather", [graph.node("Shape", ["input_ids"])[0], graph.scalar("one", 1)], axis=0)[0])


def _kept_from(graph: FusedGraph, cache: str) -> str:
    """T - min(T, slots): the first of the call's positions whose state is written (a scalar)."""
    tokens = _tokens(graph)
    return graph.node("Sub", [tokens, graph.node("Min", [tokens, _slots(graph, cache)])[0]])[0]


def _slots(graph: FusedGraph, cache: str) -> str:
    """A state buffer's slots (its second dim), an int64 scalar."""
    return graph.node("Gather", [graph.node("Shape", [cache])[0], graph.scalar("one", 1)], axis=0)[0]


def _causal_conv(graph: FusedGraph, window: str, weight, bias, at: str) -> str:
    """``recurrent.causal_conv``: sum_j weight[:, j] * window[:, j : j + T] (+ bias)."""
    weight = weight.detach().numpy()
    kernel = weight.shape[1]
    out = None
    for j in range(kernel):
        ends = graph.constant(f"conv_end({j - kernel + 1})", np.array([j - kernel + 1 if j < kernel - 1 else
                                                                     np.iinfo(np.int64).max], np.int64))
        part = graph.node("Slice", [window, graph.constant(f"conv_start({j})", np.array([j], np.int64)), ends,
                                    graph.constant("axes(1)", np.array([1], np.int64))])[0]
        term = graph.node("Mul", [part, graph.constant(f"{at}.conv({j})", weight[:, j])])[0]
        out = term if out is None else graph.node("Add", [out, term])[0]
    return out if bias is None else graph.node("Add", [out, graph.constant(f"{at}.conv_bias", bias)])[0]


def _linear(graph: FusedGraph, x: str, weight, bias, name: str) -> str:
    out = graph.matmul(x, weight, name)
    return out if bias is None else graph.node("Add", [out, graph.constant(f"{name}_bias", bias)])[0]


def _silu(graph: FusedGraph, x: str) -> str:
    return graph.node("Mul", [x, graph.node("Sigmoid", [x])[0]])[0]


def _slice(graph: FusedGraph, x: str, start: str, axis: int) -> str:
    """x[start:] along ``axis`` (``start`` an int64 scalar)."""
    starts = _unsqueeze(graph, start, [0])
    ends = graph.constant("to_the_end", np.array([np.iinfo(np.int64).max], np.int64))
    return graph.node("Slice", [x, starts, ends, graph.constant(f"axes({axis})", np.array([axis], np.int64))])[0]


def _reshape(graph: FusedGraph, x: str, shape: list[int]) -> str:
    return graph.node("Reshape", [x, graph.constant(f"shape({','.join(map(str, shape))})", np.array(shape, np.int64))])[0]


def _unsqueeze(graph: FusedGraph, x: str, axes: list[int]) -> str:
    return graph.node("Unsqueeze", [x, _axes(graph, axes)])[0]


def _axes(graph: FusedGraph, axes: list[int]) -> str:
    return graph.constant(f"axes({','.join(map(str, axes))})", np.array(axes, np.int64))


WRITERS = {ShortConv: _short_conv, Mamba2: _mamba2}
