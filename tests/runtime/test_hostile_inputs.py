"""Hostile and careless inputs to the Python API, round two: each is refused in one line naming the thing, or
answered correctly; the pipeline stays usable after every refusal."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

from specdeploy import GenerationConfig, Pipeline
from specdeploy.contract import ContractError, sha256_file, tokenizer_fingerprint
from specdeploy.runtime.config import MAX_STOP_CHARS, MAX_STOP_STRINGS, ConfigError
from specdeploy.runtime.cost_policy import Costs
from specdeploy.runtime.sampling import DistributionError, probabilities, sample

GOOD = GenerationConfig(max_new_tokens=4, ignore_eos=True, k=2)


@pytest.fixture(scope="module")
def pipeline(pair_dir):
    return Pipeline.load(pair_dir)


@pytest.mark.parametrize("temperature", [5e-324, 1e-300, 1e-7])
def test_a_temperature_too_small_to_scale_by_is_refused(temperature):
    with pytest.raises(ConfigError, match=r"temperature: got .*; expected a finite number, 0 \(greedy\) or >= 1e-06"):
        GenerationConfig(temperature=temperature)
    assert GenerationConfig(temperature=1e-6).temperature == 1e-6 and GenerationConfig(temperature=0).greedy


def test_the_sampler_refuses_a_distribution_without_mass():
    """NaN probabilities used to give the last id at every step; now the draw fails loudly."""
    rng = np.random.default_rng(0)
    for probs in (np.array([0.2, np.nan, 0.3]), np.zeros(3), np.array([np.inf, 1.0])):
        with pytest.raises(DistributionError, match="the distribution's mass is"):
            sample(probs, rng)
    logits = np.array([1.0, 2.0, 1e308])  # overflows once scaled: what a subnormal temperature did to any logits
    with pytest.raises(DistributionError):
        sample(probabilities(logits / 1e-10, GenerationConfig(temperature=1.0)), rng)
    assert sample(np.array([0.0, 1.0, 0.0]), rng) == 1


def test_nan_logits_fail_their_request_loudly(pair_dir):
    """An engine that returns NaN logits under sampling fails the request with the reason, never garbage tokens."""
    pipeline = Pipeline.load(pair_dir)

    class NanEngine:
        def __init__(self, engine):
            self.engine = engine

        def __getattr__(self, name):
            return getattr(self.engine, name)

        def infer(self, *args, **kwargs):
            output = self.engine.infer(*args, **kwargs)
            output.logits[...] = np.nan
            return output

    pipeline.target = NanEngine(pipeline.target)
    result = pipeline.generate(["w5 w6"], GenerationConfig(temperature=0.8, max_new_tokens=4, seed=1, drafter="none"))[0]
    assert result.finish_reason == "error" and "DistributionError" in result.error and result.token_ids == []


@pytest.mark.parametrize("threads,match", [
    (100_000, r"threads: got 100000; expected an integer in \[1, \d+\]"),
    (-1, r"threads: got -1; expected an integer in \[1, \d+\]"),
    (0, r"threads: got 0"),
    ("4", r"threads: got '4'"),
    (2.0, r"threads: got 2.0"),
    (True, r"threads: got True"),
])
def test_thread_counts_are_checked_before_any_work(pair_dir, threads, match):
    """100,000 used to abort the process inside ONNX Runtime; '4' was reported as an unloadable artifact."""
    with pytest.raises(ConfigError, match=match):
        Pipeline.load(pair_dir, threads=threads)


def test_stop_strings_are_bounded_in_number_and_length():
    assert len(GenerationConfig(stop=["x" * MAX_STOP_CHARS] * MAX_STOP_STRINGS).stop) == MAX_STOP_STRINGS
    with pytest.raises(ConfigError, match=f"stop: got 17 strings; expected at most {MAX_STOP_STRINGS}"):
        GenerationConfig(stop=["a"] * 17)
    with pytest.raises(ConfigError, match=f"stop: got a string of 160,000 characters; expected at most {MAX_STOP_CHARS}"):
        GenerationConfig(stop=["ab" * 80_000])
    with pytest.raises(ConfigError, match=r"stop\[1\]: a lone surrogate \(U\+D800\) at character 2"):
        GenerationConfig(stop=["ok", "ab\ud800"])


@pytest.mark.parametrize("make", [lambda: GenerationConfig(stop=[1] * 1_000_000),
                                  lambda: GenerationConfig(stop_token_ids=["7"] * 1_000_000),
                                  lambda: Costs.from_dict({"verify": [[1] * 1_000_000]}),
                                  lambda: Costs.from_dict({"draft": [["1" * 1_000_000, 1, 0.1]]})])
def test_a_huge_bad_value_is_repeated_cut_short(make):
    """A client's stop list or a remembered cost table of a million entries is refused in one short line (the value was
    repeated whole: megabytes of message)."""
    with pytest.raises(ValueError) as refused:
        make()
    assert len(str(refused.value)) < 200 and "\n" not in str(refused.value)


@pytest.mark.parametrize("field,value", [("drafter", ["model"]), ("policy", ["fixed"]), ("drafter", {"model": 1})])
def test_a_list_where_a_name_belongs_is_refused_naming_the_field(field, value):
    with pytest.raises(ConfigError, match=f"{field}: got .*; expected one of"):
        GenerationConfig(**{field: value})


def test_lone_surrogates_are_refused_naming_the_prompt(pipeline):
    with pytest.raises(ConfigError, match=r"prompt: a lone surrogate \(U\+DC00\) at character 3; expected valid Unicode"):
        pipeline.generate(["w5 \udc00 w6"], GOOD)
    with pytest.raises(ConfigError, match=r"prompt: a lone surrogate"):
        list(pipeline.stream("w5\ud83d", GOOD))
    assert pipeline.generate(["w5 w6"], GOOD)[0].token_ids  # still usable


@pytest.mark.parametrize("ids,match", [
    ([5, 2**70], r"token_ids: range \[5, 1180591620717411303424\] outside the vocabulary \[0, 128\)"),
    ([5, -1], r"token_ids: range \[-1, 5\] outside the vocabulary"),
    ([5, 500], r"token_ids: range \[5, 500\] outside the vocabulary"),
    ([5, "6"], r"token_ids: got '6' among them; expected integers"),
    ("w5", r"token_ids: got 'w5'; expected a list of token ids"),
])
def test_decode_checks_its_ids(pipeline, ids, match):
    with pytest.raises(ConfigError, match=match):
        pipeline.decode(ids)
    assert pipeline.decode(np.array([5, 6])) == pipeline.decode([5, 6]) == "w5 w6"


@pytest.mark.parametrize("reference,other,match", [
    ([5, 6], [5, 500], r"other: range \[5, 500\] outside the vocabulary \[0, 128\)"),
    ([5, -6], [5, 6], r"reference: range \[-6, 5\] outside the vocabulary"),
    ([5, 2**64], [5, 6], r"reference: range .* outside the vocabulary"),
    ([5, 6.0], [5, 6], "reference: got 6.0 among them"),
])
def test_first_divergence_checks_its_ids(pipeline, reference, other, match):
    config = GenerationConfig(max_new_tokens=4, drafter="none")
    with pytest.raises(ConfigError, match=match):
        pipeline.first_divergence("w5 w6", reference, other, config)
    plain = pipeline.generate(["w5 w6"], config)[0].token_ids
    assert pipeline.first_divergence("w5 w6", plain, plain, config) is None


def _retokenized(pair_dir, directory, far_id):
    """A copy of the artifact whose tokenizer maps one word to ``far_id``, with fingerprints and hashes made to match
    (as an attacker who controls every file would)."""
    shutil.copytree(pair_dir, directory)
    tokenizer = json.loads((directory / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    vocab["w7"] = far_id
    (directory / "tokenizer.json").write_text(json.dumps(tokenizer))
    from tokenizers import Tokenizer

    fingerprint = tokenizer_fingerprint(Tokenizer.from_file(str(directory / "tokenizer.json")))
    manifest = json.loads((directory / "manifest.json").read_text())
    for spec in manifest["models"].values():
        spec["tokenizer_fingerprint"] = fingerprint
    manifest["files"] = {p.name: sha256_file(p) for p in directory.iterdir() if p.name != "manifest.json"}
    (directory / "manifest.json").write_text(json.dumps(manifest))
    return directory


def test_a_tokenizer_mapping_a_word_beyond_the_vocabulary_is_refused(pair_dir, tmp_path):
    """It has no more tokens than the vocabulary (120 <= 128), but one of its ids is 5000: load and doctor check
    ids, not counts; and a pipeline built on such a tokenizer anyway refuses the prompt before any engine call."""
    from specdeploy.doctor import diagnose

    art = _retokenized(pair_dir, tmp_path / "art", 5000)
    with pytest.raises(ContractError, match=r"token ids up to 5000 \(120 tokens\), outside the models' vocabulary \[0, 128\)"):
        Pipeline.load(art)
    assert any("token ids up to 5000" in problem for problem, _ in diagnose(art))
    good = Pipeline.load(pair_dir)
    from tokenizers import Tokenizer

    calls = []
    good.target = type("Counting", (), {"spec": good.target.spec, "infer": lambda *a: calls.append(a)})()
    good.codec.tokenizer = Tokenizer.from_file(str(art / "tokenizer.json"))
    with pytest.raises(ConfigError, match=r"prompt: encodes to token id 5000 \('w7'\), outside the model's vocabulary"):
        good.generate(["w5 w7"], GOOD)
    assert calls == []


def test_a_bos_token_the_tokenizer_lacks_is_refused_at_export_and_at_load(tmp_path, chat_target_dir):
    """The export wrote such an artifact, which every load then refused; it now refuses to (its loader's checks run
    before it declares success). An artifact changed after export is refused at load and by doctor."""
    from specdeploy.contract import sha256_file
    from specdeploy.doctor import diagnose
    from specdeploy.exporter import ExportError, export_artifact
    from tests import tiny

    source = tiny.save_checkpoint(tiny.build_model(tiny.llama_config(head_dim=16)), tmp_path / "ckpt")  # fused: quick
    (source / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<bos>", "add_bos_token": True}))
    with pytest.raises(ExportError, match=r"would not load, so nothing was written: .*bos_token '<bos>' is not a token "
                                          r"of tokenizer.json"):
        export_artifact(source, tmp_path / "art", capacity=32, graph="fused")
    assert not (tmp_path / "art").exists() and not list(tmp_path.glob(".art.*"))
    art = tmp_path / "changed"
    shutil.copytree(chat_target_dir, art)
    config = json.loads((art / "tokenizer_config.json").read_text()) | {"bos_token": "<bos>"}
    (art / "tokenizer_config.json").write_text(json.dumps(config))
    manifest = json.loads((art / "manifest.json").read_text())
    manifest["files"]["tokenizer_config.json"] = sha256_file(art / "tokenizer_config.json")
    (art / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ContractError, match=r"bos_token '<bos>' is not a token of tokenizer.json"):
        Pipeline.load(art)
    assert any("bos_token '<bos>' is not a token" in problem for problem, _ in diagnose(art))


def test_threads_option_is_bounded_on_the_command_line(pair_dir):
    from click.testing import CliRunner

    from specdeploy.cli import main

    result = CliRunner().invoke(main, ["generate", str(pair_dir), "--prompt", "w5", "--threads", "100000"])
    assert result.exit_code == 2 and f"got 100000; expected an integer in [1, {4 * (os.cpu_count() or 1)}]" in result.output
    result = CliRunner().invoke(main, ["generate", str(pair_dir), "--prompt", "w5", "--temperature", "5e-324"])
    assert result.exit_code == 1 and "temperature: got 5e-324" in result.output
    assert isinstance(result.exception, SystemExit)


def test_an_artifact_whose_chat_template_does_not_compile_is_refused_at_load(chat_target_dir, tmp_path):
    """The loader compiles the template (it used to fail each chat request instead), as an export now does before it
    declares success: a tokenizer_config.json changed after export is one line from load and from doctor."""
    from specdeploy.contract import sha256_file
    from specdeploy.doctor import diagnose

    art = tmp_path / "art"
    shutil.copytree(chat_target_dir, art)
    config = json.loads((art / "tokenizer_config.json").read_text()) | {"chat_template": "{% if messages %}"}
    (art / "tokenizer_config.json").write_text(json.dumps(config))
    manifest = json.loads((art / "manifest.json").read_text())
    manifest["files"]["tokenizer_config.json"] = sha256_file(art / "tokenizer_config.json")
    (art / "manifest.json").write_text(json.dumps(manifest))
    expected = f"{art / 'tokenizer_config.json'}: chat_template: does not compile (Unexpected end of template"
    with pytest.raises(ContractError) as refused:
        Pipeline.load(art)
    assert str(refused.value).startswith(expected) and "\n" not in str(refused.value)
    assert any(problem.startswith(expected) for problem, _ in diagnose(art))
