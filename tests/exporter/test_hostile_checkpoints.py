"""Checkpoint headers with absurd sizes are refused before anything is allocated from them."""

from __future__ import annotations

import re
import shutil
import struct

import pytest

from specdeploy.exporter import ExportError
from specdeploy.exporter.checkpoint import check_gguf_header, load_checkpoint
from tests import tiny


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
                                          r"\[128, 32\], and the config's vocab_size 1,000,000,000,000, "):
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


# Round five: every value a config or a GGUF file declares is checked before it is used (docs/robustness.md, 121-124)

BASES = {  # model_type -> a tiny config to change one value of (head_dim 16: every family's sizes)
    "llama": lambda: tiny.llama_config("llama", head_dim=16),
    "mistral": lambda: tiny.llama_config("mistral", head_dim=16, sliding_window=4),
    "gemma3_text": lambda: tiny.llama_config("gemma3_text", head_dim=16, query_pre_attn_scalar=24, sliding_window=4,
                                             layer_types=["sliding_attention", "full_attention"], rope_parameters={
                                                 "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                                                 "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                                    "rope_theta": 1e6}}),
    "granite": lambda: tiny.llama_config("granite", head_dim=16, logits_scaling=4.0),
    "phi3": lambda: tiny.llama_config("phi3", hidden_size=64, pad_token_id=0, sliding_window=None,
                                      original_max_position_embeddings=64, rope_scaling={
                                          "rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}),
    "smollm3": lambda: tiny.llama_config("smollm3", head_dim=16, no_rope_layers=[1, 0], pad_token_id=None),
}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0}


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    built = {}

    def get(model_type):
        if model_type not in built:
            model = tiny.build_model(BASES[model_type](), seed=3)
            built[model_type] = tiny.save_checkpoint(model, tmp_path_factory.mktemp(model_type) / "ckpt")
        return built[model_type]

    return get


def _with(source, tmp_path, change):
    """A copy of checkpoint ``source`` whose config.json ``change(config)`` edited."""
    import json

    directory = tmp_path / "ckpt"
    shutil.copytree(source, directory)
    config = json.loads((directory / "config.json").read_text())
    change(config)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def _set(**values):
    return lambda config: config.update(values)


def _rope(key=None, **values):
    def change(config):
        rope = config["rope_parameters"]
        (rope[key] if key else rope).update(values)
    return change


CONFIG_PROBES = [  # (base, change, what the one line says); each exported silently, or failed with a traceback, before
    ("llama", _set(rope_parameters=YARN | {"factor": 0}), "rope_parameters.factor: got 0; expected a finite number > 0"),
    ("llama", _set(rope_parameters=YARN | {"factor": float("nan")}), "rope_parameters.factor: got nan"),
    ("llama", _set(rope_parameters=YARN | {"factor": "abc"}), "rope_parameters.factor: got 'abc'"),
    ("llama", _set(rope_parameters=YARN | {"original_max_position_embeddings": 0}),
     "rope_parameters.original_max_position_embeddings: got 0; expected an integer >= 1"),
    ("gemma3_text", _rope("full_attention", factor=0), "rope_parameters.full_attention.factor: got 0"),
    ("llama", _rope(rope_theta=-1.0), "rope_parameters.rope_theta: got -1.0; expected a finite number > 0"),
    ("gemma3_text", _set(query_pre_attn_scalar=0), "query_pre_attn_scalar: got 0; expected a finite number > 0"),
    ("granite", _set(logits_scaling=0), "logits_scaling: got 0; expected a finite number > 0"),
    ("phi3", _set(original_max_position_embeddings=0), "original_max_position_embeddings: got 0"),
    ("phi3", _rope(long_factor=[2.0] * 7), "rope_parameters.long_factor: got [2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0]; "
                                           "expected a list of finite numbers > 0, one per rotated pair of dims (8: 16 dims a head "
                                           "(hidden_size / num_attention_heads))"),
    ("smollm3", _set(no_rope_layers="abc"), "no_rope_layers: got 'abc'; expected a list with 2 entries"),
    ("gemma3_text", _set(layer_types=["sliding_attention"]), "layer_types: got ['sliding_attention']; expected a list "
                                                             "with 2 entries (one per layer, num_hidden_layers)"),
    ("llama", _set(num_attention_heads=0), "num_attention_heads: got 0; expected an integer >= 1"),
    ("llama", _set(num_attention_heads=-4), "num_attention_heads: got -4"),
    ("llama", _set(num_key_value_heads=3), "num_key_value_heads: got 3; expected an integer >= 1 that divides "
                                           "num_attention_heads (4)"),
    ("llama", _set(vocab_size=1), "eos_token_id: got 2; expected a token id or a list of at most 64, each in "
                                  "[0, vocab_size = 1)"),
    ("llama", _set(rms_norm_eps=-1.0), "rms_norm_eps: got -1.0; expected a finite number > 0"),
    ("llama", _set(rms_norm_eps=float("nan")), "rms_norm_eps: got nan"),
    ("llama", _set(num_hidden_layers=0), "num_hidden_layers: got 0; expected an integer >= 1"),
    ("llama", _set(num_hidden_layers=3), "num_hidden_layers: got 3; expected 2, the layers its weights hold"),
    ("llama", _set(num_hidden_layers=10**9), "num_hidden_layers: got 1,000,000,000; expected at most the 21 tensors"),
    ("llama", _set(max_position_embeddings=0), "max_position_embeddings: got 0; expected an integer >= 1"),
    ("gemma3_text", _set(sliding_window=0), "sliding_window: got 0; expected an integer >= 1, or null (no window)"),
    ("mistral", _set(sliding_window=-3), "sliding_window: got -3"),
    ("gemma3_text", _set(sliding_window=None), "sliding_window: got None; expected an integer >= 1: layer_types has "
                                               "sliding_attention layers"),
    ("llama", lambda config: config.pop("hidden_size"), "hidden_size 4,096 (not in the file: transformers' default)"),
    ("llama", _set(hidden_act="relu"), "hidden_act: got 'relu'; expected one of silu, gelu_pytorch_tanh"),
]


@pytest.mark.parametrize("model_type,change,message", CONFIG_PROBES, ids=[f"{i}-{p[0]}" for i, p in enumerate(CONFIG_PROBES)])
def test_a_config_value_that_cannot_be_used_is_refused_naming_the_field(bases, tmp_path, model_type, change, message):
    """Each value is refused before transformers builds a config from it or anything is traced: one line naming the
    file and the field, what it got and what it expects."""
    from specdeploy.exporter.checkpoint import load_tokenizer_and_config

    source = _with(bases(model_type), tmp_path, change)
    with pytest.raises(ExportError) as refused:
        load_tokenizer_and_config(source, tokenizer=False)
    line = str(refused.value)
    assert line.startswith(str(source / "config.json")) and message in line and "\n" not in line, line


def test_a_refused_config_leaves_nothing_and_says_one_line(bases, tmp_path):
    from click.testing import CliRunner

    from specdeploy.cli import main

    source = _with(bases("gemma3_text"), tmp_path, _set(query_pre_attn_scalar=0))
    result = CliRunner().invoke(main, ["export", "--target", str(source), "--out", str(tmp_path / "art")])
    last = result.output.strip().splitlines()[-1]  # after the progress lines: the error, one line
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    assert last == f"Error: {source / 'config.json'}: query_pre_attn_scalar: got 0; expected a finite number > 0"
    assert not (tmp_path / "art").exists() and not list(tmp_path.glob(".art.*"))


def _gguf_with(path, **metadata):
    """A tiny GGUF (tests/exporter/test_gguf.py's) whose metadata ``metadata`` overrides: key -> (writer method, value)."""
    from tests.exporter.test_gguf import write_tiny_gguf

    def override(writer):
        for method, value in metadata.values():
            getattr(writer, method)(value)

    write_tiny_gguf(path, metadata=override)
    return path


GGUF_PROBES = [  # (metadata overrides, what the one line says)
    ({"blocks": ("add_block_count", 1)}, "llama.block_count (num_hidden_layers): got 1; the file's tensors hold 2 "
                                          "blocks (blk.0 to blk.1): expected one per block held"),
    ({"blocks": ("add_block_count", 10**9)}, "llama.block_count (num_hidden_layers): got 1,000,000,000; expected at "
                                              "most the 21 tensors the file holds"),
    ({"blocks": ("add_block_count", 0)}, "llama.block_count (num_hidden_layers): got 0; expected an integer >= 1"),
    ({"base": ("add_rope_freq_base", -1.0)}, "llama.rope.freq_base (rope_theta): got -1.0; expected a finite number > 0"),
    ({"heads": ("add_head_count", 0)}, "llama.attention.head_count (num_attention_heads): got 0; expected an integer >= 1"),
    ({"kv": ("add_head_count_kv", 3)}, "llama.attention.head_count_kv (num_key_value_heads): got 3; expected an integer "
                                       ">= 1 that divides num_attention_heads (4)"),
    ({"context": ("add_context_length", 0)}, "llama.context_length (max_position_embeddings): got 0"),
    ({"eps": ("add_layer_norm_rms_eps", -1.0)}, "llama.attention.layer_norm_rms_epsilon (rms_norm_eps): got -1.0"),
    ({"vocab": ("add_vocab_size", 1)}, "tokenizer.ggml.eos_token_id (eos_token_id): got 291; expected a token id or a "
                                       "list of at most 64, each in [0, vocab_size = 1)"),
]


@pytest.mark.parametrize("metadata,message", GGUF_PROBES, ids=[next(iter(m)) + str(i) for i, (m, _) in enumerate(GGUF_PROBES)])
def test_a_gguf_value_that_cannot_be_used_is_refused_naming_its_key(tmp_path, metadata, message):
    """Each exported a wrong model silently (one block of two; base -1: token 0 forever), took the machine's memory
    (10^9 blocks), ended in a traceback (heads 0: integer modulo by zero; kv heads 3 of 4: cannot reshape array), or
    exported an artifact its loader refused (blocks 0, context 0, eps -1, vocab 1)."""
    from specdeploy.exporter.checkpoint import load_tokenizer_and_config

    path = _gguf_with(tmp_path / "m.gguf", **metadata)
    with pytest.raises(ExportError) as refused:
        load_tokenizer_and_config(path, tokenizer=False)
    line = str(refused.value)
    assert line.startswith(f"{path}: ") and message in line and "\n" not in line, line


def _array_length_at(data: bytes, key: bytes) -> int:
    """The offset of the element count of the metadata array ``key`` (after its key, its type and its items' type)."""
    at = data.index(key) + len(key)
    assert int.from_bytes(data[at:at + 4], "little") == 9  # GGUF's ARRAY type
    return at + 8


@pytest.mark.parametrize("damage,message", [
    (lambda data: data[:40], "cannot be loaded as GGUF (IndexError"),
    (lambda data: data[:5000], "cannot be loaded as GGUF ("),
    (lambda data: (lambda at: data[:at] + (2**60).to_bytes(8, "little") + data[at + 8:])(
        _array_length_at(data, b"tokenizer.ggml.tokens")), "cannot be loaded as GGUF ("),
], ids=["cut-at-40", "cut-at-5000", "array-of-2^60"])
def test_a_damaged_gguf_is_one_line_naming_it(tmp_path, damage, message):
    """gguf-py's own errors (an IndexError, struct errors without a file name) reach the user as one line naming the
    file, from every reader: the config, the pair check, an export."""
    from specdeploy.exporter import export_artifact
    from specdeploy.exporter.checkpoint import load_tokenizer_and_config

    path = _gguf_with(tmp_path / "m.gguf")
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(ExportError) as refused:
        load_tokenizer_and_config(path, tokenizer=False)
    assert str(refused.value).startswith(f"{path}: {message}") and "\n" not in str(refused.value)
    with pytest.raises(ExportError, match="cannot be loaded as GGUF"):
        export_artifact(path, tmp_path / "art", draft=path, isolate=False)
    assert not (tmp_path / "art").exists()


def test_an_export_its_loader_would_refuse_leaves_nothing(bases, tmp_path):
    """A tokenizer with ids beyond the config's vocabulary: exported, then refused by every load. The export now runs
    its loader's checks before it declares success, and leaves nothing behind."""
    from specdeploy.exporter import export_artifact

    source = tmp_path / "ckpt"
    shutil.copytree(bases("llama"), source)
    tiny.make_tokenizer(words=200).save(str(source / "tokenizer.json"))
    with pytest.raises(ExportError) as refused:
        export_artifact(source, tmp_path / "art", capacity=32, graph="fused")
    assert str(refused.value) == (f"the artifact would not load, so nothing was written: {tmp_path / 'art'}: "
                                  "tokenizer.json: token ids up to 199 (200 tokens), outside the models' vocabulary "
                                  "[0, 128)")
    assert not (tmp_path / "art").exists() and not list(tmp_path.glob(".art.*"))


def test_a_chat_template_that_does_not_compile_is_refused_at_export(checkpoints, tmp_path):
    """It was exported, and every chat request then failed; the artifact's loader now compiles it, and so does the
    export, naming the checkpoint's file."""
    import json

    from specdeploy.exporter import export_artifact

    source = tmp_path / "ckpt"
    shutil.copytree(checkpoints["target"], source)
    (source / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{% for m in messages %}{{ m }}"}))
    expected = re.escape(f"{source / 'tokenizer_config.json'}: chat_template: does not compile (") + r"Unexpected end.*line 1\)"
    with pytest.raises(ExportError, match=expected):
        export_artifact(source, tmp_path / "art", capacity=32)
    assert not (tmp_path / "art").exists()
