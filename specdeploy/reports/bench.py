"""The bench grid: the baseline and every configuration, interleaved round by round, in one process.

Several artifacts (graph forms, weight formats of one pair) run side by side in the same grid: each
configuration of each artifact, the order rotating per prompt, so that the machine's drift hits them
alike. Each configuration is compared with the plain decoding of its own artifact (speedup, identical
outputs; a greedy output that differs is located, with the plain target's margin there), and each
artifact with the first one (the reference).

Writes ``records.jsonl`` (one line per cycle record, and one per run, each tagged with its
configuration, prompt and repeat) and ``summary.json``, whose every number is recomputed from
``records.jsonl`` by ``summarize`` — the summary is never counted separately.
"""

from __future__ import annotations

import itertools
import json
import statistics
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from ..runtime.config import ConfigError, GenerationConfig
from ..runtime.registry import DRAFTERS, POLICIES
from ..runtime.suffix import SuffixIndex
from ..runtime.suffix_store import DEFAULT_SEQUENCES, DEFAULT_TOKENS
from ..runtime.telemetry import CycleRecord, acceptance_by_position, mean_accepted_length, time_split, upgraded
from ..workloads import Prompt
from .analytic import predicted_speedup

if TYPE_CHECKING:
    from ..runtime.pipeline import Pipeline


class GridError(ValueError):
    """A bench grid that cannot run."""


@dataclass(frozen=True)
class Setting:
    name: str
    config: GenerationConfig
    baseline: str  # the name of the plain-decoding setting of the same artifact at the same temperature
    artifact: str = ""  # the label of the artifact it runs on (a key of run_bench's pipelines)
    reference: str = ""  # the first artifact's plain-decoding setting at this temperature


def build_grid(ks: Sequence[int], policies: Sequence[str], drafters: Sequence[str], temperatures: Sequence[float],
               max_new_tokens: int, seed: int = 0, artifacts: Sequence[str] = ("",)) -> list[Setting]:
    """The baseline per temperature plus every (drafter, policy, k > 0, temperature) combination, for each artifact
    label in ``artifacts`` (with several, each name starts with "label | ")."""
    for name, values in (("k", ks), ("policy", policies), ("drafter", drafters), ("temperature", temperatures),
                         ("artifact", artifacts)):
        if not values:
            raise GridError(f"--{name}: empty; the grid needs at least one value")
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        raise GridError(f"--policy: unknown {unknown}; expected some of {', '.join(POLICIES)}")
    unknown = [d for d in drafters if d not in DRAFTERS or d == "none"]
    if unknown:
        expected = ", ".join(d for d in DRAFTERS if d != "none")
        raise GridError(f"--drafter: unknown {unknown}; expected some of {expected}")
    if any(k < 0 for k in ks):
        raise GridError(f"--k: got {list(ks)}; expected integers >= 0 (0 is the baseline)")
    if len(set(artifacts)) < len(artifacts):
        raise GridError(f"artifacts: got the labels {list(artifacts)}; expected each once")
    if not any(k > 0 for k in ks):
        raise GridError("the grid has no speculative configuration: give a k > 0")
    grid = []
    prefix = (lambda label: f"{label} | ") if len(artifacts) > 1 else (lambda label: "")
    for label, temperature in itertools.product(artifacts, temperatures):
        base = f"{prefix(label)}plain t={temperature:g}"
        reference = f"{prefix(artifacts[0])}plain t={temperature:g}"
        common = dict(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)
        grid.append(Setting(base, GenerationConfig(drafter="none", **common), base, label, reference))
        for drafter, policy, k in itertools.product(drafters, policies, ks):
            if k > 0:
                config = GenerationConfig(drafter=drafter, policy=policy, k=k, **common)
                grid.append(Setting(f"{prefix(label)}{drafter} {policy} k={k} t={temperature:g}", config, base, label,
                                    reference))
    return grid


def run_bench(pipelines: Mapping[str, Pipeline], grid: list[Setting], prompts: list[Prompt], out: Path, repeat: int = 1,
              batch_size: int = 1, advance: Callable[[], None] = lambda: None) -> dict:
    """Run every setting on every prompt ``repeat`` times, interleaved; write records.jsonl and summary.json.

    ``pipelines`` maps each setting's ``artifact`` label to its loaded ``Pipeline``. Chat prompts (``Prompt.messages``)
    are rendered with each artifact's own chat template. Prompts run in their order (batch by batch), so a
    conversation's turns run after each other, and each setting drafts from an index of its own answers in the round
    so far (a suffix index: a later prompt drafts from an earlier one's answer). A greedy run whose tokens differ
    from its baseline's on the same prompt and round gets a ``divergence``: the first differing position and the
    plain target's margin there (``Pipeline.first_divergence``). Returns ``summarize``'s summary.
    """
    missing = sorted({s.artifact for s in grid} - set(pipelines))
    if missing:
        raise GridError(f"the grid runs on artifacts {missing} that no pipeline was given for")
    inputs = {label: _inputs(label, pipeline, prompts) for label, pipeline in pipelines.items()}
    _warm_up(pipelines, grid, inputs)
    # each setting drafts from its own index of the answers it gave earlier in the round, empty at each round's start,
    # and reuses the K/V of those texts alone (its scope): none may draft from another's answer to the same prompt, nor
    # from its own of an earlier round, nor start from another's prompt K/V
    indexes = {(setting.name, rep): SuffixIndex(DEFAULT_TOKENS, DEFAULT_SEQUENCES) for setting in grid
               for rep in range(repeat)}
    records_path = out / "records.jsonl"
    with open(records_path, "w") as sink:
        for rep, first in itertools.product(range(repeat), range(0, len(prompts), batch_size)):
            batch = prompts[first : first + batch_size]
            offset = (rep * len(prompts) + first) % len(grid)
            results = {}
            for setting in grid[offset:] + grid[:offset]:  # rotate who runs first each round
                pipeline = pipelines[setting.artifact]
                results[setting.name] = pipeline.generate(inputs[setting.artifact][first : first + batch_size],
                                                          setting.config, batch_size=batch_size,
                                                          suffix_index=indexes[setting.name, rep],
                                                          scope=f"bench:{setting.name}:{rep}")
                advance()
            _write_batch(sink, pipelines, grid, inputs, batch, first, rep, results)
    summary = summarize(read_records(records_path))
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def _write_batch(sink, pipelines: Mapping[str, Pipeline], grid: list[Setting], inputs: dict, batch: list[Prompt],
                 first: int, rep: int, results: dict) -> None:
    """Write every setting's runs of one batch (its prompts start at index ``first``); a greedy run whose tokens
    differ from its baseline's gets their first divergence."""
    settings = {setting.name: setting for setting in grid}
    for setting in grid:
        baseline = settings[setting.baseline]
        for index, prompt, result, plain in zip(itertools.count(first), batch, results[setting.name],
                                                results[baseline.name]):
            divergence = None
            if setting.config.greedy and result.token_ids != plain.token_ids:
                divergence = pipelines[setting.artifact].first_divergence(
                    inputs[setting.artifact][index], plain.token_ids, result.token_ids, baseline.config)
            _write_run(sink, setting, prompt, rep, result, divergence)


def _warm_up(pipelines: Mapping[str, Pipeline], grid: list[Setting], inputs: dict) -> None:
    """A short run of each setting, unmeasured and drafting from no index: a session's first calls allocate."""
    for setting in grid:
        warm = replace(setting.config, max_new_tokens=min(4, setting.config.max_new_tokens))
        pipelines[setting.artifact].generate([inputs[setting.artifact][0]], warm, suffix_index=None)


def _write_run(sink, setting: Setting, prompt: Prompt, rep: int, result, divergence: dict | None) -> None:
    """One run's cycle records and its run record, tagged with its setting, prompt and round."""
    tags = {"config": setting.name, "baseline": setting.baseline, "reference": setting.reference,
            "artifact": setting.artifact, "prompt_id": prompt.id, "prompt_set": prompt.source,
            "category": prompt.category, "repeat": rep}
    for record in result.records:
        sink.write(json.dumps({"type": "cycle", **tags, **record.to_dict()}) + "\n")
    sink.write(json.dumps({"type": "run", **tags, "tokens": result.stats["tokens"], "seconds": result.stats["seconds"],
                           "token_ids": result.token_ids, "greedy": setting.config.greedy, "divergence": divergence,
                           "k": setting.config.max_drafts}) + "\n")


def _inputs(label: str, pipeline: Pipeline, prompts: list[Prompt]) -> list[str | list[int]]:
    """What ``pipeline`` takes for each prompt, rendered once before any run: its text, or a chat prompt's token ids
    (the artifact's chat template); GridError naming the artifact and prompt where one cannot be rendered."""
    from ..runtime.chat import ChatTemplateError

    inputs = []
    for prompt in prompts:
        try:
            inputs.append(prompt.for_pipeline(pipeline))
        except (ConfigError, ChatTemplateError) as exc:
            artifact = f"artifact {label}" if label else "the artifact"
            raise GridError(f"{artifact}, prompt {prompt.id} ({prompt.source}): {exc}") from exc
    return inputs


class RecordsError(ValueError):
    """A records.jsonl that is not what ``bench`` writes."""


def read_records(path: Path) -> list[dict]:
    """The records ``bench`` wrote to ``path``, one JSON object a line; RecordsError names a bad line. A cycle line
    written before 0.5 is read under its fields' new names (``telemetry.upgraded``)."""
    records = []
    for number, line in enumerate(Path(path).read_text(encoding="utf-8", errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except (ValueError, RecursionError) as exc:
            raise RecordsError(f"{path}:{number}: not a bench record ({type(exc).__name__})") from exc
        if not isinstance(record, dict) or "type" not in record:
            raise RecordsError(f"{path}:{number}: not a bench record (expected a JSON object with a 'type')")
        records.append(upgraded(record) if record["type"] == "cycle" else record)
    return records


def summarize(lines: list[dict]) -> dict:
    """Aggregates per configuration, overall and per segment (prompt set / category), from records alone."""
    segments = defaultdict(list)
    for line in lines:
        segments["all"].append(line)
        segments[f"{line['prompt_set']}/{line['category'] or '-'}"].append(line)
    return _json_safe({segment: _summarize_segment(rows) for segment, rows in segments.items()})


def _json_safe(value):
    """NaN (an undefined rate) becomes None: JSON has no NaN."""
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    return None if isinstance(value, float) and value != value else value


def _summarize_segment(lines: list[dict]) -> dict:
    runs, cycles = defaultdict(list), defaultdict(list)
    for line in lines:
        (runs if line["type"] == "run" else cycles)[line["config"]].append(line)
    out = {}
    for config, config_runs in runs.items():
        baseline, reference = config_runs[0]["baseline"], config_runs[0].get("reference", config_runs[0]["baseline"])
        records = [CycleRecord.from_dict(c) for c in cycles[config]]
        speedups = _speedups(config_runs, runs[baseline])
        split = time_split(records)
        total_time = sum(split.values()) or 1.0
        tokens, seconds = sum(r["tokens"] for r in config_runs), sum(r["seconds"] for r in config_runs)
        greedy = config_runs[0]["greedy"]
        entry = {
            "baseline": baseline,
            "artifact": config_runs[0].get("artifact", ""),
            "k": config_runs[0]["k"],
            "runs": len(config_runs),
            "tokens": tokens,
            "seconds": seconds,
            "tokens_per_s": tokens / seconds if seconds else 0.0,
            "speedup_median": statistics.median(speedups) if speedups else float("nan"),
            "speedup_min": min(speedups, default=float("nan")),
            "speedup_max": max(speedups, default=float("nan")),
            "mean_accepted_length": mean_accepted_length(records),
            "acceptance_by_position": acceptance_by_position(records),
            "time_share": {phase: t / total_time for phase, t in split.items()},
            "identical_to_baseline": _identical(config_runs, runs[baseline]) if greedy else None,
            # greedy runs that left their baseline's output: where, and the plain target's margin there
            "divergences": [{"prompt_id": r["prompt_id"], "repeat": r["repeat"], **r["divergence"]}
                            for r in config_runs if r.get("divergence")],
        }
        if reference != baseline and reference in runs:  # another artifact than the first: against the first's plain
            entry.update(_against_reference(reference, config_runs, runs[reference], greedy))
        out[config] = entry
    for config, entry in out.items():
        entry.update(_prediction(entry, cycles[config], cycles[entry["baseline"]]))
    return out


def _against_reference(reference: str, runs: list[dict], reference_runs: list[dict], greedy: bool) -> dict:
    """Speedup over, and outputs identical to, the first artifact's plain decoding (``reference``)."""
    to_reference = _speedups(runs, reference_runs)
    return {"reference": reference,
            "speedup_vs_reference_median": statistics.median(to_reference) if to_reference else float("nan"),
            "identical_to_reference": _identical(runs, reference_runs) if greedy else None}


def _speedups(runs: list[dict], baseline_runs: list[dict]) -> list[float]:
    """tok/s of ``runs`` over ``baseline_runs``', round by round (repeats the two share)."""
    rates, base_rates = _per_repeat_rates(runs), _per_repeat_rates(baseline_runs)
    return [rates[r] / base_rates[r] for r in rates if r in base_rates and base_rates[r] > 0]


def _identical(runs: list[dict], others: list[dict]) -> int:
    """Runs whose tokens equal the other setting's on the same prompt and repeat."""
    theirs = {(r["prompt_id"], r["repeat"]): r["token_ids"] for r in others}
    return sum(r["token_ids"] == theirs.get((r["prompt_id"], r["repeat"])) for r in runs)


def _per_repeat_rates(runs: list[dict]) -> dict[int, float]:
    tokens, seconds = defaultdict(int), defaultdict(float)
    for run in runs:
        tokens[run["repeat"]] += run["tokens"]
        seconds[run["repeat"]] += run["seconds"]
    return {r: tokens[r] / seconds[r] for r in tokens if seconds[r] > 0}


def _prediction(entry: dict, cycles: list[dict], baseline_cycles: list[dict]) -> dict:
    """The analytic model's speedup from this configuration's measured rates and costs."""
    drafted = [c for c in cycles if c["drafted"] > 0]
    if not drafted or not baseline_cycles:
        return {"predicted_speedup": 1.0 if entry["k"] == 0 else float("nan"), "efficiency": float("nan")}
    k = round(statistics.fmean(c["drafted"] for c in drafted))
    draft_step = sum(c["draft_s"] for c in drafted) / sum(c["drafted"] for c in drafted)
    verify = statistics.fmean(c["verify_s"] for c in drafted)
    plain_step = statistics.fmean(c["verify_s"] for c in baseline_cycles)
    rates = (entry["acceptance_by_position"] + [0.0] * k)[:k]
    predicted = predicted_speedup(rates, k, draft_step, verify, plain_step)
    return {"predicted_speedup": predicted, "efficiency": entry["speedup_median"] / predicted if predicted else float("nan")}
