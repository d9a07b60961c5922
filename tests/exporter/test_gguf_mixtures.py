"""GGUF files of the mixtures of experts, written as llama.cpp's converter writes them: its metadata keys
(``expert_count``, ``expert_used_count``, ``expert_feed_forward_length``, ``expert_shared_feed_forward_length``), each
layer's router ``ffn_gate_inp``, its experts stacked as ``ffn_{gate,up,down}_exps`` (Mixtral's w1/w3/w2 and Qwen's
per-expert projections merged, GraniteMoE's input_linear split into gate and up, gpt-oss's interleaved gate_up split
and its biases with them), shared experts as ``ffn_*_shexp`` and their gate ``ffn_gate_inp_shexp``, q and k permuted for
the families it converts as a Llama (Mixtral is a ``llama`` file with experts). Each is read back bit for bit and
exported with the logits and greedy tokens of the transformers model it was converted from.

What llama.cpp assumes of each architecture the models here assume too: qwen3moe renormalizes its chosen experts'
weights and qwen2moe and OLMoE do not, and no layer is dense.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from specdeploy import GenerationConfig, Pipeline
from specdeploy.exporter import export_artifact
from specdeploy.exporter.checkpoint import load_checkpoint, load_tokenizer_and_config
from specdeploy.exporter.registry import architecture_of
from tests import tiny
from tests.exporter.test_gguf_config import FAMILIES as DENSE
from tests.exporter.test_gguf_config import PROMPT, SIZES, converted, write_gguf

NEW = 16
EXPERTS = {"num_experts_per_tok": 2}


def _experts(writer, config, *, width: int | None = None, shared: int | None = None) -> None:
    writer.add_expert_count(getattr(config, "num_experts", None) or config.num_local_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    if width is not None:
        writer.add_expert_feed_forward_length(width)
    if shared is not None:
        writer.add_expert_shared_feed_forward_length(shared)


def _gpt_oss(writer, config) -> None:
    import gguf

    _experts(writer, config, width=config.intermediate_size)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_sliding_window(config.sliding_window)
    rope = config.rope_parameters
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(rope["factor"])
    writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])


# case: (its GGUF architecture, the Hugging Face config, whether q/k rows are stored permuted, the metadata the
# converter adds)
FAMILIES = {
    "qwen3moe": ("qwen3moe", lambda: tiny.llama_config("qwen3_moe", **SIZES, num_experts=4, **EXPERTS, moe_intermediate_size=32,
                                           norm_topk_prob=True, head_dim=16),
                 False, lambda w, c: (_experts(w, c, width=c.moe_intermediate_size), w.add_key_length(c.head_dim),
                                      w.add_value_length(c.head_dim))),
    "qwen2moe": ("qwen2moe", lambda: tiny.llama_config("qwen2_moe", **SIZES, num_experts=4, **EXPERTS, moe_intermediate_size=32,
                                           shared_expert_intermediate_size=48),
                 False, lambda w, c: _experts(w, c, width=c.moe_intermediate_size, shared=c.shared_expert_intermediate_size)),
    "olmoe": ("olmoe", lambda: tiny.llama_config("olmoe", **SIZES, num_experts=4, **EXPERTS, pad_token_id=0), False,
              lambda w, c: _experts(w, c)),
    "granitemoe": ("granitemoe", lambda: tiny.llama_config("granitemoe", **SIZES, num_local_experts=4, **EXPERTS,
                                                           embedding_multiplier=6.0, residual_multiplier=0.3,
                                                           logits_scaling=4.0, attention_multiplier=0.05),
                   True, lambda w, c: (DENSE["granite"][2](w, c), _experts(w, c))),
    # a shared expert: a granitemoe file with expert_shared_feed_forward_length
    "granitemoeshared": ("granitemoe", lambda: tiny.llama_config("granitemoeshared", **SIZES, num_local_experts=4,
                                                                 **EXPERTS, shared_intermediate_size=32,
                                                                 attention_multiplier=0.25),
                         True, lambda w, c: (DENSE["granite"][2](w, c), _experts(w, c, shared=c.shared_intermediate_size))),
    "mixtral": ("llama", lambda: tiny.llama_config("mixtral", **SIZES, num_local_experts=4, **EXPERTS), True,
              lambda w, c: _experts(w, c)),
    "gpt-oss": ("gpt-oss", lambda: tiny.llama_config("gpt_oss", **SIZES | {"intermediate_size": 32}, num_local_experts=4, **EXPERTS,
                                          head_dim=16, sliding_window=4, rope_parameters={
                                              "rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                              "original_max_position_embeddings": 64, "beta_fast": 32.0,
                                              "beta_slow": 1.0, "truncate": False}),
                False, _gpt_oss),
}


def _stacked(kind: str, layer: int) -> str:
    import gguf

    return gguf.TENSOR_NAMES[getattr(gguf.MODEL_TENSOR, kind)].format(bid=layer)


def convert(model, architecture: str, permute: bool) -> list[tuple[str, np.ndarray]]:
    """The model's tensors as the converter writes them: from its checkpoint's layout (what save_pretrained writes,
    as on the hub), experts merged per layer into stacked tensors, everything else under its table name."""
    import tempfile

    from safetensors.torch import load_file

    with tempfile.TemporaryDirectory() as directory:
        model.save_pretrained(directory)
        state = load_file(f"{directory}/model.safetensors")
    experts: dict[tuple[int, str], dict[int, np.ndarray]] = {}
    out, rest = [], {}
    per_expert = re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$")
    kinds = {"gate_proj": "FFN_GATE_EXP", "w1": "FFN_GATE_EXP", "up_proj": "FFN_UP_EXP", "w3": "FFN_UP_EXP",
             "down_proj": "FFN_DOWN_EXP", "w2": "FFN_DOWN_EXP"}
    for name, tensor in state.items():
        array = tensor.numpy().astype(np.float32)
        layer = int(name.split(".")[2]) if name.startswith("model.layers.") else None
        if (m := per_expert.match(name)) is not None:
            experts.setdefault((layer, kinds[m[3]]), {})[int(m[2])] = array
        elif name.endswith(("block_sparse_moe.input_linear.weight", "shared_mlp.input_linear.weight")):
            gate, up = np.split(array, 2, axis=-2)  # rows gate then up
            suffix = "EXP" if "block_sparse_moe" in name else "SHEXP"
            out += [(f"{_stacked(f'FFN_GATE_{suffix}', layer)}.weight", gate),
                    (f"{_stacked(f'FFN_UP_{suffix}', layer)}.weight", up)]
        elif name.endswith("mlp.experts.gate_up_proj"):  # gpt-oss: [experts, hidden, 2 * width], gate and up interleaved
            rows = array.transpose(0, 2, 1)
            out += [(f"{_stacked('FFN_GATE_EXP', layer)}.weight", rows[:, 0::2]),
                    (f"{_stacked('FFN_UP_EXP', layer)}.weight", rows[:, 1::2])]
        elif name.endswith("mlp.experts.gate_up_proj_bias"):
            out += [(f"{_stacked('FFN_GATE_EXP', layer)}.bias", array[:, 0::2]),
                    (f"{_stacked('FFN_UP_EXP', layer)}.bias", array[:, 1::2])]
        elif name.endswith("mlp.experts.down_proj"):
            out.append((f"{_stacked('FFN_DOWN_EXP', layer)}.weight", array.transpose(0, 2, 1)))
        elif name.endswith("mlp.experts.down_proj_bias"):
            out.append((f"{_stacked('FFN_DOWN_EXP', layer)}.bias", array))
        else:
            rest[name + (".weight" if name.endswith("sinks") else "")] = tensor
    for (layer, kind), each in sorted(experts.items()):
        out.append((f"{_stacked(kind, layer)}.weight", np.stack([each[e] for e in sorted(each)])))
    return out + list(converted(model, architecture, permute, rest))


BUILT: dict[str, tuple] = {}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    """One GGUF per architecture, converted from a tiny random HF model; the model, the tensors written, its greedy
    tokens after ``PROMPT`` (no cache) and its logits over prompt and tokens."""
    name = request.param
    if name not in BUILT:
        architecture, config, permute, extra = FAMILIES[name]
        model = tiny.build_model(config(), seed=3)
        path = tmp_path_factory.mktemp(name) / f"{name}.gguf"
        tensors = convert(model, architecture, permute)
        write_gguf(path, model, architecture, permute, extra, tensors)
        ids = list(PROMPT)
        with torch.no_grad():
            for _ in range(NEW):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
            logits = model(torch.tensor([ids])).logits[0].numpy()
        BUILT[name] = (name, path, model, dict(tensors), ids, logits)
    return BUILT[name]


def test_the_config_and_the_experts_read_from_the_file_are_the_models(family):
    name, path, model, tensors, _, _ = family
    _, config = load_tokenizer_and_config(path, tokenizer=False)
    expected = model.config
    assert config.model_type == expected.model_type
    for field in ("num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size", "intermediate_size",
                  "shared_expert_intermediate_size", "shared_intermediate_size", "norm_topk_prob", "head_dim",
                  "sliding_window", "swiglu_limit", "swiglu_alpha", "embedding_multiplier", "residual_multiplier",
                  "logits_scaling", "attention_multiplier", "layer_types"):
        if getattr(expected, field, None) is not None:  # the fields this family's config has
            assert getattr(config, field, None) == pytest.approx(getattr(expected, field)), field
    assert architecture_of(config.model_type).dims(config) == architecture_of(expected.model_type).dims(expected)
    if name == "gpt-oss":
        assert config.rope_parameters == expected.rope_parameters
    weights = load_checkpoint(path).weights
    stacked = [n for n in tensors if re.search(r"ffn_(gate_inp|\w+_exps|\w+_shexp)", n)]
    assert any("_exps" in n for n in stacked)
    for gguf_name in stacked:  # under llama.cpp's own names below the layer, bit for bit
        layer, kind = re.match(r"blk\.(\d+)\.(.+)$", gguf_name).groups()
        np.testing.assert_array_equal(weights[f"model.layers.{layer}.{kind}"].numpy().reshape(tensors[gguf_name].shape),
                                      tensors[gguf_name], err_msg=gguf_name)


# the fused form for every case; the explicit form's trace (seconds) for Mixtral (a llama file) alone
EXPORTS = [(name, "fused") for name in sorted(FAMILIES)] + [("mixtral", "explicit")]


@pytest.mark.parametrize("family,graph", EXPORTS, indirect=["family"])
def test_a_mixture_gguf_exports_with_the_models_logits_and_greedy_tokens(tmp_path, family, graph):
    name, path, model, _, ids, expected = family
    assert len(set(ids[len(PROMPT):])) >= 3  # tokens that tell one model from another
    manifest = export_artifact(path, tmp_path / "art", graph=graph, capacity=96, isolate=False)
    assert manifest.target.architecture == model.config.model_type
    pipeline = Pipeline.load(tmp_path / "art")
    engine = pipeline.target
    logits = engine.infer(np.array([ids], np.int64), np.array([0], np.int64), engine.allocate_cache(1, 96)).logits[0]
    np.testing.assert_allclose(logits, expected, rtol=0, atol=1e-4 * float(np.abs(expected).max()),
                               err_msg=f"{name} {graph}")
    tokens = pipeline.generate([PROMPT], GenerationConfig(drafter="none", max_new_tokens=NEW, ignore_eos=True))
    assert tokens[0].token_ids == ids[len(PROMPT):]
