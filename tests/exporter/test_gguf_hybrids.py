"""GGUF files of the hybrid families, written here as llama.cpp's converter writes them (convert_hf_to_gguf.py: its
keys, its tensor names and layouts) from tiny random Hugging Face models, read back bit for bit and exported with the
logits and greedy tokens of the transformers model the file was converted from.

- LFM2 (``lfm2``): transformers 5.25 maps the architecture (its config, tensor processor and tokenizer); the
  converter writes each layer's K/V head count (0 on a convolution layer: what tells the layers apart), the effective
  feed-forward width (LFM2's ``block_auto_adjust_ff_dim`` applied: 64 of 96 here) and the convolution's weight squeezed
  to 2-D; ``norm_eps`` 1e-3, not LFM2's default, moves the logits 250 times the tolerance if misread.
- Granite 4.0-H (``granitehybrid``): transformers does not map it; its config comes from the metadata
  (exporter/gguf_config.py: layer kinds from the per-layer K/V head counts, Mamba-2's sizes from ssm.*), its tensors
  from the converter's layout (exporter/gguf_layouts.py: A stored as -exp(A_log), D and the gated norm reshaped, the
  shared MLP split in two, q and k permuted as for a Llama); with routed experts (Granite 4.0-H tiny's and small's
  layout) the experts' gate and up split and stacked as ``ffn_*_exps`` and the shared MLP as the shared expert.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specdeploy import GenerationConfig, Pipeline
from specdeploy.exporter import export_artifact
from specdeploy.exporter.checkpoint import load_checkpoint, load_tokenizer_and_config
from specdeploy.exporter.errors import ExportError
from tests import tiny
from tests.exporter.test_gguf_config import VOCAB, add_tokenizer, permuted

PROMPT = [5, 97, 98, 99, 257, 40, 41]
NEW = 16


def lfm2_config():
    """Three layers, the middle one attention; an FFN width LFM2 adjusts (96 -> 2/3 of it, rounded up to 32: 64); an
    epsilon that is not the default."""
    return tiny.llama_config("lfm2", vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                             intermediate_size=96, max_position_embeddings=256, num_hidden_layers=3,
                             layer_types=["conv", "full_attention", "conv"], conv_L_cache=3, norm_eps=1e-3,
                             block_multiple_of=32, tie_word_embeddings=True)


def write_lfm2(path, model) -> None:
    """``model`` as llama.cpp's converter writes an LFM2 file (its LFM2Model: TextModel's keys, the K/V head count of
    each layer, 0 for a convolution, ``shortconv.l_cache``, ``norm_eps``, the FFN width after LFM2's adjustment;
    tensors under gguf-py's LFM2 names, the convolution's [hidden, 1, L] squeezed to [hidden, L], no output tensor
    where the head is tied)."""
    import gguf

    config = model.config
    writer = gguf.GGUFWriter(str(path), "lfm2")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv([0 if kind == "conv" else config.num_key_value_heads for kind in config.layer_types])
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_vocab_size(config.vocab_size)
    writer.add_shortconv_l_cache(config.conv_L_cache)
    writer.add_layer_norm_rms_eps(config.norm_eps)
    width = config.intermediate_size
    if config.block_auto_adjust_ff_dim:  # the converter's _add_feed_forward_length
        width = int(config.block_ffn_dim_multiplier * int(2 * width / 3))
        width = config.block_multiple_of * ((width + config.block_multiple_of - 1) // config.block_multiple_of)
    writer.add_feed_forward_length(width)
    add_tokenizer(writer)
    table = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LFM2, config.num_hidden_layers)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        stem, _, suffix = name.rpartition(".")
        array = tensor.numpy().astype(np.float32)
        if "conv.conv" in name:
            array = array.squeeze(1)
        writer.add_tensor(f"{table.get_name(stem)}.{suffix}", array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def reference(model) -> tuple[list[int], np.ndarray]:
    """``model``'s greedy tokens after PROMPT (each step recomputing the whole sequence) and its logits over them."""
    ids = list(PROMPT)
    with torch.no_grad():
        for _ in range(NEW):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        return ids, model(torch.tensor([ids])).logits[0].numpy()


@pytest.fixture(scope="module")
def lfm2(tmp_path_factory):
    model = tiny.build_model(lfm2_config(), seed=3)
    path = tmp_path_factory.mktemp("lfm2") / "lfm2.gguf"
    write_lfm2(path, model)
    return path, model, *reference(model)


def test_an_lfm2_file_reads_back_its_config_and_every_tensor_bit_for_bit(lfm2):
    path, model, _, _ = lfm2
    _, config = load_tokenizer_and_config(path, tokenizer=False)
    expected = model.config
    assert config.model_type == "lfm2" and config.layer_types == expected.layer_types
    for field in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size",
                  "conv_L_cache", "norm_eps", "tie_word_embeddings", "max_position_embeddings"):
        assert getattr(config, field) == pytest.approx(getattr(expected, field)), field
    checkpoint = load_checkpoint(path)
    assert set(checkpoint.weights) == set(model.state_dict()) - {"lm_head.weight"}
    for name, value in model.state_dict().items():
        if name in checkpoint.weights:
            np.testing.assert_array_equal(checkpoint.weights[name].numpy(), value.numpy(), err_msg=name)
    assert checkpoint.eos_token_ids == (VOCAB - 1,)


@pytest.mark.parametrize("graph", ["fused", "explicit"])
def test_an_lfm2_file_exports_with_the_models_logits_and_greedy_tokens(tmp_path, lfm2, graph):
    path, _, ids, expected = lfm2
    assert len(set(ids[len(PROMPT):])) >= 3  # tokens that tell one model from another
    manifest = export_artifact(path, tmp_path / "art", graph=graph, capacity=96, isolate=False)
    assert manifest.target.architecture == "lfm2" and [s.name for s in manifest.target.states] == ["conv"]
    pipeline = Pipeline.load(tmp_path / "art")
    engine = pipeline.target
    logits = engine.infer(np.array([ids], np.int64), np.array([0], np.int64), engine.allocate_cache(1, 96)).logits[0]
    np.testing.assert_allclose(logits, expected, rtol=0, atol=1e-4 * float(np.abs(expected).max()), err_msg=graph)
    tokens = pipeline.generate([PROMPT], GenerationConfig(drafter="none", max_new_tokens=NEW, ignore_eos=True))
    assert tokens[0].token_ids == ids[len(PROMPT):]


GRANITE_VOCAB = 304  # the converter pads a Mamba-2 model's token list to a multiple of 8 (its tensors stay as they are)


def granite_hybrid_config(**overrides):
    """Mamba-2, attention, Mamba-2 (two groups of two heads of 32, state 8, kernel 4, the convolution's bias), Granite's
    multipliers far from 1, no position embedding, a dense shared MLP, an untied head."""
    return tiny.llama_config(
        "granitemoehybrid", vocab_size=GRANITE_VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256, num_hidden_layers=3, layer_types=["mamba", "attention", "mamba"],
        mamba_n_heads=4, mamba_d_head=32, mamba_n_groups=2, mamba_d_state=8, mamba_d_conv=4,
        mamba_expand=2, shared_intermediate_size=48, position_embedding_type="nope", embedding_multiplier=6.0,
        attention_multiplier=0.05, residual_multiplier=0.3, logits_scaling=4.0, rms_norm_eps=1e-5,
        **{"num_local_experts": 0} | overrides)


def write_granite_hybrid(path, model, extra=None) -> None:
    """``model`` as llama.cpp's converter writes a Granite 4.0-H file (GraniteHybridModel: Granite's keys and
    multipliers as *_scale, the shared MLP's width, Mamba-2's ssm.* sizes, the K/V head count of each layer, 0 for
    Mamba-2, no RoPE and a context of 2^20; tensors: q and k permuted as for a Llama, Mamba-2's as Mamba2Model writes
    them, the shared MLP's input split into gate and up)."""
    import gguf

    config = model.config
    writer = gguf.GGUFWriter(str(path), "granitehybrid")
    writer.add_context_length(2**20)  # no RoPE: the converter's "arbitrary" context
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    # the checkpoint's "attention" layers (transformers calls them "full_attention" once loaded)
    writer.add_head_count_kv([config.num_key_value_heads if kind in ("attention", "full_attention") else 0
                              for kind in config.layer_types])
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    writer.add_expert_count(config.num_local_experts)
    if config.num_local_experts:  # GraniteMoeModel's: top-k (the width is feed_forward_length, the experts')
        writer.add_expert_used_count(config.num_experts_per_tok)
    writer.add_attention_scale(config.attention_multiplier)
    writer.add_embedding_scale(config.embedding_multiplier)
    writer.add_residual_scale(config.residual_multiplier)
    writer.add_logit_scale(config.logits_scaling)
    writer.add_expert_shared_feed_forward_length(config.shared_intermediate_size)
    writer.add_ssm_conv_kernel(config.mamba_d_conv)
    writer.add_ssm_state_size(config.mamba_d_state)
    writer.add_ssm_group_count(config.mamba_n_groups)
    writer.add_ssm_inner_size(config.mamba_expand * config.hidden_size)
    writer.add_ssm_time_step_rank(config.mamba_n_heads)
    writer.add_rope_scaling_finetuned(False)
    if extra is not None:  # a key added again overwrites the first
        extra(writer)
    add_tokenizer(writer, GRANITE_VOCAB)
    table = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GRANITE_HYBRID, config.num_hidden_layers)
    inner, groups = config.mamba_expand * config.hidden_size, config.mamba_n_groups
    for name, tensor in model.state_dict().items():
        array = tensor.numpy().astype(np.float32)
        layer, part = name.split(".", 3)[2:] if name.startswith("model.layers.") else (None, name)
        at = f"blk.{layer}"
        shared = "_shexp" if config.num_local_experts else ""  # beside routed experts, the shared MLP is the shared expert
        # transformers 5 loads the checkpoint's block_sparse_moe.input_linear as experts.gate_up_proj, output_linear
        # as experts.down_proj and router.layer as router: the converter reads the checkpoint's, the same tensors
        if part in ("shared_mlp.input_linear.weight", "block_sparse_moe.experts.gate_up_proj"):
            gate, up = np.split(array, 2, axis=-2)  # gate rows, then up rows ([experts, 2 x width, hidden])
            kind = "_exps" if part.startswith("block_sparse_moe") else shared
            writer.add_tensor(f"{at}.ffn_gate{kind}.weight", gate)
            writer.add_tensor(f"{at}.ffn_up{kind}.weight", up)
            continue
        written = {"shared_mlp.output_linear.weight": (f"ffn_down{shared}.weight", lambda a: a),
                   "block_sparse_moe.experts.down_proj": ("ffn_down_exps.weight", lambda a: a),
                   "block_sparse_moe.router.weight": ("ffn_gate_inp.weight", lambda a: a),
                   "mamba.A_log": ("ssm_a", lambda a: -np.exp(a).reshape(-1, 1)),
                   "mamba.D": ("ssm_d", lambda a: a.reshape(-1, 1)),
                   "mamba.dt_bias": ("ssm_dt.bias", lambda a: a),
                   "mamba.conv1d.weight": ("ssm_conv1d.weight", lambda a: a.squeeze(1)),
                   "mamba.norm.weight": ("ssm_norm.weight", lambda a: a.reshape(groups, inner // groups)),
                   "self_attn.q_proj.weight": ("attn_q.weight", lambda a: permuted(a, config.num_attention_heads)),
                   "self_attn.k_proj.weight": ("attn_k.weight", lambda a: permuted(a, config.num_key_value_heads))}
        if part in written:
            gguf_name, stored = written[part]
            writer.add_tensor(f"{at}.{gguf_name}", stored(array))
            continue
        stem, _, suffix = name.rpartition(".")
        writer.add_tensor(f"{table.get_name(stem)}.{suffix}", array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


ROUTED = {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32}  # as Granite 4.0-H Tiny's, smaller


@pytest.fixture(scope="module", params=["dense", "routed"])
def granite(tmp_path_factory, request):
    """A Granite 4.0-H file with its shared MLP alone (micro's layout), and one with 4 routed experts, top-2, beside
    it (tiny's and small's: the converter writes the shared MLP as the shared expert, ``ffn_*_shexp``)."""
    model = tiny.build_model(granite_hybrid_config(**(ROUTED if request.param == "routed" else {})), seed=3)
    path = tmp_path_factory.mktemp("granitehybrid") / "granite.gguf"
    write_granite_hybrid(path, model)
    return path, model, *reference(model)


def as_converted(state: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """A routed model's state dict under the names a GGUF file's experts are read by (llama.cpp's, below the layer:
    ``experts.GgufStacked``), gate and up split as the converter splits them; the rest as it is."""
    out = {}
    for name, value in state.items():
        layer, _, part = name.rpartition(".block_sparse_moe.")
        array = value.numpy()
        if part == "experts.gate_up_proj":
            out[f"{layer}.ffn_gate_exps.weight"], out[f"{layer}.ffn_up_exps.weight"] = np.split(array, 2, axis=-2)
        elif part in ("experts.down_proj", "router.weight"):
            out[f"{layer}.{'ffn_down_exps' if part == 'experts.down_proj' else 'ffn_gate_inp'}.weight"] = array
        elif ".shared_mlp." in name:
            stem = name.partition(".shared_mlp.")[0]
            if name.endswith("input_linear.weight"):
                out[f"{stem}.ffn_gate_shexp.weight"], out[f"{stem}.ffn_up_shexp.weight"] = np.split(array, 2)
            else:
                out[f"{stem}.ffn_down_shexp.weight"] = array
        else:
            out[name] = array
    return out


def test_a_granite_hybrid_file_reads_back_its_config_and_every_tensor(granite):
    """Every tensor bit for bit but A_log, which the file holds as -exp(A_log) (read back to a few units in the last
    place); a routed file's experts and shared expert under llama.cpp's names."""
    path, model, _, _ = granite
    _, config = load_tokenizer_and_config(path, tokenizer=False)
    expected = model.config
    assert config.model_type == "granitemoehybrid" and config.layer_types == expected.layer_types
    for field in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size",
                  "mamba_n_heads", "mamba_d_head", "mamba_n_groups", "mamba_d_state", "mamba_d_conv", "mamba_expand",
                  "mamba_conv_bias", "mamba_proj_bias", "attention_bias", "shared_intermediate_size",
                  "num_local_experts", "position_embedding_type", "embedding_multiplier", "attention_multiplier",
                  "residual_multiplier", "logits_scaling", "rms_norm_eps", "tie_word_embeddings"):
        assert getattr(config, field) == pytest.approx(getattr(expected, field)), field
    if expected.num_local_experts:
        assert (config.num_experts_per_tok, config.intermediate_size) == (2, 32)
    checkpoint = load_checkpoint(path)
    state = as_converted(model.state_dict()) if expected.num_local_experts else {
        name: value.numpy() for name, value in model.state_dict().items()}
    assert set(checkpoint.weights) == set(state)
    for name, value in state.items():
        got = checkpoint.weights[name].numpy()
        if name.endswith("A_log"):
            np.testing.assert_allclose(got, value, rtol=1e-6, err_msg=name)
        else:
            np.testing.assert_array_equal(got, value, err_msg=name)
    assert checkpoint.eos_token_ids == (GRANITE_VOCAB - 1,)


def test_a_granite_hybrid_file_exports_with_the_models_logits_and_greedy_tokens(tmp_path, granite):
    """Speculation over the same family's routed layers is tested from its Hugging Face checkpoints
    (tests/exporter/test_families.py, granitemoehybrid-experts): a file changes how the weights are read, not the
    graph. Both forms build their layers from the same weights: the explicit form's trace (seconds) is paid for the
    LFM2 file alone, and each form's graph of the family is held to transformers in test_parity."""
    path, _, ids, expected = granite
    assert len(set(ids[len(PROMPT):])) >= 3
    manifest = export_artifact(path, tmp_path / "art", graph="fused", capacity=96, isolate=False)
    assert manifest.target.architecture == "granitemoehybrid" and [s.name for s in manifest.target.states] == ["conv",
                                                                                                                 "ssm"]
    pipeline = Pipeline.load(tmp_path / "art")
    engine = pipeline.target
    logits = engine.infer(np.array([ids], np.int64), np.array([0], np.int64), engine.allocate_cache(1, 96)).logits[0]
    np.testing.assert_allclose(logits, expected, rtol=0, atol=1e-4 * float(np.abs(expected).max()))
    tokens = pipeline.generate([PROMPT], GenerationConfig(drafter="none", max_new_tokens=NEW, ignore_eos=True))
    assert tokens[0].token_ids == ids[len(PROMPT):]


@pytest.mark.parametrize("overrides,extra,refusal", [
    ({}, lambda w: w.add_expert_count(4),
     "granitehybrid: the GGUF metadata has no granitehybrid.expert_used_count; expected it of a file converted by "
     "llama.cpp"),
    (ROUTED, lambda w: w.add_expert_used_count(5),
     "granitehybrid.expert_used_count (num_experts_per_tok): got 5; expected an integer >= 1, at most "
     "num_local_experts (4)"),
    ({}, lambda w: w.add_ssm_inner_size(100), "granitehybrid: ssm.inner_size 100: expected a multiple of "
                                              "ssm.time_step_rank (4, Mamba-2's heads) and of embedding_length (64)"),
])
def test_what_a_granite_hybrid_file_cannot_export_is_refused_in_one_line(tmp_path, overrides, extra, refusal):
    """Experts declared without their top-k, a top-k above the experts and Mamba-2 sizes that do not divide: one line
    naming the field, before anything is written."""
    import re

    model = tiny.build_model(granite_hybrid_config(**overrides), seed=3)
    path = tmp_path / "granite.gguf"
    write_granite_hybrid(path, model, extra)  # GGUFWriter overwrites a key added twice
    with pytest.raises(ExportError, match=re.escape(refusal)) as refused:
        export_artifact(path, tmp_path / "art", isolate=False)
    assert "\n" not in str(refused.value) and not (tmp_path / "art").exists()
