"""int8 weights at 7 bits (exporter 0.3.3 on) against 8 (before): accuracy against fp32, speed, on this CPU.

Without VNNI, ONNX Runtime's uint8 x int8 GEMM adds pairs of products in saturating int16, so full-range
int8 weights can overflow it; 7-bit weights cannot (``specdeploy/exporter/int8.py``). This exports one
checkpoint with full weights (explicit graph), rewrites copies of it with ``to_int8_per_row`` at both
ranges, runs HumanEval prompts with their canonical solutions through each in one call, and prints, per
variant, the top-1 agreement with fp32 over every position and the relative logits error, then the median
time of a 1- and a 5-token call after a 64-token prefix (both ranges run the same kernel).

    python -m tools.bench_int8_range --checkpoint GGUF_OR_DIR --workdir DIR [--tasks 4] [--rounds 7] [--out FILE]
"""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

try:
    from tools import arguments
except ImportError:  # run as a script (python tools/bench_int8_range.py): its folder is on the path
    import arguments

VARIANTS = {"int8, 7-bit weights (0.3.3)": True, "int8, 8-bit weights (0.3.2)": False}


def main(argv: list[str] | None = None) -> int:
    parser = arguments.parser(__doc__)
    parser.add_argument("--checkpoint", required=True, help="a .gguf file or HF model dir (the model to quantize)")
    parser.add_argument("--workdir", type=Path, required=True, help="where the three exports go (reused if there)")
    parser.add_argument("--tasks", type=arguments.integer(1), default=4,
                        help="HumanEval tasks (prompt + canonical solution) to score")
    parser.add_argument("--rounds", type=arguments.integer(1), default=7, help="timed calls per size and variant (median reported)")
    parser.add_argument("--out", type=Path, help="write the figures as JSON here")
    args = parser.parse_args(argv)
    if args.tasks < 1 or args.rounds < 1:
        parser.error("--tasks and --rounds must be at least 1")

    from specdeploy.contract import Manifest
    from specdeploy.workloads import humaneval_records

    directories = _exports(args.checkpoint, args.workdir)
    full = directories["fp32"]
    manifest = Manifest.read(full)

    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(full / manifest.tokenizer))
    records = humaneval_records()[: args.tasks]
    texts = [np.array([tokenizer.encode(r["prompt"] + r["canonical_solution"]).ids[: manifest.target.capacity - 8]])
             for r in records]
    figures = _figures(directories, texts, args.rounds)
    print(f"{args.checkpoint}: {len(texts)} HumanEval tasks, {sum(t.shape[1] for t in texts)} positions, vs fp32")
    print(f"{'variant':32} {'top-1':>7} {'err mean':>9} {'err max':>8} {'T=1 ms':>8} {'T=5 ms':>8}")
    for name, row in figures.items():
        quality = (f"{row['top-1 agreement']:7.3f} {row['relative error mean']:9.3f} {row['relative error max']:8.3f}"
                   if name in VARIANTS else f"{'-':>7} {'-':>9} {'-':>8}")
        print(f"{name:32} {quality} {row['ms T=1']:8.1f} {row['ms T=5']:8.1f}")
    if args.out:
        args.out.write_text(json.dumps({"checkpoint": str(args.checkpoint), "figures": figures}, indent=2))
    return 0


def _exports(checkpoint: str, workdir: Path) -> dict[str, Path]:
    """The fp32 export and its int8 rewrite at each range, by variant name; each made once, reused after."""
    from specdeploy.contract import Manifest
    from specdeploy.exporter.int8 import to_int8_per_row
    from specdeploy.exporter.onnx_graph import EXTERNAL_DATA_BYTES

    full = workdir / "full"
    if not (full / "manifest.json").is_file():
        print(f"exporting {checkpoint} with full weights to {full} ...", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "specdeploy.cli", "export", "--target", checkpoint, "--out", str(full),
                        "--force"], check=True)
    manifest = Manifest.read(full)
    directories = {"fp32": full}
    for name, reduce_range in VARIANTS.items():
        directory = workdir / ("int8-7bit" if reduce_range else "int8-8bit")
        if not (directory / ".done").is_file():
            shutil.rmtree(directory, ignore_errors=True)
            shutil.copytree(full, directory)
            started = time.perf_counter()
            to_int8_per_row(directory / manifest.target.file, EXTERNAL_DATA_BYTES, reduce_range=reduce_range)
            print(f"{name}: rewritten in {time.perf_counter() - started:.0f} s", file=sys.stderr)
            (directory / ".done").touch()
        directories[name] = directory
    return directories


def _figures(directories: dict[str, Path], texts: list[np.ndarray], rounds: int) -> dict[str, dict]:
    """Per variant: the timed calls' median ms and, against fp32, the top-1 agreement and relative logits error."""
    from specdeploy.contract import Manifest
    from specdeploy.engines import load_engine

    figures: dict[str, dict] = {}
    logits: dict[str, list[np.ndarray]] = {}
    for name, directory in directories.items():
        engine = load_engine(directory, Manifest.read(directory), "target", "cpu", 2)
        logits[name] = [_run(engine, ids) for ids in texts]
        figures[name] = {f"ms T={t}": _time(engine, texts[0], t, rounds) for t in (1, 5)}
        del engine
    reference = logits["fp32"]
    for name in VARIANTS:
        agree = np.concatenate([(a.argmax(-1) == b.argmax(-1)).ravel() for a, b in zip(logits[name], reference)])
        error = np.concatenate([(np.linalg.norm(a - b, axis=-1) / np.linalg.norm(b, axis=-1)).ravel()
                                for a, b in zip(logits[name], reference)])
        figures[name] |= {"top-1 agreement": float(agree.mean()), "relative error mean": float(error.mean()),
                          "relative error max": float(error.max()), "positions": int(agree.size)}
    return figures


def _run(engine, ids: np.ndarray) -> np.ndarray:
    """Every position's logits [tokens, vocab] of one call over a fresh cache."""
    cache = engine.allocate_cache(1, engine.spec.capacity)
    return engine.infer(ids, np.zeros(1, np.int64), cache).logits[0].copy()


def _time(engine, ids: np.ndarray, tokens: int, rounds: int) -> float:
    """Median ms of a ``tokens``-token call after a prefix of up to 64 tokens (the first call is a warm-up)."""
    prefix = min(64, ids.shape[1] - tokens)
    cache = engine.allocate_cache(1, engine.spec.capacity)
    engine.infer(ids[:, :prefix], np.zeros(1, np.int64), cache)
    step, seconds = ids[:, prefix : prefix + tokens], []
    for _ in range(rounds + 1):
        started = time.perf_counter()
        engine.infer(step, np.array([prefix], np.int64), cache)
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds[1:]) * 1e3


if __name__ == "__main__":
    sys.exit(main())
