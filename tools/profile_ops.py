"""Where one call's time goes, per operator type, at 1 token and at the verification sizes.

Speculation pays only when verifying T tokens costs well under T single-token calls, and that
ratio is set by the kernels of the machine at hand (ONNX Runtime's int4 MatMulNBits ran 5 tokens
at 1.36x one token on one CPU and at 1.9x on another). This tool runs each model of an artifact
under ONNX Runtime's profiler at each token count (batch 1, after a past of --past tokens,
interleaved round by round, a warm-up round first) and prints, per operator type, the median
milliseconds a call spends in it, its ratio to one token, and the nodes whose time grows the most:
the kernels to blame when `specdeploy bench` finds verification dear.

    python -m tools.profile_ops --artifact DIR [--role target|draft|both] [--tokens 1,5,9] [--past 256]
        [--rounds 5] [--threads 2] [--top 8] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from collections import defaultdict
from pathlib import Path

import numpy as np

from tools import arguments


def profile(path: Path, spec, token_counts: list[int], past: int, rounds: int, threads: int, workdir: Path) -> dict:
    """Run ``path`` under the profiler; returns {"calls": {T: [ms of each timed call]}, "ops": {T: {op: [ms]}},
    "nodes": {T: {node: (op, [ms])}}}, one list entry per timed round."""
    from specdeploy.engines import OrtEngine

    engine = OrtEngine(path, spec, threads=threads, profile=workdir / path.stem)
    capacity = past + max(token_counts) + 1
    cache = engine.allocate_cache(1, capacity)
    rng = np.random.default_rng(0)
    for buf in cache:
        buf[:] = rng.normal(0, 1, buf.shape)  # a past of plausible magnitude: attention over real numbers
    inputs = {t: rng.integers(0, spec.vocab_size, (1, t)) for t in token_counts}
    order = []  # (T, timed) of each session run, in the order they ran
    for timed in [False] + [True] * rounds:
        for t in token_counts:
            engine.infer(inputs[t], np.array([past], np.int64), cache)
            order.append((t, timed))
    events = json.loads(Path(engine.session.end_profiling()).read_text())
    return attribute(events, order)


def attribute(events: list[dict], order: list[tuple[int, bool]]) -> dict:
    """Assign each kernel event to the session run that encloses it; ``order`` gives each run's (T, timed).

    ONNX Runtime's trace holds one "model_run" event per run and one "<node>_kernel_time" event per node
    executed (args.op_name its operator type), both with a start ``ts`` and a ``dur`` in microseconds."""
    runs = sorted((e for e in events if e.get("name") == "model_run"), key=lambda e: e["ts"])
    if len(runs) != len(order):
        raise RuntimeError(f"the profile holds {len(runs)} runs; expected {len(order)} (one per call made)")
    kernels = sorted((e for e in events if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")),
                     key=lambda e: e["ts"])
    calls: dict[int, list[float]] = defaultdict(list)
    ops: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    nodes: dict[int, dict[str, tuple[str, list[float]]]] = defaultdict(dict)
    position = 0
    for run, (tokens, timed) in zip(runs, order):
        start, stop = run["ts"], run["ts"] + run["dur"]
        per_op: dict[str, float] = defaultdict(float)
        per_node: dict[str, tuple[str, float]] = {}
        while position < len(kernels) and kernels[position]["ts"] < stop:
            kernel = kernels[position]
            position += 1
            if kernel["ts"] < start:
                continue  # a kernel outside any run (none expected): not this call's time
            op = kernel["args"]["op_name"]
            node = kernel["name"].removesuffix("_kernel_time")
            per_op[op] += kernel["dur"] / 1e3
            per_node[node] = (op, per_node.get(node, (op, 0.0))[1] + kernel["dur"] / 1e3)
        if not timed:
            continue
        calls[tokens].append(run["dur"] / 1e3)
        for op, ms in per_op.items():
            ops[tokens][op].append(ms)
        for node, (op, ms) in per_node.items():
            nodes[tokens].setdefault(node, (op, []))[1].append(ms)
    return {"calls": dict(calls), "ops": {t: dict(v) for t, v in ops.items()}, "nodes": dict(nodes)}


def summarize(profiled: dict, token_counts: list[int], top: int) -> dict:
    """Medians: {"call": {T: ms}, "ops": {op: {T: ms}}, "growth": [(node, op, {T: ms})...] largest first}."""
    def median(values):
        return statistics.median(values) if values else 0.0

    first, last = token_counts[0], token_counts[-1]
    call = {t: median(profiled["calls"][t]) for t in token_counts}
    names = sorted({op for t in token_counts for op in profiled["ops"][t]})
    ops = {op: {t: median(profiled["ops"][t].get(op, [])) for t in token_counts} for op in names}
    ops = dict(sorted(ops.items(), key=lambda item: -item[1][last]))
    node_names = {node for t in token_counts for node in profiled["nodes"][t]}
    growth = []
    for node in node_names:
        op = next(profiled["nodes"][t][node][0] for t in token_counts if node in profiled["nodes"][t])
        ms = {t: median(profiled["nodes"][t].get(node, (op, []))[1]) for t in token_counts}
        growth.append((node, op, ms))
    growth.sort(key=lambda item: -(item[2][last] - item[2][first]))
    return {"call": call, "ops": ops, "growth": growth[:top]}


def table(title: str, summary: dict, token_counts: list[int]) -> str:
    """The report of one model as text."""
    first = token_counts[0]
    heads = [f"T={t}" for t in token_counts] + [f"T={t}/T={first}" for t in token_counts[1:]]
    lines = [title, f"  {'operator':<34}" + "".join(f"{h:>11}" for h in heads) + f"{'share':>8}"]

    def row(name: str, ms: dict) -> str:
        ratios = [ms[t] / ms[first] if ms[first] else float("nan") for t in token_counts[1:]]
        share = ms[first] / summary["call"][first] if summary["call"][first] else 0.0
        return (f"  {name[:34]:<34}" + "".join(f"{ms[t]:>9.2f}ms" for t in token_counts)
                + "".join(f"{r:>10.2f}x" for r in ratios) + f"{share:>8.0%}")

    lines += [row(op, ms) for op, ms in summary["ops"].items()]
    kernels = {t: sum(ms[t] for ms in summary["ops"].values()) for t in token_counts}
    lines += [row("(all kernels)", kernels), row("(whole call)", summary["call"])]
    lines.append(f"  nodes whose time grows the most from T={first} to T={token_counts[-1]}:")
    lines += [row(f"{node} ({op})", ms) for node, op, ms in summary["growth"]]
    return "\n".join(lines)


def main() -> None:
    parser = _parser()
    args = parser.parse_args()

    from specdeploy.contract import Manifest

    try:
        token_counts = sorted({int(t) for t in args.tokens.split(",")})
    except ValueError:
        parser.error(f"--tokens: expected comma-separated integers, got {args.tokens!r}")
    if token_counts[0] < 1 or args.past < 0 or args.rounds < 1:
        parser.error(f"--tokens must be >= 1, --past >= 0 and --rounds >= 1; got {token_counts}, {args.past}, {args.rounds}")
    manifest = Manifest.read(args.artifact)
    roles = [r for r in ("target", "draft") if args.role in (r, "both") and r in manifest.models]
    if not roles:
        parser.error(f"{args.artifact} has no {args.role} model (it holds {', '.join(manifest.models)})")
    report = {}
    with tempfile.TemporaryDirectory(prefix="specdeploy-profile-") as workdir:
        for role in roles:
            spec = manifest.models[role]
            if args.past + token_counts[-1] > spec.capacity:
                parser.error(f"--past {args.past} + {token_counts[-1]} tokens exceed the {role}'s capacity {spec.capacity}")
            profiled = profile(args.artifact / spec.file, spec, token_counts, args.past, args.rounds, args.threads,
                               Path(workdir))
            summary = summarize(profiled, token_counts, args.top)
            print(table(f"{role} ({spec.file}), batch 1, past {args.past}, median of {args.rounds} calls, ms per call",
                        summary, token_counts))
            report[role] = {"call_ms": summary["call"], "ops_ms": summary["ops"],
                            "growth": [{"node": n, "op": o, "ms": ms} for n, o, ms in summary["growth"]]}
    if args.out:
        args.out.write_text(json.dumps({"artifact": str(args.artifact), "past": args.past, "rounds": args.rounds,
                                        "threads": args.threads, "models": report}, indent=2))


def _parser() -> argparse.ArgumentParser:
    parser = arguments.parser(__doc__.splitlines()[0])
    parser.add_argument("--artifact", type=arguments.artifact, required=True, help="an exported artifact dir")
    parser.add_argument("--role", choices=["target", "draft", "both"], default="both",
                        help="which model(s) to profile (default: both)")
    parser.add_argument("--tokens", default="1,5,9", help="new tokens per call, comma-separated (default: 1,5,9)")
    parser.add_argument("--past", type=arguments.integer(0), default=256, help="cached tokens before each call (default: 256)")
    parser.add_argument("--rounds", type=arguments.integer(1), default=5, help="timed calls per token count (default: 5)")
    parser.add_argument("--threads", type=arguments.integer(1), default=2, help="ONNX Runtime threads (default: 2)")
    parser.add_argument("--top", type=arguments.integer(1), default=8, help="nodes listed by growth (default: 8)")
    parser.add_argument("--out", type=Path, help="also write the medians as JSON")
    return parser


if __name__ == "__main__":
    main()
