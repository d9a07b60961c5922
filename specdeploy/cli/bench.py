"""``specdeploy bench`` and ``specdeploy report``."""

from __future__ import annotations

import json
from pathlib import Path

import click
from rich.progress import Progress
from rich.table import Table

from ..files import FileRefused, open_regular
from ..reports.plots import PLOTS
from .common import CliConsole, provider_options, threads_option

# what bench and report write into --out: only a directory of these is replaced by --force
BENCH_FILES = ("records.jsonl", "summary.json", "report.html", "report.md", *PLOTS)


def _csv(kind):
    def parse(ctx, param, value):
        if value is None:
            return None
        items = [v.strip() for v in value.split(",") if v.strip()]
        try:
            return [kind(v) for v in items]
        except ValueError as exc:
            raise click.BadParameter(f"{value!r}: expected a comma-separated list of {kind.__name__}") from exc
    return parse


@click.command()
@click.argument("directories", nargs=-1, required=True, type=click.Path(path_type=Path, exists=True, file_okay=False))
@click.option("--prompts", "prompts_path", default=None,
              help="Prompt file (.txt, .jsonl with 'prompt', or Spec-Bench .jsonl), or 'humaneval' (all 164; extra 'bench').")
@click.option("--humaneval", "humaneval_count", type=click.IntRange(min=0), default=0, show_default=True,
              help="HumanEval prompts (extra 'bench'), from task --humaneval-from on.")
@click.option("--humaneval-from", type=click.IntRange(min=0), default=0, show_default=True,
              help="The first HumanEval task --humaneval takes.")
@click.option("--specbench", "specbench_count", type=click.IntRange(min=0), default=0, show_default=True,
              help="Spec-Bench prompts (shipped with specdeploy) per group: mt_bench, translation, summarization, qa, "
                   "math_reasoning, rag; reported per group.")
@click.option("--conversations", "conversation_count", type=click.IntRange(min=0), default=0, show_default=True,
              help="Code-edit conversations (shipped with specdeploy; 8, of 3 turns each), as chat prompts through the "
                   "artifact's chat template, each turn after the one before (at --batch-size 1; a larger batch may "
                   "decode a conversation's turns together); reported as conversation/turn_1 and conversation/later_turns.")
@click.option("--structured", "structured_count", type=click.IntRange(min=0), default=0, show_default=True,
              help="Structured-output prompts (shipped with specdeploy; 8): chat prompts asking for JSON records.")
@click.option("--k", "--num-speculative-tokens", "ks", default="0,1,2,4,8", show_default=True, callback=_csv(int),
              help="Draft lengths; 0 is plain target decoding (always run as the baseline).")
@click.option("--policy", "policies", default="fixed", show_default=True, callback=_csv(str),
              help="Comma list of fixed, confidence, heuristic, cost.")
@click.option("--drafter", "drafters", default="model", show_default=True, callback=_csv(str),
              help="Comma list of model, prompt-lookup, hybrid.")
@click.option("--temperature", "temperatures", default="0", show_default=True, callback=_csv(float),
              help="Comma list of temperatures (0: greedy).")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=128, show_default=True, help="Tokens per prompt.")
@click.option("--repeat", type=click.IntRange(min=1), default=1, show_default=True,
              help="Rounds over all prompts; the speedup spread is taken over rounds.")
@click.option("--batch-size", type=click.IntRange(min=1), default=1, show_default=True, help="Prompts decoded together.")
@click.option("--limit", type=click.IntRange(min=1), default=None, help="Use only the first N prompts.")
@threads_option
@provider_options(draft=True)
@click.option("--seed", type=int, default=0, show_default=True, help="Sampling seed.")
@click.option("--out", required=True, type=click.Path(path_type=Path), help="Directory for records.jsonl and summary.json.")
@click.option("--force", is_flag=True, help="Replace an existing --out directory.")
def bench(directories, prompts_path, humaneval_count, humaneval_from, specbench_count, conversation_count,
          structured_count, ks, policies, drafters, temperatures, max_new_tokens, repeat, batch_size, limit, threads,
          provider, draft_provider, seed, out, force):
    """Run the baseline and a grid of configurations on each artifact DIRECTORY in one process, interleaved per
    prompt; record and summarise. With several artifacts, each is also compared with the first."""
    from .. import Pipeline
    from ..contract import ContractError
    from ..engines import ProviderError
    from ..reports.bench import GridError, build_grid, run_bench
    from ..runtime.cache import CapacityError
    from ..runtime.config import ConfigError
    from ..workloads import PromptFileError

    if humaneval_from and not humaneval_count:
        raise click.UsageError("--humaneval-from goes with --humaneval N")
    labels = _labels(directories)
    try:
        grid = build_grid(ks, policies, drafters, temperatures, max_new_tokens, seed, labels)
        prompts = _prompts(prompts_path, humaneval_count, humaneval_from, specbench_count, conversation_count,
                           structured_count)
    except (GridError, PromptFileError, ConfigError) as exc:
        raise click.ClickException(str(exc)) from exc
    prompts = prompts[:limit] if limit else prompts
    written = _bench_output(out, force)
    try:
        pipelines = {label: Pipeline.load(directory, provider=provider, draft_provider=draft_provider, threads=threads)
                     for label, directory in zip(labels, directories)}
        for path in written:  # what an earlier bench (and report) wrote; nothing else is there
            path.unlink()
        out.mkdir(parents=True, exist_ok=True)
        total = repeat * -(-len(prompts) // batch_size) * len(grid)
        with Progress(console=CliConsole(stderr=True), transient=True) as progress:
            task = progress.add_task(f"bench: {len(grid)} configurations x {len(prompts)} prompts x {repeat}", total=total)
            summary = run_bench(pipelines, grid, prompts, out, repeat, batch_size, lambda: progress.advance(task))
    except (ContractError, CapacityError, ProviderError, ValueError) as exc:
        raise click.ClickException(str(exc)) from exc
    segments = sorted(s for s in summary if s != "all") if len(summary) > 2 else []  # one segment: the whole run
    for segment in [*segments, "all"]:
        _print_summary(summary[segment], segment)
    CliConsole(stderr=True).print(f"wrote {out / 'records.jsonl'} and {out / 'summary.json'}; `specdeploy report {out}` plots them")


def _bench_output(out: Path, force: bool) -> list[Path]:
    """The files of an earlier bench run that ``--force`` replaces in ``out``; refused in one line where ``out`` exists
    without ``--force``, or holds anything but bench's (and report's) own files: each with one of their names, and
    a records.jsonl whose first line is a bench record. The directory itself (a symlink's target, the current
    directory) stays."""
    if not (out.exists() or out.is_symlink()):
        return []
    if not force:
        raise click.ClickException(f"{out}: already exists; pass --force to replace it")
    refused = click.ClickException(f"{out}: not a bench output directory (expected only {', '.join(BENCH_FILES)}, as "
                                   "`specdeploy bench` and `report` write them); --force replaces nothing else")
    if not out.is_dir():
        raise refused
    entries = list(out.iterdir())
    if not entries:
        return []
    if any(p.name not in BENCH_FILES or p.is_symlink() or not p.is_file() for p in entries):
        raise refused
    try:
        with open_regular(out / "records.jsonl") as records:
            first = json.loads(records.readline(2**20))
    except (FileRefused, OSError, ValueError, RecursionError):  # missing, a FIFO, not JSON
        raise refused from None
    if not isinstance(first, dict) or first.get("type") not in ("cycle", "run") or "config" not in first:
        raise refused
    return entries


def _labels(directories: tuple[Path, ...]) -> list[str]:
    """Each artifact's name in the grid: its directory's name, with its position where two share one."""
    names = [d.name for d in directories]
    return [name if names.count(name) == 1 else f"{i}:{name}" for i, name in enumerate(names)]


def _prompts(path: str | None, humaneval_count: int, humaneval_from: int, specbench_count: int,
             conversation_count: int = 0, structured_count: int = 0) -> list:
    """The prompt file's prompts (or all of HumanEval's), then the workload --humaneval / --specbench /
    --conversations / --structured ask for, in that order, each prompt segmented by its group (a Spec-Bench group,
    a conversation's first or later turns)."""
    from dataclasses import replace

    from ..workloads import PromptFileError, humaneval, load_prompts, workload

    if path is None and not any((humaneval_count, specbench_count, conversation_count, structured_count)):
        raise PromptFileError("no prompts: give --prompts, --humaneval N, --specbench N, --conversations N or --structured N")
    prompts = [] if path is None else humaneval() if path == "humaneval" else load_prompts(path)
    chosen = workload(humaneval_count, specbench_count, humaneval_from, conversation_count, structured_count)
    return prompts + [replace(prompt, category=group.rsplit("/", 1)[-1]) for group, prompt in chosen]


def _print_summary(summary: dict, segment: str) -> None:
    from ..reports.plots import summary_table

    header, rows = summary_table(summary)
    table = Table(*header, title=f"bench, {segment} (speedup against the baseline measured in the same run)")
    for row in rows:
        table.add_row(*row)
    CliConsole().print(table)


@click.command()
@click.argument("directory", type=click.Path(path_type=Path, exists=True, file_okay=False))
def report(directory):
    """Plot a bench directory: PNGs, report.html (self-contained) and report.md."""
    from ..reports.bench import RecordsError
    from ..reports.plots import write_report

    if not (directory / "summary.json").is_file() or not (directory / "records.jsonl").is_file():
        raise click.ClickException(f"{directory}: no summary.json / records.jsonl; run `specdeploy bench --out {directory}`")
    try:
        written = write_report(directory)
    except (RecordsError, ValueError, KeyError, TypeError, RecursionError) as exc:
        # summary.json and records.jsonl are bench's own output: anything else is a damaged file
        raise click.ClickException(f"{directory}: damaged bench output ({type(exc).__name__}: {exc}); "
                                   "run `specdeploy bench` again") from exc
    for path in written:
        click.echo(path)
