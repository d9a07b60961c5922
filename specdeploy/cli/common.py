"""What the commands share: the error console, reading a manifest, sizes for people."""

from __future__ import annotations

from pathlib import Path

import click
from rich.console import Console

from ..contract import ContractError, Manifest
from ..runtime.config import max_threads

console = Console(stderr=True)


def speculation_options(k_help: str):
    """--k, --policy, --drafter and --confidence-threshold, as ``generate`` and ``serve`` take them.

    The defaults are the configuration measured fastest in fresh processes and under load (README, The cost
    policy in fresh processes): the cost policy drafting up to 8 tokens, by prompt lookup where the text repeats
    and with the draft model elsewhere. ``GenerationConfig``'s own defaults stay the fixed-K draft model, whose
    cycles are predictable: what tests and experiments build on."""
    from ..runtime.drafters import DRAFTERS
    from ..runtime.policies import POLICIES

    options = [
        click.option("--k", "--num-speculative-tokens", "k", type=int, default=8, show_default=True, help=k_help),
        click.option("--policy", type=click.Choice(list(POLICIES)), default="cost", show_default=True,
                     help="Draft-length policy. cost: the length (0 = plain decoding) with the most tokens per second, "
                          "from measured engine costs and acceptance; fixed: always --k; confidence: up to --k, stopping "
                          "where the draft is unsure; heuristic: transformers' +2 / -1 schedule."),
        click.option("--drafter", type=click.Choice(list(DRAFTERS)), default="hybrid", show_default=True,
                     help="model: the artifact's draft; prompt-lookup: n-gram; hybrid: prompt lookup where the text repeats "
                          "itself, the draft model elsewhere; none: plain target decoding."),
        click.option("--confidence-threshold", type=float, default=0.4, show_default=True,
                     help="--policy confidence: stop drafting once the draft's top probability falls below this."),
    ]

    def apply(command):
        for option in reversed(options):
            command = option(command)
        return command

    return apply


threads_option = click.option(
    "--threads", type=click.IntRange(1, max_threads()), default=None,
    help="Threads of one ONNX Runtime pool that both models share, for the whole process (default: a pool per model "
         "of ONNX Runtime's size, one thread per physical core, whose threads stop spinning when a call ends); at most "
         "4 per core: more only oversubscribe the cores.")


def read_manifest(directory: Path) -> Manifest:
    try:
        return Manifest.read(directory)
    except ContractError as exc:
        raise click.ClickException(str(exc)) from exc


def human(size: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return str(size)
