"""The described families beyond parity (test_parity): greedy decoding equal to transformers' own, each setting that
makes a family differ shown to change the output (so parity could not pass without it), long-RoPE across its trained
length, int4 weights, and a combination a form cannot express refused in one line."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specdeploy import GenerationConfig, Pipeline
from specdeploy.contract import Manifest
from specdeploy.engines import load_engine
from tests import tiny
from tests.exporter.cases import MIXTURES, PARITY_CASES, REFUSED, longrope

NEW_FAMILIES = ("qwen3", "gemma2", "gemma3_text", "phi3", "phi3-partial", "granite", "olmo2", "smollm3", "mistral-window",
                "llama-rope-yarn", "lfm2", "granitemoehybrid", "granitemoehybrid-experts", *MIXTURES)
PROMPT = list(range(5, 13))  # 8 tokens: with 32 more, past every window and within long-RoPE's 64 positions
NEW = 32


def _transformers_greedy(model, ids: list[int], new: int) -> list[int]:
    """transformers' own greedy generation (its caches, windowed layers' included), EOS not stopping it."""
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=new, do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("form", ["explicit", "fused"])
@pytest.mark.parametrize("name", NEW_FAMILIES)
def test_greedy_equals_transformers_greedy(exported_architecture, name, form):
    model, directory = exported_architecture(name, form)
    config = GenerationConfig(drafter="none", max_new_tokens=NEW, ignore_eos=True)
    ours = Pipeline.load(directory).generate([PROMPT], config)[0].token_ids
    assert list(ours) == _transformers_greedy(model, PROMPT, NEW), f"{name} ({form})"


# (parity case, the settings that turn one feature off): each turned off moves transformers' logits
SETTINGS_THAT_BITE = {
    "window (mistral)": ("mistral-window", {"sliding_window": None}),
    "window (qwen3 layer_types)": ("qwen3", {"sliding_window": None, "layer_types": ["full_attention"] * 2}),
    "window (gemma2)": ("gemma2", {"sliding_window": 256}),
    "attention soft-cap": ("gemma2", {"attn_logit_softcapping": None}),
    "final soft-cap": ("gemma2", {"final_logit_softcapping": None}),
    "query_pre_attn_scalar": ("gemma2", {"query_pre_attn_scalar": 16}),
    "embedding multiplier": ("granite", {"embedding_multiplier": 1.0}),
    "residual multiplier": ("granite", {"residual_multiplier": 1.0}),
    "attention multiplier": ("granite", {"attention_multiplier": 0.25}),
    "logits scaling": ("granite", {"logits_scaling": 1.0}),
    "rope-less layer": ("smollm3", {"no_rope_layers": [1, 1]}),
    "local RoPE base": ("gemma3_text", {"rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 1e6},
                                                           "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                                              "rope_theta": 1e6}}}),
    "YaRN": ("llama-rope-yarn", {"rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}}),
    "long-RoPE": ("phi3", {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}),
    "experts per token": ("mixtral", {"num_experts_per_tok": 1}),
    "renormalized expert weights": ("qwen3_moe", {"norm_topk_prob": True}),
    "clamped SwiGLU's limit": ("gpt_oss", {"swiglu_limit": 7.0}),
    "clamped SwiGLU's alpha": ("gpt_oss", {"swiglu_alpha": 1.0}),
    # every dim of each head rotated (its long-RoPE given a factor per frequency)
    "partial rotary": ("phi3-partial", {"rope_parameters": {**longrope(64), "rope_theta": 10000.0, "partial_rotary_factor": 1.0,
                                                            "original_max_position_embeddings": 64}}),
}


@pytest.mark.parametrize("feature", sorted(SETTINGS_THAT_BITE))
def test_each_family_setting_moves_the_logits(feature):
    """A window shorter than the text, soft-caps, multipliers, a rope-less layer, scaled RoPE: each turned off moves
    transformers' logits by far more than the parity tolerance, so parity holds only with it built in."""
    name, off = SETTINGS_THAT_BITE[feature]
    model = tiny.build_model(PARITY_CASES[name](), seed=3)
    changed = PARITY_CASES[name]()
    for key, value in off.items():
        setattr(changed, key, value)
    other = type(model)(changed).eval()
    other.load_state_dict(model.state_dict())
    ids = torch.tensor([list(range(5, 19))])  # 14 tokens, as the parity tests' longest
    with torch.no_grad():
        a, b = model(ids).logits, other(ids).logits
    assert (a - b).abs().max() > 100 * 1e-4 * max(1.0, a.abs().max().item()), feature


# (sizes, rotated dims of each head): Phi-3's whole head; Phi-4-mini's three quarters, over two heads sharing a K/V head
ROTARY = {"full": ({"hidden_size": 64}, 16),
          "partial": ({"hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1, "partial_rotary_factor": 0.75}, 48)}


@pytest.mark.parametrize("rotary", sorted(ROTARY))
def test_long_rope_chooses_its_factors_by_position(tmp_path, rotary):
    """A text crossing original_max_position_embeddings (16 here): each token's RoPE uses the short factors below that
    position and the long ones from it on, as transformers computes when it generates token by token after a prompt
    within the trained length; transformers' single forward over the whole text uses the long factors for every token,
    which is not what the graph computes (rope.py says why: a token's K/V must depend on its position alone). With
    partial rotary too (the fused form's caches are as wide as the rotated share of a head)."""
    sizes, rotated = ROTARY[rotary]
    config = tiny.llama_config("phi3", **sizes, original_max_position_embeddings=16, sliding_window=None,
                               pad_token_id=0, rope_scaling={"rope_type": "longrope", "short_factor": [1.0] * (rotated // 2),
                                                             "long_factor": [1.0 + i for i in range(rotated // 2)]})
    model = tiny.build_model(config, seed=3)
    ids = np.random.default_rng(0).integers(0, tiny.VOCAB, 24)
    with torch.no_grad():
        out = model(torch.tensor(ids[None, :8]), use_cache=True)  # the prompt within the trained length
        stepwise, cache = [out.logits[0]], out.past_key_values
        for t in range(8, 24):
            out = model(torch.tensor(ids[None, t : t + 1]), past_key_values=cache, use_cache=True)
            stepwise.append(out.logits[0])
            cache = out.past_key_values
        stepwise = torch.cat(stepwise).numpy()
        whole = model(torch.tensor(ids[None])).logits[0].numpy()
    for form in ("explicit", "fused"):
        directory = tiny.export_cli(tmp_path / form, tiny.save_checkpoint(model, tmp_path / "ckpt"), None, "--graph", form)
        engine = load_engine(directory, Manifest.read(directory), "target")
        logits = engine.infer(ids[None], np.zeros(1, np.int64), engine.allocate_cache(1, 32)).logits[0]
        tolerance = 1e-4 * np.abs(stepwise).max()
        assert np.abs(logits - stepwise).max() <= tolerance, form
        assert np.abs(logits[:16] - whole[:16]).max() > 100 * tolerance  # the single call's long factors differ


@pytest.mark.parametrize("name", ["qwen3", "gemma2", "gemma3_text", "phi3", "granite", "olmo2", "smollm3"])
def test_int4_fused_export_runs_close_to_full_weights(exported_architecture, tmp_path, name):
    _, full = exported_architecture(name, "fused")
    checkpoint = exported_architecture.checkpoint(name)
    directory = tiny.export_cli(tmp_path / "int4", checkpoint, None, "--graph", "fused", "--weights", "int4",
                                "--block-size", "16")
    ids = np.random.default_rng(1).integers(0, tiny.VOCAB, (1, 10))
    logits = {}
    for kind, d in (("full", full), ("int4", directory)):
        engine = load_engine(d, Manifest.read(d), "target")
        logits[kind] = engine.infer(ids, np.zeros(1, np.int64), engine.allocate_cache(1, 16)).logits
    assert Manifest.read(directory).target.weights == "int4" and np.isfinite(logits["int4"]).all()
    assert np.abs(logits["int4"] - logits["full"]).max() > 0  # quantized: not the same weights


@pytest.mark.parametrize("name,form", sorted(REFUSED))
def test_a_combination_a_form_cannot_express_is_refused_in_one_line(tmp_path, name, form):
    from click.testing import CliRunner

    from specdeploy.cli import main

    checkpoint = tiny.save_checkpoint(tiny.build_model(PARITY_CASES[name](), seed=3), tmp_path / "ckpt")
    result = CliRunner().invoke(main, ["export", "--target", str(checkpoint), "--out", str(tmp_path / "art"),
                                       "--graph", form])
    assert result.exit_code != 0
    message = [line for line in result.output.splitlines() if REFUSED[name, form] in line]
    assert len(message) == 1 and name.split("-")[0] in message[0] and "--graph explicit" in message[0], result.output
    assert not (tmp_path / "art").exists()


def test_a_trimmed_draft_keeps_its_cut_tokens_at_minus_inf_under_a_logits_soft_cap(exported_architecture, tmp_path):
    """A soft-cap maps -inf to -cap: Gemma's is applied to the computed logits before the cut columns are padded on,
    so a draft scoring half the vocabulary never proposes the other half."""
    checkpoint = exported_architecture.checkpoint("gemma2")
    directory = tiny.export_cli(tmp_path / "art", checkpoint, checkpoint, "--graph", "fused",
                                "--draft-vocab", str(tiny.VOCAB // 2))
    manifest = Manifest.read(directory)
    ids = np.random.default_rng(2).integers(0, tiny.VOCAB // 2, (1, 6))
    logits = {}
    for role in ("target", "draft"):
        engine = load_engine(directory, manifest, role)
        logits[role] = engine.infer(ids, np.zeros(1, np.int64), engine.allocate_cache(1, 8)).logits
    assert np.isneginf(logits["draft"][..., tiny.VOCAB // 2 :]).all()
    np.testing.assert_allclose(logits["draft"][..., : tiny.VOCAB // 2], logits["target"][..., : tiny.VOCAB // 2],
                               rtol=1e-5, atol=1e-5)
    assert np.abs(logits["target"]).max() <= 4.0  # the cap (4) bounds the target's logits


RAGGED = [PROMPT, [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8, 5]]  # batch 2 of two lengths; the second repeats, so it drafts


@pytest.mark.parametrize("form", ["explicit", "fused"])
@pytest.mark.parametrize("name", NEW_FAMILIES)
def test_speculative_greedy_equals_plain_and_seeded_sampling_repeats(exported_architecture, name, form):
    """Each family's graph under the runtime: suffix-index drafts verified K + 1 at a time over a ragged batch of 2, some
    rejected (and for a mixture some kept), give plain decoding's tokens, and a seeded sampled request's text is the same
    whether or not anything drafts."""
    _, directory = exported_architecture(name, form)
    pipeline = Pipeline.load(directory)
    plain = GenerationConfig(drafter="none", max_new_tokens=24, ignore_eos=True)
    expected = [r.token_ids for r in pipeline.generate(RAGGED, plain, scope=None)]
    speculative = pipeline.generate(RAGGED, GenerationConfig(drafter="suffix", policy="fixed", k=4, max_new_tokens=24,
                                                             ignore_eos=True), scope=None)
    assert [r.token_ids for r in speculative] == expected, f"{name} ({form})"
    records = [record for result in speculative for record in result.records]
    assert any(record.drafted for record in records) and any(record.rejected_at for record in records)  # and some rejected
    if name in MIXTURES:  # a mixture's verification routes each of its tokens apart: kept drafts too
        assert any(record.accepted for record in records), f"{name} ({form})"
    sampled = [GenerationConfig(drafter=drafter, policy="fixed", k=4, temperature=0.9, seed=11, max_new_tokens=16,
                                ignore_eos=True) for drafter in ("none", "suffix", "none")]
    texts = [[r.token_ids for r in pipeline.generate(RAGGED, config, scope=None)] for config in sampled]
    assert texts[0] == texts[1] == texts[2], f"{name} ({form})"
