"""Where one call's time goes inside OpenVINO, per operator type, at each token count.

ONNX Runtime's profiler sees an OpenVINO-placed graph as one node (the EP's compiled subgraph), so this tool compiles
the artifact's graph with OpenVINO itself (the ``openvino`` package of the version the EP bundles:
``onnxruntime-openvino`` 1.24.1 bundles OpenVINO 2025.4.1), as the EP does (device CPU, the precision given, the
threads given, one stream), with its performance counters on, and runs it at each token count after a past of
``--past`` slots in caches of ``--capacity`` (random K/V), rounds interleaved. Prints, per operator type as OpenVINO's
CPU plugin runs it (its fused nodes: ``FullyConnectedCompressed`` for an int4 MatMulNBits, ``Subgraph`` for a fused
attention or elementwise run, ``RMS``, ``RoPE``), the median milliseconds a call spends in it; the sum of the counters
and the call's wall time, whose difference is what the plugin spends between nodes (shape preparation, copies).

    build/ov-native-venv/bin/python -m tools.profile_openvino --artifact DIR [--role target] [--tokens 1,5,9]
        [--past 200] [--capacity 2048] [--rounds 5] [--threads 2] [--precision f32] [--out FILE.json]
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

from tools.arguments import artifact, integer, integers, parser


def profile(path: Path, spec: dict, token_counts: list[int], past: int, capacity: int, rounds: int, threads: int,
            precision: str) -> dict:
    """{"ops": {T: {op type: median ms}}, "counted": {T: ms}, "wall": {T: ms}, "compile_s": seconds}."""
    import openvino

    core = openvino.Core()
    began = time.perf_counter()
    compiled = core.compile_model(core.read_model(str(path)), "CPU", {
        "PERF_COUNT": "YES", "INFERENCE_PRECISION_HINT": precision, "INFERENCE_NUM_THREADS": threads,
        "NUM_STREAMS": 1})
    compile_s = time.perf_counter() - began
    request = compiled.create_infer_request()
    names = [port.get_any_name() for port in compiled.inputs]
    rng = np.random.default_rng(0)
    caches = {name: rng.standard_normal((1, spec["kv_heads"], capacity, spec["head_dim"])).astype(np.float32)
              for name in names if name.startswith("cache_")}
    feeds = {}
    for t in token_counts:
        feed = {"input_ids": rng.integers(0, spec["vocab_size"], (1, t)), "past_len": np.array([past], np.int64), **caches}
        if "num_logits" in names:
            feed["num_logits"] = np.array([t], np.int64)  # every position's logits, as a verification keeps them
        feeds[t] = feed
        request.infer(feed)  # the first call of a shape prepares it
    ops = {t: defaultdict(list) for t in token_counts}
    counted, wall = defaultdict(list), defaultdict(list)
    for _ in range(rounds):
        for t in token_counts:
            began = time.perf_counter()
            request.infer(feeds[t])
            wall[t].append((time.perf_counter() - began) * 1e3)
            per = defaultdict(float)
            for info in request.profiling_info:
                per[info.node_type] += info.real_time.total_seconds() * 1e3
            for op, ms in per.items():
                ops[t][op].append(ms)
            counted[t].append(sum(per.values()))
    return {"ops": {t: {op: statistics.median(v) for op, v in by_op.items()} for t, by_op in ops.items()},
            "counted": {t: statistics.median(v) for t, v in counted.items()},
            "wall": {t: statistics.median(v) for t, v in wall.items()}, "compile_s": compile_s}


def report(result: dict, token_counts: list[int], top: int = 12) -> list[str]:
    last = token_counts[-1]
    order = sorted(result["ops"][last], key=lambda op: -result["ops"][last][op])
    lines = ["op type".ljust(28) + "".join(f"T={t:<9}" for t in token_counts)]
    for op in order[:top]:
        lines.append(op.ljust(28) + "".join(f"{result['ops'][t].get(op, 0.0):<11.2f}" for t in token_counts))
    lines.append("sum of the counters".ljust(28) + "".join(f"{result['counted'][t]:<11.2f}" for t in token_counts))
    lines.append("call (wall)".ljust(28) + "".join(f"{result['wall'][t]:<11.2f}" for t in token_counts))
    return lines


def main() -> None:
    options = parser(__doc__)
    options.add_argument("--artifact", type=artifact, required=True)
    options.add_argument("--role", choices=["target", "draft"], default="target")
    options.add_argument("--tokens", type=integers(1, "token counts"), default=[1, 5, 9])
    options.add_argument("--past", type=integer(0), default=200)
    options.add_argument("--capacity", type=integer(2), default=None, help="cache slots [default: the artifact's]")
    options.add_argument("--rounds", type=integer(1), default=5)
    options.add_argument("--threads", type=integer(1), default=2)
    options.add_argument("--precision", choices=["f32", "bf16"], default="f32", help="OpenVINO's inference precision")
    options.add_argument("--out", type=Path, default=None)
    args = options.parse_args()
    manifest = json.loads((args.artifact / "manifest.json").read_text())
    spec = manifest["models"][args.role]
    capacity = args.capacity or spec["capacity"]
    load = os.getloadavg()
    print(f"{args.artifact} {args.role}: past {args.past}, capacity {capacity}, {args.threads} threads, precision "
          f"{args.precision}; load {load[0]:.1f}; median ms a call of {args.rounds} rounds")
    result = profile(args.artifact / spec["file"], spec, args.tokens, args.past, capacity, args.rounds, args.threads,
                     args.precision)
    for line in report(result, args.tokens):
        print(line)
    if args.out is not None:
        args.out.write_text(json.dumps({"artifact": str(args.artifact), "role": args.role, "past": args.past,
                                        "capacity": capacity, "load": load, **result}, indent=1))


if __name__ == "__main__":
    main()
