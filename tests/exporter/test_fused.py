"""The fused form's compressed weights are the explicit form's, and what it cannot take is refused clearly.

Parity against transformers (every architecture, ragged past, garbage in unused slots) is in test_parity;
greedy and sampled losslessness in tests/runtime.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from specdeploy.contract import IR_VERSION, Manifest
from specdeploy.engines import EngineInputError, load_engine
from specdeploy.exporter.dims import Dims
from specdeploy.exporter.fused import FusedGraph
from tests import tiny


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    config = tiny.llama_config(hidden_size=64, intermediate_size=128)  # int4 blocks of 32: two per column
    return tiny.save_checkpoint(tiny.build_model(config, seed=5, conditioned=True), tmp_path_factory.mktemp("f") / "ckpt")


def _logits(directory, ids):
    manifest = Manifest.read(directory)
    engine = load_engine(directory, manifest, "target")
    cache = engine.allocate_cache(1, ids.shape[1] + 1)
    return engine.infer(ids, np.zeros(1, np.int64), cache).logits


@pytest.mark.parametrize("options,op", [(["--weights", "int4"], "MatMulNBits"), (["--weights", "int8"], "MatMulInteger"),
                                        (["--dtype", "float16"], "MatMul")])
def test_compressed_fused_graph_computes_what_the_explicit_one_does(checkpoint, tmp_path, options, op):
    """int4 weights quantized as the fused graph is written are ONNX Runtime's quantizer's own values (and
    int8 / fp16 reuse the explicit form's rewrites), so both forms agree to rounding."""
    ids = np.random.default_rng(0).integers(0, tiny.VOCAB, (1, 12))
    explicit = _logits(tiny.export_cli(tmp_path / "explicit", checkpoint, None, *options), ids)
    fused_dir = tiny.export_cli(tmp_path / "fused", checkpoint, None, "--graph", "fused", *options)
    fused = _logits(fused_dir, ids)
    tolerance = (3e-2 if "float16" in options else 2e-3) * np.abs(explicit).max()
    assert np.abs(fused - explicit).max() <= tolerance
    ops = {node.op_type for node in onnx.load(str(fused_dir / "target.onnx")).graph.node}
    assert op in ops and "GroupQueryAttention" in ops
    if op != "MatMul":
        assert "MatMul" not in ops  # every weight compressed, lm_head included


def test_head_dim_the_fused_rotary_cannot_take_is_refused(tmp_path):
    ckpt = tiny.save_checkpoint(tiny.build_model(tiny.llama_config(), seed=0), tmp_path / "ckpt")  # head_dim 8
    from click.testing import CliRunner

    from specdeploy.cli import main

    result = CliRunner().invoke(main, ["export", "--target", str(ckpt), "--out", str(tmp_path / "art"), "--graph", "fused"])
    assert result.exit_code != 0
    assert "head_dim to be a multiple of 16" in result.output and "got 8" in result.output and "--graph explicit" in result.output
    assert not (tmp_path / "art").exists()


def test_the_fused_writer_reports_each_quarter_of_the_layers(tmp_path):
    messages = []
    graph = FusedGraph(tmp_path / "m.onnx", Dims(num_layers=28, num_heads=2, kv_heads=2, head_dim=16, vocab_size=10),
                       progress=messages.append)  # a dict of the sizes before Dims (its num_heads unread here)
    for layer in range(28):
        graph.layer_written(layer)
    graph.data.close()
    assert messages == [f"{n}/28 layers written" for n in (7, 14, 21, 28)]


@pytest.fixture(scope="module")
def fused_and_explicit(checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("forms")
    return {form: tiny.export_cli(out / form, checkpoint, None, "--graph", form) for form in ("fused", "explicit")}


@pytest.mark.parametrize("form", ["fused", "explicit"])
def test_every_graph_declares_an_ir_version_the_oldest_supported_onnxruntime_reads(fused_and_explicit, form):
    """onnx writes its own newest IR version by default (14 for onnx 1.23), which this machine's onnxruntime 1.32 reads
    but onnxruntime-gpu 1.31.1 refused on an H200: each graph declares IR_VERSION, what onnxruntime 1.20 reads."""
    graphs = sorted(fused_and_explicit[form].glob("*.onnx"))
    assert graphs
    for path in graphs:
        assert onnx.load(str(path), load_external_data=False).ir_version <= IR_VERSION == 10


def test_a_fused_graph_computes_only_the_logits_asked_for(fused_and_explicit):
    """A prefill chunk needs no logits and a draft's catch-up one position's: the fused graph takes ``num_logits``
    and puts only each row's last positions through the head, with the same values and the same cache."""
    directory = fused_and_explicit["fused"]
    manifest = Manifest.read(directory)
    assert manifest.target.trims_logits and "num_logits" in [i.name for i in onnx.load(str(directory / "target.onnx")).graph.input]
    engine = load_engine(directory, manifest, "target")
    ids = np.random.default_rng(1).integers(0, tiny.VOCAB, (1, 12))
    full_cache, cut_cache = engine.allocate_cache(1, 16), engine.allocate_cache(1, 16)
    full = engine.infer(ids, np.zeros(1, np.int64), full_cache).logits.copy()
    assert full.shape == (1, 12, tiny.VOCAB)
    for last, kept in ((1, 1), (3, 3), (12, 12), (100, 12)):
        got = engine.infer(ids, np.zeros(1, np.int64), cut_cache, last).logits
        assert got.shape == (1, kept, tiny.VOCAB)
        np.testing.assert_allclose(got, full[:, -kept:], rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(cut_cache.stacked[..., :12, :], full_cache.stacked[..., :12, :])
    # two rows with different pasts run row by row: each row's last position alone
    pair = engine.allocate_cache(2, 16)
    engine.infer(ids[:, :4].repeat(2, 0), np.zeros(2, np.int64), pair)
    past = np.array([4, 2], np.int64)
    both = engine.infer(ids[:, 4:7].repeat(2, 0), past, pair, 1).logits
    assert both.shape == (2, 1, tiny.VOCAB)
    np.testing.assert_allclose(both[0], full[0, 6:7], rtol=1e-5, atol=1e-5)
    with pytest.raises(EngineInputError, match="last | received 0"):
        engine.infer(ids, np.zeros(1, np.int64), cut_cache, 0)


def test_an_explicit_graph_returns_every_position_whatever_is_asked(fused_and_explicit):
    """The explicit form (and a fused artifact from before exporter 0.3.2) has no ``num_logits``: asked for the
    last position's logits, it returns all of them, and callers index the last."""
    directory = fused_and_explicit["explicit"]
    manifest = Manifest.read(directory)
    assert not manifest.target.trims_logits
    engine = load_engine(directory, manifest, "target")
    ids = np.random.default_rng(1).integers(0, tiny.VOCAB, (1, 5))
    assert engine.infer(ids, np.zeros(1, np.int64), engine.allocate_cache(1, 8), 1).logits.shape == (1, 5, tiny.VOCAB)
    with pytest.raises(EngineInputError, match="last | received 0"):
        engine.infer(ids, np.zeros(1, np.int64), engine.allocate_cache(1, 8), 0)


def test_a_manifest_from_before_trimmed_logits_still_loads_and_a_bad_flag_is_refused(fused_and_explicit, tmp_path):
    import json
    import shutil

    from specdeploy.contract import ContractError

    for value, works in ((None, False), (True, True), ("yes", False), (1, False)):
        copy = tmp_path / f"art-{value}"
        shutil.copytree(fused_and_explicit["fused"], copy)
        data = json.loads((copy / "manifest.json").read_text())
        if value is None:
            del data["models"]["target"]["trims_logits"]  # exporter 0.3.1's manifests have no such field
        else:
            data["models"]["target"]["trims_logits"] = value
        (copy / "manifest.json").write_text(json.dumps(data))
        if value is None:
            spec = Manifest.read(copy).target
            assert spec.trims_logits is False and "num_logits" not in spec.inputs
            with pytest.raises(Exception, match=r"the graph has \[.num_logits.\] the manifest does not list"):
                load_engine(copy, Manifest.read(copy), "target")
        elif works:
            assert Manifest.read(copy).target.trims_logits is True
        else:
            with pytest.raises(ContractError, match="trims_logits must be true or false"):
                Manifest.read(copy)


def test_explicit_exports_declare_slot_attention_and_a_fused_one_claiming_it_is_refused(fused_and_explicit, tmp_path):
    """The explicit graph's attention runs over every slot with the new K/V at theirs (exact mode rests on it): its
    manifest says so; a fused graph's saying so, or a flag that is not a bool, is refused."""
    import json
    import shutil

    from specdeploy.contract import ContractError

    assert Manifest.read(fused_and_explicit["explicit"]).target.slot_attention is True
    assert Manifest.read(fused_and_explicit["fused"]).target.slot_attention is False
    for form, value, message in (("fused", True, "slot_attention on a fused graph; only the explicit form declares it"),
                                 ("explicit", "yes", "slot_attention must be true or false")):
        copy = shutil.copytree(fused_and_explicit[form], tmp_path / f"{form}-{value}")
        data = json.loads((copy / "manifest.json").read_text())
        data["models"]["target"]["slot_attention"] = value
        (copy / "manifest.json").write_text(json.dumps(data))
        with pytest.raises(ContractError, match=message):
            Manifest.read(copy)


def test_inspect_shows_the_logits_input_where_the_graph_has_it(fused_and_explicit):
    from click.testing import CliRunner

    from specdeploy.cli import main

    shown = {form: CliRunner().invoke(main, ["inspect", str(d)], env={"COLUMNS": "240"}) for form, d in fused_and_explicit.items()}
    assert all(result.exit_code == 0 for result in shown.values())
    # shapes print as written (rich once took "[batch, tokens]" for markup and printed an empty column)
    assert all("[batch, kv_heads, capacity, head_dim]" in result.output for result in shown.values())
    assert "num_logits" in shown["fused"].output and "[batch, min(tokens, num_logits), vocab]" in shown["fused"].output
    assert "num_logits" not in shown["explicit"].output and "[batch, tokens, vocab]" in shown["explicit"].output


@pytest.fixture(scope="module")
def fp16_graphs(checkpoint, tmp_path_factory):
    """The fused float16 forms a GPU runs: full weights with a draft scoring half the vocabulary (its head ends in a Pad),
    int4 weights, and Phi-4-mini's partial rotary under long-RoPE (its cos/sin caches a rotated share of a head wide)."""
    from tests.exporter.cases import PARITY_CASES

    out = tmp_path_factory.mktemp("fp16")
    full = tiny.export_cli(out / "full", checkpoint, checkpoint, "--graph", "fused", "--dtype", "float16",
                           "--draft-vocab", str(tiny.VOCAB // 2))
    int4 = tiny.export_cli(out / "int4", checkpoint, None, "--graph", "fused", "--dtype", "float16", "--weights", "int4")
    partial = tiny.save_checkpoint(tiny.build_model(PARITY_CASES["phi3-partial"](), seed=3), out / "partial-ckpt")
    partial = tiny.export_cli(out / "partial", partial, None, "--graph", "fused", "--dtype", "float16")
    return {"target": full / "target.onnx", "trimmed draft": full / "draft.onnx", "int4 target": int4 / "target.onnx",
            "partial rotary target": partial / "target.onnx"}


def test_every_node_of_the_fused_fp16_graph_runs_on_the_cuda_ep_with_no_copy_inside(fp16_graphs):
    """As onnxruntime-genai's builder ensures for its graphs: each node has a CUDA kernel for its types, and the only
    nodes ONNX Runtime moves to the CPU EP are host-side shape reads whose results stay on the host (the capacity, for
    GroupQueryAttention's total_sequence_length; num_logits, for Slice's starts), so no value is copied to the device
    inside a call and the session can be captured as a CUDA graph (tests/exporter/cuda_placement.py says where each
    rule comes from)."""
    from tests.exporter.cuda_placement import placement

    for name, path in fp16_graphs.items():
        model = onnx.load(str(path), load_external_data=False)
        found = placement(model)
        assert found["no_kernel"] == [] and found["copies"] == [], (name, found)
        assert sorted(op.split(":")[0] for op in found["cpu"]) == ["Cast", "Gather", "Neg"], (name, found["cpu"])
        assert found["host_inputs"] == ["num_logits"]  # bound on the host by the engine, read there by the graph
        ops = {node.op_type for node in model.graph.node}
        assert "GroupQueryAttention" in ops and "ArgMax" in ops and ("MatMulNBits" in ops) == ("int4" in name)
        assert ("Pad" in ops) == ("trimmed" in name)
        inputs = {i.name: i.type.tensor_type.elem_type for i in model.graph.input}
        assert inputs["seqlens_k"] == onnx.TensorProto.INT32 and "past_len" not in inputs
        assert inputs["cache_key.0"] == onnx.TensorProto.FLOAT16
        if "partial" in name:  # the op rotates twice its caches' width of each head: 48 of 64
            widths = {t.name: t.dims[1] for t in model.graph.initializer if len(t.dims) == 2}
            assert {widths[n.input[7]] for n in model.graph.node if n.op_type == "GroupQueryAttention"} == {24}


def test_the_placement_check_finds_the_length_arithmetic_of_older_fused_graphs(fp16_graphs):
    """Exporter 0.3.4's fused graphs computed GroupQueryAttention's lengths from past_len in the graph: ONNX Runtime put
    Add, Sub, ReduceMax and two Casts on the CPU EP (as measured on an H200, docs/results/gpu/h200-7699245.log) and
    copied seqlens_k to the device, which ruled out CUDA graphs; the check sees exactly that."""
    from tests.exporter.cuda_placement import placement

    model = _with_lengths_from_past_len(onnx.load(str(fp16_graphs["target"]), load_external_data=False))
    found = placement(model)
    assert sorted(op.split(":")[0] for op in found["cpu"] if "legacy" in op) == ["Add", "Cast", "Cast", "ReduceMax", "Sub"]
    assert {reader.split(":")[0] for _, reader in found["copies"]} == {"GroupQueryAttention"}
    assert found["no_kernel"] == []


def test_a_fused_fp32_graph_has_no_cuda_attention_kernel(fused_and_explicit):
    """GroupQueryAttention's CUDA kernel takes float16 or bfloat16: a fused float32 graph would run it on the CPU EP,
    which is why the engine refuses such an artifact on CUDA (tests/engines/test_ort.py)."""
    from tests.exporter.cuda_placement import placement

    model = onnx.load(str(fused_and_explicit["fused"] / "target.onnx"), load_external_data=False)
    assert {op.split(":")[0] for op in placement(model)["no_kernel"]} == {"GroupQueryAttention"}


def _with_lengths_from_past_len(model: onnx.ModelProto) -> onnx.ModelProto:
    """The graph as exporter 0.3.4 wrote it: past_len in, seqlens_k and total_sequence_length computed from it."""
    from onnx import TensorProto, helper

    graph = model.graph
    gqa = [n for n in graph.node if n.op_type == "GroupQueryAttention"]
    total = gqa[0].input[6]
    kept = [n for n in graph.node if total not in n.output and not (set(n.output) & _ancestors(graph, total))]
    legacy = [helper.make_node("Shape", ["input_ids"], ["/tokens"], name="legacy/Shape", start=1, end=2),
              helper.make_node("Add", ["past_len", "/tokens"], ["/total"], name="legacy/Add"),
              helper.make_node("Sub", ["/total", "legacy/one"], ["/last"], name="legacy/Sub"),
              helper.make_node("Cast", ["/last"], ["legacy/seqlens_k"], name="legacy/Cast", to=TensorProto.INT32),
              helper.make_node("ReduceMax", ["/total"], ["/longest"], name="legacy/ReduceMax", keepdims=0),
              helper.make_node("Cast", ["/longest"], [total], name="legacy/Cast_1", to=TensorProto.INT32)]
    for node in kept:
        for i, value in enumerate(node.input):
            if value == "seqlens_k":
                node.input[i] = "legacy/seqlens_k"
    del graph.node[:]
    graph.node.extend(legacy + kept)
    graph.initializer.append(helper.make_tensor("legacy/one", TensorProto.INT64, [1], [1]))
    inputs = [helper.make_tensor_value_info("past_len", TensorProto.INT64, ["batch"]) if i.name == "seqlens_k" else i
              for i in graph.input]
    del graph.input[:]
    graph.input.extend(inputs)
    return model


def _ancestors(graph, value: str) -> set[str]:
    """The values ``value`` is computed from, within the graph's nodes."""
    producer = {out: n for n in graph.node for out in n.output}
    found, pending = set(), [value]
    while pending:
        node = producer.get(pending.pop())
        if node is not None:
            for v in node.input:
                if v and v not in found:
                    found.add(v)
                    pending.append(v)
    return found


HYBRIDS = ("lfm2", "granitemoehybrid")


@pytest.fixture(scope="module")
def hybrid_fp16(tmp_path_factory):
    """The fused float16 artifacts of the tiny hybrids (test_parity's LFM2 and Granite 4.0-H cases)."""
    from tests.exporter.cases import PARITY_CASES

    out = tmp_path_factory.mktemp("hybrid-fp16")
    found = {}
    for name in HYBRIDS:
        checkpoint = tiny.save_checkpoint(tiny.build_model(PARITY_CASES[name](), seed=3), out / f"{name}-ckpt")
        found[name] = tiny.export_cli(out / name, checkpoint, None, "--graph", "fused", "--dtype", "float16")
    return found


@pytest.mark.parametrize("name", HYBRIDS)
def test_every_node_of_a_fused_fp16_hybrid_runs_on_the_cuda_ep_with_no_copy_inside(hybrid_fp16, name):
    """A recurrent layer's state slots come in as inputs the engine fills (``read_slots_*``, ``write_slots_*``), as
    seqlens_k does: each node has a CUDA kernel for its types, what ONNX Runtime moves to the CPU EP is the call's
    shape read on the host (its tokens and rows, for Slice's starts and Range's bounds) and num_logits, and no value
    is copied to the device inside a call, so the session can be captured as a CUDA graph. The states are read with
    Gather over the buffer's rows and slots (GatherND's CUDA kernel was not capture-safe: onnxruntime#32120)."""
    from tests.exporter.cuda_placement import placement

    model = onnx.load(str(hybrid_fp16[name] / "target.onnx"), load_external_data=False)
    found = placement(model)
    assert found["no_kernel"] == [] and found["copies"] == [], (name, found)
    assert found["host_inputs"] == ["num_logits"]
    assert _host_side(model.graph, found["cpu"]) == set(), found["cpu"]
    spec = Manifest.read(hybrid_fp16[name]).target
    assert spec.takes_state_slots and spec.slot_inputs == [f"{kind}_slots_{state.name}" for state in spec.states
                                                           for kind in ("read", "write")]
    inputs = {i.name: i.type.tensor_type.elem_type for i in model.graph.input}
    assert {inputs[n] for n in spec.slot_inputs} == {onnx.TensorProto.INT64} and "seqlens_k" in inputs
    ops = {node.op_type for node in model.graph.node}
    assert "ScatterND" in ops and "GatherND" not in ops and "Mod" not in ops


@pytest.mark.parametrize("name", HYBRIDS)
def test_an_older_fused_hybrid_with_its_slots_computed_in_the_graph_still_loads_and_computes_alike(hybrid_fp16, name,
                                                                                                 tmp_path):
    """Exporter 5addc93 wrote fused hybrids that computed their state slots from seqlens_k and the call's shape: the
    placement check finds that arithmetic's host values copied to the device (its graphs repeated it per layer: 6
    copies in LFM2's, 13 in Granite 4.0-H's; here once per state), and such an artifact, its manifest without
    ``takes_state_slots``, still loads and computes what the new graph does: a prefill, a ragged decode at batch 2,
    and a verification that wraps Mamba-2's rings."""
    import json
    import shutil

    from specdeploy.contract import sha256_file
    from tests.exporter.cuda_placement import placement

    new = hybrid_fp16[name]
    old = shutil.copytree(new, tmp_path / "old")
    spec = Manifest.read(new).target
    model = _with_slots_from_lengths(onnx.load(str(new / "target.onnx")), spec.states)
    onnx.save_model(model, str(old / "target.onnx"))
    data = json.loads((old / "manifest.json").read_text())
    del data["models"]["target"]["takes_state_slots"]
    data["files"]["target.onnx"] = sha256_file(old / "target.onnx")
    (old / "manifest.json").write_text(json.dumps(data))
    assert Manifest.read(old).target.slot_inputs == [] and not set(spec.slot_inputs) & set(Manifest.read(old).target.inputs)
    found = placement(model)
    assert found["no_kernel"] == [] and found["copies"] and all("legacy/" in reader for _, reader in found["copies"])

    ids = np.random.default_rng(4).integers(0, tiny.VOCAB, (2, 24))
    logits = []
    for directory in (new, old):
        engine = load_engine(directory, Manifest.read(directory), "target")
        cache = engine.allocate_cache(2, 32)
        base = engine.infer(ids[:, :16], np.zeros(2, np.int64), cache).logits.copy()  # rows alone: InPlaceCalls
        ragged = engine.infer(ids[:, 16:17], np.array([16, 12], np.int64), cache).logits.copy()
        wrapped = engine.infer(ids[:1, 17:23], np.array([17], np.int64), cache.rows(0, 1)).logits.copy()  # positions 17-22
        logits.append((base, ragged, wrapped))
    for got, want in zip(logits[1], logits[0]):
        np.testing.assert_array_equal(got, want)


def _host_side(graph, cpu: list[str]) -> set[str]:
    """The values the CPU EP's nodes read that are neither shapes, small constants, num_logits nor computed on the CPU
    from those: what the device would have to send to the host (none in a graph fit for CUDA graphs)."""
    on_cpu = {name.split(":", 1)[1] for name in cpu}
    host = {"num_logits"} | {t.name for t in graph.initializer if np.prod(t.dims) <= 100}
    host |= {n.output[0] for n in graph.node if n.op_type == "Shape"}
    host |= {out for n in graph.node if n.name in on_cpu for out in n.output}
    return {v for n in graph.node if n.name in on_cpu for v in n.input if v and v not in host}


def _with_slots_from_lengths(model: onnx.ModelProto, states) -> onnx.ModelProto:
    """The fused hybrid graph as exporter 5addc93 wrote it: no slot inputs; each state's slots computed from seqlens_k
    (past_len = seqlens_k - tokens + 1) and the shapes, position p at p mod the buffer's slots, -1 before position 0."""
    from onnx import TensorProto, helper

    from specdeploy.contract import slot_input_names

    graph = model.graph
    node, const = helper.make_node, helper.make_tensor
    inits = [const("legacy/zero", TensorProto.INT64, [], [0]), const("legacy/one", TensorProto.INT64, [], [1]),
             const("legacy/minus_one", TensorProto.INT64, [], [-1]), const("legacy/axis1", TensorProto.INT64, [1], [1]),
             const("legacy/axis0", TensorProto.INT64, [1], [0])]
    nodes = [node("Shape", ["input_ids"], ["legacy/ids_shape"], name="legacy/Shape"),
             node("Gather", ["legacy/ids_shape", "legacy/one"], ["legacy/tokens"], name="legacy/Gather", axis=0),
             node("Cast", ["seqlens_k"], ["legacy/last"], name="legacy/Cast", to=TensorProto.INT64),
             node("Sub", ["legacy/tokens", "legacy/one"], ["legacy/back"], name="legacy/Sub"),
             node("Sub", ["legacy/last", "legacy/back"], ["legacy/past"], name="legacy/Sub_past"),
             node("Unsqueeze", ["legacy/past", "legacy/axis1"], ["legacy/past_col"], name="legacy/Unsqueeze")]
    for state in states:
        at = f"legacy/{state.name}"
        inits.append(const(f"{at}/offsets", TensorProto.INT64, [state.lookback], list(range(-state.lookback, 0))))
        nodes += [node("Shape", [f"cache_{state.name}.{state.layers[0]}"], [f"{at}/shape"], name=f"{at}/Shape"),
                  node("Gather", [f"{at}/shape", "legacy/one"], [f"{at}/slots"], name=f"{at}/Gather", axis=0),
                  node("Add", ["legacy/past_col", f"{at}/offsets"], [f"{at}/read_pos"], name=f"{at}/Add_read"),
                  node("Mod", [f"{at}/read_pos", f"{at}/slots"], [f"{at}/read_slot"], name=f"{at}/Mod_read"),
                  node("Less", [f"{at}/read_pos", "legacy/zero"], [f"{at}/before"], name=f"{at}/Less"),
                  node("Where", [f"{at}/before", "legacy/minus_one", f"{at}/read_slot"], [f"read_slots_{state.name}"],
                       name=f"{at}/Where"),
                  node("Min", ["legacy/tokens", f"{at}/slots"], [f"{at}/kept"], name=f"{at}/Min"),
                  node("Sub", ["legacy/tokens", f"{at}/kept"], [f"{at}/kept_from"], name=f"{at}/Sub"),
                  node("Add", ["legacy/past", f"{at}/kept_from"], [f"{at}/first"], name=f"{at}/Add_first"),
                  node("Range", ["legacy/zero", f"{at}/kept", "legacy/one"], [f"{at}/steps"], name=f"{at}/Range"),
                  node("Unsqueeze", [f"{at}/first", "legacy/axis1"], [f"{at}/first_col"], name=f"{at}/Unsqueeze_first"),
                  node("Unsqueeze", [f"{at}/steps", "legacy/axis0"], [f"{at}/steps_row"], name=f"{at}/Unsqueeze_steps"),
                  node("Add", [f"{at}/first_col", f"{at}/steps_row"], [f"{at}/write_pos"], name=f"{at}/Add_write"),
                  node("Mod", [f"{at}/write_pos", f"{at}/slots"], [f"write_slots_{state.name}"], name=f"{at}/Mod_write")]
    kept = list(graph.node)
    del graph.node[:]
    graph.node.extend(nodes + kept)
    graph.initializer.extend(inits)
    inputs = [i for i in graph.input if i.name not in set(slot_input_names(states))]
    del graph.input[:]
    graph.input.extend(inputs)
    return model
