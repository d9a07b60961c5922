"""tools/demo.py's core on tiny artifacts: every configuration against the target alone in one process, output
checked token for token, speedups and drafted cycles from what ran, and a verdict that calls an even run even."""

from __future__ import annotations

from dataclasses import replace

import pytest
from rich.console import Console

from specdeploy import GenerationConfig, Pipeline
from specdeploy.runtime.pipeline import GenerationResult
from tools import demo

CASES = (demo.Case("new text", "w5 w6 w7", chat=False),
         demo.Case("a repeating text", "w30 w31 w32 w33 w30 w31 w32 w33 w30 w31", chat=False))


def test_every_configuration_runs_each_round_and_is_the_targets_own_output(pair_dir):
    pipeline = Pipeline.load(pair_dir)
    configs = demo.configurations(GenerationConfig(k=3, policy="fixed", drafter="hybrid"), max_new_tokens=12)
    assert list(configs) == [demo.PLAIN, demo.DEFAULT, demo.SUFFIX, demo.MODEL]
    assert configs[demo.MODEL] == replace(configs[demo.DEFAULT], drafter="model")
    assert configs[demo.SUFFIX] == replace(configs[demo.DEFAULT], drafter="suffix")
    results = demo.measure(pipeline, CASES, configs, rounds=2)
    for case in CASES:
        plain = pipeline.generate([case.prompt], configs[demo.PLAIN])[0].token_ids
        for name, measured in results[case.title].items():
            assert measured.token_ids == plain and measured.identical and measured.divergence is None, name
            assert measured.tokens == 2 * len(plain) and measured.seconds > 0  # both rounds pooled
            assert sum(r.committed for r in measured.records) == measured.tokens
        assert results[case.title][demo.PLAIN].drafted == 0
        assert results[case.title][demo.MODEL].drafted > 0  # the fixed policy drafts every cycle it can


def test_exact_demo_runs_every_configuration_in_exact_mode_and_says_so(fused_dirs, tmp_path, monkeypatch):
    configs = demo.configurations(GenerationConfig(k=3, policy="fixed", drafter="hybrid"), max_new_tokens=12, exact=True)
    assert all(config.exact for config in configs.values())
    pipeline = Pipeline.load(fused_dirs["close"])
    for name, measured in demo.measure(pipeline, CASES[:1], configs, rounds=1)[CASES[0].title].items():
        assert measured.identical and measured.token_ids == pipeline.generate([CASES[0].prompt], configs[demo.PLAIN])[
            0].token_ids, name
    monkeypatch.setattr(demo, "measure", lambda *args: {case.title: {} for case in demo.CASES})
    monkeypatch.setattr(demo, "show", lambda *args: None)
    out = tmp_path / "out.txt"
    with out.open("w") as handle:
        monkeypatch.setattr("sys.stdout", handle)
        demo.main(["--artifact", str(fused_dirs["close"]), "--exact", "--rounds", "1"])
    shown = out.read_text()
    assert "greedy, exact mode (--exact" in shown
    assert "'s CPU provider, fused graphs" in shown  # the provider it ran on (this onnxruntime has no OpenVINO)


def test_a_draft_that_is_the_target_costs_a_target_step_and_is_always_accepted(self_dir, tmp_path):
    pipeline = Pipeline.load(self_dir)
    configs = demo.configurations(GenerationConfig(k=3, policy="fixed", drafter="hybrid"), max_new_tokens=13)
    measured = demo.measure(pipeline, CASES[:1], configs, rounds=1)[CASES[0].title]
    model = measured[demo.MODEL]
    assert model.accepted_per_drafted_cycle() == 3.0  # 13 tokens: three cycles of 3 drafts + 1, then a plain step
    lines = demo.reasons(measured, configs)
    assert lines[1].startswith(f"the draft model alone, {model.rate / measured[demo.PLAIN].rate:.2f}x: a drafted token costs")
    assert f"{model.drafted} of {len(model.records)} cycles drafted" in lines[1] and "policy chose plain" not in lines[1]
    console = Console(file=(tmp_path / "out.txt").open("w"), width=200)
    demo.show(CASES[0], measured, configs, console)
    console.file.close()
    shown = (tmp_path / "out.txt").read_text()
    assert CASES[0].prompt + measured[demo.PLAIN].text in shown  # the completion continues its prompt


@pytest.mark.parametrize("speedups, expected", [
    ((1.6, 1.7, 0.95), "speculation pays here, 1.60x the target alone, carried by the suffix index"),
    ((1.3, 1.2, 1.15), "carried by the suffix index and the draft model"),
    ((1.2, 1.05, 1.0), "carried by neither drafter alone: only the two together"),
    ((1.04, 0.97, 0.93), "about even: 1.04x the target alone"),
    ((0.95, 1.3, 0.8), "about even: 0.95x"),
    ((0.8, 0.9, 0.7), "speculation costs time here: 0.80x"),
])
def test_the_verdict_calls_a_gain_only_beyond_the_machines_spread(speedups, expected):
    assert expected in demo.verdict(*speedups)


class _Scripted:
    """A pipeline whose draft-model runs leave the target's output at token 2."""

    def __init__(self):
        self.located = []

    def generate(self, prompts, config, suffix_index="shared", scope="shared"):
        assert suffix_index is None  # each run drafts as a first request would: from its own text alone
        assert scope is None  # and prefills it whole: no K/V kept from another run of the same prompt
        ids = [5, 6, 9, 9] if config.drafter == "model" else [5, 6, 7, 8]
        return [GenerationResult(text="", token_ids=ids, stats={})]

    def first_divergence(self, prompt, reference, other, config):
        self.located.append((reference, other, config.drafter))
        return {"position": 2, "margin": 0.125}


def test_an_output_that_leaves_the_targets_is_located_once_with_the_targets_margin():
    pipeline = _Scripted()
    configs = demo.configurations(GenerationConfig(k=2, policy="fixed", drafter="hybrid"), max_new_tokens=4)
    measured = demo.measure(pipeline, CASES[:1], configs, rounds=2)[CASES[0].title]
    assert [name for name, m in measured.items() if not m.identical] == [demo.MODEL]
    assert measured[demo.MODEL].divergence == {"position": 2, "margin": 0.125}
    assert pipeline.located == [([5, 6, 7, 8], [5, 6, 9, 9], "none")]  # against the target alone, under its config
    assert "at token 2, where the target's own margin between the two tokens is 0.12" in demo._differs(
        measured[demo.MODEL].divergence)
