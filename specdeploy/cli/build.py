"""``specdeploy build``: TensorRT plans from an artifact's verify-v1 graphs."""

from __future__ import annotations

from pathlib import Path

import click

from .common import CliConsole


@click.command()
@click.argument("directory", type=click.Path(path_type=Path, exists=True, file_okay=False))
@click.option("--trt", is_flag=True, required=True, help="Build TensorRT plans (tensorrt or tensorrt_rtx).")
@click.option("--fp16", "precision", flag_value="fp16", help="fp16 precision (TensorRT-RTX: the graph must be fp16).")
@click.option("--bf16", "precision", flag_value="bf16", help="bf16 precision.")
@click.option("--max-batch", type=click.IntRange(min=1), default=1, show_default=True, help="Largest batch the plans take.")
@click.option("--max-draft", type=click.IntRange(min=0), default=8, show_default=True,
              help="Largest draft length K: verify calls carry up to K + 1 tokens.")
@click.option("--capacity", type=click.IntRange(min=2), default=None, help="Largest cache capacity (default: exported).")
@click.option("--opt-capacity", type=click.IntRange(min=1), default=None,
              help="Capacity the kernels are tuned for (default: half of --capacity).")
def build(directory, trt, precision, max_batch, max_draft, capacity, opt_capacity):
    """Build TensorRT engines next to the ONNX graphs and record the build facts in the manifest."""
    from ..contract import ContractError
    from ..engines.trt_build import BuildError, build_engines

    console = CliConsole(stderr=True)
    try:
        manifest = build_engines(directory, max_batch, max_draft, capacity, opt_capacity, precision or "auto",
                                 log=console.log)
    except (BuildError, ContractError) as exc:
        raise click.ClickException(str(exc)) from exc
    for role, entry in manifest.engines.items():
        console.print(f"[green]built[/] {role}: {entry['file']} ({entry['module']} {entry['tensorrt_version']}, "
                      f"{entry['gpu']}, profiles {', '.join(p['name'] for p in entry['profiles'])})")
