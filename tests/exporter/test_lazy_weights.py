"""A Hugging Face folder's safetensors shards are read as the exporter takes each tensor, as GGUF files are."""

from __future__ import annotations

import torch

from specdeploy.exporter import artifact
from specdeploy.exporter.checkpoint import load_checkpoint
from specdeploy.exporter.lazy_weights import SafetensorsWeights
from tests import tiny


def test_sharded_safetensors_are_read_as_taken_each_once_and_released_layer_by_layer(tmp_path, monkeypatch):
    model = tiny.build_model(tiny.llama_config(num_hidden_layers=3, hidden_size=64, intermediate_size=128), seed=0)
    source = tmp_path / "ckpt"
    model.save_pretrained(source, safe_serialization=True, max_shard_size="60KB")
    tiny.make_tokenizer().save(str(source / "tokenizer.json"))
    assert len(list(source.glob("*.safetensors"))) > 1

    checkpoint = load_checkpoint(source)
    assert isinstance(checkpoint.weights, SafetensorsWeights) and checkpoint.weights.held() == 0
    expected = {name: tensor for name, tensor in model.state_dict().items() if name in checkpoint.weights}
    assert set(expected) == set(checkpoint.weights) and len(expected) >= 3 + 9 * 3
    assert checkpoint.parameters == sum(p.numel() for p in model.parameters())
    for name, tensor in expected.items():
        torch.testing.assert_close(checkpoint.weights[name], tensor, rtol=0, atol=0, msg=name)

    reads, held = [], []
    original = SafetensorsWeights._read

    def spied(self, name):
        reads.append(name)
        held.append(self.held())
        return original(self, name)

    monkeypatch.setattr(SafetensorsWeights, "_read", spied)
    staging = tmp_path / "staging"
    staging.mkdir()
    artifact._trace("target", source, staging, 96, lambda step: None, artifact.Form("fused"))
    assert sorted(reads) == sorted(set(reads)) == sorted(expected)  # every tensor, once
    firsts = [i for i, name in enumerate(reads) if name.startswith("model.layers.")
              and not reads[i - 1].startswith(name[: name.index(".", 13) + 1])]
    assert len(firsts) == 3 and all(held[i] <= 2 for i in firsts)  # the embedding and final norm, no other layer
