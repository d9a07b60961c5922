"""Timings and the big-shape check of tools/gpu_check.py: ``Engine.infer`` latency, the same graph with its caches
bound once as device OrtValues, and Qwen2.5-shaped fused fp16 targets with random weights written on the machine.

Imported by gpu_check.py (run as a script, this folder is first on sys.path); needs numpy, onnxruntime, and torch
for ``check_big`` alone.
"""

from __future__ import annotations

import statistics
import tempfile
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

import numpy as np

CAPACITY = 512  # cache slots of the tiny artifacts: a past of 256 and a few verified tokens fit
PAST = 256
CALLS = 50
BIG = {  # Qwen2.5 shapes (tied embeddings, q/k/v bias); "test" keeps the path under test on a CPU
    "1.5b": {"hidden": 1536, "layers": 28, "heads": 12, "kv_heads": 2, "head_dim": 128, "ffn": 8960, "vocab": 151936},
    "0.5b": {"hidden": 896, "layers": 24, "heads": 14, "kv_heads": 2, "head_dim": 64, "ffn": 4864, "vocab": 151936},
    "test": {"hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2, "head_dim": 16, "ffn": 128, "vocab": 256},
}
BIG_CAPACITY = 1024


def last_logits(engine, ids: np.ndarray, cache=None) -> np.ndarray:
    """Logits [1, 5, vocab] of ``ids``' last 5 tokens, called at once after a prefill of the others."""
    from specdeploy.engines.base import prefill

    cache = cache if cache is not None else engine.allocate_cache(1, ids.shape[1] + 8)
    past = ids.shape[1] - 5
    prefill(engine, cache, ids, [past])
    logits = engine.infer(ids[:, past:], np.array([past], np.int64), cache).logits.copy()
    cache.commit([ids.shape[1]])
    return logits


def engine_latency(engine, calls: int = CALLS, capacity: int = CAPACITY) -> dict:
    """ms per ``engine.infer`` (wall, and the engine's own ``seconds``) at batch 1, T = 1 and 5, after PAST tokens."""
    from specdeploy.engines.base import prefill

    rng = np.random.default_rng(4)
    cache = engine.allocate_cache(1, capacity)
    prefill(engine, cache, rng.integers(0, engine.spec.vocab_size, (1, PAST)), [PAST])
    past = np.array([PAST], np.int64)
    timings = {}
    for tokens in (1, 5):
        ids = rng.integers(0, engine.spec.vocab_size, (1, tokens))
        walls, inner = [], []
        for i in range(calls + 5):  # 5 warm-up calls
            start = time.perf_counter()
            seconds = engine.infer(ids, past, cache).seconds
            if i >= 5:
                walls.append(time.perf_counter() - start)
                inner.append(seconds)
        timings[f"T{tokens}"] = {"median_ms": ms(statistics.median(walls)), "p90_ms": ms(np.percentile(walls, 90)),
                                 "engine_seconds_median_ms": ms(statistics.median(inner))}
    return timings


def resident_latency(path: Path, spec, provider: str, ids: np.ndarray, expected: np.ndarray | None,
                     calls: int = CALLS, capacity: int = CAPACITY) -> dict:
    """ms per call of the same graph with its caches bound once as OrtValues on the device (a fused graph's
    present_* bound to the same values: shared past/present buffers), logits to the host. A fused graph first
    runs ``ids`` as ``last_logits`` does, its logits compared with ``expected``."""
    import onnxruntime as ort

    from specdeploy.engines.ort import PROVIDERS

    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.add_session_config_entry("session.force_spinning_stop", "1")
    chain = list(dict.fromkeys([PROVIDERS[provider], "CPUExecutionProvider"]))
    session = ort.InferenceSession(str(path), options, providers=chain)
    device = "cpu" if provider == "cpu" else "cuda"
    dtype = np.float16 if spec.dtype == "float16" else np.float32
    caches = [ort.OrtValue.ortvalue_from_shape_and_type(list(spec.cache_shape(1, capacity)), dtype, device, 0)
              for _ in spec.cache_inputs]

    def bound(tokens: np.ndarray, past: int):
        binding = session.io_binding()
        binding.bind_output("logits", "cpu")  # first: get_outputs() lists outputs in the order they were bound
        for name, value in zip(spec.cache_inputs, caches):
            binding.bind_ortvalue_input(name, value)
        for i, name in enumerate(spec.outputs[1:]):
            if spec.writes_cache:
                binding.bind_ortvalue_output(name, caches[i])
            else:
                binding.bind_output(name, device)
        binding.bind_cpu_input("input_ids", np.ascontiguousarray(tokens))
        binding.bind_cpu_input("past_len", np.array([past], np.int64))
        if spec.trims_logits:
            binding.bind_cpu_input("num_logits", np.array([tokens.shape[1]], np.int64))
        return binding

    timings = {}
    if spec.writes_cache and expected is not None:  # the shared buffers are the cache: prefill, then the 5-token call
        past = ids.shape[1] - 5
        session.run_with_iobinding(bound(ids[:, :past], 0))
        call = bound(ids[:, past:], past)
        session.run_with_iobinding(call)
        timings["logits_max_abs_diff"] = float(np.abs(call.get_outputs()[0].numpy() - expected).max())
    rng = np.random.default_rng(5)
    for tokens in (1, 5):
        binding = bound(rng.integers(0, spec.vocab_size, (1, tokens)), PAST)
        walls = []
        for i in range(calls + 5):
            start = time.perf_counter()
            session.run_with_iobinding(binding)
            if i >= 5:
                walls.append(time.perf_counter() - start)
        timings[f"T{tokens}"] = {"median_ms": ms(statistics.median(walls)), "p90_ms": ms(np.percentile(walls, 90))}
    return timings


def check_big(name: str, provider: str) -> dict:
    """Write a Qwen2.5-shaped fused fp16 target with random weights (the exporter's fused writer, no transformers),
    then time it as ``engine_latency`` and ``resident_latency`` do."""
    import torch

    from specdeploy.contract import ModelSpec
    from specdeploy.engines.ort import OrtEngine
    from specdeploy.exporter.fused import FusedGraph
    from specdeploy.exporter.llama import LlamaVerify

    shape = BIG[name]
    dims = {"num_layers": shape["layers"], "num_heads": shape["heads"], "kv_heads": shape["kv_heads"],
            "head_dim": shape["head_dim"], "vocab_size": shape["vocab"]}
    pool = np.random.default_rng(0).standard_normal(1 << 22).astype(np.float32) * 0.02

    def tensor(*size):  # tiled from one random pool: random enough for timing, and fast
        return torch.from_numpy(np.resize(pool, size))

    hidden, q, kv = shape["hidden"], shape["heads"] * shape["head_dim"], shape["kv_heads"] * shape["head_dim"]
    weights = {"model.embed_tokens.weight": tensor(shape["vocab"], hidden), "model.norm.weight": torch.ones(hidden)}
    for i in range(shape["layers"]):
        p = f"model.layers.{i}."
        weights.update({f"{p}self_attn.q_proj.weight": tensor(q, hidden), f"{p}self_attn.k_proj.weight": tensor(kv, hidden),
                        f"{p}self_attn.v_proj.weight": tensor(kv, hidden), f"{p}self_attn.q_proj.bias": tensor(q),
                        f"{p}self_attn.k_proj.bias": tensor(kv), f"{p}self_attn.v_proj.bias": tensor(kv),
                        f"{p}self_attn.o_proj.weight": tensor(hidden, q), f"{p}mlp.gate_proj.weight": tensor(shape["ffn"], hidden),
                        f"{p}mlp.up_proj.weight": tensor(shape["ffn"], hidden),
                        f"{p}mlp.down_proj.weight": tensor(hidden, shape["ffn"]),
                        f"{p}input_layernorm.weight": torch.ones(hidden),
                        f"{p}post_attention_layernorm.weight": torch.ones(hidden)})
    config = SimpleNamespace(rms_norm_eps=1e-6, rope_theta=1e6)
    record = {"shape": shape, "capacity": BIG_CAPACITY}
    with tempfile.TemporaryDirectory(prefix="gpu-check-big-") as tmp:
        path = Path(tmp) / "target.onnx"
        start = time.perf_counter()
        with torch.no_grad():
            module = LlamaVerify(config, weights, dims, streamed=True)
            graph = FusedGraph(path, dims, dtype=np.float16)
            graph.save(module.write_fused(graph, BIG_CAPACITY))
        del module, weights
        record["write_s"] = round(time.perf_counter() - start, 1)
        record["bytes"] = sum(p.stat().st_size for p in Path(tmp).iterdir())
        spec = ModelSpec(role="target", file=path.name, architecture="qwen2", dtype="float16", weights="full",
                         capacity=BIG_CAPACITY, tokenizer_fingerprint="", graph="fused", trims_logits=True,
                         **{k: dims[k] for k in ("num_layers", "num_heads", "kv_heads", "head_dim", "vocab_size")})
        start = time.perf_counter()
        engine = OrtEngine(path, spec, provider=provider)  # written here, at the IR version every onnxruntime >= 1.20 reads
        record["session_s"] = round(time.perf_counter() - start, 1)
        ids = np.random.default_rng(3).integers(0, shape["vocab"], (1, PAST + 5))
        expected = guard(lambda: last_logits(engine, ids))  # the device resident caches' logits against the engine's
        record["engine_logits"] = expected if isinstance(expected, dict) else {"max_abs": float(np.abs(expected).max())}
        record["engine"] = guard(lambda: engine_latency(engine, capacity=BIG_CAPACITY))
        record["device_cache"] = guard(lambda: resident_latency(
            path, spec, provider, ids, None if isinstance(expected, dict) else expected, capacity=BIG_CAPACITY))
    return record


def guard(work):
    """``work()``, or {"error": the exception and the traceback's last lines} if it raised."""
    try:
        return work()
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {str(exc)[:500]}",
                "traceback": traceback.format_exc().strip().splitlines()[-6:]}


def ms(seconds: float) -> float:
    return round(1000 * float(seconds), 3)
