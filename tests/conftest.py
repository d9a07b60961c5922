"""Session-scoped tiny checkpoints and artifacts: each model is built and exported once per run."""

from __future__ import annotations

import pytest

from tests import tiny


@pytest.fixture(scope="session", autouse=True)
def user_cache(tmp_path_factory):
    """The tests' own SPECDEPLOY_CACHE (remembered digests): never the user's, and inherited by the CLI runs."""
    import os

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
def exported_architecture(tmp_path_factory):
    """name -> (transformers model, artifact dir) for the parity cases, each exported once per session."""
    from tests.exporter.cases import PARITY_CASES

    cache = {}

    def get(name):
        if name not in cache:
            model = tiny.build_model(PARITY_CASES[name](), seed=3)
            root = tmp_path_factory.mktemp(name)
            cache[name] = (model, tiny.export_cli(root / "art", tiny.save_checkpoint(model, root / "ckpt")))
        return cache[name]

    return get
