"""Token rates of one pair on several providers in one process: each side an artifact with its target on one execution
provider and its draft on the same one or another, every side's plain decoding and default speculation interleaved
prompt by prompt (``reports.bench.run_bench``: the order turning each prompt), so that drift on a shared machine hits
them alike.

    python -m tools.bench_provider_rates --side cpu=FUSED@cpu --side ov=OPENVINO@openvino \
        --side ov+cpu=OPENVINO@openvino+cpu [--humaneval 8] [--specbench 1] [--max-new-tokens 64] [--threads 2] \
        --out DIR

A side is ``LABEL=DIR@PROVIDER[+DRAFT_PROVIDER]`` (a provider: a word, or ``openvino:DEVICE:PRECISION``). Sides that
run the same target graph on the same provider share its session, and the plain decoding of the first of them is every
one's baseline (plain decoding never calls a draft). The first side's plain decoding is the reference every side is
also compared with. Writes DIR/records.jsonl and DIR/summary.json (as ``specdeploy bench`` does; ``specdeploy report
DIR`` plots them) and prints each setting's tokens per second, its speedup over its own plain decoding and over the
reference, and how many of its outputs were its plain decoding's token for token; then each setting's target calls by
their token count T, apart after a call of the same T and after another (``calls_by_shape``).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
from collections import defaultdict
from pathlib import Path

from tools.arguments import integer, parser


def side(text: str) -> tuple[str, Path, str, str | None]:
    """LABEL=DIR@PROVIDER[+DRAFT_PROVIDER] -> (label, artifact dir, provider text, draft provider text or None)."""
    label, sep, rest = text.partition("=")
    directory, at, providers = rest.rpartition("@")
    if not sep or not at or not label or not directory or not providers:
        raise argparse.ArgumentTypeError(f"got {text!r}; expected LABEL=DIR@PROVIDER[+DRAFT_PROVIDER]")
    if not (Path(directory) / "manifest.json").is_file():
        raise argparse.ArgumentTypeError(f"{directory}: no manifest.json; expected an artifact dir")
    provider, _, draft = providers.partition("+")
    return label, Path(directory), provider, draft or None


def pipelines(sides, threads: int) -> tuple[dict, dict]:
    """({label: Pipeline}, {label: the label whose plain decoding is its baseline}). One session per (graph file,
    provider): sides that share a target graph and its provider share its engine, and the first of them plain-decodes
    for all."""
    from specdeploy import Pipeline
    from specdeploy.contract import Manifest, read_tokenizer, verify_files
    from specdeploy.engines import load_engine
    from specdeploy.runtime.artifact import chat_template
    from tools.bench_providers import provider_of

    engines, out, plain_of, first_with = {}, {}, {}, {}
    for label, directory, target_provider, draft_provider in sides:
        manifest = Manifest.read(directory)
        problems = verify_files(directory, manifest, remembered=True)
        if problems:
            raise SystemExit(f"{directory}: artifact files do not match the manifest: {problems[0]}")
        loaded = {}
        for role, text in (("target", target_provider), ("draft", draft_provider or target_provider)):
            if role not in manifest.models:
                continue
            provider = provider_of(text)
            spec = manifest.models[role]
            key = (role, manifest.files[spec.file], provider.key)  # the graph's digest: a copy shares the session
            if key not in engines:
                engines[key] = load_engine(directory, manifest, role, provider, threads)
            loaded[role] = engines[key]
        tokenizer = read_tokenizer(directory / manifest.tokenizer)
        out[label] = Pipeline(manifest, tokenizer, loaded["target"], loaded.get("draft"), directory,
                              chat_template=chat_template(directory, manifest, tokenizer))
        target_key = next(key for key, engine in engines.items() if engine is loaded["target"])
        plain_of[label] = first_with.setdefault(target_key, label)
    return out, plain_of


def grid(labels: list[str], plain_of: dict, config) -> list:
    """Plain decoding of each side that owns its target's session, and ``config`` (the default speculation) on every
    side, named "LABEL | plain" and "LABEL | default"; the first side's plain decoding is the reference."""
    from dataclasses import replace

    from specdeploy.reports.bench import Setting

    reference = f"{labels[0]} | plain"
    settings = []
    for label in labels:
        baseline = f"{plain_of[label]} | plain"
        if plain_of[label] == label:
            settings.append(Setting(baseline, replace(config, drafter="none"), baseline, label, reference))
        settings.append(Setting(f"{label} | default", config, baseline, label, reference))
    return settings


def main() -> None:
    options = parser(__doc__)
    options.add_argument("--side", type=side, action="append", required=True,
                         help="LABEL=DIR@PROVIDER[+DRAFT_PROVIDER] (repeatable; the first is the reference)")
    options.add_argument("--humaneval", type=integer(0), default=8, help="HumanEval prompts 0 .. N - 1")
    options.add_argument("--specbench", type=integer(0), default=1, help="Spec-Bench's first N questions of each group")
    options.add_argument("--max-new-tokens", type=integer(1), default=64)
    options.add_argument("--repeat", type=integer(1), default=1)
    options.add_argument("--threads", type=integer(1), default=2)
    options.add_argument("--out", type=Path, required=True)
    args = options.parse_args()
    labels = [label for label, *_ in args.side]
    if len(set(labels)) < len(labels):
        options.error(f"--side: labels {labels}; expected each once")

    import onnxruntime

    from specdeploy import GenerationConfig
    from specdeploy.reports.bench import run_bench
    from specdeploy.workloads import workload

    prompts = [replace_category(prompt, group) for group, prompt in workload(args.humaneval, args.specbench)]
    loaded, plain_of = pipelines(args.side, args.threads)
    settings = grid(labels, plain_of, GenerationConfig(max_new_tokens=args.max_new_tokens, temperature=0.0, seed=0))
    args.out.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()
    print(f"{len(settings)} settings x {len(prompts)} prompts x {args.repeat}, {args.threads} threads, onnxruntime "
          f"{onnxruntime.__version__}; load {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}; "
          f"{platform.processor() or platform.machine()}", flush=True)
    summary = run_bench(loaded, settings, prompts, args.out, args.repeat)
    after = os.getloadavg()
    for segment in ["all", *sorted(s for s in summary if s != "all")]:
        print(f"\n{segment}")
        for name, entry in summary[segment].items():
            against = entry.get("speedup_vs_reference_median")
            print(f"  {name:<24} {entry['tokens_per_s']:7.2f} tok/s  x{entry['speedup_median']:.2f} own plain"
                  + ("" if against is None else f"  x{against:.2f} reference")
                  + ("" if entry["identical_to_baseline"] is None else
                     f"  identical {entry['identical_to_baseline']}/{entry['runs']}"))
    print("\nTarget calls by tokens T, median ms: after a call of the same T in the request, after another T")
    for line in calls_by_shape(args.out / "records.jsonl"):
        print(line)
    print(f"\nload after: {after[0]:.1f} {after[1]:.1f} {after[2]:.1f}")


def calls_by_shape(records: Path, most_tokens: int = 5) -> list[str]:
    """Per setting, the median seconds of its target calls of T = 1 .. ``most_tokens`` tokens, apart where the
    request's previous call had the same T and where it had another: a provider that prepares each new input shape
    (OpenVINO) pays for a change of T at every call that makes one, which a table of costs by T alone averages away."""
    from specdeploy.reports.bench import read_records

    seconds, previous = defaultdict(list), {}
    for record in read_records(records):
        if record["type"] != "cycle":
            continue
        request, tokens = (record["config"], record["request_id"]), record["drafted"] + 1
        if request in previous:
            seconds[(record["config"], tokens, previous[request] == tokens)].append(record["verify_s"])
        previous[request] = tokens
    lines = []
    for config in dict.fromkeys(config for config, _, _ in seconds):
        cells = []
        for tokens in range(1, most_tokens + 1):
            same, changed = seconds.get((config, tokens, True)), seconds.get((config, tokens, False))
            if same or changed:
                cells.append(f"T={tokens}: " + " / ".join("-" if not calls else
                                                         f"{statistics.median(calls) * 1e3:.1f} (n {len(calls)})"
                                                         for calls in (same, changed)))
        lines.append(f"  {config:<24} " + "   ".join(cells))
    return lines


def replace_category(prompt, group: str):
    """The prompt segmented by its workload group's last part (a Spec-Bench group), as ``specdeploy bench`` does."""
    from dataclasses import replace

    return replace(prompt, category=group.rsplit("/", 1)[-1])


if __name__ == "__main__":
    main()
