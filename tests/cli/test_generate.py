"""CLI: specdeploy generate."""

from __future__ import annotations

import json

from click.testing import CliRunner

from specdeploy import GenerationConfig, Pipeline
from specdeploy.cli import main


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def test_generate_json_matches_the_api(pair_dir):
    result = run("generate", pair_dir, "--prompt", "w5 w6 w7", "--prompt", "w8", "--max-new-tokens", "10",
                 "--k", "3", "--json")
    assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in result.output.splitlines() if line.startswith("{")]
    expected = Pipeline.load(pair_dir).generate(["w5 w6 w7", "w8"], GenerationConfig(k=3, max_new_tokens=10))
    assert [line["token_ids"] for line in lines] == [r.token_ids for r in expected]
    assert [line["text"] for line in lines] == [r.text for r in expected]
    assert {"tokens_per_s", "mean_accepted_length", "acceptance_by_position"} <= set(lines[0]["stats"])


def test_generate_streams_text_and_prints_stats(pair_dir):
    result = run("generate", pair_dir, "--prompt", "w5 w6 w7", "--max-new-tokens", "8", "--policy", "cost")
    assert result.exit_code == 0, result.output
    text = Pipeline.load(pair_dir).generate("w5 w6 w7", GenerationConfig(max_new_tokens=8))[0].text
    assert text in result.output and "tok/s" in result.output and "speculative decoding" in result.output


def test_prompt_files(pair_dir, tmp_path):
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text(json.dumps({"prompt": "w5 w6"}) + "\n\n" + json.dumps({"prompt": "w9"}) + "\n")
    text = tmp_path / "p.txt"
    text.write_text("w5 w6\nw9\n")
    outputs = []
    for path in (jsonl, text):
        result = run("generate", pair_dir, "--prompt-file", path, "--max-new-tokens", "5", "--json", "--batch-size", "2")
        assert result.exit_code == 0, result.output
        outputs.append([json.loads(x)["token_ids"] for x in result.output.splitlines() if x.startswith("{")])
    assert outputs[0] == outputs[1] and len(outputs[0]) == 2


def test_generate_errors(pair_dir, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "w5"}) + "\n{oops\n")
    chat = tmp_path / "chat.jsonl"  # its text is only the last message: the conversation would be dropped
    chat.write_text(json.dumps({"id": "c1", "messages": [{"role": "user", "content": "w5"}]}) + "\n")
    cases = [
        (["--prompt-file", bad], "bad.jsonl:2: not valid JSON"),
        (["--prompt-file", chat], "chat.jsonl: prompt c1 is a chat prompt ('messages'); expected text prompts"),
        (["--prompt", "w5", "--temperature", "-1"], "temperature: got -1.0"),
        (["--prompt", "w5", "--top-p", "0"], "top_p: got 0.0"),
        (["--prompt", "w5", "--max-new-tokens", "500"], "capacity 96"),
        (["--prompt", "w5", "--policy", "nope"], "Invalid value for '--policy'"),
        ([], "give --prompt or --prompt-file"),
    ]
    for args, message in cases:
        result = run("generate", pair_dir, *args)
        assert result.exit_code != 0 and message in result.output, (args, result.output)
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    result = run("generate", pair_dir, "--prompt-file", empty)
    assert result.exit_code != 0 and "contains no prompt" in result.output


def test_compare_with_target_alone(pair_dir):
    result = run("generate", pair_dir, "--prompt", "w5 w6 w7", "--prompt", "w9 w9", "--max-new-tokens", "12",
                 "--compare", "--json")
    assert result.exit_code == 0, result.output
    lines = [json.loads(x) for x in result.output.splitlines() if x.startswith("{")]
    comparison = lines[-1]["comparison"]
    assert comparison["identical_outputs"] == comparison["prompts"] == 2 and comparison["divergences"] == []
    assert comparison["speedup"] == comparison["speculative_tokens_per_s"] / comparison["plain_tokens_per_s"]
    table = run("generate", pair_dir, "--prompt", "w5 w6 w7", "--max-new-tokens", "12", "--compare")
    assert table.exit_code == 0 and "identical outputs" in table.output and "2 / 2" not in table.output


def test_prompt_with_brackets_is_printed_verbatim(pair_dir):
    result = run("generate", pair_dir, "--prompt", "w5 [int] w6", "--max-new-tokens", "3")
    assert result.exit_code == 0, result.output
    assert "w5 [int] w6" in result.output  # not swallowed as rich markup


def _reject_nan(constant):
    raise ValueError(f"not strict JSON: {constant}")


def test_generate_json_is_strict(pair_dir):
    result = run("generate", pair_dir, "--prompt", "w5 w6 w7", "--max-new-tokens", "6", "--drafter", "none", "--json",
                 "--compare")
    assert result.exit_code == 0, result.output
    lines = [json.loads(x, parse_constant=_reject_nan) for x in result.output.splitlines() if x.startswith("{")]
    assert lines[0]["stats"]["acceptance_rate"] is None  # nothing was drafted: the rate is undefined
    assert lines[0]["finish_reason"] == "length" and "comparison" in lines[-1]


class _Failing:
    """Wraps an engine; every call that carries token 5 fails."""

    def __init__(self, engine):
        self.engine = engine

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def infer(self, input_ids, *args, **kwargs):
        if (input_ids == 5).any():
            raise RuntimeError("injected engine fault")
        return self.engine.infer(input_ids, *args, **kwargs)


def test_a_failed_prompt_is_reported_and_the_exit_code_says_so(pair_dir, monkeypatch):
    load = Pipeline.load.__func__

    def failing_load(cls, *args, **kwargs):
        pipeline = load(cls, *args, **kwargs)
        pipeline.target = _Failing(pipeline.target)
        return pipeline

    monkeypatch.setattr(Pipeline, "load", classmethod(failing_load))
    for extra in (["--json"], []):  # batched JSON rows, and streamed text
        result = run("generate", pair_dir, "--prompt", "w5 w6 w7", "--prompt", "w8 w9", "--max-new-tokens", "4", *extra)
        assert result.exit_code == 1, result.output
        assert "1 of 2 prompts failed: prompt 0:" in result.output and "injected engine fault" in result.output
        if extra:
            rows = [json.loads(x) for x in result.output.splitlines() if x.startswith("{")]
            assert rows[0]["finish_reason"] == "error" and "injected engine fault" in rows[0]["error"]
            assert rows[1]["finish_reason"] == "length" and len(rows[1]["token_ids"]) == 4


def test_every_generation_option_has_a_flag():
    import dataclasses

    from specdeploy.cli.generate import generate

    params = {p.name for p in generate.params}
    assert {f.name for f in dataclasses.fields(GenerationConfig)} <= params


def test_ecosystem_option_names_and_the_rest_of_the_config(pair_dir):
    result = run("generate", pair_dir, "--prompt", "w5 w6 w7", "--max-tokens", "10", "--num-speculative-tokens", "2",
                 "--policy", "confidence", "--confidence-threshold", "0.3", "--ignore-eos", "--stop-token-id", "7",
                 "--json")
    assert result.exit_code == 0, result.output
    line = json.loads(next(x for x in result.output.splitlines() if x.startswith("{")))
    config = GenerationConfig(max_new_tokens=10, k=2, policy="confidence", confidence_threshold=0.3, ignore_eos=True,
                              stop_token_ids=(7,))
    assert line["token_ids"] == Pipeline.load(pair_dir).generate("w5 w6 w7", config)[0].token_ids


def test_a_huge_prompt_is_refused_before_it_is_echoed(pair_dir, tmp_path):
    prompt_file = tmp_path / "huge.txt"
    prompt_file.write_text("w5 " * 4_000_000 + "\n")
    result = run("generate", pair_dir, "--prompt-file", prompt_file)
    assert result.exit_code != 0 and "over the artifact's capacity" in result.output
    assert len(result.output) < 2000  # one line, not the prompt


def test_json_finish_reasons_are_stop_length_or_error(pair_dir):
    plain = Pipeline.load(pair_dir).generate("w5 w6 w7", GenerationConfig(max_new_tokens=8, ignore_eos=True))[0]
    result = run("generate", pair_dir, "--prompt", "w5 w6 w7", "--prompt", "w5 w6 w7", "--max-new-tokens", "8",
                 "--ignore-eos", "--stop-token-id", str(plain.token_ids[3]), "--json")
    lines = [json.loads(x) for x in result.output.splitlines() if x.startswith("{")]
    assert result.exit_code == 0 and [line["finish_reason"] for line in lines] == ["stop", "stop"]
    first = plain.token_ids.index(plain.token_ids[3])  # the stop token ends the row where it first appears
    assert lines[0]["stopped_by"] == "eos" and lines[0]["token_ids"] == plain.token_ids[: first + 1]
    result = run("generate", pair_dir, "--prompt", "w5 w6 w7", "--max-new-tokens", "3", "--ignore-eos", "--json")
    assert json.loads(result.output.splitlines()[-1])["finish_reason"] == "length"


def test_exact_compare_says_its_mode_and_the_outputs_are_identical(fused_dirs):
    result = run("generate", fused_dirs["close"], "--prompt", "w5 w6 w7", "--prompt", "w9 w9", "--max-new-tokens", "12",
                 "--k", "4", "--policy", "fixed", "--exact", "--compare", "--json")
    assert result.exit_code == 0, result.output
    lines = [json.loads(x) for x in result.output.splitlines() if x.startswith("{")]
    assert all(line["stats"]["exact"] is True for line in lines[:-1])
    comparison = lines[-1]["comparison"]
    assert comparison["exact"] is True and comparison["identical_outputs"] == comparison["prompts"] == 2
    table = run("generate", fused_dirs["close"], "--prompt", "w5 w6 w7", "--max-new-tokens", "12", "--exact",
                "--compare")
    assert table.exit_code == 0 and "exact (--exact)" in table.output
    default = run("generate", fused_dirs["close"], "--prompt", "w5 w6 w7", "--max-new-tokens", "12", "--compare")
    assert default.exit_code == 0 and "│ default" in default.output
