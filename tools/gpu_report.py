"""The printed lines and the results files of tools/gpu_check.py (imported by it)."""

from __future__ import annotations

import json
from pathlib import Path


def write_results(report: dict, folder: Path, commit: str) -> Path:
    """The report as ``folder/<gpu>-<commit>.json`` and a one-screen summary beside it (.md), naming the GPU, its driver
    and the commit."""
    env = report["environment"]
    found = env.get("gpu", "")
    gpu, driver = (found.split(", ") + ["?", "?"])[:2] if found and not found.startswith("nvidia-smi") else ("no GPU", "-")
    stem = f"{gpu.replace(' ', '-').lower()}-{commit[:12] or 'unknown'}"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{stem}.json").write_text(json.dumps({"commit": commit, **report}, indent=1, default=str))
    lines = [f"# GPU check: {gpu}, driver {driver}, commit {commit or 'unknown'}", "",
             f"onnxruntime {env['onnxruntime']} ({env['available_providers'][0]}), numpy {env['numpy']}, "
             f"{report['seconds']:.0f} s; command: tools/gpu_check.py (its docstring)", ""]
    lines += ["| shape | mode | T1 ms | T5 ms | T9 ms |", "|---|---|---|---|---|"]
    for source, records in (("ours", report["big"]), ("peer", report["peer"])):
        for name, record in records.items():
            for mode in ("plain", "cuda graphs"):
                timing = record.get(mode, {})
                timing = timing.get("latency", timing)
                if all(f"T{t}" in timing for t in (1, 5, 9)):
                    lines.append(f"| {source} {name} | {mode} | " + " | ".join(f"{timing[f'T{t}']['median_ms']:.3f}"
                                                                        for t in (1, 5, 9)) + " |")
    lines += ["", "| artifact | section | case | equal | diverged (prompt@position margin) | acc | reused |",
              "|---|---|---|---|---|---|---|"]
    records = dict(report["artifacts"]) | ({"imported genai": report["imported"]} if report.get("imported") else {})
    for name, record in records.items():
        if "skipped" in record or "refused" in record:
            lines.append(f"| {name} | - | {record.get('skipped') or 'refused: ' + record['refused'][:80]} | | | | |")
        for section in ("exactness", "prefix", "exact"):
            cases = record.get(section, {})
            if any(key in cases for key in ("error", "skipped", "refused")):  # the section as a whole
                lines.append(f"| {name} | {section} | - | " + _case_cells(cases) + " |")
                continue
            for case, r in cases.items():
                if isinstance(r, dict):  # a case (the prefix section's counts are in the JSON)
                    lines.append(f"| {name} | {section} | {case} | " + _case_cells(r) + " |")
        rolled = record.get("rollback", {})
        if rolled.get("lengths"):
            worst = max(rolled["lengths"], key=lambda c: c["max_abs_diff"] / max(c["one_behind_diff"], 1e-30))
            same = sum(c["argmax"][0] == c["argmax"][1] for c in rolled["lengths"])
            lines.append(f"| {name} | rollback | lengths {rolled['lengths'][0]['length']}-{rolled['lengths'][-1]['length']}"
                         f" | {same}/{len(rolled['lengths'])} | worst {worst['max_abs_diff']:.2g} (one behind "
                         f"{worst['one_behind_diff']:.2g}) | | |")
    for name, pair in report["pairs"].items():
        speedups = pair.get("replay", {}).get("speedup_over_plain", {})
        lines.append(f"\n{name}: cycle bytes {pair.get('cycle_bytes')}; replayed speedup over plain {speedups}")
    (folder / f"{stem}.md").write_text("\n".join(lines) + "\n")
    return folder / f"{stem}.json"


def _case_cells(r) -> str:
    """A decoding case's cells: equal of, divergences with margins, mean accepted length, prompt tokens reused."""
    if not isinstance(r, dict):
        return f"{r} | | |"
    if "error" in r or "skipped" in r or "refused" in r:
        what = "ERROR " + r["error"][:80] if "error" in r else r.get("skipped") or "refused: " + r["refused"][:80]
        return f"{what} | | |"
    if "equal" not in r:
        return " | | |"
    diverged = " ".join(f"p{d['prompt']}@{d.get('position')} {d.get('margin', float('nan')):.3g}" for d in r["diverged"])
    return (f"{r['equal']}/{r['of']} | {diverged or '-'} | {r.get('mean_accepted_length', '-')} | "
            f"{r.get('cached_prompt_tokens', '-')}")


def print_environment(env: dict) -> None:
    modules = " ".join(f"{m}={'y' if ok else 'n'}" for m, ok in env["modules"].items())
    print(f"python {env['python']} {env['machine']} | numpy {env['numpy']} | onnx {env['onnx']} (IR {env['onnx_ir_version']}) | "
          f"onnxruntime {env['onnxruntime']} {env['ort_device']} {env['available_providers']}")
    print(f"gpu: {env['gpu'] or '-'} | preload_dlls: {env.get('preload_dlls', '-')} | probe session: "
          f"{env['probe_session_providers']} | vendored: {env['vendored'] or '-'} | {modules}")


def print_skipped(name: str, record: dict) -> None:
    print(f"== {name}: SKIPPED ({record['skipped']})")


def _cases(title: str, cases: dict) -> None:
    """One line of a decoding section's cases: equal of, margins where they part, acceptance, reused tokens."""
    if not cases:
        return
    if "error" in cases or "skipped" in cases or "refused" in cases:
        what = "ERROR " + str(cases["error"])[:200] if "error" in cases else cases.get("skipped") or cases["refused"][:200]
        print(f"  {title}: {what}")
        return
    texts = []
    for case, r in cases.items():
        if not isinstance(r, dict):
            texts.append(f"{case}: {r}")
            continue
        if "error" in r or "skipped" in r:
            texts.append(f"{case}: {'ERROR ' + r['error'][:160] if 'error' in r else 'SKIPPED ' + r['skipped']}")
            continue
        if "equal" not in r:
            continue
        text = f"{case}: {r['equal']}/{r['of']}"
        if "mean_accepted_length" in r:
            text += f" (acc {r['mean_accepted_length']:.2f}, cycles {r.get('cycles')})"
        if "cached_prompt_tokens" in r:
            text += f" (reused {r['cached_prompt_tokens']} prompt tokens)"
        text += "".join(f" [p{d['prompt']}@{d.get('position')} margin {d.get('margin', float('nan')):.3g}]"
                        for d in r["diverged"])
        texts.append(text + (f" row errors: {r['row_errors']}" if "row_errors" in r else ""))
    print(f"  {title}: " + " | ".join(texts))


def print_imported(record: dict) -> None:
    if "skipped" in record:
        print_skipped("imported genai", record)
        return
    load = record.get("load")
    print(f"== imported genai ({record.get('folder')}): " + (f"load FAILED {load.get('error')}" if load else
                                                            f"{record.get('manifest')}, loaded in {record.get('load_s')} s"))
    for section in ("exactness", "prefix", "exact"):
        _cases(section, record.get(section, {}))
    for kind, timings in record.get("latency", {}).items():
        if isinstance(timings, dict):
            print(f"  {kind} ms: " + _timings(timings))


def print_artifact(name: str, record: dict) -> None:
    load = record.get("load", {})
    print(f"== {name}: " + "; ".join(f"{v['provider']} via {v['via']} {v['seconds']:.1f} s" if "via" in v else
                                      f"{side} load FAILED {v.get('error')}" for side, v in load.items())
          + (f" | IR lowered ({record['ir_lowered']})" if "ir_lowered" in record else ""))
    _cases("exactness", record.get("exactness", {}))
    _cases("prefix reuse", record.get("prefix", {}))
    _cases("exact mode", record.get("exact", {}))
    _rollback(record.get("rollback", {}))
    if record.get("costs"):
        print(f"  measured costs (batch, tokens, s): {record['costs']}")
    place = record.get("placement", {})
    if "error" in place:
        print(f"  nodes: ERROR {place['error'][:200]}")
    elif place:
        print(f"  nodes ({place['graph_nodes']} in the graph): " + "; ".join(
            f"{p.replace('ExecutionProvider', '')} {place['nodes_per_provider'][p]} "
            f"{' '.join(f'{op}:{n}' for op, n in ops.items())}" for p, ops in place["ops_per_provider"].items())
              + f" | copies inside a call: {place.get('copies_inside', '-')}")
    cache = record.get("cache", {})
    if "error" in cache:
        print(f"  cache: ERROR {cache['error'][:200]}")
    elif cache:
        print(f"  cache: {cache['buffer']} on_host={cache['on_host']} memory={cache['memory']} | "
              f"vs cpu: logits {cache['logits_max_abs_diff']:.2g} (of {cache['logits_max_abs']:.2g}), "
              f"cache {cache['cache_max_abs_diff']:.2g}, new slots written={cache['new_slots_written']}, "
              f"beyond valid: nonzero {cache['beyond_valid_nonzero']:.2f} finite={cache['beyond_valid_finite']}"
              + (f" | states {cache['states_max_abs_diff']} (of {cache['states_max_abs']})" if "states_max_abs" in cache
                 else ""))
    if "refused" in record:
        print(f"  refused: {record['refused'][:300]}")
    for kind, timings in record.get("latency", {}).items():
        if isinstance(timings, dict):
            print(f"  {kind} ms: " + _timings(timings))
    if record.get("seconds"):
        print(f"  seconds per part: {record['seconds']}")


def _rollback(record: dict) -> None:
    """One line: each length a verification was rolled back to, its logits' distance from a fresh prefill's (and from
    the one a position shorter), the argmax on both sides and the margin where they part."""
    if not record:
        return
    if "error" in record or "skipped" in record:
        print(f"  rollback: {'ERROR ' + record['error'][:200] if 'error' in record else record['skipped']}")
        return
    print(f"  rollback (k {record['k']} after {record['past']}): " + " | ".join(
        f"{c['length']}: {c['max_abs_diff']:.2g} (one behind {c['one_behind_diff']:.2g}) argmax {c['argmax'][0]}"
        + ("" if c["argmax"][0] == c["argmax"][1] else f"/{c['argmax'][1]} margin {c['margin']:.3g}")
        for c in record["lengths"]))


def _timings(timings: dict) -> str:
    if "error" in timings:
        return f"ERROR {timings['error'][:200]}"
    return " | ".join(f"{t} median {v['median_ms']:.3f} p90 {v['p90_ms']:.3f}"
                      + (f" (engine {v['engine_seconds_median_ms']:.3f}; bytes in {v['to_device_bytes']}, "
                         f"out {v['to_host_bytes']})" if "engine_seconds_median_ms" in v else "")
                      for t, v in timings.items() if isinstance(v, dict))


def print_big(name: str, record: dict) -> None:
    if "error" in record or "skipped" in record:
        print(f"== big {name}: {record.get('error') or record.get('skipped')}")
        return
    print(f"== big {name}: wrote {record['bytes'] / 1e9:.2f} GB in {record['write_s']} s; logits max {record.get('logits_max_abs')}"
          f", CUDA graphs vs plain {record.get('graphs_vs_plain_max_abs_diff', '-')}")
    for mode in ("plain", "cuda graphs"):
        if mode in record:
            entry = record[mode]
            print(f"  {mode} ms (past {record['past']}, capacity {record['capacity']}; session {entry.get('session_s')} s, "
                  f"captures {entry.get('captures')}): " + _timings(entry.get("latency", entry)))


def print_pair(name: str, pair: dict) -> None:
    replayed = pair.get("replay", {})
    print(f"== pair {name}: cycle bytes {pair.get('cycle_bytes')} | replayed tokens/s {replayed.get('tokens_per_s')} "
          f"| speedup over plain {replayed.get('speedup_over_plain', replayed.get('error'))}")


def print_peer(name: str, record: dict) -> None:
    if "error" in record or "skipped" in record:
        print(f"== peer {name}: {record.get('error') or record.get('skipped')}")
        return
    print(f"== peer {name}: built in {record['build_s']} s")
    for mode in ("plain", "cuda graphs"):
        if mode in record:
            print(f"  {mode} ms (past {record['past']}, capacity {record['capacity']}): " + _timings(record[mode]))
