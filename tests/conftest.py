"""Session-scoped tiny checkpoints and artifacts: each model is built and exported once per run."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from tests import foreign as foreign_models
from tests import tiny, traces


@pytest.fixture(scope="session", autouse=True)
def export_cache(tmp_path_factory):
    """One directory of tiny exports for the whole run, shared by every xdist worker (``tiny.export_cli``)."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):  # each worker's basetemp sits in the run's own
        root = root.parent
    tiny.EXPORT_CACHE = root / "tiny-exports"
    tiny.EXPORT_CACHE.mkdir(exist_ok=True)
    yield tiny.EXPORT_CACHE
    tiny.EXPORT_CACHE = None


@pytest.fixture(scope="session", autouse=True)
def trace_cache(export_cache):
    """Each explicit-form trace made once per run, shared by every xdist worker (tests/traces.py)."""
    with pytest.MonkeyPatch.context() as patch:
        traces.install(patch, export_cache / "traces")
        yield traces.ROOT
    traces.ROOT = None


@pytest.fixture(scope="session", autouse=True)
def user_cache(tmp_path_factory):
    """The tests' own SPECDEPLOY_CACHE (remembered digests): never the user's, and inherited by the CLI runs."""
    path = tmp_path_factory.mktemp("user-cache")
    previous, os.environ["SPECDEPLOY_CACHE"] = os.environ.get("SPECDEPLOY_CACHE"), str(path)
    yield path
    if previous is None:
        del os.environ["SPECDEPLOY_CACHE"]
    else:
        os.environ["SPECDEPLOY_CACHE"] = previous


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """Tiny llama-family checkpoints: a target, a perturbed target (a draft that agrees often) and
    an unrelated random model (a draft that is pure noise)."""
    root = tmp_path_factory.mktemp("checkpoints")
    config = tiny.llama_config()
    target = tiny.build_model(config, seed=0)
    close = tiny.build_model(config, seed=1, perturb_from=target, noise=0.05)
    noise = tiny.build_model(tiny.llama_config(num_hidden_layers=1, hidden_size=16, num_attention_heads=2,
                                               num_key_value_heads=1, intermediate_size=24), seed=2)
    return {
        "target": tiny.save_checkpoint(target, root / "target"),
        "close": tiny.save_checkpoint(close, root / "close"),
        "noise": tiny.save_checkpoint(noise, root / "noise"),
        "models": {"target": target, "close": close, "noise": noise},
    }


@pytest.fixture(scope="session")
def pair_dir(checkpoints, tmp_path_factory):
    """Target with a close draft: partial, ragged acceptance."""
    return tiny.export_cli(tmp_path_factory.mktemp("art") / "pair", checkpoints["target"], checkpoints["close"])


@pytest.fixture(scope="session")
def self_dir(checkpoints, tmp_path_factory):
    """Target drafting for itself: every draft is accepted."""
    return tiny.export_cli(tmp_path_factory.mktemp("art") / "self", checkpoints["target"], checkpoints["target"])


@pytest.fixture(scope="session")
def noise_dir(checkpoints, tmp_path_factory):
    """A draft that is pure noise: almost nothing is accepted, output must not change."""
    return tiny.export_cli(tmp_path_factory.mktemp("art") / "noise", checkpoints["target"], checkpoints["noise"])


@pytest.fixture(scope="session")
def fused_dirs(tmp_path_factory):
    """The close, self and noise pairs as fused graphs ("close", "self", "noise", and "trimmed": the close pair with
    the draft's vocabulary cut in half -> artifact dir): the same
    tiny models as ``checkpoints`` but with head_dim 16, the least ONNX Runtime's GroupQueryAttention rotates."""
    root = tmp_path_factory.mktemp("fused")
    config = tiny.llama_config(head_dim=16)
    target = tiny.build_model(config, seed=0)
    close = tiny.build_model(config, seed=1, perturb_from=target, noise=0.05)
    noise = tiny.build_model(tiny.llama_config(num_hidden_layers=1, hidden_size=16, num_attention_heads=2,
                                               num_key_value_heads=1, intermediate_size=24, head_dim=16), seed=2)
    saved = {name: tiny.save_checkpoint(model, root / name) for name, model in
             (("target", target), ("close", close), ("noise", noise))}
    dirs = {name: tiny.export_cli(root / f"{name}-art", saved["target"], saved[draft], "--graph", "fused")
            for name, draft in (("close", "close"), ("self", "target"), ("noise", "noise"))}
    # the close draft scoring only the first half of the vocabulary (--draft-vocab)
    dirs["trimmed"] = tiny.export_cli(root / "trimmed-art", saved["target"], saved["close"], "--graph", "fused",
                                      "--draft-vocab", str(tiny.VOCAB // 2))
    return dirs


# Llama 3's chat template, as tests/runtime/test_chat.py renders it
LLAMA3_CHAT_TEMPLATE = (
    "{{- bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>"
    "\\n\\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")


@pytest.fixture(scope="session")
def chat_target_dir(checkpoints, tmp_path_factory):
    """The tiny target alone (no draft), with a tokenizer_config.json that has a chat template and asks for BOS."""
    root = tmp_path_factory.mktemp("chat")
    source = root / "ckpt"
    shutil.copytree(checkpoints["target"], source)
    (source / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": LLAMA3_CHAT_TEMPLATE, "bos_token": {"content": "<s>", "special": True}, "eos_token": "</s>",
        "add_bos_token": True, "model_max_length": 256}))
    return tiny.export_cli(root / "art", source)


@pytest.fixture(scope="session")
def exported_architecture(tmp_path_factory):
    """(name, graph form) -> (transformers model, artifact dir) for the parity cases, each exported once per session;
    ``.checkpoint(name)``: the case's checkpoint directory (a test exporting it otherwise shares its trace)."""
    from tests.exporter.cases import PARITY_CASES

    models, artifacts = {}, {}

    def built(name):
        if name not in models:
            model = tiny.build_model(PARITY_CASES[name](), seed=3)
            root = tmp_path_factory.mktemp(name)
            models[name] = (model, tiny.save_checkpoint(model, root / "ckpt"), root)
        return models[name]

    def get(name, graph="explicit"):
        model, checkpoint, root = built(name)
        if (name, graph) not in artifacts:
            artifacts[name, graph] = tiny.export_cli(root / f"art-{graph}", checkpoint, None, "--graph", graph)
        return model, artifacts[name, graph]

    get.checkpoint = lambda name: built(name)[1]
    return get


@pytest.fixture(scope="session")
def foreign(export_cache):
    """Folders written by onnxruntime-genai and optimum, and their imports (tests/foreign.py), built once per run:
    {"folders": name -> folder, "artifacts": name -> imported artifact dir, "references": folder name -> each prompt's
    greedy continuation by the folder's own tool}."""
    from filelock import FileLock

    root = export_cache / "foreign"
    root.mkdir(exist_ok=True)
    with FileLock(f"{root}.lock"):
        done = root / "references.json"
        if not done.is_file():
            done.write_text(json.dumps(foreign_models.build(root)))
    return {"folders": {name: root / name for name in foreign_models.FOLDERS},
            "artifacts": {name: root / "artifacts" / name for name in foreign_models.ARTIFACTS},
            "references": json.loads(done.read_text())}
