"""Policies compared without the machine's noise: the real runtime driven by engines that replay recorded text.

Greedy speculative decoding emits the target's own greedy tokens whatever the drafts, so one plain run of a
prompt fixes what every configuration emits, and the draft's greedy guess at each position of that text fixes
which of its drafts any configuration's target keeps (a draft after a rejected one is never kept, so guesses
off the text never matter). Recorded once per prompt (``record``), with a table of what each engine call costs
on this machine by tokens and past (``measure``), every configuration then runs through the real decoder,
drafters and policies against ``ReplayEngine``s: each returns the recorded next token at the positions on the
recorded text and moves a virtual clock by the call's cost from the table. ``time.perf_counter`` reads that
clock, so the policies measure the table's costs, and the runtime's own time between calls is counted as it
runs. The same configuration over the same traces gives nearly the same seconds whatever else the machine does
(exactly the same, and so the same decisions, with ``--no-runtime-time``, which counts the runtime's own time as
nothing: on a loaded machine that time can tip a near-tie, 42 of 952 runs apart between two runs of one tree at a
load of 10 on 2 cores), and a change to a policy is judged on many prompts in seconds, not hours of noisy runs; a
paired wall-clock run (``tools/bench_peer.py``) then confirms what the replay chose.

What a replay leaves out: near-ties that a verification's arithmetic tips (a real speculative run can leave
the plain text there: docs/runtime.md, Exact mode), a machine's drift, and the first calls of a process at each shape,
which ONNX Runtime runs cold (``--cold`` prices them at a multiple of the table's cost). Greedy only. A table
measured under a provider that pays for a change of shape (OpenVINO's) holds that change, and the replay charges it
to every call whose shape differs from its model's previous call's.

    python -m tools.replay record --artifact DIR --out traces.json [--humaneval 8] [--humaneval-from 8]
        [--specbench 4] [--max-new-tokens 128] [--provider openvino]
    python -m tools.replay run --traces traces.json [--lengths 32,128] [--ks 1,2,3,4] [--warm] [--cold 1.0]
        [--noise 0.15 --seeds 3] [--out FILE]

What a cost table allows at best (the draft model's drafts, free ones, per workload group): ``tools/ceiling.py``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from specdeploy.contract import PREFILL_CHUNK, ModelSpec
from specdeploy.engines.base import Engine
from specdeploy.engines.providers import PROVIDERS
from specdeploy.runtime.suffix_store import SuffixStore
from tools.arguments import artifact, integer, integers, json_object, number, parser, prompt_file, refusing

PASTS = (32, 384, 896)  # pasts the cost table is measured at (a HumanEval prompt is ~150 tokens, Spec-Bench rag ~700)
FULL = (*range(1, 10), 11, 13, 17)  # calls that keep every position's logits: decode and verification (T = K + 1)
TRIMMED = (2, 4, 8, 16, 32, 64, 128, PREFILL_CHUNK)  # calls that keep the last position's: prefill, catch-ups
TOKEN_SLOT = (0, 0, 0, 0)  # (layer tensor, kv head, -, dim): the cache element of each slot a replay writes its token into
_real_clock = time.perf_counter
SINGLE_SOURCES = ("plain", "cost", "lookup, cost", "suffix, cost")  # each source alone under the cost policy


@dataclass
class Trace:
    """One prompt's plain greedy decoding: the text every greedy configuration emits, and the draft's guesses."""

    group: str
    prompt_id: str
    prompt: list[int]
    output: list[int]  # the target's greedy tokens after the prompt
    draft_next: list[int]  # the draft's greedy guess after each token of prompt + output (index p guesses p + 1)

    @property
    def sequence(self) -> list[int]:
        return self.prompt + self.output


class CostTable:
    """Seconds of one batch-1 call of each model by new tokens, logits kept and past, from medians measured on this
    machine; in between, linear in tokens and in past (a call's cost is about linear in both past a few tokens). Its
    calls keep their model's previous shape (``measure_engines``); a call whose input shape differs costs that model's
    ``change`` more (OpenVINO's execution provider prepares every new shape: 8-9 ms; tables measured before it have
    none, their calls each measured after another shape)."""

    def __init__(self, table: dict):
        # "pasts": the pasts measured at; "change": role -> seconds; role -> {"full" | "trimmed": {tokens: [seconds at
        # each past]}}
        self.pasts, self.change = table["pasts"], table.get("change", {})
        self.by_tokens = {role: {kind: {int(t): v for t, v in measured.items()} for kind, measured in kinds.items()}
                          for role, kinds in table.items() if role not in ("pasts", "change")}

    def seconds(self, role: str, tokens: int, past: int, kept: int, changed: bool = True) -> float:
        """A call of ``tokens`` after ``past`` keeping ``kept`` positions' logits (``changed``: its input's shape
        differs from the model's previous call's)."""
        extra = self.change.get(role, 0.0) if changed else 0.0
        full, trimmed = self.by_tokens[role]["full"], self.by_tokens[role]["trimmed"]
        if kept == tokens and tokens in full or tokens == 1:
            return float(np.interp(past, self.pasts, full[tokens])) + extra
        widest = max(t for t in full if t in trimmed)  # the head over one more position: full minus trimmed there
        head = (np.array(full[widest]) - np.array(trimmed[widest])) / (widest - 1)
        row = np.array(_along(trimmed, tokens)) + np.maximum(head, 0.0) * (kept - 1)
        return float(np.interp(past, self.pasts, row)) + extra


def _along(rows: dict[int, list[float]], tokens: int) -> list[float]:
    """The row for ``tokens``, interpolated (or extrapolated from the last two) between measured token counts."""
    counts = sorted(rows)
    if tokens in rows:
        return rows[tokens]
    if tokens > counts[-1]:
        a, b = counts[-2], counts[-1]
    elif tokens < counts[0]:
        return rows[counts[0]]
    else:
        b = next(c for c in counts if c > tokens)
        a = max(c for c in counts if c < tokens)
    w = (tokens - a) / (b - a)
    return [(1 - w) * x + w * y for x, y in zip(rows[a], rows[b])]


class VirtualClock:
    """``time.perf_counter`` while a replay runs: real time, plus what the replayed calls cost beyond their own
    run time. Installed for the whole process (the runtime reads ``time.perf_counter`` everywhere)."""

    def __init__(self, runtime_time: bool = True):
        # runtime_time False: only the replayed calls move it (the runtime's own time counts as nothing)
        self.offset, self.real = 0.0, _real_clock if runtime_time else (lambda: 0.0)

    def __call__(self) -> float:
        return self.real() + self.offset

    def __enter__(self) -> VirtualClock:
        time.perf_counter = self
        return self

    def __exit__(self, *exc) -> None:
        time.perf_counter = _real_clock


class ReplayEngine(Engine):
    """An engine whose greedy token at each position of a recorded text is the recorded one, and whose calls cost
    what the table says. Each cache slot holds its token (``TOKEN_SLOT``) and slot 0 of the next element the
    trace's number, so a row's text goes wherever the runtime moves the row (joins, leaves, rollbacks)."""

    def __init__(self, spec: ModelSpec, traces: list[Trace], costs: CostTable, clock: VirtualClock, cold: float = 1.0,
                 noise: float = 0.0, seed: int = 0):
        spec = replace(spec, graph="fused")  # it keeps its own tokens in place: nothing for the runtime to stage
        self.spec, self.traces, self.costs, self.clock, self.cold = spec, traces, costs, clock, cold
        self.by_start = {tuple(t.prompt[:PREFILL_CHUNK]): i for i, t in enumerate(traces)}
        self.seen_shapes: set[tuple[int, int]] = set()  # (tokens, kept) called since ``new_process``
        self.calls: list[tuple[int, int, int]] = []  # (batch, tokens, kept) of every call, for tests and reports
        self.shape: tuple[int, int] | None = None  # the input shape of the latest call (None: a new process)
        # a shared machine's spread: each call's cost times a log-normal factor (seeded: the same runs again)
        self.noise, self.rng = noise, np.random.default_rng([seed, spec.role == "draft"])
        self.expected: int | None = None

    def expect(self, index: int | None) -> None:
        """The next prompt prefilled is trace ``index``'s (None: found by its first tokens). Told by ``replay``:
        a conversation's turns share their start, so a prefill's first chunk cannot tell them apart."""
        self.expected = index

    def new_process(self) -> None:
        """Every shape is cold again (a fresh ``specdeploy generate``)."""
        self.seen_shapes.clear()
        self.shape = None

    def allocate_cache(self, batch: int, capacity: int):
        from specdeploy.engines.base import KVCache

        # the real cache's shape, but one layer pair: replays read only the token slots
        return KVCache(np.zeros((2 * self.spec.num_layers, batch, self.spec.kv_heads, capacity, 2), np.float32))

    def _check_cache(self, cache, batch: int) -> int:
        return cache[0].shape[2]

    def infer_impl(self, input_ids, past_len, cache, kept: int):
        began = self.clock.real()
        batch, tokens = input_ids.shape
        self.calls.append((batch, tokens, kept))
        keys = cache[0]  # [batch, kv_heads, capacity, 2]
        guess = self._guesses()
        logits = np.zeros((batch, kept, self.spec.vocab_size), np.float32)
        for b in range(batch):
            start = int(past_len[b])
            if start == 0:
                keys[b, 0, 0, 1] = self._trace_of(input_ids[b]) + 1
            trace = int(keys[b, 0, 0, 1]) - 1
            keys[b, 0, start : start + tokens, 0] = input_ids[b]
            if trace < 0:  # no recorded text (the pipeline's warm-up): its calls cost what the table says, nothing more
                continue
            sequence, next_of = self.traces[trace].sequence, guess(self.traces[trace])
            on_until = start + _agree(input_ids[b], sequence[start:])  # slots before it hold the recorded text
            for j in range(kept):
                p = start + tokens - kept + j  # the slot whose token this position follows
                logits[b, j, next_of[p] if p < on_until and p < len(next_of) else 0] = 30.0
        if batch != 1:
            raise NotImplementedError("replay: batch 1 only (the cost table is batch 1's)")
        changed, self.shape = self.shape != (batch, tokens), (batch, tokens)
        cost = self.costs.seconds(self.spec.role, tokens, int(past_len.max()), kept, changed)
        shape = (tokens, kept)
        if shape not in self.seen_shapes:
            self.seen_shapes.add(shape)
            cost *= self.cold
        if self.noise:
            cost *= float(np.exp(self.noise * self.rng.standard_normal()))
        self.clock.offset += cost - (self.clock.real() - began)
        return logits, None, None  # no new K/V (the graph writes in place), no ids

    def _guesses(self):
        if self.spec.role == "target":
            return lambda trace: trace.sequence[1:]
        return lambda trace: trace.draft_next

    def _trace_of(self, ids: np.ndarray) -> int:
        if self.expected is not None:
            return self.expected
        key = tuple(int(t) for t in ids[:PREFILL_CHUNK])
        for start, index in self.by_start.items():
            if start[: len(key)] == key or key[: len(start)] == start:
                return index
        return -1  # a prompt that no trace starts with: the warm-up's


def _agree(ids: np.ndarray, sequence: list[int]) -> int:
    """How many leading tokens of ``ids`` follow ``sequence``."""
    n = 0
    for x, y in zip(ids, sequence):
        if int(x) != y:
            break
        n += 1
    return n


class _Detokenizer:
    """What a replayed ``Pipeline`` needs of a tokenizer: nothing is decoded to text."""

    def decode(self, ids, skip_special_tokens=True) -> str:
        return ""

    def token_to_id(self, token):
        return None


class _Remembered:
    """``RememberedCosts`` in memory: what one replayed process leaves for the next."""

    def __init__(self):
        self.record: dict | None = None

    def recall(self, table: str = "costs"):
        from specdeploy.runtime.cost_policy import Costs

        if self.record is None or table not in self.record:
            return None
        return Costs.from_dict(json.loads(json.dumps(self.record[table])))  # as on disk

    def recall_answers(self):
        from specdeploy.runtime.answer_lengths import AnswerLengths

        if self.record is None or "answers" not in self.record:
            return None
        return AnswerLengths.from_list(json.loads(json.dumps(self.record["answers"])))

    def remember(self, costs, exact_costs, answers=None) -> None:
        self.record = {"costs": costs.to_dict(), "exact_costs": exact_costs.to_dict()}
        if answers is not None:
            self.record["answers"] = answers.to_list()


def record(pipeline, prompts, max_new_tokens: int, log=print) -> list[Trace]:
    """Plain greedy decoding of each (group, prompt), and the draft's greedy guess at every position of it."""
    from specdeploy import GenerationConfig

    config = GenerationConfig(drafter="none", max_new_tokens=max_new_tokens)
    traces = []
    for index, (group, prompt) in enumerate(prompts):
        ids = pipeline.encode(prompt.for_pipeline(pipeline)).tolist()  # a chat prompt through the artifact's template
        output = pipeline.generate([ids], config, suffix_index=None, scope=None)[0].token_ids
        traces.append(Trace(group, prompt.id, ids, output, guesses(pipeline.draft, ids + output)))
        agree = np.mean([g == t for g, t in zip(traces[-1].draft_next[len(ids) - 1 :], output)])
        log(f"[{index + 1}/{len(prompts)}] {group} {prompt.id}: {len(ids)} + {len(output)} tokens, "
            f"draft agrees on {agree:.2f} of the output")
    return traces


def guesses(engine, sequence: list[int], chunk: int = 64) -> list[int]:
    """The engine's greedy next token after each token of ``sequence`` (one pass, ``chunk`` tokens a call)."""
    cache = engine.allocate_cache(1, len(sequence) + 1)
    tokens = np.array([sequence], np.int64)
    out = []
    for start in range(0, len(sequence), chunk):
        part = tokens[:, start : start + chunk]
        logits = engine.infer(part, np.array([start], np.int64), cache, last=part.shape[1]).logits
        out += logits[0].argmax(-1).tolist()
    return out


def measure(pipeline, rounds: int = 5, log=print) -> dict:
    """Median seconds of one batch-1 call of the pipeline's target and draft (``measure_engines``), and what a change
    of shape costs each (``calibration.change_seconds``, at the middle past: its one-token calls)."""
    from specdeploy.runtime.calibration import change_seconds

    engines = {"target": pipeline.target, "draft": pipeline.draft}
    table = measure_engines(engines, rounds, log)
    past = table["pasts"][len(table["pasts"]) // 2]
    table["change"] = {role: change_seconds(engine, engine.allocate_cache(1, engine.spec.capacity), past,
                                            None if role == "target" else 1) for role, engine in engines.items()}
    log(f"cost table: a change of shape {', '.join(f'{r} {s * 1e3:.1f} ms' for r, s in table['change'].items())}")
    return table


def measure_engines(engines: dict, rounds: int = 5, log=print, statistic=statistics.median) -> dict:
    """Median (or ``statistic``'s) seconds of one batch-1 call of each engine (role -> engine) at each of ``FULL``
    (every position's logits) and ``TRIMMED`` (the last position's) token counts after each of ``PASTS`` (those the
    models hold), every call once a round in a shuffled order, after a first unmeasured round; each call made twice in
    a row and the second timed: a call that keeps its shape (``measure`` adds what a change costs)."""
    capacity = min(engine.spec.capacity for engine in engines.values())
    pasts = [p for p in PASTS if p + PREFILL_CHUNK <= capacity] or [min(8, capacity // 4), capacity // 3]
    full = [t for t in FULL if t + max(pasts) <= capacity]
    trimmed = [t for t in TRIMMED if t + max(pasts) <= capacity]
    rng = np.random.default_rng(0)
    times = {}
    for role, engine in engines.items():
        cache = engine.allocate_cache(1, capacity)
        for kind, counts in (("full", full), ("trimmed", trimmed)):
            for tokens in counts:
                ids = rng.integers(0, engine.spec.vocab_size, (1, tokens))
                for past in pasts:
                    times[role, kind, tokens, past] = (engine, cache, ids, [])
    keys = list(times)
    for round_ in range(rounds + 1):
        rng.shuffle(keys)  # what a call follows changes its cost: no call always follows the same one
        for key in keys:
            engine, cache, ids, seconds = times[key]
            past, kind = key[3], key[1]
            call = (ids, np.array([past], np.int64), cache, 1 if kind == "trimmed" else None)
            engine.infer(*call)
            began = _real_clock()
            engine.infer(*call)
            if round_:
                seconds.append(_real_clock() - began)
        log(f"cost table: round {round_}/{rounds} measured" if round_ else "cost table: warm-up round done")
    table: dict = {"pasts": pasts} | {role: {"full": {}, "trimmed": {}} for role in engines}
    for (role, kind, tokens, _past), (*_, seconds) in times.items():  # in PASTS order: a row per past
        table[role][kind].setdefault(str(tokens), []).append(statistic(seconds))
    return table


def replay(data: dict, config, fresh: bool = True, cold: float = 1.0, traces: list[Trace] | None = None,
           noise: float = 0.0, seed: int = 0, runtime_time: bool = True) -> list[dict]:
    """Run ``config`` over the recorded traces through the real runtime and replay engines; per trace, the
    virtual seconds (prefill and decoding) and what the policy did. ``fresh``: each request a new process
    (``specdeploy generate``: costs recalled from the previous process's record, every shape cold again);
    otherwise one pipeline serves them all in turn."""
    from specdeploy import Pipeline
    from specdeploy.contract import Manifest

    if not config.greedy:
        raise SystemExit("replay: greedy configurations only (temperature 0)")
    traces = traces if traces is not None else [Trace(**t) for t in data["traces"]]
    specs = {role: ModelSpec(**{**spec, "eos_token_ids": tuple(spec["eos_token_ids"])}) for role, spec in data["models"].items()}
    manifest = Manifest(models=specs)
    costs, clock, memory = CostTable(data["costs"]), VirtualClock(runtime_time), _Remembered()
    # one index of earlier answers for the whole run, as one pipeline or server keeps it: a trace drafts from the
    # traces before it, never from its own recorded answer; each configuration's run starts it empty
    store = SuffixStore()
    target = ReplayEngine(specs["target"], traces, costs, clock, cold, noise, seed)
    draft = ReplayEngine(specs["draft"], traces, costs, clock, cold, noise, seed)
    out = []
    with clock:
        # prompts prefilled whole, as recorded: a replay engine's cache holds its trace's tokens, not K/V to reuse
        pipeline = Pipeline(manifest, _Detokenizer(), target, draft, remembered_costs=memory, suffix_store=store,
                            prefix_cache_bytes=0)
        if fresh:  # an earlier run on this machine left its record (a short prompt first)
            shortest = min(traces, key=lambda t: len(t.prompt))
            for engine in (target, draft):
                engine.expect(traces.index(shortest))
            pipeline.generate([shortest.prompt], replace(config, max_new_tokens=16), suffix_index=None)
        for number, trace in enumerate(traces):
            for engine in (target, draft):
                engine.expect(number)
            if fresh:
                pipeline = Pipeline(manifest, _Detokenizer(), target, draft, remembered_costs=memory,
                                    suffix_store=store, prefix_cache_bytes=0)
                target.new_process()
                draft.new_process()
            out.append(_replayed(trace, pipeline.generate([trace.prompt], config)[0], config))
    return out


def _replayed(trace: Trace, result, config) -> dict:
    """One trace's replayed run as a row of ``replay``'s; AssertionError where it left the recorded text."""
    expected = trace.output[: config.max_new_tokens]
    if result.token_ids != expected[: len(result.token_ids)] or (
            len(result.token_ids) < len(expected) and result.finish_reason != "eos"):
        raise AssertionError(f"{trace.prompt_id}: the replay left the recorded text (a replay bug)")
    stats = result.stats
    return {"group": trace.group, "prompt": trace.prompt_id, "tokens": stats["tokens"],
            "seconds": stats["seconds"] + stats["prefill_s"], "prefill_s": stats["prefill_s"],
            "cycles": len(result.records), "drafted": sum(r.drafted for r in result.records),
            "accepted": sum(r.accepted for r in result.records),
            "drafted_by_cycle": [r.drafted for r in result.records], "accepted_by_cycle": [r.accepted for r in result.records]}


def configurations(ks: list[int]) -> dict:
    """Plain decoding, fixed K by the draft model, the cost policy over the draft model, and the default (the cost
    policy over the hybrid drafter)."""
    from specdeploy import GenerationConfig

    out = {"plain": GenerationConfig(drafter="none")}
    out |= {f"k={k}": GenerationConfig(policy="fixed", k=k, drafter="model") for k in ks}
    out["cost"] = GenerationConfig(policy="cost", k=8, drafter="model")
    out["lookup, cost"] = GenerationConfig(policy="cost", k=8, drafter="prompt-lookup")
    out["suffix, cost"] = GenerationConfig(policy="cost", k=8, drafter="suffix")
    out["hybrid, cost"] = GenerationConfig(policy="cost", k=8, drafter="hybrid")
    return out


def summarize(runs: dict[str, list[dict]], lengths: list[int], log=print) -> list[dict]:
    """tok/s (all tokens over all seconds) per group, length and configuration; the cost policy and the hybrid
    cost policy against plain decoding and the best fixed K (the goal: never below plain, within 5 % of the best K)."""
    names = list(runs)
    groups = sorted({r["group"] for rs in runs.values() for r in rs}, key=lambda g: (g != "humaneval", g))
    log(f"{'group':24} {'new':>4} " + " ".join(f"{n:>12}" for n in names)
        + "  cost/plain  cost/best K  hybrid/plain  hybrid/best K  hybrid/best source")
    summary = []
    for tokens in lengths:
        for group in [*groups, "all"]:
            rates = {}
            for name in names:
                rows = [r for r in runs[name] if r["max_new_tokens"] == tokens and group in ("all", r["group"])]
                rates[name] = sum(r["tokens"] for r in rows) / sum(r["seconds"] for r in rows)
            best = max(v for n, v in rates.items() if n.startswith("k="))
            single = max(rates[n] for n in SINGLE_SOURCES if n in rates)
            entry = {"group": group, "max_new_tokens": tokens, "tok_s": rates,
                     "cost_vs_plain": rates["cost"] / rates["plain"], "cost_vs_best_k": rates["cost"] / best,
                     "hybrid_vs_plain": rates["hybrid, cost"] / rates["plain"],
                     "hybrid_vs_best_k": rates["hybrid, cost"] / best,
                     "hybrid_vs_best_source": rates["hybrid, cost"] / single}
            summary.append(entry)
            log(f"{group:24} {tokens:4} " + " ".join(f"{rates[n]:12.2f}" for n in names)
                + f"  {entry['cost_vs_plain']:10.2f}  {entry['cost_vs_best_k']:11.2f}"
                + f"  {entry['hybrid_vs_plain']:12.2f}  {entry['hybrid_vs_best_k']:13.2f}"
                + f"  {entry['hybrid_vs_best_source']:15.2f}")
    return summary


def main() -> None:
    options = _parser()
    args = options.parse_args()
    with refusing(options):
        if args.command == "record":
            return _record_traces(args)
        data = args.traces  # read and checked as the arguments were parsed
        if getattr(args, "costs", None):
            data["costs"] = args.costs
        if not data["costs"]:
            options.error("--traces: the traces file holds no cost table (recorded with --rounds 0); expected --costs "
                          "naming one")
        _replay_configurations(args, data)


TRACES = "a traces file (tools.replay record's --out)"


def traces_file(text: str) -> dict:
    """``run --traces``: a traces file whose traces, models and cost table have the shapes ``record`` writes."""
    data = json_object(TRACES, "traces", "models", "costs")(text)
    try:
        if not data["traces"] or not isinstance(data["traces"], list):
            raise ValueError("no traces")
        traces = [Trace(**t) for t in data["traces"]]
        if not all(isinstance(getattr(t, f), list) and t.sequence for t in traces for f in ("prompt", "output", "draft_next")):
            raise ValueError("a trace whose prompt, output or draft guesses are not lists of token ids")
        for role in ("target", "draft"):
            spec = data["models"][role]
            ModelSpec(**{**spec, "eos_token_ids": tuple(spec["eos_token_ids"])})
        if data["costs"]:  # record --rounds 0 measures none: such traces are run at another's (run --costs)
            cost_table(data["costs"])
    except (TypeError, ValueError, KeyError, AttributeError) as exc:
        raise argparse.ArgumentTypeError(f"{text}: not the shape record writes ({type(exc).__name__}: {exc}); "
                                         f"expected {TRACES}") from None
    return data


def cost_table(given) -> dict:
    """``run --costs``: a cost table, alone or as a traces file's ``costs``."""
    table = given.get("costs", given) if isinstance(given, dict) else given
    if not isinstance(table, dict) or not isinstance(table.get("pasts"), list) or not {"target", "draft"} <= set(table):
        raise argparse.ArgumentTypeError("not a cost table (no pasts, target and draft); expected one that "
                                         "tools.replay record measured, alone or in its traces file")
    return table


def _parser() -> argparse.ArgumentParser:
    options = parser(__doc__)
    commands = options.add_subparsers(dest="command", required=True)
    rec = commands.add_parser("record", help="plain runs, the draft's guesses and the cost table, from an artifact")
    rec.add_argument("--artifact", type=artifact, required=True, help="the artifact of the pair to record (make demo's)")
    rec.add_argument("--out", type=Path, required=True, help="the traces' JSON file")
    rec.add_argument("--humaneval", type=integer(0), default=8, help="HumanEval prompts")
    rec.add_argument("--humaneval-from", type=integer(0), default=8, help="first HumanEval prompt")
    rec.add_argument("--specbench", type=integer(0), default=4, help="Spec-Bench prompts per category group")
    rec.add_argument("--conversations", type=integer(0), default=0, help="code-edit conversations, each turn in order")
    rec.add_argument("--structured", type=integer(0), default=0, help="structured-output (JSON) prompts")
    rec.add_argument("--prompts", type=prompt_file, default=None,
                     help="a prompt file (text, JSONL or Spec-Bench) instead of HumanEval and Spec-Bench; groups by category")
    rec.add_argument("--max-new-tokens", type=integer(1), default=128, help="the longest completion a replay may ask for")
    rec.add_argument("--rounds", type=integer(0), default=7, help="measured rounds of the cost table (0: none; replay them "
                     "with --costs)")
    rec.add_argument("--threads", type=integer(1), default=2, help="ONNX Runtime threads, as the CLI runs them")
    rec.add_argument("--provider", choices=PROVIDERS, default="cpu",
                     help="the execution provider both models run on, as the CLI's --provider")
    run = commands.add_parser("run", help="replay configurations over recorded traces")
    run.add_argument("--traces", type=traces_file, required=True, help="the traces' JSON file (record's --out)")
    run.add_argument("--lengths", type=integers(1), default="32,128", help="comma list of max new tokens")
    run.add_argument("--ks", type=integers(1), default="1,2,3,4", help="comma list of fixed K")
    run.add_argument("--warm", action="store_true",
                     help="one long-lived pipeline serves every prompt (default: each a fresh process, as the CLI)")
    run.add_argument("--cold", type=number(0), default=1.0,
                     help="the first call at each shape in a process costs this multiple of the table's")
    run.add_argument("--costs", type=_checked_costs, default=None,
                     help="another cost table: a JSON file of one, or of traces whose table to take (another machine's)")
    run.add_argument("--noise", type=number(0), default=0.0,
                     help="each call's cost times exp(NOISE x a standard normal draw): a shared machine's spread")
    run.add_argument("--seeds", type=integer(1), default=1, help="with --noise: replay each configuration this many times")
    run.add_argument("--no-runtime-time", dest="runtime_time", action="store_false",
                     help="count the runtime's own time as nothing: only the table's costs move the clock, so two trees' "
                     "decisions and seconds compare exactly, whatever the machine's load")
    run.add_argument("--out", type=Path, default=None, help="write the runs and the summary as JSON")
    return options


def _checked_costs(text: str) -> dict:
    given = json_object("a cost table, or a traces file holding one")(text)
    try:
        return cost_table(given)
    except argparse.ArgumentTypeError as exc:
        raise argparse.ArgumentTypeError(f"{text}: {exc}") from None


def _record_traces(args: argparse.Namespace) -> None:
    """``record``: the artifact's plain runs, its draft's guesses and the cost table, written to ``--out``."""
    from specdeploy import Pipeline
    from specdeploy.workloads import workload

    pipeline = Pipeline.load(args.artifact, args.provider, threads=args.threads)
    if pipeline.draft is None:
        raise SystemExit(f"{args.artifact}: no draft model to replay")
    if args.prompts:
        from specdeploy.workloads import load_prompts

        prompts = [(p.category or "prompts", p) for p in load_prompts(args.prompts)]
    else:
        prompts = workload(args.humaneval, args.specbench, args.humaneval_from, args.conversations, args.structured)
    costs = measure(pipeline, args.rounds) if args.rounds else {}
    traces = record(pipeline, prompts, args.max_new_tokens)
    models = {role: asdict(spec) for role, spec in pipeline.manifest.models.items()}
    args.out.write_text(json.dumps({"artifact": str(args.artifact), "threads": args.threads, "models": models,
                                    "costs": costs, "traces": [asdict(t) for t in traces]}))
    print(f"wrote {args.out}: {len(traces)} traces")


def _replay_configurations(args: argparse.Namespace, data: dict) -> None:
    """``run``: every configuration replayed at each length (and seed) over the traces; the summary printed."""
    lengths = args.lengths
    # a trace that ends in EOS is a whole answer, replayed at any length; one cut at its recording's length is not
    eos = set(data["models"]["target"]["eos_token_ids"])
    cut = [len(t["output"]) for t in data["traces"]
           if len(t["output"]) < max(lengths) and (not t["output"] or t["output"][-1] not in eos)]
    if cut:
        raise SystemExit(f"--lengths: {max(lengths)} new tokens, but {len(cut)} traces were recorded to {min(cut)} "
                         "tokens and cut there (they end without EOS); expected lengths up to that")
    runs = {name: [] for name in configurations(args.ks)}
    for tokens in lengths:
        for name, config in configurations(args.ks).items():
            for seed in range(args.seeds if args.noise else 1):
                for row in replay(data, replace(config, max_new_tokens=tokens), fresh=not args.warm, cold=args.cold,
                                  noise=args.noise, seed=seed, runtime_time=args.runtime_time):
                    runs[name].append({**row, "config": name, "max_new_tokens": tokens, "seed": seed})
    summary = summarize(runs, lengths)
    if args.out:
        args.out.write_text(json.dumps({"runs": runs, "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
