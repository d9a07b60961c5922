"""The ``specdeploy`` command: thin; it parses, calls the library and prints."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

from . import __version__
from .contract import ContractError, Manifest

console = Console(stderr=True)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="specdeploy")
def main():
    """Deploy speculative decoding: export draft/target pairs to ONNX and run them."""


@main.command()
@click.option("--target", required=True, help="Target checkpoint: a HF model dir (safetensors), a .gguf file or a hub id.")
@click.option("--draft", default=None, help="Draft checkpoint (same forms as --target); must share the target's tokenizer.")
@click.option("--out", required=True, type=click.Path(path_type=Path), help="Artifact dir to write.")
@click.option("--dtype", type=click.Choice(["float32", "float16"]), default="float32", show_default=True,
              help="Weight and KV-cache dtype.")
@click.option("--weights", type=click.Choice(["full", "int4", "int8"]), default="full", show_default=True,
              help="int4: 4-bit block-wise MatMul weights (ONNX Runtime's MatMulNBits); int8: per-channel int8 "
                   "weights, activations quantized per row (ONNX Runtime's dynamic quantizer, rewritten per row).")
@click.option("--draft-weights", type=click.Choice(["full", "int4", "int8"]), default=None,
              help="Weight format of the draft (default: same as --weights).")
@click.option("--capacity", type=click.IntRange(min=2), default=2048, show_default=True,
              help="Maximum cache slots (prompt + new tokens + draft length + 1) a request may use.")
@click.option("--block-size", type=click.Choice(["16", "32", "64", "128", "256"]), default="32", show_default=True,
              help="int4: weights per quantization block (larger: faster decode, coarser weights).")
@click.option("--accuracy-level", type=click.IntRange(0, 4), default=4, show_default=True,
              help="int4: MatMulNBits compute type (4: int8 activations, fastest on CPU; 0: fp32).")
@click.option("--force", is_flag=True, help="Replace an existing output dir.")
def export(target, draft, out, dtype, weights, draft_weights, capacity, block_size, accuracy_level, force):
    """Export Hugging Face causal LMs to verify-v1 ONNX graphs plus a manifest."""
    from .exporter import ExportError, export_artifact

    try:
        with console.status("exporting") as status:
            def progress(step):
                console.log(step)
                status.update(step)

            manifest = export_artifact(target, out, draft=draft, dtype=dtype, weights=weights, capacity=capacity,
                                       force=force, draft_weights=draft_weights, progress=progress,
                                       block_size=int(block_size), accuracy_level=accuracy_level)
    except (ExportError, ContractError) as exc:
        raise click.ClickException(str(exc)) from exc
    console.print(f"[green]exported[/] {', '.join(manifest.models)} to {out}")


def _read_manifest(directory: Path) -> Manifest:
    try:
        return Manifest.read(directory)
    except ContractError as exc:
        raise click.ClickException(str(exc)) from exc


@main.command()
@click.argument("directory", type=click.Path(path_type=Path, exists=True, file_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print the manifest and file sizes as JSON.")
def inspect(directory, as_json):
    """Show an artifact's contract, tensors, sizes and files."""
    manifest = _read_manifest(directory)
    sizes = {name: (directory / name).stat().st_size if (directory / name).exists() else None
             for name in manifest.files}
    if as_json:
        data = json.loads(manifest.to_json())
        data["file_sizes"] = sizes
        for role, spec in manifest.models.items():
            data["models"][role]["inputs"] = spec.inputs
            data["models"][role]["outputs"] = spec.outputs
        click.echo(json.dumps(data, indent=2))
        return
    out = Console()
    out.print(f"[bold]{directory}[/]  contract {manifest.contract}, exporter {manifest.exporter_version}, opset {manifest.opset}")
    models = Table("role", "architecture", "params", "layers", "heads / kv", "head dim", "vocab", "dtype", "weights",
                   "capacity", title="models")
    for spec in manifest.models.values():
        models.add_row(spec.role, spec.architecture, f"{spec.parameters / 1e6:.1f}M", str(spec.num_layers),
                       f"{spec.num_heads} / {spec.kv_heads}", str(spec.head_dim), str(spec.vocab_size), spec.dtype,
                       spec.weights, str(spec.capacity))
    out.print(models)
    tensors = Table("tensor", "dtype", "shape", title="verify-v1 tensors (per model; i = layer)")
    spec = manifest.target
    tensors.add_row("input_ids", "int64", "[batch, tokens]")
    tensors.add_row("past_len", "int64", "[batch]")
    tensors.add_row("cache_key.{i} / cache_value.{i}", spec.dtype, "[batch, kv_heads, capacity, head_dim]")
    tensors.add_row("logits", "float32", "[batch, tokens, vocab]")
    tensors.add_row("new_key.{i} / new_value.{i}", spec.dtype, "[batch, kv_heads, tokens, head_dim]")
    out.print(tensors)
    files = Table("file", "size", "sha256", title="files")
    for name, digest in sorted(manifest.files.items()):
        size = sizes[name]
        files.add_row(name, "missing" if size is None else _human(size), digest[:16] + "…")
    out.print(files)


def _human(size: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return str(size)


@main.command()
@click.argument("directory", required=False, type=click.Path(path_type=Path, exists=True, file_okay=False))
@click.option("--target", default=None, help="Check a checkpoint pair before export: the target checkpoint.")
@click.option("--draft", default=None, help="With --target: the draft checkpoint.")
def doctor(directory, target, draft):
    """Check an artifact DIRECTORY (manifest, hashes, tokenizer, pair, capacity, graphs), or a checkpoint pair
    (--target/--draft) before export. Exits 1 on a problem, saying what to do."""
    from .doctor import diagnose, diagnose_pair

    if (directory is None) == (target is None):
        raise click.UsageError("give either DIRECTORY or --target (with optional --draft), not both")
    problems = diagnose(directory) if directory is not None else diagnose_pair(target, draft)
    out = Console()
    if not problems:
        out.print(f"[green]ok[/] {directory or target}: no problem found")
        return
    for what, fix in problems:
        out.print(f"[red]problem[/] {what}\n  [bold]fix:[/] {fix}")
    sys.exit(1)


from .cli_bench import bench, report  # noqa: E402
from .cli_build import build  # noqa: E402
from .cli_generate import generate  # noqa: E402

for command in (generate, bench, report, build):
    main.add_command(command)


if __name__ == "__main__":
    main()
