"""Every weight format of every described family, in both graph forms: fp16, int8 and int4 exports give logits
within the format's rounding of transformers' and, under the runtime, speculative greedy equal to plain greedy.

Each family is the parity case's tiny model (tests/exporter/cases.py: windows shorter than the text, soft-caps,
multipliers far from 1, a rope-less layer), exported once in float32 in the explicit form (``exported_architecture``,
shared with test_families). The explicit form's trace does not depend on the weight format (``ExportOptions.form`` gives every
format the same float32 trace, asserted below): each format's export here reuses the float32 export's trace and runs
the rest of the export (the int8 / int4 / fp16 rewrite, the manifest, the hashes) for real, so that twelve families
in three formats cost twelve traces, not forty-eight (the multimodal Gemma 3's language model among them).
"""

from __future__ import annotations

import copy
import dataclasses
import shutil

import numpy as np
import onnx
import pytest
import torch

from specdeploy import GenerationConfig, Pipeline
from specdeploy.contract import Manifest
from specdeploy.exporter import artifact
from specdeploy.exporter.options import ExportOptions
from tests import tiny
from tests.exporter.cases import MIXTURES

ROUTED = (*MIXTURES, "granitemoehybrid-experts")  # Granite 4.0-H's routed experts beside its Mamba-2: a mixture too
FAMILIES = ("llama", "mistral-window", "qwen2", "gpt2", "qwen3", "gemma2", "gemma3_text", "gemma3", "phi3", "phi3-partial",
            "granite", "olmo2", "smollm3", "lfm2", "granitemoehybrid", *ROUTED)
# format -> (export options, the manifest's (dtype, weights), the op its weights become, the largest logit error
# allowed against transformers, relative to the largest logit). fp16 rounds weights and activations (measured up to
# 0.011); int8 rounds weights per column and activations per row (measured up to 0.17 on these untrained models, whose
# weights of std 0.3 amplify rounding layer by layer); int4 is held to transformers' model with the same int4 weights
# (``_rounded_to_int4``), what remains being the int8 activations of accuracy level 4 (measured up to 0.11; the plain
# model is up to 0.95 away, so a layer left unquantized or quantized differently fails). A mixture's int8 error is
# larger (MIXTURE_INT8): its routers choose from int8-rounded activations, and a token whose two best experts nearly tie
# can take the other (measured up to 0.26, mixtral, whose closest margins between a chosen and an unchosen expert are
# 0.005 of probability)
FORMATS = {
    "fp16": (["--dtype", "float16"], ("float16", "full"), None, 2e-2),
    "int8": (["--weights", "int8"], ("float32", "int8"), "MatMulInteger", 0.25),
    "int4": (["--weights", "int4", "--block-size", "16"], ("float32", "int4"), "MatMulNBits", 0.15),
}
MIXTURE_INT8 = 0.35
# how far apart the two forms may be: int4 and int8 weights are the same values in both (measured 1e-7); fp16 forms
# round in another order (measured up to 0.006, and 0.0099 for phi3-partial, whose one head of 64 dims makes the
# untrained model's attention peakier; a rotary or layer gone wrong moves the logits by their whole scale). A mixture's
# experts hold the same values in both forms too, but the fused form's MoE op sums a token's experts in its own order
# (float differences of 1e-7, which the next layer's int8 activations, rounded per row, can lift to a whole step:
# measured 0.014 of the largest logit, mixtral int8), and its int4 QMoE at accuracy level 4 rounds the experts'
# activations to int8 where the explicit form keeps them in float (measured up to 0.036, granitemoeshared)
AGREEMENT = {"fp16": 2e-2, "int8": 1e-4, "int4": 1e-4}
MIXTURE_AGREEMENT = {"fp16": 2e-2, "int8": 0.05, "int4": 0.05}
IDS = list(range(5, 19))  # 14 tokens: past every window (4)
RAGGED = [IDS[:8], [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8, 5]]  # batch 2 of two lengths; the second repeats, so it drafts


def test_the_explicit_trace_is_the_same_for_every_weight_format():
    """What makes reusing the float32 trace exact: the explicit form is traced in float32 without int4, whatever the
    format asked for (the rewrites come after the trace)."""
    forms = {ExportOptions(dtype=dtype, weights=weights).form("target")
             for dtype in ("float32", "float16") for weights in ("full", "int8", "int4")}
    assert len(forms) == 1


@pytest.fixture(scope="module")
def traced_once():
    """The explicit form's trace of a checkpoint taken from its float32 export's artifact: (checkpoint -> float32
    artifact dir) is filled by ``export``; ``artifact._trace`` is replaced for the module by a copy of that artifact's
    graph and tokenizer files into the staging dir, and the facts its manifest records."""
    seeds = {}
    real = artifact._trace

    def trace(role, source, staging, capacity, progress, form=artifact.Form()):
        full = seeds.get(str(source))
        if form.graph != "explicit" or role != "target" or full is None:
            return real(role, source, staging, capacity, progress, form)
        spec = Manifest.read(full).target
        assert spec.capacity == capacity and spec.graph == "explicit" and spec.weights == "full"
        for path in full.iterdir():
            if path.name != "manifest.json":
                shutil.copy(path, staging / path.name)
        facts = dataclasses.asdict(spec)
        for field in ("role", "file", "dtype", "weights", "graph", "imported"):
            del facts[field]
        return {k: tuple(v) if isinstance(v, list) else v for k, v in facts.items()}

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(artifact, "_trace", trace)
        yield seeds


@pytest.fixture(scope="module")
def export(exported_architecture, traced_once, tmp_path_factory):
    """(family, form, format) -> (transformers model, float32 artifact, the format's artifact), each exported once."""
    done = {}

    def get(name, form, fmt):
        model, full = exported_architecture(name, "explicit")
        checkpoint = exported_architecture.checkpoint(name)
        traced_once[str(checkpoint)] = full
        if (name, form, fmt) not in done:
            out = tmp_path_factory.mktemp(f"{name}-{form}-{fmt}") / "art"
            done[name, form, fmt] = tiny.export_cli(out, checkpoint, None, "--graph", form, *FORMATS[fmt][0])
        return model, full, done[name, form, fmt]

    return get


def _rounded_to_int4(model, block_size: int):
    """A copy of ``model`` whose linear layers' weights are rounded as ONNX Runtime's MatMulNBits quantizer rounds them
    (symmetric, ``block_size`` inputs per block, 4 bits): what an int4 export computes, but for its activations."""
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, DefaultWeightOnlyQuantizer
    from transformers.pytorch_utils import Conv1D

    quantizer = DefaultWeightOnlyQuantizer(DefaultWeightOnlyQuantConfig(block_size=block_size, is_symmetric=True))

    def rounded_matmul(matmul: np.ndarray) -> np.ndarray:  # [in, out] -> the values MatMulNBits holds, [out, in]
        packed, scales, _ = quantizer.qbits_block_quant(np.ascontiguousarray(matmul))  # [out, blocks, block / 2]
        levels = np.stack([packed & 15, packed >> 4], -1).reshape(*scales.shape, -1).astype(np.float32) - 8
        return (levels * scales[..., None]).reshape(matmul.shape[1], -1)[:, : matmul.shape[0]]

    rounded = copy.deepcopy(model)
    for name, module in rounded.named_modules():
        if hasattr(module, "is_transposed"):  # a mixture's experts: [experts, out, in], or [experts, in, out] transposed
            for weight in ("gate_up_proj", "down_proj"):
                stacked = getattr(module, weight).detach().numpy()
                values = np.stack([rounded_matmul(e if module.is_transposed else e.T) for e in stacked])  # [experts, out, in]
                setattr(module, weight, torch.nn.Parameter(torch.from_numpy(
                    np.ascontiguousarray(values.transpose(0, 2, 1) if module.is_transposed else values))))
            continue
        if not isinstance(module, (torch.nn.Linear, Conv1D)) or name.endswith("shared_expert_gate"):
            continue  # a shared expert's gate is a router: full precision (a router's weight is no Linear)
        conv = isinstance(module, Conv1D)  # GPT-2's Conv1D holds the MatMul's [in, out] itself; Linear its transpose
        values = rounded_matmul(module.weight.detach().numpy() if conv else module.weight.detach().numpy().T)
        # a tied head is untied: embeddings stay full
        module.weight = torch.nn.Parameter(torch.from_numpy(np.ascontiguousarray(values.T if conv else values)))
    return rounded


def _prefill(directory, ids: list[int]) -> np.ndarray:
    engine = Pipeline.load(directory).target
    return engine.infer(np.array([ids]), np.zeros(1, np.int64), engine.allocate_cache(1, len(ids))).logits[0]


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("name", FAMILIES)
def test_a_family_in_each_weight_format_stays_near_transformers_and_drafts_losslessly(export, name, fmt):
    """Both forms of the format: the manifest says it and the weights are its op; the two forms agree to rounding
    (each writes the format its own way: the explicit form rewrites its trace, the fused form quantizes as it writes);
    both stay within the format's tolerance of transformers; speculative greedy (suffix drafts, K + 1 verified over a
    ragged batch of 2) equals plain greedy."""
    options, recorded, op, tolerance = FORMATS[fmt]
    tolerance = MIXTURE_INT8 if name in ROUTED and fmt == "int8" else tolerance
    logits = {}
    for form in ("explicit", "fused"):
        model, _, directory = export(name, form, fmt)
        spec = Manifest.read(directory).target
        assert (spec.dtype, spec.weights, spec.graph) == (*recorded, form)
        ops = {node.op_type for node in onnx.load(str(directory / "target.onnx"), load_external_data=False).graph.node}
        assert op is None or op in ops, sorted(ops)
        if name in ROUTED and form == "fused":  # the experts on ONNX Runtime's MoE op, quantized ones on QMoE
            assert ("MoE" if fmt == "fp16" else "QMoE") in ops, sorted(ops)
        logits[form] = _prefill(directory, IDS)

        pipeline = Pipeline.load(directory)
        plain = GenerationConfig(drafter="none", max_new_tokens=16, ignore_eos=True)
        expected_tokens = [r.token_ids for r in pipeline.generate(RAGGED, plain, scope=None)]
        speculative = pipeline.generate(RAGGED, GenerationConfig(drafter="suffix", policy="fixed", k=4,
                                                                 max_new_tokens=16, ignore_eos=True), scope=None)
        assert [r.token_ids for r in speculative] == expected_tokens, f"{name} ({form}, {fmt})"
        assert any(record.k for result in speculative for record in result.records)  # drafts were verified
    with torch.no_grad():
        expected = (_rounded_to_int4(model, 16) if fmt == "int4" else model)(torch.tensor([IDS])).logits[0].numpy()
    scale = np.abs(expected).max()
    between = np.abs(logits["fused"] - logits["explicit"]).max() / scale
    errors = {form: np.abs(value - expected).max() / scale for form, value in logits.items()}
    agreement = (MIXTURE_AGREEMENT if name in ROUTED else AGREEMENT)[fmt]
    assert between <= agreement, f"{name} {fmt}: the forms differ by {between:.4f} of the largest logit"
    for form, error in errors.items():
        assert 0 < error <= tolerance, f"{name} {form} {fmt}: {error:.4f} of the largest logit from transformers"
