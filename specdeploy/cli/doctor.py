"""``specdeploy doctor``: check an artifact, or a checkpoint pair before export."""

from __future__ import annotations

import sys
from pathlib import Path

import click
from rich.markup import escape

from .common import CliConsole, provider_options

SHOWN = 20  # problems printed in full; the rest are counted


@click.command()
@click.argument("directory", required=False, type=click.Path(path_type=Path, exists=True, file_okay=False))
@click.option("--target", default=None, help="Check a checkpoint pair before export: the target checkpoint.")
@click.option("--draft", default=None, help="With --target: the draft checkpoint.")
@provider_options(draft=True)
def doctor(directory, target, draft, provider, draft_provider):
    """Check an artifact DIRECTORY (manifest, hashes, tokenizer, pair, capacity, graphs loaded on --provider, the
    draft's on --draft-provider where given), or a checkpoint pair (--target/--draft) before export. Exits 1 on a
    problem, saying what to do."""
    from ..doctor import describe, diagnose, diagnose_pair

    if (directory is None) == (target is None):
        raise click.UsageError("give either DIRECTORY or --target (with optional --draft), not both")
    problems = (diagnose(directory, provider, draft_provider) if directory is not None
                else diagnose_pair(target, draft))
    out = CliConsole()
    if not problems:
        out.print(f"[green]ok[/] {directory or target}: no problem found")
        for line in describe(directory, target, draft):
            out.print(escape(line))
        return
    for what, fix in problems[:SHOWN]:
        out.print(f"[red]problem[/] {escape(what)}\n  [bold]fix:[/] {escape(fix)}")
    if len(problems) > SHOWN:
        out.print(f"[red]… and {len(problems) - SHOWN:,} more problems[/] ({len(problems):,} in all)")
    sys.exit(1)
