"""The hybrid families (exporter/hybrids.py; Granite 4.0-H with routed experts too) beyond parity (test_parity): a prefill
longer than a ring of states, in one call and in chunks, against transformers; what the manifest declares of their
recurrent state, and a manifest that misdeclares it refused; a malformed config refused in one line naming the field."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from specdeploy import Pipeline
from specdeploy.contract import ContractError, Manifest
from specdeploy.engines import base, load_engine
from tests import tiny
from tests.exporter.cases import PARITY_CASES

HYBRIDS = ("lfm2", "granitemoehybrid", "granitemoehybrid-experts")
TEXT = list(np.random.default_rng(5).integers(0, tiny.VOCAB, 48))  # longer than Mamba-2's rings (19 and 21 slots)


@pytest.mark.parametrize("form", ["explicit", "fused"])
@pytest.mark.parametrize("name", HYBRIDS)
def test_a_prefill_longer_than_a_ring_in_one_call_and_in_chunks_matches_transformers(exported_architecture, monkeypatch,
                                                                                      name, form):
    """One call of 40 tokens writes only its last positions' states (a ring keeps no more), chunks of 7 carry them
    across calls; either way the 8 tokens verified after it get transformers' logits."""
    model, directory = exported_architecture(name, form)
    engine = load_engine(directory, Manifest.read(directory), "target")
    with torch.no_grad():
        reference = model(torch.tensor([TEXT])).logits[0].numpy()
    tolerance = 1e-4 * np.abs(reference).max()
    whole = engine.allocate_cache(1, 64)
    first = engine.infer(np.array([TEXT[:40]]), np.zeros(1, np.int64), whole).logits[0]
    assert np.abs(first - reference[:40]).max() <= tolerance
    monkeypatch.setattr(base, "PREFILL_CHUNK", 7)
    chunked = engine.allocate_cache(1, 64)
    base.prefill(engine, chunked, np.array([TEXT]), [40])
    for cache in (whole, chunked):
        cache.commit([40])
        logits = engine.infer(np.array([TEXT[40:]]), np.array([40]), cache).logits[0]
        assert np.abs(logits - reference[40:]).max() <= tolerance


def test_the_manifest_declares_each_recurrent_state(exported_architecture):
    """LFM2's conv inputs one a cache slot (positional); Mamba-2's conv inputs and scan state in rings, the most drafts
    a cycle may verify said by them; K/V for the attention layer alone; the mixers among the features."""
    lfm2 = Manifest.read(exported_architecture("lfm2", "explicit")[1]).target
    assert [(s.name, s.layers, s.shape, s.lookback, s.slots) for s in lfm2.states] == [("conv", (0,), (32,), 2, 0)]
    assert lfm2.kv_layers == [1] and lfm2.max_drafts is None and "short_conv mixer on 1 of 2 layers" in lfm2.features
    assert lfm2.inputs == ["input_ids", "past_len", "cache_key.1", "cache_value.1", "cache_conv.0"]
    granite = Manifest.read(exported_architecture("granitemoehybrid", "fused")[1]).target
    assert [(s.name, s.shape, s.lookback, s.slots) for s in granite.states] == [("conv", (96,), 3, 21),
                                                                               ("ssm", (4, 16, 8), 1, 19)]
    assert granite.max_drafts == 16 and granite.keeps_ring and "mamba2 mixer on 1 of 2 layers" in granite.features
    assert granite.outputs == ["logits", "present_key.1", "present_value.1", "present_conv.0", "present_ssm.0", "ids"]
    assert granite.inputs == ["input_ids", "seqlens_k", "cache_key.1", "cache_value.1", "cache_conv.0", "cache_ssm.0",
                              "read_slots_conv", "write_slots_conv", "read_slots_ssm", "write_slots_ssm", "num_logits"]


@pytest.mark.parametrize("change,match", [
    ({"name": "key"}, r"states\[0\]: name 'key' must be lower-case letters"),
    ({"layers": [1]}, r"graph inputs/outputs disagree with the manifest"),  # layer 1 is the attention layer
    ({"layers": [5]}, r"states\[0\]: layers must be distinct layer indices in \[0, 2\), got \[5\]"),
    ({"shape": [31]}, r"cache_conv.0: the graph declares float32 \['batch', 'capacity', 32\]; the manifest says float32 "
                      r"\['\?', '\?', 31\] \(dtype, its state's slots and shape of the target model\)"),
    ({"slots": 3}, r"states\[0\]: a ring of 3 slots holds no draft \(lookback 2\); expected at least 5"),
    ({"lookback": 0}, r"states\[0\]: lookback must be at least 1, got 0"),
])
def test_a_manifest_misdeclaring_a_recurrent_state_is_refused(exported_architecture, tmp_path, change, match):
    art = tmp_path / "art"
    shutil.copytree(exported_architecture("lfm2", "explicit")[1], art)
    manifest = json.loads((art / "manifest.json").read_text())
    manifest["models"]["target"]["states"][0].update(change)
    (art / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises((ContractError, RuntimeError), match=match):
        Pipeline.load(art)


@pytest.mark.parametrize("name,form,value,match", [
    ("lfm2", "explicit", True, "takes_state_slots on an explicit graph; only a fused graph with recurrent states takes"),
    ("granitemoehybrid", "fused", "yes", "takes_state_slots must be true or false, got 'yes'"),
])
def test_a_manifest_misdeclaring_the_state_slot_inputs_is_refused(exported_architecture, tmp_path, name, form, value,
                                                                 match):
    """A fused hybrid takes its states' slots as inputs the engine fills (``ModelSpec.takes_state_slots``); the flag
    on an explicit graph, or not a bool, is refused naming it."""
    art = shutil.copytree(exported_architecture(name, form)[1], tmp_path / "art")
    manifest = json.loads((art / "manifest.json").read_text())
    manifest["models"]["target"]["takes_state_slots"] = value
    (art / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ContractError, match=match):
        Manifest.read(art)


# (parity case, config.json fields changed, what the one line of the refusal says: one part or several)
MALFORMED = {
    "conv kernel 0": ("lfm2", {"conv_L_cache": 0}, "config.json: conv_L_cache: got 0; expected an integer >= 2"),
    "conv kernel unlike the weights": ("lfm2", {"conv_L_cache": 2}, ("conv.weight holds [32, 1, 3], and the "
                                                                   "config's", "conv_L_cache 2", "make it [32, 1, 2]")),
    "layer_types too long": ("lfm2", {"layer_types": ["conv", "full_attention", "conv"]},
                             "layer_types: got ['conv', 'full_attention', 'conv']; "
                             "expected a list with 2 entries"),
    "layer type without a mixer": ("lfm2", {"layer_types": ["conv", "sliding_attention"]},
                                   ("layer_types: got ['conv', 'sliding_attention']; expected a list",
                                    "each 'conv' or 'full_attention'")),
    "state size unlike the weights": ("granitemoehybrid", {"mamba_d_state": 16},
                                      ("conv1d.weight holds [96, 1, 4], and the config's", "mamba_d_state 16",
                                       "make it [128, 1, 4]")),
    "head sizes that disagree": ("granitemoehybrid", {"mamba_d_head": 8},
                                 "mamba_d_head: got 8; expected an integer >= 1 with "
                                 "mamba_n_heads x mamba_d_head = mamba_expand x hidden_size (2 x 32)"),
    "groups not dividing heads": ("granitemoehybrid", {"mamba_n_groups": 3},
                                  "mamba_n_groups: got 3; expected an integer >= 1 that divides mamba_n_heads (4)"),
    "conv kernel 0 (Mamba-2)": ("granitemoehybrid", {"mamba_d_conv": 0}, "mamba_d_conv: got 0; expected an integer >= 2"),
    "top-k above the experts": ("granitemoehybrid-experts", {"num_experts_per_tok": 5},
                                "num_experts_per_tok: got 5; expected an integer >= 1, at most num_local_experts (4)"),
    "experts unlike the weights": ("granitemoehybrid-experts", {"num_local_experts": 6},
                                   "num_local_experts 6 disagrees with model.layers.0.block_sparse_moe.router.layer."
                                   "weight [4, 32]; expected 6 rows, one per expert"),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid-checkpoints")
    return {name: tiny.save_checkpoint(tiny.build_model(PARITY_CASES[name](), seed=3), root / name) for name in HYBRIDS}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_a_malformed_config_is_refused_in_one_line_naming_the_field(checkpoints, tmp_path, case):
    from click.testing import CliRunner

    from specdeploy.cli import main

    name, change, said = MALFORMED[case]
    source = tmp_path / "ckpt"
    shutil.copytree(checkpoints[name], source)
    config = json.loads((source / "config.json").read_text()) | change
    (source / "config.json").write_text(json.dumps(config))
    result = CliRunner().invoke(main, ["export", "--target", str(source), "--out", str(tmp_path / "art")])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit)  # refused, not a traceback
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and all(part in errors[0] for part in ((said,) if isinstance(said, str) else said)), (
        result.output)
    assert not (tmp_path / "art").exists()
