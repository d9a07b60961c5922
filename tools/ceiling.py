"""The most speculation can reach on a machine: which speed goals it can meet at all.

The draft model (``--past``): fixed K at an acceptance a at every position decodes (1 + a + .. + a^K) tokens per
K draft steps and a (K + 1)-token verification, against one token per plain step; no prefill, no catch-up: an upper
bound for any policy over that draft model.

Free drafts, per workload group: speculation shortens decoding, never a prompt's prefill. Even a drafter whose
every draft the target keeps, at no cost of its own, emits T tokens per target call at the price of a T-token
verification, so with a table of this machine's call costs (v(T): a target call of T tokens, ``tools/replay.py
record``) its decoding is at most max_T T v(1) / v(T) times plain decoding's. A live run's plain decoding
(``tools/bench_peer.py``: each prompt's first-token time, which every configuration shares, and its decoding time)
then bounds each group end to end: first token + decoding time / that speed-up. A goal above the bound cannot be
met on this machine by any drafter; the bound also assumes no runtime time and no rejected draft, so a real one
stays below it.

    python -m tools.ceiling --costs tools/replay_data/costs_epyc_vnni.json [--past 256]
    python -m tools.ceiling --costs tools/replay_data/costs_epyc_vnni.json --live docs/results/bench_peer/bench_peer.json
        [--goal spec_bench/rag=1.6 ...] [--out FILE]
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from specdeploy.runtime.cost_policy import draft_changes
from tools.arguments import integer, parser
from tools.replay import CostTable


def model_ceiling(costs: CostTable, past: int, rates=(1.0, 0.9, 0.8), k_max: int = 8, log=print) -> dict:
    """The draft model's decoding speed-up over plain at fixed K = 1..``k_max`` and acceptance a at every position
    (a = 1: every draft kept), (1 + a + .. + a^K) / (K c_d + v(K + 1)) against 1 / v(1), at ``past``. At a fixed K the
    target keeps its shape; the draft changes its own twice a cycle where the table holds a change (OpenVINO's)."""
    plain = costs.seconds("target", 1, past, 1, changed=False)
    step, change = costs.seconds("draft", 1, past, 1, changed=False), costs.change.get("draft", 0.0)
    out = {}
    for a in rates:
        speed = {k: sum(a**j for j in range(k + 1))
                 / (k * step + draft_changes(k) * change + costs.seconds("target", k + 1, past, k + 1, changed=False))
                 * plain
                 for k in range(1, k_max + 1)}
        best = max(speed, key=speed.get)
        out[a] = {"best_k": best, "speedup": speed[best], "by_k": speed}
        log(f"the draft model, acceptance {a:.2f} at every position: best K = {best}, {speed[best]:.2f}x plain decoding "
            f"(K = 1..{k_max}: " + " ".join(f"{v:.2f}" for v in speed.values()) + ")")
    return out


def free_speedup(costs: CostTable) -> dict:
    """The best decoding speed-up over plain of drafts that are free and always kept: max over the table's measured
    verification sizes T (every position's logits) and pasts of T v(1) / v(T), the past most favourable to it (a bound
    must not be the table's dearest case); and the same for drafts of any length, v(T) continued by the line through
    the two largest sizes measured (its limit, v(1) over the line's slope, where the slope is positive)."""
    full = costs.by_tokens["target"]["full"]
    sizes = sorted(full)
    best = {"tokens": 1, "past": costs.pasts[0], "speedup": 1.0}
    for i, past in enumerate(costs.pasts):
        for tokens in sizes:
            speedup = tokens * full[1][i] / full[tokens][i]
            if speedup > best["speedup"]:
                best = {"tokens": tokens, "past": past, "speedup": speedup}
    a, b = sizes[-2], sizes[-1]
    slopes = [(full[b][i] - full[a][i]) / (b - a) for i in range(len(costs.pasts))]
    unbounded = max((full[1][i] / s for i, s in enumerate(slopes) if s > 0), default=float("inf"))
    return best | {"any_length": max(unbounded, best["speedup"])}


def group_bounds(bench: dict, speedup: float, goals: dict[str, float]) -> list[dict]:
    """Per group of a ``bench_peer`` run: plain decoding's and the default's tok/s (medians over prompts, end to end,
    as the run's report gives them) and the bound of a drafter ``speedup`` times faster at decoding. A prompt's first
    token is the fastest any specdeploy configuration of it took (each prefills the same prompt; a slow one is the
    machine's noise, and a bound must not count it). With a group's goal (x plain), the decoding speed-up it needs."""
    runs = bench["runs"]
    plain, default = _configuration(runs, "plain"), _configuration(runs, "default")
    ours = [name for name in runs if name.startswith("specdeploy")]
    out = []
    for group in bench["by_group"]:
        prompts = [i for i, run in enumerate(runs[plain]) if run["group"] == group]
        rows = [(runs[plain][i], runs[default][i], min(runs[name][i]["first_s"] for name in ours)) for i in prompts]
        rates = {"plain": [p["tokens"] / p["seconds"] for p, _, _ in rows],
                 "default": [d["tokens"] / d["seconds"] for _, d, _ in rows],
                 "bound": [p["tokens"] / (first + (p["seconds"] - first) / speedup) for p, _, first in rows]}
        median = {name: statistics.median(values) for name, values in rates.items()}
        share = statistics.median(first / p["seconds"] for p, _, first in rows)  # of plain decoding's time
        entry = {"group": group, "prompts": len(rows), "first_token_share": share, **median,
                 "default_vs_plain": median["default"] / median["plain"], "bound_vs_plain": median["bound"] / median["plain"]}
        if group in goals:  # the goal's time 1 / goal of plain's; the first token's share of it is fixed
            left = 1 / goals[group] - share
            entry |= {"goal": goals[group], "decoding_speedup_needed": (1 - share) / left if left > 0 else float("inf")}
        out.append(entry)
    return out


def _configuration(runs: dict, kind: str) -> str:
    """The first specdeploy configuration of ``kind`` ("plain", "default"): bench_peer names them "system: kind ..."."""
    found = [name for name in runs if name.startswith("specdeploy") and name.split(": ", 1)[-1].startswith(kind)]
    if not found:
        raise SystemExit(f"--live: no specdeploy configuration '{kind}' in the run; it has {', '.join(runs)}")
    return found[0]


def main() -> None:
    options = parser(__doc__)
    options.add_argument("--costs", type=Path, required=True,
                         help="a cost table of this machine: a JSON file of one, or of traces whose table to take")
    options.add_argument("--past", type=integer(0), default=256, help="the past the draft model's ceiling reads the costs at")
    options.add_argument("--live", type=Path, default=None,
                         help="a tools/bench_peer.py run's JSON (its plain and default configurations) to bound per group")
    options.add_argument("--goal", action="append", default=[], metavar="GROUP=X",
                         help="a group's goal in x plain decoding (repeatable): prints the decoding speed-up it needs")
    options.add_argument("--out", type=Path, default=None, help="write the speed-up and the groups' bounds as JSON")
    args = options.parse_args()
    costs = CostTable(_read(args.costs, "--costs", ("pasts", "target"), inside="costs"))
    print(f"batch 1, past {args.past}: v(1) {costs.seconds('target', 1, args.past, 1, changed=False) * 1e3:.1f} ms, "
          f"a draft step {costs.seconds('draft', 1, args.past, 1, changed=False) * 1e3:.1f} ms")
    model = model_ceiling(costs, args.past)
    best = free_speedup(costs)
    print(f"free drafts, every one kept: {best['speedup']:.2f}x plain decoding at T = {best['tokens']} (past "
          f"{best['past']}); of any length: {best['any_length']:.2f}x")
    groups = []
    if args.live:
        groups = group_bounds(_read(args.live, "--live", ("runs", "by_group")), best["speedup"], _goals(args.goal))
        print(f"{'group':28} {'prompts':>7} {'first token':>11} {'plain':>6} {'default':>7} {'bound':>6} "
              f"{'default/plain':>13} {'bound/plain':>11} {'goal':>5} {'decoding x needed':>17}")
        for g in groups:
            goal = f"{g['goal']:5.2f} {g['decoding_speedup_needed']:17.2f}" if "goal" in g else ""
            print(f"{g['group']:28} {g['prompts']:7} {g['first_token_share']:10.0%} {g['plain']:6.1f} {g['default']:7.1f} "
                  f"{g['bound']:6.1f} {g['default_vs_plain']:13.2f} {g['bound_vs_plain']:11.2f} {goal}")
    if args.out:
        args.out.write_text(json.dumps({"model": model, "free_drafts": best, "groups": groups}, indent=1))


def _read(path: Path, option: str, keys: tuple[str, ...], inside: str | None = None) -> dict:
    """The JSON object at ``path`` (or its ``inside`` member) holding ``keys``; SystemExit naming what is wrong."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise SystemExit(f"{option} {path}: cannot be read as JSON ({exc})") from None
    data = data.get(inside, data) if isinstance(data, dict) and inside else data
    missing = [key for key in keys if not isinstance(data, dict) or key not in data]
    if missing:
        expected = "a cost table (tools/replay.py record's, or its 'costs')" if inside else "a tools/bench_peer.py run's JSON"
        raise SystemExit(f"{option} {path}: no {', '.join(missing)}; expected {expected}")
    return data


def _goals(given: list[str]) -> dict[str, float]:
    goals = {}
    for text in given:
        group, _, value = text.partition("=")
        try:
            goals[group] = float(value)
        except ValueError:
            raise SystemExit(f"--goal: got {text!r}; expected GROUP=X, X a number (e.g. spec_bench/rag=1.6)") from None
        if not goals[group] > 1:
            raise SystemExit(f"--goal: got {text!r}; expected a speed-up over plain above 1")
    return goals


if __name__ == "__main__":
    main()
