"""Tiny seeded random models with a small word-level tokenizer, built inside the tests (no downloads)."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

VOCAB = 128
WORDS = 120  # tokenizer entries: 4 specials + 116 words; the model vocab (128) is a little larger
SPECIALS = ["<unk>", "<s>", "</s>", "<pad>"]
EOS = 2


def make_tokenizer(words: int = WORDS, shift: int = 0):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from tokenizers.decoders import WordPiece

    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for i in range(len(SPECIALS), words):
        vocab[f"w{i + shift}"] = i
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    tokenizer.add_special_tokens(SPECIALS)
    return tokenizer


def llama_config(kind: str = "llama", **overrides):
    """A tiny config of model_type ``kind``: Llama's sizes, for any decoder family transformers knows."""
    from transformers import AutoConfig

    base = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=48, max_position_embeddings=256, eos_token_id=EOS, bos_token_id=1,
                tie_word_embeddings=False)
    base.update(overrides)
    return AutoConfig.for_model(kind, **base)


def gpt2_config(**overrides):
    from transformers import GPT2Config

    base = dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=256, eos_token_id=EOS, bos_token_id=1)
    base.update(overrides)
    return GPT2Config(**base)


def build_model(config, seed: int = 0, perturb_from=None, noise: float = 0.0, conditioned: bool = False):
    """A random model from ``config``; with ``perturb_from``, that model's weights plus Gaussian noise.

    The default init (std 0.3) gives well-separated logits for exact greedy tests. ``conditioned``
    scales weights by 1/sqrt(fan_in) instead, so that weight noise (int4) does not get amplified
    chaotically layer by layer, as it never is in a trained model.
    """
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
            elif not conditioned:
                p.normal_(0, 0.3)
            else:
                fan_in = p.shape[1] if "embed" not in name and "wte" not in name else 1
                p.normal_(0, (4.0 if "lm_head" in name else 0.5) / fan_in**0.5)
        if perturb_from is not None:
            model.load_state_dict(perturb_from.state_dict())
            for p in model.parameters():
                p.add_(torch.randn_like(p) * noise)
    return model


def save_mxfp4_checkpoint(model, directory: Path, seed: int = 5) -> Path:
    """A gpt-oss ``model``'s checkpoint with its experts as gpt-oss checkpoints store them, MXFP4 ``*_blocks`` and
    ``*_scales`` (the config's quantization_config says mxfp4): random codes and scales, which ``model``'s experts are
    set to the values of (transformers' own ``convert_moe_packed_tensors`` decodes them)."""
    import numpy as np
    import torch
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    rng, packed = np.random.default_rng(seed), {}
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            for name in ("gate_up_proj", "down_proj"):
                experts = getattr(layer.mlp.experts, name)  # [experts, in, out]; blocks of 32 inputs a row of out
                count, inputs, outputs = experts.shape
                blocks = torch.from_numpy(rng.integers(0, 256, (count, outputs, inputs // 32, 16), dtype=np.uint8))
                scales = torch.from_numpy(rng.integers(124, 128, (count, outputs, inputs // 32), dtype=np.uint8))
                experts.copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
                packed[f"model.layers.{i}.mlp.experts.{name}_blocks"] = blocks
                packed[f"model.layers.{i}.mlp.experts.{name}_scales"] = scales
    directory = save_checkpoint(model, directory)
    weights = {name: tensor for name, tensor in load_file(directory / "model.safetensors").items()
               if not name.endswith(("experts.gate_up_proj", "experts.down_proj"))}
    save_file(weights | packed, directory / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                                                                         "model.layers.*.mlp.router"]}
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def save_checkpoint(model, directory: Path, tokenizer=None) -> Path:
    directory = Path(directory)
    model.save_pretrained(directory, safe_serialization=True)
    (tokenizer or make_tokenizer()).save(str(directory / "tokenizer.json"))
    return directory


# A directory every worker of this test run shares (set by conftest.py): an export that tiny.export_cli made once
# is copied from there instead of traced again (an explicit-form tiny model's trace costs ~6 s of torch.export)
EXPORT_CACHE: Path | None = None


def export_cli(out: Path, target: Path, draft: Path | None = None, *extra: str) -> Path:
    """Export through the CLI, as a user would; the same checkpoints and options give a copy of the same artifact.

    The artifact is exported once per test run (``EXPORT_CACHE``, shared by the xdist workers under a file lock)
    and copied to ``out``: a copy, never a link, so that a test may damage its artifact without touching another's.
    """
    out = Path(out)
    options = ["--capacity", "96", *extra] + (["--draft", str(draft)] if draft is not None else [])
    if EXPORT_CACHE is None or out.exists():  # an existing ``out`` is the exporter's to refuse or replace
        return _export(out, target, options)
    from filelock import FileLock

    cached = EXPORT_CACHE / _export_key(target, draft, options)
    with FileLock(f"{cached}.lock"):
        if not (cached / "manifest.json").is_file():
            shutil.rmtree(cached, ignore_errors=True)  # a failed export's leftovers
            _export(cached, target, options)
    shutil.copytree(cached, out)
    return out


def _export(out: Path, target: Path, options: list[str]) -> Path:
    from click.testing import CliRunner

    from specdeploy.cli import main

    result = CliRunner().invoke(main, ["export", "--target", str(target), "--out", str(out), *options],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return out


def _export_key(target: Path, draft: Path | None, options: list[str]) -> str:
    """A digest of what an export reads: every file of the checkpoints (a directory or a GGUF file) and the options,
    the draft's path among them replaced by its content."""
    digest = hashlib.sha256()
    for source in (target, draft):
        source = Path(source) if source is not None else None
        files = [] if source is None else sorted(source.rglob("*")) if source.is_dir() else [source]
        for path in (f for f in files if f.is_file()):
            digest.update(f"{path.relative_to(source) if source.is_dir() else path.name}\0".encode())
            digest.update(hashlib.sha256(path.read_bytes()).digest())
        digest.update(b"\1")
    digest.update(json.dumps([o for o in options if o != str(draft)]).encode())
    return digest.hexdigest()[:32]


def read_json(path: Path):
    return json.loads(Path(path).read_text())


def export_pair(directory: Path, capacity: int = 256, noise: float = 0.02) -> Path:
    """A tiny llama target and a perturbed copy as its draft, exported to ``directory / "art"``."""
    directory = Path(directory)
    target = build_model(llama_config(), seed=0)
    draft = build_model(llama_config(), seed=1, perturb_from=target, noise=noise)
    return export_cli(directory / "art", save_checkpoint(target, directory / "t"), save_checkpoint(draft, directory / "d"),
                      "--capacity", str(capacity))


def ort_session(model, options=None):
    """An ONNX Runtime session of ``model`` (a path or bytes) for a test to run directly, on this process's thread
    pool (``engines.ort.fit_thread_pool``): tests of several files share a worker process, and once one of them made
    the shared pool, ONNX Runtime refuses a session a pool of its own."""
    import onnxruntime as ort

    from specdeploy.engines.ort import fit_thread_pool

    options = options or ort.SessionOptions()
    fit_thread_pool(options)
    return ort.InferenceSession(str(model) if isinstance(model, Path) else model, options,
                                providers=["CPUExecutionProvider"])
