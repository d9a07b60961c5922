"""A multimodal checkpoint's language model (Gemma 3's Gemma3ForConditionalGeneration, model_type "gemma3"): exported
from its text config and its text weights, saying so in one line; its parity against transformers' multimodal model
over text is test_parity's "gemma3" case."""

from __future__ import annotations

import numpy as np
import torch
from click.testing import CliRunner
from safetensors import safe_open

from specdeploy.cli import main
from specdeploy.contract import Manifest
from specdeploy.engines import load_engine
from tests import tiny
from tests.exporter.cases import PARITY_CASES

NOTE = "language model only: image inputs are not exported"


def test_the_text_config_and_weights_are_taken_and_the_image_inputs_left_out_in_one_line(exported_architecture,
                                                                                         tmp_path):
    """The text config's sizes and features, the text weights (a checkpoint in the hub's own names, the vision tower's
    left unread), a pair (the model drafting for itself: the pair's checks read the text config's vocabulary), and the
    one line that says what is not exported, in the manifest and in ``specdeploy inspect``."""
    model, _ = exported_architecture("gemma3", "fused")
    checkpoint = exported_architecture.checkpoint("gemma3")
    with safe_open(str(checkpoint / "model.safetensors"), "pt") as stored:  # the hub's names, a vision tower among them
        names = set(stored.keys())
    assert "language_model.model.embed_tokens.weight" in names and any(n.startswith("vision_tower.") for n in names)
    directory = tiny.export_cli(tmp_path / "art", checkpoint, checkpoint, "--graph", "fused")
    manifest = Manifest.read(directory)
    text = PARITY_CASES["gemma3"]().text_config
    for spec in (manifest.target, manifest.draft):
        assert (spec.architecture, spec.family) == ("gemma3", "gemma3")
        assert (spec.num_layers, spec.num_heads, spec.kv_heads, spec.head_dim, spec.vocab_size) == (
            text.num_hidden_layers, text.num_attention_heads, text.num_key_value_heads, text.head_dim, text.vocab_size)
        assert spec.features[-1] == NOTE and "tied embeddings" in spec.features
    ids = np.random.default_rng(4).integers(0, tiny.VOCAB, (1, 9))
    with torch.no_grad():
        expected = model(torch.tensor(ids)).logits[0].numpy()
    for role in ("target", "draft"):
        engine = load_engine(directory, manifest, role)
        logits = engine.infer(ids, np.zeros(1, np.int64), engine.allocate_cache(1, 16)).logits[0]
        np.testing.assert_allclose(logits, expected, rtol=0, atol=1e-4 * np.abs(expected).max(), err_msg=role)
    shown = CliRunner().invoke(main, ["inspect", str(directory)])
    assert shown.exit_code == 0 and len([line for line in shown.output.splitlines() if NOTE in line]) == 2, shown.output
