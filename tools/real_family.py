"""A family's real weights, checked against transformers: greedy output of the same GGUF, token for token.

The tiny random models of the test suite prove each family's graph equal to transformers' forward; this tool does
the same for a real checkpoint, where weights, vocabulary and the config's own settings (windows, RoPE bases,
soft-caps) are the ones users run. It fetches the model's pinned GGUF (``tools.fetch_models``), exports it at fp32
(cached), and decodes each prompt greedily twice: with transformers' own model over the same GGUF file dequantized
to fp32 (a token at a time over its own cache, EOS not forbidden), and with specdeploy plain decoding. With
``--int4`` it also exports int4 and compares specdeploy's speculative decoding (the suffix index) with its own plain
decoding of that artifact. Where two outputs part, it reports the position and the reference's top-two margin
there (a near-tie or not).

    python -m tools.real_family --model gemma3-270m [--tokens 32] [--graph fused] [--int4] [--out FILE]

Exits 1 when an fp32 output differs from transformers' other than at a near-tie (margin below --near-tie).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from tools import arguments

# Three prompts of different kinds: code, a question, prose to continue. Tokenized with the artifact's tokenizer
# (``Pipeline.encode``, BOS as the model's tokenizer adds it) and sent to both as the same ids.
PROMPTS = (
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Question: Why is the sky blue? Answer:",
    "The history of the printing press begins",
)


def export(gguf: Path, out: Path, graph: str, weights: str, log) -> Path:
    """The artifact of ``gguf`` at ``weights`` in the ``graph`` form, exported once into ``out``."""
    if (out / "manifest.json").is_file():
        return out
    log(f"exporting {gguf.name} ({weights}, {graph}) to {out}")
    command = [sys.executable, "-m", "specdeploy.cli", "export", "--target", str(gguf), "--out", str(out),
               "--weights", weights, "--graph", graph, "--capacity", "1024", "--force"]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"real_family: export failed:\n{result.stdout[-2000:]}{result.stderr[-2000:]}")
    return out


def reference(gguf: Path, prompts: list[list[int]], tokens: int, log) -> tuple[list[list[int]], list[list[float]]]:
    """transformers' greedy tokens for each prompt's ids, and its top-two margin at each generated position."""
    import torch
    from transformers import AutoModelForCausalLM

    began = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    log(f"transformers loaded {gguf.name} in {time.perf_counter() - began:.0f} s")
    outputs, margins = [], []
    for ids in prompts:  # greedy by hand: generate(min_new_tokens=...) would forbid EOS, which plain decoding keeps
        tokens_so_far, past, step = [], None, torch.tensor([ids])
        mine = []
        with torch.no_grad():
            for _ in range(tokens):
                out = model(step, past_key_values=past, use_cache=True)
                logits, past = out.logits[0, -1].float(), out.past_key_values
                top = torch.topk(logits, 2).values
                mine.append(float(top[0] - top[1]))
                tokens_so_far.append(int(logits.argmax()))
                step = torch.tensor([[tokens_so_far[-1]]])
        outputs.append(tokens_so_far)
        margins.append(mine)
    return outputs, margins


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where ``a`` and ``b`` differ (one ending early counts), or None."""
    for position, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return position
    return None if len(a) == len(b) else min(len(a), len(b))


def run(args: argparse.Namespace, log=print) -> dict:
    from specdeploy import GenerationConfig, Pipeline
    from tools.fetch_models import fetch

    gguf = args.gguf or fetch(args.model, args.cache, log=log)
    artifacts = args.cache / "artifacts"
    fp32 = export(gguf, artifacts / f"{gguf.stem}-fp32-{args.graph}", args.graph, "full", log)
    pipeline = Pipeline.load(fp32, threads=args.threads)
    prompt_ids = [pipeline.encode(text).tolist() for text in PROMPTS]
    plain = GenerationConfig(drafter="none", max_new_tokens=args.tokens, ignore_eos=True)
    ours = [result.token_ids for result in pipeline.generate(prompt_ids, plain, batch_size=1)]
    pipeline.close()
    theirs, margins = reference(gguf, prompt_ids, args.tokens, log)
    rows, failed = [], False
    for text, mine, their, margin in zip(PROMPTS, ours, theirs, margins):
        at = first_difference(their, mine)
        near_tie = at is not None and at < len(margin) and margin[at] < args.near_tie
        failed |= at is not None and not near_tie
        rows.append({"prompt": text, "tokens": len(their), "first_difference": at,
                     "margin_there": None if at is None or at >= len(margin) else margin[at], "near_tie": near_tie})
        log(f"fp32 {text[:40]!r}: " + ("identical" if at is None else
                                        f"differs at {at} (transformers' margin {margin[at]:.4f})"))
    report = {"model": args.model, "gguf": gguf.name, "graph": args.graph, "tokens": args.tokens, "fp32": rows}
    if args.int4:
        int4 = export(gguf, artifacts / f"{gguf.stem}-int4-{args.graph}", args.graph, "int4", log)
        pipeline = Pipeline.load(int4, threads=args.threads)
        plain4 = pipeline.generate(prompt_ids, plain, batch_size=1, suffix_index=None, scope=None)
        suffix = GenerationConfig(drafter="suffix", max_new_tokens=args.tokens, ignore_eos=True)
        spec4 = pipeline.generate(prompt_ids, suffix, batch_size=1, suffix_index=None, scope=None)
        report["int4_suffix"] = []
        for text, a, b in zip(PROMPTS, plain4, spec4):
            at = first_difference(a.token_ids, b.token_ids)
            divergence = None if at is None else pipeline.first_divergence(text, a.token_ids, b.token_ids, plain)
            report["int4_suffix"].append({"prompt": text, "first_difference": at, "divergence": divergence,
                                          "accepted_per_cycle": b.stats.get("mean_accepted_length")})
            log(f"int4 suffix vs int4 plain {text[:40]!r}: " + ("identical" if at is None else f"differs at {at}"))
        pipeline.close()
    report["passed"] = not failed
    return report


def main() -> None:
    from tools.fetch_models import DEFAULT_CACHE, MODELS

    parser = arguments.parser(__doc__)
    parser.add_argument("--model", default="gemma3-270m", choices=sorted(MODELS), help="the pinned GGUF to check")
    parser.add_argument("--gguf", type=Path, default=None, help="a GGUF file of your own instead of --model's")
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="where GGUF files and artifacts are kept")
    parser.add_argument("--tokens", type=arguments.integer(1), default=32, help="greedy tokens per prompt (at least 1)")
    parser.add_argument("--graph", choices=("explicit", "fused"), default="fused", help="the graph form exported")
    parser.add_argument("--int4", action="store_true", help="also export int4 and check the suffix drafter's greedy "
                        "output against int4 plain decoding")
    parser.add_argument("--near-tie", type=arguments.number(0.0), default=1e-3, help="a difference where transformers' top two "
                        "logits are closer than this is reported, not failed")
    parser.add_argument("--threads", type=arguments.integer(1), default=2, help="ONNX Runtime threads")
    parser.add_argument("--out", type=Path, default=None, help="write the report as JSON here")
    args = parser.parse_args()
    if args.gguf is not None and not args.gguf.is_file():
        parser.error(f"--gguf: {args.gguf} is not a file")
    report = run(args, log=lambda message: print(message, file=sys.stderr))
    text = json.dumps(report, indent=1, default=lambda value: value.tolist() if isinstance(value, np.ndarray) else str(value))
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    sys.exit(0 if report["passed"] else 1)


if __name__ == "__main__":
    main()
