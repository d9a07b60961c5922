"""``specdeploy export``: Hugging Face checkpoints (or GGUF files) to a verify-v1 artifact."""

from __future__ import annotations

from pathlib import Path

import click

from ..contract import ContractError
from .common import console


@click.command()
@click.option("--target", required=True, help="Target checkpoint: a HF model dir (safetensors), a .gguf file or a hub id.")
@click.option("--draft", default=None, help="Draft checkpoint (same forms as --target); must share the target's tokenizer.")
@click.option("--out", required=True, type=click.Path(path_type=Path), help="Artifact dir to write.")
@click.option("--dtype", type=click.Choice(["float32", "float16"]), default="float32", show_default=True,
              help="Weight and KV-cache dtype.")
@click.option("--weights", type=click.Choice(["full", "int4", "int8"]), default="full", show_default=True,
              help="int4: 4-bit block-wise MatMul weights (ONNX Runtime's MatMulNBits); int8: per-channel int8 "
                   "weights, activations quantized per row (ONNX Runtime's dynamic quantizer's graph, one scale per row).")
@click.option("--draft-weights", type=click.Choice(["full", "int4", "int8"]), default=None,
              help="Weight format of the draft (default: same as --weights).")
@click.option("--capacity", type=click.IntRange(min=2), default=None,
              help="Maximum cache slots (prompt + new tokens + draft length + 1) a request may use "
                   "[default: the model's max_position_embeddings, at most 2048].")
@click.option("--block-size", type=click.Choice(["16", "32", "64", "128", "256"]), default="32", show_default=True,
              help="int4: weights per quantization block (larger: faster decode, coarser weights).")
@click.option("--accuracy-level", type=click.IntRange(0, 4), default=4, show_default=True,
              help="int4: MatMulNBits compute type (4: int8 activations, fastest on CPU; 0: fp32).")
@click.option("--graph", type=click.Choice(["explicit", "fused"]), default="explicit", show_default=True,
              help="The form of the graphs written for the CPU provider (OpenVINO's is its own: --provider). explicit: "
                   "standard ONNX ops, new K/V as outputs (the reference; what TensorRT parses); fused: ONNX Runtime's "
                   "fused LLM ops (GroupQueryAttention writing the cache in place, fused norms, MatMulNBits), a dozen "
                   "nodes a layer, written straight from the weights.")
@click.option("--draft-vocab", type=click.IntRange(min=1), default=None,
              help="With --graph fused: the draft scores only the first N token ids (BPE ids come in merge order, "
                   "most common first) and -inf for the rest: a smaller head, a faster draft step; output stays "
                   "exactly the target's [default: the whole vocabulary].")
@click.option("--provider", type=click.Choice(["cpu", "openvino"]), default="cpu", show_default=True,
              help="The execution provider the graphs are written for. openvino: the explicit form whose attention "
                   "reads only the filled cache slots and whose head runs over the kept positions only, which OpenVINO "
                   "runs whole (it refuses the fused form's in-place GroupQueryAttention); it runs on the CPU provider "
                   "too.")
@click.option("--draft-provider", type=click.Choice(["cpu", "openvino"]), default=None,
              help="The execution provider the draft's graph is written for, where it differs [default: --provider's]. "
                   "--provider openvino --draft-provider cpu --graph fused: OpenVINO's form for the target, whose "
                   "verifications it runs quicker, and the fused form for the draft, whose one-token calls the CPU "
                   "provider runs quicker (generate --provider openvino --draft-provider cpu).")
@click.option("--force", is_flag=True, help="Replace an existing output dir.")
def export(target, draft, out, dtype, weights, draft_weights, capacity, block_size, accuracy_level, graph, draft_vocab,
           provider, draft_provider, force):
    """Export Hugging Face causal LMs to verify-v1 ONNX graphs plus a manifest."""
    from ..exporter import ExportError, ExportOptions, export_artifact

    try:
        options = ExportOptions(dtype=dtype, weights=weights, draft_weights=draft_weights, capacity=capacity, graph=graph,
                                block_size=int(block_size), accuracy_level=accuracy_level, draft_vocab=draft_vocab,
                                force=force, provider=provider, draft_provider=draft_provider)
        with console.status("exporting") as status:
            def progress(step):
                console.log(step)
                status.update(step)

            manifest = export_artifact(target, out, draft=draft, options=options, progress=progress)
    except (ExportError, ContractError) as exc:
        raise click.ClickException(str(exc)) from exc
    except OSError as exc:  # what the filesystem refused that no check foresaw (a disk filling, a permission changed)
        where = exc.filename or out
        raise click.ClickException(f"{where}: {exc.strerror or exc} ({type(exc).__name__}); nothing was written "
                                   f"to {out}") from exc
    console.print(f"[green]exported[/] {', '.join(manifest.models)} to {out}")
