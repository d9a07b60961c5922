"""Timings and the big shapes of tools/gpu_check.py: ``Engine.infer`` per call at T = 1, 5 and 9 with and without CUDA
graphs, the bytes a greedy cycle moves between host and device, Qwen2.5-shaped fused fp16 targets with random weights
written on the machine, the same shapes built by onnxruntime-genai's model builder (the peer) and timed alike, and
the cost tables tools/replay.py replays the real pair's traces at.

Imported by tools.gpu_check; needs numpy, onnxruntime, and torch
for the big shapes (``RandomWeights`` feeds the exporter's own fused writer, one layer at a time, so a 7B-shaped model
is written without ever holding its 15 GB).
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

import numpy as np

CAPACITY = 512  # cache slots of the tiny artifacts: a past of 256 and a few verified tokens fit
PAST = 256
CALLS = 30
TOKENS = (1, 5, 9)  # a draft step or plain decoding, verifications of K = 4 and K = 8
BIG = {  # Qwen2.5 shapes (q/k/v bias; "tied": one embedding for input and head); "test" keeps the paths under test on a CPU
    "0.5b": {"hidden": 896, "layers": 24, "heads": 14, "kv_heads": 2, "head_dim": 64, "ffn": 4864, "vocab": 151936, "tied": True},
    "1.5b": {"hidden": 1536, "layers": 28, "heads": 12, "kv_heads": 2, "head_dim": 128, "ffn": 8960, "vocab": 151936,
             "tied": True},
    "7b": {"hidden": 3584, "layers": 28, "heads": 28, "kv_heads": 4, "head_dim": 128, "ffn": 18944, "vocab": 152064,
           "tied": False},
    "test": {"hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2, "head_dim": 16, "ffn": 128, "vocab": 256, "tied": True},
}
BIG_PAST, BIG_CAPACITY = 1024, 2048  # the peer's graphs were first timed at a past of 1024 (issue 40): the same here
TEST_PAST, TEST_CAPACITY = 32, 600  # the "test" shape's: room for the cost table's pasts and a 512-token prefill
CYCLE_K = 4


def last_logits(engine, ids: np.ndarray, cache=None) -> np.ndarray:
    """Logits [1, 5, vocab] of ``ids``' last 5 tokens, called at once after a prefill of the others."""
    from specdeploy.engines.base import prefill

    cache = cache if cache is not None else engine.allocate_cache(1, ids.shape[1] + 8)
    past = ids.shape[1] - 5
    prefill(engine, cache, ids, [past])
    logits = engine.infer(ids[:, past:], np.array([past], np.int64), cache).logits.copy()
    cache.commit([ids.shape[1]])
    return logits


def engine_latency(engine, capacity: int = CAPACITY, past: int = PAST, tokens=TOKENS, calls: int = CALLS) -> dict:
    """Per token count T at batch 1 after ``past`` tokens: ms per ``engine.infer`` reading the argmax ids (wall, and the
    engine's own ``seconds``), and the bytes each call moved to the device and back (``device.transfers``)."""
    from specdeploy.engines.base import prefill
    from specdeploy.engines.memory import transfers

    rng = np.random.default_rng(4)
    cache = engine.allocate_cache(1, capacity)
    prefill(engine, cache, rng.integers(0, engine.spec.vocab_size, (1, past)), [past])
    at = np.array([past], np.int64)
    timings = {}
    for t in tokens:
        ids = rng.integers(0, engine.spec.vocab_size, (1, t))
        walls, inner = [], []
        for i in range(calls + 3):  # 3 warm-up calls: the first of a shape captures its CUDA graph
            before = transfers.to_device, transfers.to_host
            start = time.perf_counter()
            out = engine.infer(ids, at, cache)
            _ = out.ids  # what greedy acceptance reads
            if i >= 3:
                walls.append(time.perf_counter() - start)
                inner.append(out.seconds)
        timings[f"T{t}"] = {"median_ms": ms(statistics.median(walls)), "p90_ms": ms(np.percentile(walls, 90)),
                            "engine_seconds_median_ms": ms(statistics.median(inner)),
                            "to_device_bytes": transfers.to_device - before[0], "to_host_bytes": transfers.to_host - before[1]}
    return timings


def cycle_bytes(target, draft, capacity: int, past: int, k: int = CYCLE_K) -> dict:
    """Bytes one greedy cycle at batch 1 moves between host and device: ``k`` draft steps and a verification of k + 1
    tokens, each reading its argmax ids, as greedy acceptance does."""
    from specdeploy.engines.memory import transfers

    rng = np.random.default_rng(6)
    caches = {e: e.allocate_cache(1, capacity) for e in (target, draft)}
    for engine, cache in caches.items():  # a past of random K/V: the bytes do not depend on it
        _ = engine.infer(rng.integers(0, engine.spec.vocab_size, (1, 8)), np.array([past - 8], np.int64), cache, 1).ids
    before = transfers.to_device, transfers.to_host
    token = np.array([[int(rng.integers(0, draft.spec.vocab_size))]])
    drafts = []
    for step in range(k):
        token = draft.infer(token, np.array([past + step], np.int64), caches[draft]).ids
        drafts.append(int(token[0, 0]))
    _ = target.infer(np.array([[drafts[0], *drafts]]), np.array([past], np.int64), caches[target]).ids
    return {"k": k, "to_device": transfers.to_device - before[0], "to_host": transfers.to_host - before[1]}


class _Weights:
    """Random tensors in a Qwen2 checkpoint's names and shapes, made when taken (``LazyWeights``): tiled from one seeded
    pool, random enough for timing and fast to make."""

    @staticmethod
    def shapes(shape: dict) -> dict[str, tuple[int, ...]]:
        hidden, q, kv = shape["hidden"], shape["heads"] * shape["head_dim"], shape["kv_heads"] * shape["head_dim"]
        names = {"model.embed_tokens.weight": (shape["vocab"], hidden), "model.norm.weight": (hidden,)}
        if not shape["tied"]:
            names["lm_head.weight"] = (shape["vocab"], hidden)
        for i in range(shape["layers"]):
            p = f"model.layers.{i}."
            names |= {f"{p}self_attn.q_proj.weight": (q, hidden), f"{p}self_attn.k_proj.weight": (kv, hidden),
                      f"{p}self_attn.v_proj.weight": (kv, hidden), f"{p}self_attn.q_proj.bias": (q,),
                      f"{p}self_attn.k_proj.bias": (kv,), f"{p}self_attn.v_proj.bias": (kv,),
                      f"{p}self_attn.o_proj.weight": (hidden, q), f"{p}mlp.gate_proj.weight": (shape["ffn"], hidden),
                      f"{p}mlp.up_proj.weight": (shape["ffn"], hidden), f"{p}mlp.down_proj.weight": (hidden, shape["ffn"]),
                      f"{p}input_layernorm.weight": (hidden,), f"{p}post_attention_layernorm.weight": (hidden,)}
        return names

    @staticmethod
    def tensor(name: str, size: tuple[int, ...]):
        import torch

        if name.endswith("norm.weight"):
            return torch.ones(size)
        pool = np.random.default_rng(0).standard_normal(1 << 22).astype(np.float32) * 0.02
        return torch.from_numpy(np.resize(pool, size))


def random_weights(shape: dict):
    """A ``LazyWeights`` of ``_Weights``: each tensor made when the writer takes it and dropped when it is done."""
    from specdeploy.exporter.lazy_weights import LazyWeights

    class RandomWeights(LazyWeights):
        kind = "random"

        def __init__(self):
            super().__init__()
            self._shapes = _Weights.shapes(shape)

        def _read(self, name: str):
            return _Weights.tensor(name, self._shapes[name])

    return RandomWeights()


def dims_of(shape: dict):
    from specdeploy.exporter.dims import Dims

    return Dims(num_layers=shape["layers"], num_heads=shape["heads"], kv_heads=shape["kv_heads"],
                head_dim=shape["head_dim"], vocab_size=shape["vocab"])


def write_target(shape: dict, path: Path, capacity: int):
    """Write a fused fp16 graph of ``shape`` with random weights through the exporter's own writer; return its spec."""
    import torch
    from transformers import Qwen2Config

    from specdeploy.contract import ModelSpec
    from specdeploy.exporter.fused import FusedGraph
    from specdeploy.exporter.llama import LLAMA, DecoderVerify

    dims = dims_of(shape)
    # a config of the family the shapes are, as the exporter reads one (RoPE by the family's own default function)
    config = Qwen2Config(vocab_size=shape["vocab"], hidden_size=shape["hidden"], intermediate_size=shape["ffn"],
                         num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
                         num_key_value_heads=shape["kv_heads"], rms_norm_eps=1e-6, tie_word_embeddings=shape["tied"],
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    with torch.no_grad():
        module = DecoderVerify(LLAMA, config, random_weights(shape), dims, streamed=True)
        graph = FusedGraph(path, dims, dtype=np.float16)
        graph.save(module.write_fused(graph, capacity))
    return ModelSpec(role="target", file=path.name, architecture="qwen2", dtype="float16", weights="full", capacity=capacity,
                     tokenizer_fingerprint="", graph="fused", trims_logits=True, takes_seqlens_k=True, argmax_ids=True,
                     **dims.spec_fields())


def check_big(name: str, provider: str, workdir: Path, keep: bool = False) -> dict:
    """Write ``BIG[name]`` and time it on ``provider``, without and (on CUDA) with CUDA graphs: per-call latency, the
    logits of both against each other, and (``keep``) the engine for the cost tables, in ``record["engine"]``."""
    from specdeploy.engines.ort import OrtEngine

    shape = BIG[name]
    past, capacity = (TEST_PAST, TEST_CAPACITY) if name == "test" else (BIG_PAST, BIG_CAPACITY)
    record = {"shape": shape, "past": past, "capacity": capacity}
    path = workdir / f"{name}.onnx"
    start = time.perf_counter()
    spec = write_target(shape, path, capacity)
    record["write_s"] = round(time.perf_counter() - start, 1)
    record["bytes"] = sum(p.stat().st_size for p in workdir.iterdir() if p.name.startswith(path.name))
    ids = np.random.default_rng(3).integers(0, shape["vocab"], (1, past + 5))
    modes = {"plain": False} | ({"cuda graphs": True} if provider == "cuda" else {})
    logits = {}
    for mode, graphs in modes.items():
        start = time.perf_counter()
        engine = guard(lambda graphs=graphs: OrtEngine(path, spec, provider=provider, cuda_graphs=graphs))
        if isinstance(engine, dict):
            record[mode] = engine
            continue
        entry = record[mode] = {"session_s": round(time.perf_counter() - start, 1), "captures": engine.graphs is not None}
        logits[mode] = guard(lambda engine=engine: last_logits(engine, ids, engine.allocate_cache(1, capacity)))
        entry["latency"] = guard(lambda engine=engine: engine_latency(engine, capacity, past))
        if keep and mode == list(modes)[-1]:
            record["engine"] = engine
    arrays = [v for v in logits.values() if isinstance(v, np.ndarray)]
    if arrays:
        record["logits_max_abs"] = float(np.abs(arrays[0]).max())
    if len(arrays) == 2:
        record["graphs_vs_plain_max_abs_diff"] = float(np.abs(arrays[0] - arrays[1]).max())
    return record


def write_peer_checkpoint(shape: dict, directory: Path, capacity: int) -> Path:
    """The same random weights as ``write_target``'s, as a Hugging Face Qwen2 checkpoint (fp16 safetensors, one file a
    layer) that onnxruntime-genai's model builder reads, with a small tokenizer beside it (the builder copies one)."""
    import torch
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    shapes, index = _Weights.shapes(shape), {}
    groups: dict[str, list[str]] = {}
    for name in shapes:
        group = name.split(".")[2] if name.startswith("model.layers.") else "other"
        groups.setdefault(group, []).append(name)
    for group, names in groups.items():
        file = f"model-{group}.safetensors"
        save_file({n: _Weights.tensor(n, shapes[n]).to(torch.float16).contiguous() for n in names}, str(directory / file))
        index |= dict.fromkeys(names, file)
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    config = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": shape["hidden"],
              "intermediate_size": shape["ffn"], "num_hidden_layers": shape["layers"],
              "num_attention_heads": shape["heads"], "num_key_value_heads": shape["kv_heads"],
              "head_dim": shape["head_dim"], "vocab_size": shape["vocab"], "max_position_embeddings": capacity,
              "rms_norm_eps": 1e-6, "rope_theta": 1e6, "tie_word_embeddings": shape["tied"], "hidden_act": "silu",
              "torch_dtype": "float16", "bos_token_id": 1, "eos_token_id": 2, "use_sliding_window": False}
    (directory / "config.json").write_text(json.dumps(config))
    words = {f"w{i}": i for i in range(64)}
    tokenizer = {"version": "1.0", "added_tokens": [], "normalizer": None, "pre_tokenizer": {"type": "WhitespaceSplit"},
                 "post_processor": None, "decoder": None, "truncation": None, "padding": None,
                 "model": {"type": "WordLevel", "vocab": words, "unk_token": "w0"}}
    (directory / "tokenizer.json").write_text(json.dumps(tokenizer))
    (directory / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    return directory


def check_peer(name: str, provider: str, workdir: Path) -> dict:
    """The peer's graph of ``BIG[name]`` (onnxruntime-genai's model builder over the same random weights), timed at the
    same past and capacity as ours, without and (on CUDA) with CUDA graphs."""
    import importlib.util

    if importlib.util.find_spec("onnxruntime_genai") is None:
        return {"skipped": "onnxruntime_genai is not installed, so the peer's graphs cannot be built: carry the "
                           "onnxruntime-genai-cuda 0.18 wheel (../shared/tools/gpu-bundle --wheel "
                           "onnxruntime-genai-cuda==0.18.0) or pip install onnxruntime-genai"}
    shape = BIG[name]
    past, capacity = (TEST_PAST, TEST_CAPACITY) if name == "test" else (BIG_PAST, BIG_CAPACITY)
    record = {"past": past, "capacity": capacity}
    start = time.perf_counter()
    checkpoint = write_peer_checkpoint(shape, workdir / f"{name}-hf", capacity)
    out = workdir / f"{name}-peer"
    precision = "fp16" if provider == "cuda" else "fp32"  # the builder's CPU graphs are fp32
    # in this process: a process of its own spent ~13 s importing torch and transformers again, for a graph that takes
    # the builder 0.4 s (the test shape) or ~1 minute (1.5B)
    from onnxruntime_genai.models.builder import create_model, parse_extra_options

    args = ("", str(checkpoint), str(out), precision, provider, str(workdir / f"{name}-cache"))
    built = guard(lambda: create_model(*args, **parse_extra_options(*args, [])))
    record["build_s"] = round(time.perf_counter() - start, 1)
    if isinstance(built, dict):
        return record | {"error": f"the builder failed: {built['error']}", "traceback": built["traceback"]}
    modes = {"plain": False} | ({"cuda graphs": True} if provider == "cuda" else {})
    for mode, graphs in modes.items():
        record[mode] = guard(lambda graphs=graphs: peer_latency(out / "model.onnx", provider, graphs, past, capacity,
                                                                shape["head_dim"]))
    return record


def peer_latency(path: Path, provider: str, graphs: bool, past: int, capacity: int, head_dim: int, tokens=TOKENS,
                 calls: int = CALLS) -> dict:
    """ms per call of an onnxruntime-genai decoder graph at batch 1 after ``past`` tokens, run as its runtime runs it:
    past and present K/V one shared buffer of ``capacity`` slots, the attention mask a static [1, capacity] buffer
    (ones over the past and the new tokens), every input and output bound once where the session computes, the
    logits left there; under CUDA graphs one graph id per token count."""
    from specdeploy.engines.graphs import run_options
    from specdeploy.engines.ort import TYPES, CudaMemory, HostMemory, bind

    memory = CudaMemory() if provider == "cuda" else HostMemory()
    session, kv = _peer_session(path, provider, graphs, memory, capacity, head_dim)
    vocab = session.get_outputs()[0].shape[-1]
    logits_type = TYPES[session.get_outputs()[0].type]
    mask = np.zeros((1, capacity), np.int64)
    timings = {}
    for t in tokens:
        ids = memory.empty((1, t), np.int64)
        device_mask = memory.empty((1, capacity), np.int64)
        logits = memory.empty((1, t, vocab), logits_type)
        binding = session.io_binding()
        bind(binding, "input_ids", memory.name, ids)
        bind(binding, "attention_mask", memory.name, device_mask)
        for name, buffer in kv.items():
            bind(binding, name, memory.name, buffer)
            present = name.replace("past_key_values.", "present.")
            bind(binding, present, memory.name, buffer, output=True)
        bind(binding, session.get_outputs()[0].name, memory.name, logits, output=True)
        memory.upload(ids, np.random.default_rng(t).integers(0, vocab, (1, t)))
        mask[0, : past + t] = 1
        memory.upload(device_mask, mask)
        timings[f"T{t}"] = _bound_run_ms(session, binding, run_options(t if graphs else -1), calls)
    return timings


def _peer_session(path: Path, provider: str, graphs: bool, memory, capacity: int, head_dim: int):
    """(session, K/V buffers): an ONNX Runtime session of the peer's graph on ``provider`` and a zeroed
    [1, kv_heads, capacity, head_dim] buffer in ``memory`` per past_key_values input, by name."""
    import onnxruntime as ort

    from specdeploy.engines.ort import TYPES

    options = ort.SessionOptions()
    options.log_severity_level = 3
    device_options = memory.provider_options() | ({"enable_cuda_graph": "1"} if graphs else {})
    chain = [("CUDAExecutionProvider", device_options), "CPUExecutionProvider"] if provider == "cuda" else [
        "CPUExecutionProvider"]
    session = ort.InferenceSession(str(path), options, providers=chain)
    kv = {}
    for value in session.get_inputs():
        if value.name.startswith("past_key_values."):
            kv_heads = value.shape[1]  # its head size is a named dim ("kv_cache_dim")
            kv[value.name] = memory.zeros((1, kv_heads, capacity, head_dim), TYPES[value.type])
    return session, kv


def _bound_run_ms(session, binding, run, calls: int) -> dict:
    """Median and p90 ms of ``calls`` runs of ``session`` over ``binding``, after 3 unmeasured ones."""
    walls = []
    for i in range(calls + 3):
        start = time.perf_counter()
        session.run_with_iobinding(binding, run)
        if i >= 3:
            walls.append(time.perf_counter() - start)
    return {"median_ms": ms(statistics.median(walls)), "p90_ms": ms(np.percentile(walls, 90))}


def cost_tables(target, draft, rounds: int = 3) -> dict:
    """tools/replay.py's cost table of ``target`` and ``draft`` (its ``measure``, on these engines)."""
    from tools import replay

    return replay.measure(SimpleNamespace(target=target, draft=draft), rounds=rounds, log=lambda message: None)


def replay_speedups(traces: Path, table: dict, max_new_tokens: int = 128, ks=(1, 2, 3, 4)) -> dict:
    """Tokens per second of the real runtime over the recorded traces of the real pair (its acceptance) at ``table``'s
    costs, plain and speculative (tools/replay.py's configurations); speedups over plain."""
    from dataclasses import replace

    from tools import replay

    data = json.loads(traces.read_text())
    data["costs"] = table
    rates = {}
    for name, config in replay.configurations(list(ks)).items():
        rows = replay.replay(data, replace(config, max_new_tokens=max_new_tokens))
        rates[name] = sum(r["tokens"] for r in rows) / sum(r["seconds"] for r in rows)
    return {"tokens_per_s": {k: round(v, 2) for k, v in rates.items()},
            "speedup_over_plain": {k: round(v / rates["plain"], 3) for k, v in rates.items() if k != "plain"}}


def guard(work):
    """``work()``, or {"error": the exception and the traceback's last lines} if it raised."""
    try:
        return work()
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {str(exc)[:500]}",
                "traceback": traceback.format_exc().strip().splitlines()[-6:]}


def ms(seconds: float) -> float:
    return round(1000 * float(seconds), 3)


def scratch(prefix: str) -> Path:
    """A temporary folder for written graphs (removed by the caller's ``shutil.rmtree``)."""
    return Path(tempfile.mkdtemp(prefix=prefix))
