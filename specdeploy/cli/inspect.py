"""``specdeploy inspect``: an artifact's contract, tensors, sizes and files."""

from __future__ import annotations

import json
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table
from rich.text import Text

from ..files import FileRefused, regular_size
from ..reports.graph import graph_summary
from .common import human, read_manifest

SHOWN_FILES = 50  # rows of the files table; --json lists them all


@click.command()
@click.argument("directory", type=click.Path(path_type=Path, exists=True, file_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print the manifest, file sizes and graph summaries as JSON.")
def inspect(directory, as_json):
    """Show an artifact's contract, tensors, graphs (nodes, nodes per layer, op counts), sizes and files."""
    manifest = read_manifest(directory)
    sizes, unreadable = {}, {}  # name -> bytes of each regular file; name -> why it is not one (missing, a FIFO, ...)
    for name in manifest.files:
        try:
            sizes[name] = regular_size(directory / name)
        except FileRefused as exc:
            sizes[name], unreadable[name] = None, str(exc).removeprefix(f"{directory / name}: ")
    graphs = {}
    for role, spec in manifest.models.items():
        if sizes.get(spec.file) is not None:
            try:
                graphs[role] = graph_summary(directory / spec.file)
            except Exception as exc:  # onnx's own errors for a truncated or foreign file; FileRefused if swapped
                unreadable[spec.file] = f"not a readable ONNX graph ({type(exc).__name__})"
    if as_json:
        data = json.loads(manifest.to_json())
        data["file_sizes"] = sizes
        data["unreadable_files"] = unreadable
        data["graphs"] = graphs
        for role, spec in manifest.models.items():
            data["models"][role]["inputs"] = spec.inputs
            data["models"][role]["outputs"] = spec.outputs
        click.echo(json.dumps(data, indent=2))
        return
    out = Console()
    out.print(f"[bold]{directory}[/]  contract {manifest.contract}, exporter {manifest.exporter_version}, opset {manifest.opset}")
    models = Table("role", "architecture", "params", "layers", "heads / kv", "head dim", "vocab", "dtype", "weights",
                   "capacity", "graph", title="models")
    for spec in manifest.models.values():
        models.add_row(spec.role, spec.architecture, f"{spec.parameters / 1e6:.1f}M", str(spec.num_layers),
                       f"{spec.num_heads} / {spec.kv_heads}", str(spec.head_dim),
                       str(spec.vocab_size) + (f" (scores {spec.vocab_kept})" if spec.vocab_kept else ""), spec.dtype,
                       spec.weights, str(spec.capacity), spec.graph)
    out.print(models)
    tensors = Table("tensor", "dtype", "shape", title="verify-v1 tensors (per model; i = layer)")
    spec = manifest.target
    rows = [("input_ids", "int64", "[batch, tokens]"), ("past_len", "int64", "[batch]"),
            ("cache_key.{i} / cache_value.{i}", spec.dtype, "[batch, kv_heads, capacity, head_dim]")]
    if any(model.trims_logits for model in manifest.models.values()):  # exporter 0.3.2's fused graphs
        rows += [("num_logits", "int64", "[1] (logits of each row's last num_logits tokens only)"),
                 ("logits", "float32", "[batch, min(tokens, num_logits), vocab]")]
    else:
        rows.append(("logits", "float32", "[batch, tokens, vocab]"))
    for graph in sorted({model.graph for model in manifest.models.values()}):
        if graph == "fused":  # the cache itself: bound to the input buffers, the new K/V written at past_len ..
            rows.append(("present_key.{i} / present_value.{i}", spec.dtype,
                         "[batch, kv_heads, capacity, head_dim] (= the cache, written in place)"))
        else:
            rows.append(("new_key.{i} / new_value.{i}", spec.dtype, "[batch, kv_heads, tokens, head_dim]"))
    for row in rows:  # as Text: rich would take "[batch, tokens]" for markup and print nothing
        tensors.add_row(*map(Text, row))
    out.print(tensors)
    table = Table("role", "nodes", "per layer", "most frequent ops",
                  title="graphs, as stored (ONNX Runtime fuses some at load; each node is a dispatch)")
    for role, summary in graphs.items():
        per_layer = summary["nodes_per_layer"]
        ops = ", ".join(f"{op} {count}" for op, count in list(summary["ops"].items())[:6])
        table.add_row(role, str(summary["nodes"]), "-" if per_layer is None else f"{per_layer:g}", ops)
    out.print(table)
    files = Table("file", "size", "sha256", title="files")
    listed = sorted(manifest.files.items())
    for name, digest in listed[:SHOWN_FILES]:
        size = sizes[name]
        files.add_row(Text(name), Text(unreadable.get(name, "?")) if size is None else human(size), digest[:16] + "…")
    if len(listed) > SHOWN_FILES:
        files.add_row(f"… and {len(listed) - SHOWN_FILES:,} more", "", "")
    out.print(files)
