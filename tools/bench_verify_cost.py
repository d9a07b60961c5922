"""How much does verifying T tokens cost against decoding one? (issue: verify cost)

Builds random Llama models (~30M and ~125M parameters by default), exports each to a verify-v1
graph (fp32, optionally int4), and times one ONNX Runtime call at tokens = 1, 5 and 9 with a past
of half the capacity, batch 1, on a shared 2-thread pool. Prints median latency and the ratio to
tokens = 1. All ratios come from the same run, interleaved, so machine drift hits them alike.

    python -m tools.bench_verify_cost [--sizes 30m,125m] [--weights full,int4] [--capacity 512]
    python -m tools.bench_verify_cost --artifact DIR            # the models of an exported artifact
    python -m tools.bench_verify_cost --artifact DIR --ragged   # batch 2: one row drafting, the other not
    python -m tools.bench_verify_cost --artifact DIR --variants int4-b32-a4,int8-b32-a4,...
        # re-quantizes the artifact's fp32 target per variant (weights-bits, block size, accuracy level;
        # "dyn8": ONNX Runtime's dynamic int8 quantization)
        # and times each: the configuration search for compressed targets
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from tools import arguments

SIZES = {  # hidden, layers, heads, kv_heads, intermediate, vocab
    "30m": (384, 6, 6, 2, 1024, 32000),  # tied embeddings, as small released models have
    "125m": (576, 30, 9, 3, 1536, 49152),
}


def build(size: str, weights: str, capacity: int, workdir: Path, block_size: int, accuracy_level: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from specdeploy.contract import ModelSpec
    from specdeploy.exporter import onnx_graph
    from specdeploy.exporter.llama import LLAMA, DescribedArchitecture

    hidden, layers, heads, kv, inter, vocab = SIZES[size]
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv, intermediate_size=inter, max_position_embeddings=capacity,
                         tie_word_embeddings=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    params = sum(p.numel() for p in model.parameters())
    family = DescribedArchitecture(LLAMA)
    with torch.no_grad():
        proto = onnx_graph.export_graph(family.build(config, model.state_dict(), capacity), family.dims(config), None)
    if weights == "int4":
        proto = onnx_graph.to_int4(proto, block_size=block_size, accuracy_level=accuracy_level)
    path = workdir / f"{size}-{weights}.onnx"
    onnx_graph.save(proto, path)
    spec = ModelSpec(role="target", file=path.name, architecture="llama", num_layers=layers, num_heads=heads,
                     kv_heads=kv, head_dim=hidden // heads, vocab_size=vocab, dtype="float32", weights=weights,
                     capacity=capacity, tokenizer_fingerprint="0" * 64, parameters=params)
    return path, spec


def measure(engine, capacity: int, token_counts, repeats: int) -> dict[int, float]:
    """Median seconds of one call per token count, interleaved round by round."""
    rng = np.random.default_rng(0)
    cache = _random_cache(engine, 1, capacity, rng)
    past = np.array([capacity // 2], np.int64)
    inputs = {t: rng.integers(0, engine.spec.vocab_size, (1, t)) for t in token_counts}
    times = {t: [] for t in token_counts}
    for t in token_counts:  # warm-up
        engine.infer(inputs[t], past, cache)
    for _ in range(repeats):
        for t in token_counts:
            began = time.perf_counter()
            engine.infer(inputs[t], past, cache)
            times[t].append(time.perf_counter() - began)
    return {t: statistics.median(v) for t, v in times.items()}


def measure_ragged(engine, capacity: int, tokens: int, repeats: int) -> dict[str, float]:
    """Median seconds of a batch-2 call, interleaved: one token a row (plain decoding), ``tokens`` a row (both rows
    drafted ``tokens`` - 1), and a ragged verification, one row ``tokens`` and the other one token (a row without
    drafts), padded as one call sees it and with each row's width (``Engine.infer(widths=)``)."""
    rng = np.random.default_rng(0)
    cache = _random_cache(engine, 2, capacity, rng)
    past = np.full(2, capacity // 2, np.int64)
    ids = rng.integers(0, engine.spec.vocab_size, (2, tokens))
    calls = {"one token a row": lambda: engine.infer(ids[:, :1], past, cache),
             f"{tokens} tokens a row": lambda: engine.infer(ids, past, cache),
             f"rows of {tokens} and 1, padded": lambda: engine.infer(ids, past, cache),
             f"rows of {tokens} and 1, widths": lambda: engine.infer(ids, past, cache, widths=[tokens, 1])}
    times = {name: [] for name in calls}
    for round_ in range(repeats + 1):  # the first round warms each shape up
        for name, call in calls.items():
            began = time.perf_counter()
            call()
            if round_:
                times[name].append(time.perf_counter() - began)
    return {name: statistics.median(v) for name, v in times.items()}


def _random_cache(engine, batch: int, capacity: int, rng):
    """A cache of ``batch`` rows whose every slot holds random K/V: a past's cost, whatever its values."""
    cache = engine.allocate_cache(batch, capacity)
    for buf in cache:
        buf[:] = rng.normal(0, 1, buf.shape)
    return cache


def quantized_variant(source: Path, variant: str, workdir: Path) -> Path:
    """``source`` (an fp32 verify graph) re-quantized as ``variant``, e.g. "int4-b32-a4" or "int8-b128-a0"."""
    import onnx

    from specdeploy.exporter import onnx_graph

    path = workdir / f"{variant}.onnx"
    if variant == "dyn8":  # int8 weights per channel, activations quantized per call: MatMulInteger / QGEMM
        from onnxruntime.quantization import QuantType, quantize_dynamic

        quantize_dynamic(str(source), str(path), weight_type=QuantType.QInt8, per_channel=True, reduce_range=True,
                         use_external_data_format=True, op_types_to_quantize=["MatMul"])
        return path
    kind, block, level = variant.split("-")
    bits = {"int4": 4, "int8": 8}[kind]
    model = onnx.load(str(source))
    quantized = onnx_graph.quantize_weights(model, bits=bits, block_size=int(block[1:]), accuracy_level=int(level[1:]))
    onnx_graph.save(quantized, path)
    return path


def report(label: str, params: int, medians: dict[int, float]) -> str:
    base = medians[min(medians)]
    cells = "  ".join(f"T={t}: {m * 1e3:7.2f} ms ({m / base:4.2f}x)" for t, m in medians.items())
    return f"{label:<22} {params / 1e6:7.1f}M  {cells}"


def main() -> None:
    from specdeploy.engines import OrtEngine

    args = _parser().parse_args()
    token_counts = [int(t) for t in args.tokens.split(",")]

    if args.ragged and not args.artifact:
        _parser().error("--ragged: times an artifact's target; give --artifact")
    print(f"median latency of one call, batch {2 if args.ragged else 1}, past {args.capacity // 2}, capacity {args.capacity}, "
          f"{args.threads} threads, {args.repeats} repeats")
    if args.artifact:
        return _time_artifact(args, token_counts)
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes.split(","):
            for weights in args.weights.split(","):
                path, spec = build(size, weights, args.capacity, Path(tmp), args.block_size, args.accuracy_level)
                engine = OrtEngine(path, spec, threads=args.threads)
                medians = measure(engine, args.capacity, token_counts, args.repeats)
                print(report(f"llama-{size} {weights}", spec.parameters, medians), flush=True)
                del engine


def _parser() -> argparse.ArgumentParser:
    parser = arguments.parser(__doc__)
    parser.add_argument("--sizes", default="30m,125m", help="comma list of " + ", ".join(SIZES))
    parser.add_argument("--weights", default="full", help="comma list of full, int4")
    parser.add_argument("--capacity", type=arguments.integer(1), default=512,
                        help="cache slots; calls run after a past of half of them")
    parser.add_argument("--tokens", default="1,5,9", help="comma list of tokens a call (--ragged: the largest)")
    parser.add_argument("--repeats", type=arguments.integer(1), default=30, help="timed calls of each kind, interleaved")
    parser.add_argument("--threads", type=arguments.integer(1), default=2, help="ONNX Runtime threads")
    parser.add_argument("--block-size", type=arguments.integer(1), default=32, help="int4 MatMulNBits block size")
    parser.add_argument("--accuracy-level", type=arguments.integer(0), default=4,
                        help="int4 MatMulNBits accuracy level (0, 1, 2, 4)")
    parser.add_argument("--artifact", type=arguments.artifact, help="time the target (and draft) of an exported artifact instead")
    parser.add_argument("--ragged", action="store_true", help="with --artifact: its target at batch 2, a ragged "
                        "verification padded against each row's own width")
    parser.add_argument("--variants", default="", help="with --artifact: quantization variants of its fp32 target")
    parser.add_argument("--optimization", default="all", choices=["none", "basic", "extended", "all"],
                        help="ONNX Runtime graph optimization level")
    return parser


def _time_artifact(args: argparse.Namespace, token_counts: list[int]) -> None:
    """Print the timings of ``--artifact``'s models, or of its fp32 target re-quantized as each of ``--variants``."""
    import dataclasses

    from specdeploy.contract import Manifest
    from specdeploy.engines import OrtEngine

    manifest = Manifest.read(args.artifact)
    if args.ragged:
        spec = manifest.target
        engine = OrtEngine(args.artifact / spec.file, spec, threads=args.threads, optimization=args.optimization)
        tokens = max(token_counts)
        for name, seconds in measure_ragged(engine, min(args.capacity, spec.capacity), tokens, args.repeats).items():
            print(f"target, batch 2, {name}: {seconds * 1e3:.1f} ms", flush=True)
        return
    if args.variants:
        spec = manifest.target
        if spec.weights != "full" or spec.dtype != "float32":
            sys.exit("--variants needs an artifact with an fp32, full-weight target")
        with tempfile.TemporaryDirectory(dir=args.artifact.parent) as tmp:
            for variant in args.variants.split(","):
                path = quantized_variant(args.artifact / spec.file, variant, Path(tmp))
                engine = OrtEngine(path, dataclasses.replace(spec, weights="int4"), threads=args.threads,
                                   optimization=args.optimization)
                medians = measure(engine, min(args.capacity, spec.capacity), token_counts, args.repeats)
                print(report(f"target {variant}", spec.parameters, medians), flush=True)
                del engine
                path.unlink()
                path.with_name(path.name + ".data").unlink(missing_ok=True)
        return
    for role, spec in manifest.models.items():
        engine = OrtEngine(args.artifact / spec.file, spec, threads=args.threads, optimization=args.optimization)
        medians = measure(engine, min(args.capacity, spec.capacity), token_counts, args.repeats)
        print(report(f"{role} {spec.weights}/{spec.dtype}", spec.parameters, medians), flush=True)


if __name__ == "__main__":
    main()
