"""``specdeploy inspect``: an artifact's contract, tensors, sizes and files."""

from __future__ import annotations

import json
import os
from pathlib import Path

import click
from rich.table import Table
from rich.text import Text

from ..doctor import described
from ..files import FileRefused, open_regular
from ..reports.graph import graph_summary
from ..values import short
from .common import CliConsole, human, provider_options, read_manifest

SHOWN_FILES = 50  # rows of the files table; --json lists them all
SHOWN_UNREADABLE = 20  # files that cannot be read, named on stderr; the rest are counted


@click.command()
@click.argument("directory", type=click.Path(path_type=Path, exists=True, file_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print the manifest, file sizes and graph summaries as JSON.")
@provider_options(default=None)
def inspect(directory, as_json, provider):
    """Show an artifact's contract, tensors, graphs (nodes, nodes per layer, op counts), sizes and files. A file the
    manifest lists that cannot be read (missing, permissions, not a graph) is named with the reason, in its table
    rows and once more at the end (--json: ``unreadable_files``); ``doctor`` checks the artifact. With --provider,
    also where ONNX Runtime places each graph's nodes on that provider (each graph is loaded on it: seconds for a
    large model)."""
    manifest = read_manifest(directory)
    sizes, unreadable = {}, {}  # name -> bytes of each regular file; name -> why it cannot be read
    for name in manifest.files:
        try:
            sizes[name] = _readable_size(directory / name)
        except FileRefused as exc:
            sizes[name], unreadable[name] = None, exc.reason
    graphs = {}
    for role, spec in manifest.models.items():
        if spec.file not in unreadable:
            try:
                graphs[role] = graph_summary(directory / spec.file)
            except Exception as exc:  # onnx's own errors for a truncated or foreign file; FileRefused if swapped
                unreadable[spec.file] = f"not a readable ONNX graph ({type(exc).__name__}: {short(str(exc), 120, quoted=False)})"
    placements = _placements(directory, manifest, provider, unreadable) if provider is not None else None
    if as_json:
        data = json.loads(manifest.to_json())
        data["file_sizes"] = sizes
        data["unreadable_files"] = unreadable
        data["graphs"] = graphs
        if placements is not None:
            data["placement"] = {"provider": provider.key, "models": placements}
        for role, spec in manifest.models.items():
            data["models"][role]["inputs"] = spec.inputs
            data["models"][role]["outputs"] = spec.outputs
        click.echo(json.dumps(data, indent=2))
        return
    out = CliConsole()
    out.print(f"[bold]{directory}[/]  contract {manifest.contract}, exporter {manifest.exporter_version}, opset {manifest.opset}")
    models = Table("role", "architecture", "params", "layers", "heads / kv", "head dim", "vocab", "dtype", "weights",
                   "capacity", "graph", title="models")
    for spec in manifest.models.values():
        models.add_row(spec.role, spec.architecture, f"{spec.parameters / 1e6:.1f}M", str(spec.num_layers),
                       f"{spec.num_heads} / {spec.kv_heads}", str(spec.head_dim),
                       str(spec.vocab_size) + (f" (scores {spec.vocab_kept})" if spec.vocab_kept else ""), spec.dtype,
                       spec.weights, str(spec.capacity), spec.graph)
    out.print(models)
    for spec in manifest.models.values():  # as Text: a feature's brackets are not markup
        if spec.family:
            out.print(Text(described(spec.role, spec.family, spec.features)))
    out.print(_imported_table(manifest) if manifest.target.imported else _tensors_table(manifest))
    table = Table("role", "nodes", "per layer", "most frequent ops",
                  title="graphs, as stored (ONNX Runtime fuses some at load; each node is a dispatch)")
    for role, spec in manifest.models.items():
        if role not in graphs:  # said, not left out: the table would look complete
            table.add_row(role, "-", "-", Text(f"{spec.file}: {unreadable.get(spec.file, 'not read')}"))
            continue
        summary = graphs[role]
        per_layer = summary["nodes_per_layer"]
        ops = ", ".join(f"{op} {count}" for op, count in list(summary["ops"].items())[:6])
        table.add_row(role, str(summary["nodes"]), "-" if per_layer is None else f"{per_layer:g}", ops)
    out.print(table)
    if placements is not None:
        out.print(_placement_table(placements, provider))
    files = Table("file", "size", "sha256", title="files")
    listed = sorted(manifest.files.items())
    for name, digest in listed[:SHOWN_FILES]:
        size = sizes[name]
        note = unreadable.get(name)
        shown = note if size is None else human(size) + (f" ({note})" if note else "")
        files.add_row(Text(name), Text(shown or "?"), digest[:16] + "…")
    if len(listed) > SHOWN_FILES:
        files.add_row(f"… and {len(listed) - SHOWN_FILES:,} more", "", "")
    out.print(files)
    _say_unreadable(out, unreadable)


def _placements(directory: Path, manifest, provider, unreadable: dict[str, str]) -> dict[str, dict]:
    """role -> {EP: {operator type: nodes}} on ``provider``, or {"error": why} where the graph cannot be loaded there."""
    from ..engines.ort import placement
    from ..engines.providers import ProviderError

    placed = {}
    for role, spec in manifest.models.items():
        if spec.file in unreadable:
            placed[role] = {"error": unreadable[spec.file]}
            continue
        try:
            placed[role] = placement(directory / spec.file, provider)
        except ProviderError as exc:
            placed[role] = {"error": str(exc)}
        except Exception as exc:  # ONNX Runtime's own load errors
            placed[role] = {"error": f"ONNX Runtime cannot load it on {provider.key} ({type(exc).__name__}: "
                                     f"{short(str(exc), 200, quoted=False)})"}
    return placed


def _placement_table(placements: dict[str, dict], provider) -> Table:
    """Per model: the nodes ONNX Runtime places on ``provider``'s EP, and the ones it leaves to another (by type)."""
    table = Table("role", f"nodes on {provider.key}", "nodes elsewhere", title=f"placement on {provider.key}")
    for role, placed in placements.items():
        if "error" in placed:
            table.add_row(role, "-", Text(placed["error"]))
            continue
        own = sum(placed.get(provider.ep, {}).values())
        others = [f"{ep}: " + ", ".join(f"{op} {count}" for op, count in sorted(ops.items(), key=lambda item: -item[1]))
                  for ep, ops in placed.items() if ep != provider.ep]
        table.add_row(role, str(own), Text("; ".join(others) or "none: the graph runs whole"))
    return table


def _tensors_table(manifest) -> Table:
    """The verify-v1 tensors of our exported graphs."""
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
    return tensors


def _imported_table(manifest) -> Table:
    """Each imported graph's own contract: the tool that wrote it, its cache layout, its tensors and what the import
    changed in its file."""
    table = Table("role", "source", "cache", "tensors (i = layer)", "rewrites", title="imported graphs' own contracts")
    for spec in manifest.models.values():
        io = spec.imported
        layout = {"shared": "one buffer fed as past, bound as present (written in place); lengths from the mask",
                  "concatenated": "present = past + new tokens; the engine feeds past[:past_len]"}[io.cache]
        names = [io.input_ids, io.attention_mask, io.position_ids, f"{io.past_key} / {io.past_value}", io.logits,
                 f"{io.present_key} / {io.present_value}"]
        table.add_row(spec.role, f"{io.source} ({io.origin})", Text(layout), Text(", ".join(n for n in names if n)),
                      Text("; ".join(io.rewrites)))
    return table


def _readable_size(path: Path) -> int:
    """The size of the regular file at ``path``, once it has been opened for reading (a stat alone says nothing of
    permissions); FileRefused saying why not."""
    with open_regular(path) as handle:
        return os.fstat(handle.fileno()).st_size


def _say_unreadable(out: CliConsole, unreadable: dict[str, str]) -> None:
    """One line per file that cannot be read (the first SHOWN_UNREADABLE, then a count), after the tables."""
    named = sorted(unreadable.items())
    for name, why in named[:SHOWN_UNREADABLE]:
        out.print(Text(f"cannot read {name}: {why}", style="red"))
    if len(named) > SHOWN_UNREADABLE:
        out.print(Text(f"… and {len(named) - SHOWN_UNREADABLE:,} more files that cannot be read", style="red"))
    if named:
        out.print(f"{len(named):,} listed files cannot be read; `specdeploy doctor` says what to do about them")
