"""``specdeploy import``: an onnxruntime-genai model folder or an optimum export to an artifact, graphs as they are.

A command of its own beside ``export``: an export builds graphs from weights and takes options for how (dtype, weight
format, graph form, int4 blocks); an import builds nothing, and none of those options would mean anything to it.
"""

from __future__ import annotations

from pathlib import Path

import click

from ..contract import ContractError
from .common import console


@click.command(name="import")
@click.argument("source", type=click.Path(path_type=Path))
@click.option("--out", required=True, type=click.Path(path_type=Path), help="Artifact dir to write.")
@click.option("--draft", default=None, type=click.Path(path_type=Path),
              help="A draft model folder (either kind); must share the target's tokenizer.")
@click.option("--capacity", type=click.IntRange(min=2), default=None,
              help="Maximum cache slots (prompt + new tokens + draft length + 1) a request may use "
                   "[default: the folders' context length, at most 2048].")
@click.option("--force", is_flag=True, help="Replace an existing output dir.")
def import_(source, out, draft, capacity, force):
    """Import SOURCE, an onnxruntime-genai model folder (genai_config.json) or an optimum export (config.json beside
    model.onnx), to an artifact the runtime drives as it drives exported ones."""
    from ..importer import ImportRefused, import_artifact

    try:
        manifest = import_artifact(source, out, draft=draft, capacity=capacity, force=force, progress=console.log)
    except (ImportRefused, ContractError) as exc:
        raise click.ClickException(str(exc)) from exc
    except OSError as exc:
        raise click.ClickException(f"{exc.filename or out}: {exc.strerror or exc}; nothing was written to {out}") from exc
    kinds = ", ".join(f"{role} ({spec.imported.source}, {spec.weights})" for role, spec in manifest.models.items())
    console.print(f"[green]imported[/] {kinds} to {out}")
