"""Op by op: where a target's arithmetic for one position first differs between two calls (``bench_exactness --ops``).

A call's shape can change a position's logits (int4 MatMulNBits has a one-row kernel; attention a one-token path).
This module runs the target's graph as ONNX Runtime optimizes it for the engine (the same fusions, so the same
kernels), every node's outputs exposed as graph outputs and the optimizer then off, and compares one position's slice
of every intermediate between two calls over the same tokens: the first node whose output differs, and by how much.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class Call:
    """One target call and the position of it compared: row ``row``'s new token ``at`` ([batch, tokens] ``ids`` from
    each row's ``past``)."""

    ids: np.ndarray  # [batch, tokens] int64
    past: list[int]
    row: int = 0
    at: int = 0

    @property
    def shape(self) -> str:
        batch, tokens = self.ids.shape
        return f"T={tokens}" + (f" batch {batch}" if batch > 1 else "") + f", row {self.row} token {self.at}"


class OpProbe:
    """``spec``'s graph in ``directory`` as ONNX Runtime's CPU EP optimizes it, with every node's outputs exposed."""

    def __init__(self, directory: Path, spec, workdir: Path):
        import onnx
        import onnxruntime as ort

        from specdeploy.engines.ort import fit_thread_pool

        self.spec = spec
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.optimized_model_filepath = str(workdir / "optimized.onnx")
        # a 1.5B model's weights are past protobuf's 2 GB: the optimized graph keeps them in a file beside it
        options.add_session_config_entry("session.optimized_model_external_initializers_file_name", "optimized.data")
        options.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
        fit_thread_pool(options)  # the engines' pool: ONNX Runtime refuses a session its own once one is shared
        ort.InferenceSession(str(directory / spec.file), options, providers=["CPUExecutionProvider"])
        model = onnx.load(str(workdir / "optimized.onnx"), load_external_data=False)
        declared = {o.name for o in model.graph.output}
        self.producers: dict[str, tuple[str, str]] = {}  # output name -> (node name, op type), in graph order
        for node in model.graph.node:
            for name in node.output:
                if name and name not in self.producers:
                    self.producers[name] = (node.name, node.op_type)
                    if name not in declared:
                        model.graph.output.append(onnx.ValueInfoProto(name=name))
        onnx.save(model, str(workdir / "exposed.onnx"))
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # optimized already
        fit_thread_pool(options)
        self.session = ort.InferenceSession(str(workdir / "exposed.onnx"), options, providers=["CPUExecutionProvider"])
        order = {name: i for i, name in enumerate(self.producers)}  # a declared output where its node computes it
        self.names = sorted((o.name for o in self.session.get_outputs()), key=lambda name: order.get(name, -1))
        self.token_axes: dict[str, list[tuple[int, int]]] = {}  # name -> (axis, its size a token), first: the rows'
        self.batch_axis: dict[str, int | None] = {}
        self.slot_axes: dict[str, list[int]] = {}  # name -> the axes over the cache's slots (an explicit form's keys)

    def run(self, call: Call, cache) -> dict[str, np.ndarray]:
        """Every exposed output of ``call`` over ``cache`` (a KVCache of the call's batch; not written)."""
        spec, tokens = self.spec, call.ids.shape[1]
        past = np.array(call.past, np.int64)
        feeds = {"input_ids": call.ids,
                 spec.lengths_input: (past + tokens - 1).astype(np.int32) if spec.takes_seqlens_k else past}
        if spec.trims_logits:
            feeds["num_logits"] = np.array([tokens], np.int64)
        feeds |= dict(zip(spec.cache_inputs, cache.buffers))
        return dict(zip(self.names, self.session.run(self.names, feeds)))

    def learn_axes(self, runs: dict, wider: dict[str, np.ndarray] | None = None) -> None:
        """Which axes of each output follow the call's tokens and batch, from runs of shapes (1, 2) and (1, 3), and
        (1, 1) and (2, 1) (a fused graph takes several tokens after a past only at batch 1), and which the cache's
        slots: ``wider`` is the (1, 1) run over a cache one slot larger (None: no output is read by slot)."""
        for name in self.names:
            self.slot_axes[name] = [] if wider is None else _grown(runs[1, 1][name], wider[name])
            two, three = runs[1, 2][name], runs[1, 3][name]
            self.token_axes[name] = [(axis, np.shape(three)[axis] - np.shape(two)[axis]) for axis in _grown(two, three)]
            batch = _grown(runs[1, 1][name], runs[2, 1][name])
            self.batch_axis[name] = batch[0] if batch else None

    def position(self, name: str, output: np.ndarray, call: Call) -> np.ndarray | None:
        """The compared position's slice of ``output``; None where it has none to compare (a shape, a scalar)."""
        array = np.asarray(output)
        if array.dtype.kind not in "fc" or array.ndim == 0:
            return None
        index: list = [slice(None)] * array.ndim
        batch, tokens = self.batch_axis.get(name), self.token_axes.get(name, [])
        if batch is not None:
            index[batch] = call.row
        if tokens:
            axis, per_token = tokens[0]
            # per_token > 1: the explicit form's query heads folded into rows, group-major (row = g * tokens + t,
            # ``exporter.layers.cached_attention``): the position's row of each group
            index[axis] = call.at if per_token == 1 else slice(call.at, None, array.shape[axis] // per_token)
        elif name in self.spec.cache_outputs and self.spec.writes_cache:  # the whole cache: the slot it wrote
            index[2] = call.past[call.row] + call.at
        elif batch is None:
            return array  # no position in it: a weight-derived value, compared whole
        if name not in self.spec.cache_outputs:
            # an explicit form's scores and keys over every slot: those the position sees (up to its own); the slots
            # past it hold what earlier calls left there, masked before the softmax
            for axis in self.slot_axes.get(name, []):
                index[axis] = slice(0, call.past[call.row] + call.at + 1)
        return array[tuple(index)]


def _grown(small, large) -> list[int]:
    """The axes whose size differs between two outputs of the same rank."""
    a, b = np.shape(small), np.shape(large)
    return [i for i in range(len(a)) if a[i] != b[i]] if len(a) == len(b) else []


@dataclass
class OpDiff:
    """One exposed output's difference between two calls at the compared position."""

    order: int
    name: str
    op_type: str
    max_abs: float
    equal: bool


def compare_ops(probe: OpProbe, first: tuple[Call, dict], second: tuple[Call, dict]) -> list[OpDiff]:
    """Every exposed output's slice at each call's compared position, in graph order: how far they differ."""
    (call_a, run_a), (call_b, run_b) = first, second
    diffs = []
    for order, name in enumerate(probe.names):
        a, b = probe.position(name, run_a[name], call_a), probe.position(name, run_b[name], call_b)
        if a is None or b is None or a.ndim != b.ndim:
            continue
        common = tuple(slice(0, min(x, y)) for x, y in zip(a.shape, b.shape))  # a key axis: the keys both saw
        a, b = a[common].astype(np.float64), b[common].astype(np.float64)
        finite = np.isfinite(a) & np.isfinite(b)
        equal = bool(np.array_equal(a, b, equal_nan=True))
        gap = float(np.abs(a - b)[finite].max()) if finite.any() and not equal else 0.0
        diffs.append(OpDiff(order, name, probe.producers.get(name, ("", "graph input"))[1], gap, equal))
    return diffs


def summary(diffs: list[OpDiff], spec) -> dict:
    """The first differing output (graph order), how many differ, the logits' and the written K/V's largest change,
    and the largest change per op type."""
    differing = [d for d in diffs if not d.equal]
    by_type: dict[str, float] = {}
    for d in differing:
        by_type[d.op_type] = max(by_type.get(d.op_type, 0.0), d.max_abs)
    first = differing[0] if differing else None
    kv = [d.max_abs for d in diffs if d.name in spec.cache_outputs]
    logits = [d.max_abs for d in diffs if d.name == spec.outputs[0]]
    return {"outputs_compared": len(diffs), "outputs_differing": len(differing),
            "first_differing": None if first is None else {"op_type": first.op_type, "output": first.name,
                                                           "max_abs": first.max_abs},
            "logits_max_abs": logits[0] if logits else None, "kv_written_max_abs": max(kv) if kv else None,
            "max_abs_by_op_type": dict(sorted(by_type.items(), key=lambda item: -item[1]))}


def op_report(engine, directory: Path, sequence: list[int], start: int, sizes: list[int], workdir: Path,
              every_row: bool = False, log=print) -> list[dict]:
    """Op-by-op comparisons over ``sequence``, its first ``start`` tokens prefilled, position ``start`` compared:

    - "T=1 vs T=W": row 0 of a one-token call (plain decoding today) against row 0 of a W-token call (verification);
    - "T=2 vs T=W": the same with a two-token call (a plain step padded with one dummy token);
    - "verify row j vs T=1/T=2/T=W at p+j": row j of a W-token call against the call that decodes that position
      alone (one token, or two with a dummy, or W), over the K/V the W-token call wrote: what exactness needs (rows 1
      and W - 1; ``every_row``: each);
    - "batch mate" (where rows run together, the explicit form): row 1 of a two-row W-token call against batch 1.
    Each: ``summary`` of ``compare_ops``. Positions start .. start + max(sizes) must be inside ``sequence``.
    """
    from specdeploy.engines.base import prefill

    spec, widest = engine.spec, max(sizes)
    if len(sequence) < start + widest + 1:
        raise ValueError(f"sequence: {len(sequence)} tokens; expected at least {start + widest + 1} (start {start} + "
                         f"the widest call {widest} + 1)")
    probe = OpProbe(directory, spec, workdir)
    capacity = len(sequence) + widest + 2
    tokens = np.array([sequence], np.int64)
    mate = np.roll(tokens, 7, axis=1)  # another row's tokens beside it

    def cache(rows: np.ndarray):
        # each row prefilled alone: in one call of several rows, an odd prefill pairs a row's last token with the next
        # row's first in int4 MatMulNBits (its kernels take rows in pairs), and the batch mate's cache would differ
        # before the compared call (exact mode's even chunks keep each row's tokens in pairs of its own)
        made = engine.allocate_cache(len(rows), capacity)
        for b in range(len(rows)):
            prefill(engine, made.rows(b, b + 1), rows[b : b + 1], [start])
        made.commit([start] * len(rows))
        return made

    def window(at: int, width: int, rows: np.ndarray = tokens) -> np.ndarray:
        return np.ascontiguousarray(rows[:, at : at + width])

    one, both = cache(tokens), cache(np.concatenate([mate, tokens]))
    pair = np.concatenate([mate, tokens])
    wider = engine.allocate_cache(1, capacity + 1)
    prefill(engine, wider, tokens, [start])  # for the axes' sizes alone
    probe.learn_axes({(1, 1): probe.run(Call(window(start, 1), [start]), one),
                      (1, 2): probe.run(Call(window(start, 2), [start]), one),
                      (1, 3): probe.run(Call(window(start, 3), [start]), one),
                      (2, 1): probe.run(Call(window(start, 1, pair), [start] * 2), both)},
                     probe.run(Call(window(start, 1), [start]), wider))

    def ran(call: Call, over) -> tuple[Call, dict]:
        return call, probe.run(call, over)

    rows = []

    def report(case: str, first, second) -> None:
        found = summary(compare_ops(probe, first, second), spec)
        rows.append({"case": case, "first": first[0].shape, "second": second[0].shape} | found)
        hit = found["first_differing"]
        log(f"{case}: " + ("bit-identical at every op" if hit is None else
                           f"first differs at {hit['op_type']} ({hit['output']}, {hit['max_abs']:.2e}); logits "
                           f"{found['logits_max_abs']:.2e}, K/V written {found['kv_written_max_abs'] or 0:.2e}; "
                           f"{found['outputs_differing']} of {found['outputs_compared']} outputs differ"))

    plain = ran(Call(window(start, 1), [start]), one)
    padded = ran(Call(window(start, 2), [start]), one)
    for width in sizes:
        verify = ran(Call(window(start, width), [start]), one)
        report(f"T=1 vs T={width}, row 0", plain, verify)
        if width > 2:
            report(f"T=2 vs T={width}, row 0", padded, verify)
        engine.infer(window(start, width), np.array([start], np.int64), one)  # the K/V a verification writes
        for j in range(1, width) if every_row else sorted({1, width - 1}):
            at = start + j
            row_j = ran(Call(window(start, width), [start], at=j), one)
            report(f"verify T={width} row {j} vs T=1 at p+{j}", row_j, ran(Call(window(at, 1), [at]), one))
            report(f"verify T={width} row {j} vs T=2 at p+{j}", row_j, ran(Call(window(at, 2), [at]), one))
            if width > 2:
                report(f"verify T={width} row {j} vs T={width} at p+{j}", row_j, ran(Call(window(at, width), [at]), one))
        if not engine.call_form.rows_alone:
            report(f"batch mate: T={width} row 0 alone vs beside another row", verify,
                   ran(Call(window(start, width, pair), [start] * 2, row=1), both))
    return rows


def matmul_nbits_rows(k: int, n: int, block: int, accuracy: int, most: int = 9) -> dict:
    """One int4 MatMulNBits node (random weights, K x N, ``block`` weights a block, ``accuracy`` level) on this CPU:
    for calls of M = 2 .. ``most`` rows, which rows (M, j) differ from row j computed alone (M = 1), and which from row
    j computed as row 0 of a two-row call. Whether a kernel branches on the row count, apart from any graph."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from specdeploy.engines.ort import fit_thread_pool

    rng = np.random.default_rng(0)
    blocks = (k + block - 1) // block
    weights = rng.integers(0, 256, (n, blocks, block // 2), dtype=np.uint8)
    scales = (rng.random(n * blocks, dtype=np.float32) * 0.02 + 0.001).astype(np.float32)
    node = helper.make_node("MatMulNBits", ["A", "B", "S"], ["Y"], domain="com.microsoft", K=k, N=n, bits=4,
                            block_size=block, accuracy_level=accuracy)
    graph = helper.make_graph([node], "matmul", [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["M", k])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["M", n])],
                              [numpy_helper.from_array(weights, "B"), numpy_helper.from_array(scales, "S")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    options = ort.SessionOptions()
    fit_thread_pool(options)
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    x = rng.standard_normal((most, k)).astype(np.float32)
    alone = [session.run(None, {"A": x[j : j + 1]})[0][0] for j in range(most)]
    paired = [session.run(None, {"A": np.stack([x[j], x[0]])})[0][0] for j in range(most)]
    unlike_alone, unlike_paired = [], []
    for m in range(2, most + 1):
        y = session.run(None, {"A": x[:m]})[0]
        unlike_alone += [(m, j) for j in range(m) if not np.array_equal(y[j], alone[j])]
        unlike_paired += [(m, j) for j in range(m) if not np.array_equal(y[j], paired[j])]
    return {"k": k, "n": n, "block": block, "accuracy_level": accuracy, "rows_compared": sum(range(2, most + 1)),
            "differ_from_one_row_call": unlike_alone, "differ_from_row_0_of_two": unlike_paired}
