"""tools/replay.py: recorded plain runs replayed through the real runtime keep exactly the drafts a real run keeps,
emit the recorded text, and take the cost table's seconds; the tool records and replays end to end."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest

from specdeploy import GenerationConfig, Pipeline
from specdeploy.runtime.suffix import SuffixIndex
from specdeploy.workloads import Prompt

ROOT = Path(__file__).resolve().parents[2]
TOOL = ["-m", "tools.replay"]
PROMPTS = ["w5 w6 w7 w8 w5 w6 w7", "w20 w31 w9 w44", "w7 w7 w8 w9 w10 w11 w12 w7 w8"]


def _tool():
    from tools import replay

    return replay


def _linear_costs(pasts=(8, 32)) -> dict:
    """Seconds that a test can add up: a call costs base + per token (+ per past slot), full logits or trimmed."""
    def rows(base, per_token, tokens, head=0.0):
        return {str(t): [base + per_token * t + head * t + 1e-5 * p for p in pasts] for t in tokens}

    return {"pasts": list(pasts),
            "target": {"full": rows(0.010, 0.002, range(1, 10), 0.001), "trimmed": rows(0.010, 0.002, (2, 4, 8, 16, 32))},
            "draft": {"full": rows(0.004, 0.001, range(1, 10), 0.0005), "trimmed": rows(0.004, 0.001, (2, 4, 8, 16, 32))}}


@pytest.fixture(scope="module")
def recorded(fused_dirs):
    tool = _tool()
    pipeline = Pipeline.load(fused_dirs["close"])
    prompts = [("g" if i < 2 else "h", Prompt(str(i), text)) for i, text in enumerate(PROMPTS)]
    traces = tool.record(pipeline, prompts, 24, log=lambda *_: None)
    models = {role: asdict(spec) for role, spec in pipeline.manifest.models.items()}
    return tool, pipeline, {"models": models, "costs": _linear_costs(), "traces": [asdict(t) for t in traces]}


@pytest.mark.parametrize("config", [
    GenerationConfig(k=3, policy="fixed", drafter="model", max_new_tokens=24),
    GenerationConfig(k=1, policy="fixed", drafter="model", max_new_tokens=24),
    GenerationConfig(k=4, policy="fixed", drafter="hybrid", max_new_tokens=24),
    GenerationConfig(k=4, policy="fixed", drafter="prompt-lookup", max_new_tokens=24),
    GenerationConfig(k=4, policy="fixed", drafter="suffix", max_new_tokens=24),
], ids=["model k=3", "model k=1", "hybrid k=4", "lookup k=4", "suffix k=4"])
def test_a_replay_keeps_the_drafts_a_real_run_keeps_and_emits_its_text(recorded, config):
    """Under a fixed K a cycle's drafts depend on the text alone: the replay must keep, cycle by cycle, exactly the
    drafts the real engines kept, and emit the real run's tokens."""
    tool, pipeline, data = recorded
    replayed = tool.replay(data, config, fresh=False)
    index = SuffixIndex()  # as the replay's: the earlier prompts' answers, in order, from empty
    for text, row in zip(PROMPTS, replayed):
        real = pipeline.generate([text], config, suffix_index=index)[0]
        assert row["tokens"] == len(real.token_ids)
        assert row["accepted_by_cycle"] == [r.accepted for r in real.records], text
        assert row["drafted_by_cycle"] == [r.drafted for r in real.records], text
    assert sum(row["accepted"] for row in replayed) > 0  # the close draft is right often: the check has drafts to keep


def test_turns_of_a_conversation_are_replayed_as_themselves_though_they_share_a_start(fused_dirs):
    """A later turn's prompt starts with the earlier turn's: its prefill's first tokens match both traces, and each
    must replay its own recorded text."""
    tool = _tool()
    pipeline = Pipeline.load(fused_dirs["close"])
    first = "w5 w6 w7 w8"
    answer = pipeline.generate(first, GenerationConfig(drafter="none", max_new_tokens=6))[0].token_ids
    later = f"{first} {pipeline.decode(answer)} w9"  # the next turn: the conversation so far, and more
    traces = tool.record(pipeline, [("c", Prompt("1", first)), ("c", Prompt("2", later))], 12, log=lambda *_: None)
    models = {role: asdict(spec) for role, spec in pipeline.manifest.models.items()}
    data = {"models": models, "costs": _linear_costs(), "traces": [asdict(t) for t in traces]}
    config = GenerationConfig(k=3, policy="fixed", drafter="hybrid", max_new_tokens=12)
    replayed = tool.replay(data, config)
    assert [row["tokens"] for row in replayed] == [len(t.output) for t in traces]


def test_the_recorded_text_is_plain_greedy_decoding_and_the_guesses_the_drafts(recorded):
    tool, pipeline, data = recorded
    for trace, text in zip(data["traces"], PROMPTS):
        assert trace["output"] == pipeline.generate([text], GenerationConfig(drafter="none", max_new_tokens=24))[0].token_ids
        sequence = trace["prompt"] + trace["output"]
        assert len(trace["draft_next"]) == len(sequence)
        # the draft's guess after the prompt is the first draft a real cycle proposes
        cache = pipeline.draft.allocate_cache(1, len(sequence) + 1)
        for at in range(1, len(sequence) + 1):
            logits = pipeline.draft.infer(np.array([[sequence[at - 1]]]), np.array([at - 1]), cache).logits
            assert int(logits[0, -1].argmax()) == trace["draft_next"][at - 1]


def test_the_clock_moves_by_the_cost_table(recorded):
    """Plain decoding of n tokens after a prompt of m: one trimmed prefill call of m - 1 tokens, then n calls of one
    token, each at its past; the replayed seconds are those plus the runtime's own (small) time."""
    tool, _, data = recorded
    costs = tool.CostTable(data["costs"])
    rows = tool.replay(data, GenerationConfig(drafter="none", max_new_tokens=24), fresh=False)
    for trace, row in zip(data["traces"], rows):
        m = len(trace["prompt"])
        prefill = costs.seconds("target", m - 1, 0, 1)
        decode = sum(costs.seconds("target", 1, m - 1 + i, 1) for i in range(row["tokens"]))
        assert prefill <= row["prefill_s"] < prefill + 0.05
        assert prefill + decode <= row["seconds"] < prefill + decode + 0.25


def test_without_the_runtimes_own_time_the_clock_moves_by_the_cost_table_alone(recorded):
    """--no-runtime-time: the replayed seconds are the table's costs exactly, the same in every run (before/after
    comparisons of decisions on a loaded machine)."""
    tool, _, data = recorded
    costs = tool.CostTable(data["costs"])
    config = GenerationConfig(drafter="none", max_new_tokens=24)
    rows = tool.replay(data, config, fresh=False, runtime_time=False)
    assert rows == tool.replay(data, config, fresh=False, runtime_time=False)
    for trace, row in zip(data["traces"], rows):
        m = len(trace["prompt"])
        prefill = costs.seconds("target", m - 1, 0, 1)
        decode = sum(costs.seconds("target", 1, m - 1 + i, 1) for i in range(row["tokens"]))
        assert row["prefill_s"] == pytest.approx(prefill) and row["seconds"] == pytest.approx(prefill + decode)


def test_the_cost_table_interpolates_in_tokens_and_past_and_prices_the_head():
    costs = _tool().CostTable(_linear_costs())
    assert costs.seconds("target", 4, 8, 4) == pytest.approx(0.010 + 0.002 * 4 + 0.001 * 4 + 8e-5)
    assert costs.seconds("target", 4, 20, 4) == pytest.approx(0.010 + 0.002 * 4 + 0.001 * 4 + 2e-4)  # between pasts
    assert costs.seconds("target", 12, 8, 1) == pytest.approx(0.010 + 0.002 * 12 + 8e-5)  # between trimmed counts
    assert costs.seconds("target", 64, 8, 1) == pytest.approx(0.010 + 0.002 * 64 + 8e-5)  # beyond: the last two's line
    # every position's logits over more tokens than the full rows hold: the trimmed call and the head per position
    head = (costs.seconds("target", 8, 8, 8) - costs.seconds("target", 8, 8, 1)) / 7
    assert costs.seconds("target", 12, 8, 12) == pytest.approx(costs.seconds("target", 12, 8, 1) + 11 * head)
    assert costs.seconds("draft", 1, 8, 1) == pytest.approx(0.004 + 0.001 + 0.0005 + 8e-5)


def test_a_table_with_a_change_of_shape_charges_it_where_a_call_changes_shape_and_the_warm_up_measures_it(recorded):
    """A table measured on OpenVINO holds what a change of shape costs each model: its calls kept their shape, and a
    call whose shape differs from its model's previous call's costs that much more. Plain decoding changes shape at its
    first step after the prefill, then keeps it; the pipeline's warm-up measures the change the table charges."""
    from specdeploy.runtime.calibration import change_seconds

    tool, pipeline, data = recorded
    table = _linear_costs() | {"change": {"target": 0.004, "draft": 0.001}}
    costs = tool.CostTable(table)
    plain = tool.CostTable(_linear_costs())
    assert plain.change == {}  # a table measured before: no change charged
    assert costs.seconds("target", 3, 8, 3) == pytest.approx(plain.seconds("target", 3, 8, 3) + 0.004)
    assert costs.seconds("target", 3, 8, 3, changed=False) == pytest.approx(plain.seconds("target", 3, 8, 3))
    assert costs.seconds("draft", 1, 8, 1) == pytest.approx(plain.seconds("draft", 1, 8, 1) + 0.001)
    changing = {**data, "costs": table}
    rows = tool.replay(changing, GenerationConfig(drafter="none", max_new_tokens=24), fresh=False, runtime_time=False)
    for trace, row in zip(data["traces"], rows):
        m = len(trace["prompt"])
        prefill = costs.seconds("target", m - 1, 0, 1)
        decode = sum(costs.seconds("target", 1, m - 1 + i, 1, changed=i == 0) for i in range(row["tokens"]))
        assert row["seconds"] == pytest.approx(prefill + decode)
    traces = [tool.Trace(**t) for t in data["traces"]]
    with tool.VirtualClock(runtime_time=False) as clock:
        for role, last, change in (("target", None, 0.004), ("draft", 1, 0.001)):
            engine = tool.ReplayEngine(pipeline.manifest.models[role], traces, costs, clock)
            assert change_seconds(engine, engine.allocate_cache(1, 64), 8, last) == pytest.approx(change)


def test_the_tool_records_and_replays_every_configuration(fused_dirs, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p, "id": str(i), "category": "c" if i else "d"}) + "\n"
                               for i, p in enumerate(PROMPTS)))
    traces, out = tmp_path / "traces.json", tmp_path / "replayed.json"
    done = subprocess.run([sys.executable, *TOOL, "record", "--artifact", str(fused_dirs["close"]), "--prompts",
                           str(prompts), "--max-new-tokens", "12", "--rounds", "1", "--provider", "cpu", "--out", str(traces)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    data = json.loads(traces.read_text())
    assert [t["prompt_id"] for t in data["traces"]] == ["0", "1", "2"]
    assert all(v > 0 for role in ("target", "draft") for kind in data["costs"][role].values() for row in kind.values()
               for v in row)
    assert set(data["costs"]["change"]) == {"target", "draft"} and min(data["costs"]["change"].values()) >= 0
    done = subprocess.run([sys.executable, *TOOL, "run", "--traces", str(traces), "--lengths", "6,12", "--ks", "1,2",
                           "--out", str(out)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    assert set(report["runs"]) == {"plain", "k=1", "k=2", "cost", "lookup, cost", "suffix, cost", "hybrid, cost"}
    assert all(len(rows) == 2 * len(PROMPTS) for rows in report["runs"].values())
    assert [(s["group"], s["max_new_tokens"]) for s in report["summary"]] == [
        (g, n) for n in (6, 12) for g in ("c", "d", "all")]
    assert "cost/best K" in done.stdout
    done = subprocess.run([sys.executable, *TOOL, "run", "--traces", str(traces), "--lengths", "40"],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode != 0 and "recorded to 12 tokens and cut there" in done.stderr
    # answers that end in EOS are whole: replayed at any length (chat answers end long before a budget)
    eos = data["models"]["target"]["eos_token_ids"][0]
    ended = tmp_path / "ended.json"
    ended.write_text(json.dumps({**data, "traces": [
        {**t, "output": t["output"][:5] + [eos], "draft_next": t["draft_next"][: len(t["prompt"]) + 6]}
        for t in data["traces"]]}))
    done = subprocess.run([sys.executable, *TOOL, "run", "--traces", str(ended), "--lengths", "40", "--ks", "1",
                           "--out", str(out)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    assert {row["tokens"] for rows in json.loads(out.read_text())["runs"].values() for row in rows} == {6}

    # record --rounds 0 measures no costs: such traces (the sessions' shipped ones) run at another file's table,
    # and without one they are refused in one line (they were refused even with --costs: "not a cost table")
    uncosted = tmp_path / "uncosted.json"
    uncosted.write_text(json.dumps({**data, "costs": {}}))
    done = subprocess.run([sys.executable, *TOOL, "run", "--traces", str(uncosted), "--costs", str(traces),
                           "--lengths", "6", "--ks", "1", "--out", str(out)], capture_output=True, text=True,
                          timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    def decisions(rows):  # the seconds carry the runtime's own time, which differs between two runs
        return [{k: v for k, v in row.items() if k not in ("seconds", "prefill_s")} for row in rows]

    assert decisions(json.loads(out.read_text())["runs"]["k=1"]) == decisions(report["runs"]["k=1"][: len(PROMPTS)])
    done = subprocess.run([sys.executable, *TOOL, "run", "--traces", str(uncosted), "--lengths", "6"],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 2 and "holds no cost table" in done.stderr and "Traceback" not in done.stderr
