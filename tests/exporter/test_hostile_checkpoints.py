"""Checkpoint headers with absurd sizes are refused before anything is allocated from them."""

from __future__ import annotations

import shutil
import struct

import pytest

from specdeploy.exporter import ExportError
from specdeploy.exporter.checkpoint import check_gguf_header, load_checkpoint


def _gguf(path, version=3, tensors=10, entries=10):
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", version, tensors, entries) + b"\0" * 64)
    return path


@pytest.mark.parametrize("kwargs,match", [
    (dict(tensors=1 << 60), "declares 1152921504606846976 tensors"),
    (dict(entries=1 << 40), "metadata entries; refusing"),
    (dict(version=99), "GGUF version 99 is not supported"),
])
def test_absurd_gguf_headers(tmp_path, kwargs, match):
    path = _gguf(tmp_path / "m.gguf", **kwargs)
    with pytest.raises(ExportError, match=match):
        check_gguf_header(path)
    with pytest.raises(ExportError, match=match):
        load_checkpoint(path)


def test_not_a_gguf(tmp_path):
    (tmp_path / "m.gguf").write_bytes(b"PK\x03\x04" + b"\0" * 40)
    with pytest.raises(ExportError, match="not a GGUF file"):
        load_checkpoint(tmp_path / "m.gguf")


def test_plausible_gguf_header_passes(tmp_path):
    check_gguf_header(_gguf(tmp_path / "m.gguf"))


def test_safetensors_header_larger_than_the_file(checkpoints, tmp_path):
    src = shutil.copytree(checkpoints["target"], tmp_path / "ckpt")
    data = (src / "model.safetensors").read_bytes()
    (src / "model.safetensors").write_bytes(struct.pack("<Q", 1 << 62) + data[8:])
    with pytest.raises(ExportError, match=r"header of 4611686018427387904 bytes in a \d+-byte file"):
        load_checkpoint(src)


def test_a_config_that_disagrees_with_its_weights_is_refused(checkpoints, tmp_path):
    """config.json claiming a vocabulary of 10**12 beside 128-token weights: no artifact is written."""
    import json

    from specdeploy.exporter import ExportOptions, export_artifact

    source = tmp_path / "ckpt"
    shutil.copytree(checkpoints["target"], source)
    config = json.loads((source / "config.json").read_text())
    config["vocab_size"] = 10**12
    (source / "config.json").write_text(json.dumps(config))
    with pytest.raises(ExportError, match=r"config.json disagrees with its weights: model.embed_tokens.weight holds "
                                          r"\[128, 32\], and the config's vocab_size 1,000,000,000,000 makes it"):
        export_artifact(source, tmp_path / "art", options=ExportOptions(capacity=64))
    assert not (tmp_path / "art").exists()


def test_a_string_add_bos_token_is_refused_at_export(checkpoints, tmp_path):
    """transformers would take "false" as true (a BOS on every prompt); the exporter used to do the same."""
    import json

    from click.testing import CliRunner

    from specdeploy.cli import main

    source = tmp_path / "ckpt"
    shutil.copytree(checkpoints["target"], source)
    (source / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "add_bos_token": "false"}))
    result = CliRunner().invoke(main, ["export", "--target", str(source), "--out", str(tmp_path / "art"), "--capacity", "32"])
    assert result.exit_code == 1 and "add_bos_token: got 'false' (str); expected true or false" in result.output
    assert not (tmp_path / "art").exists()
