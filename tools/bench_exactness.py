"""How far a verification's arithmetic moves a target's logits from plain decoding's: what a "near-tie" is.

Speculative greedy decoding keeps the target's greedy token at every position, but it computes that position in a
call of K + 1 tokens, and a compressed target's kernels (int4 MatMulNBits, its activations quantized per block) do
not give bit-identical logits for another call size. Where the top two tokens are closer than that arithmetic moves
them, a speculative run can emit the other one. This tool measures the move on real text: each prompt decoded
plainly, then the same positions computed one token a call (as plain decoding does) and ``T`` tokens a call (a
verification), after the same prefill, in caches of the same size. Per call size it reports the largest change of
any logit, how far the margin between the one-token call's top two tokens moved (largest and median), and the
positions whose top token changed. A divergence whose margin (``Pipeline.first_divergence``) is inside the moves
seen here is the arithmetic's, not the runtime's.

``--ops`` says where the move comes from, op by op (``tools.op_diff``): over the first prompt and its plain greedy
tokens, the target's graph as ONNX Runtime optimizes it, every node's output exposed, is run at T = 1, T = 2 and each
size; per comparison it prints the first node whose output differs for the same position, the logits' and the written
K/V's largest change. Exact mode (``GenerationConfig.exact``) is chosen from what it shows.

``--provider`` runs the target on another execution provider (``openvino``, ``openvino:DEVICE:PRECISION``), and
``--against N`` compares each size with calls of N tokens instead of one (``--against 2``: exact mode's premise, that
in calls of an even number of tokens every row runs the same kernels, checked on that provider).

    python -m tools.bench_exactness --artifact ART [--humaneval 2] [--specbench 1] [--tokens 64] [--sizes 5,9]
        [--against 1] [--provider cpu] [--ops [--every-row]] [--out FILE]
"""

from __future__ import annotations

import json
import statistics
import tempfile
from pathlib import Path

import numpy as np

from tools.arguments import artifact, integer, integers, parser, refusing
from tools.bench_providers import provider_of


def logits_by_call(engine, sequence: list[int], start: int, size: int, capacity: int) -> np.ndarray:
    """The logits after each token of ``sequence[start:-1]`` ([positions, vocab]): the first ``start`` tokens
    prefilled, the rest fed ``size`` tokens a call, as a verification of ``size`` tokens feeds them."""
    from specdeploy.engines.base import prefill

    ids = np.array([sequence], np.int64)
    cache = engine.allocate_cache(1, capacity)
    prefill(engine, cache, ids, [start])
    rows, at = [], start
    while at < len(sequence) - 1:
        end = min(at + size, len(sequence) - 1)
        rows.append(np.array(engine.infer(ids[:, at:end], np.array([at], np.int64), cache).logits[0, : end - at]))
        cache.past_len[:] = end
        at = end
    return np.concatenate(rows)


def compare(one: np.ndarray, other: np.ndarray) -> dict:
    """``other``'s logits against the one-token calls' ``one``: the largest change of a logit, the moves of the margin
    between ``one``'s top two tokens, and the positions whose top token differs."""
    order = np.argsort(one, axis=1)
    first, second = order[:, -1], order[:, -2]
    rows = np.arange(len(one))
    margins = one[rows, first] - one[rows, second]
    moves = np.abs(margins - (other[rows, first] - other[rows, second]))
    return {"positions": len(one), "max_logit_change": float(np.abs(one - other).max()),
            "margin_move_max": float(moves.max()), "margin_move_median": float(np.median(moves)),
            "top_token_changed": int((other.argmax(axis=1) != first).sum())}


def measure(pipeline, prompts, tokens: int, sizes: list[int], log=print, against: int = 1) -> list[dict]:
    """Per prompt and call size, ``compare`` over the prompt's ``tokens`` plain greedy tokens, with calls of
    ``against`` tokens (one, as plain decoding calls; two, as exact mode's)."""
    from specdeploy import GenerationConfig

    config = GenerationConfig(drafter="none", max_new_tokens=tokens)
    out = []
    for group, prompt in prompts:
        ids = pipeline.encode(prompt.for_pipeline(pipeline)).tolist()  # text, or a chat prompt's rendered ids
        sequence = ids + pipeline.generate([ids], config, suffix_index=None, scope=None)[0].token_ids
        capacity = len(sequence) + max(sizes) + 1
        one = logits_by_call(pipeline.target, sequence, len(ids) - 1, against, capacity)
        for size in sizes:
            row = {"group": group, "prompt": prompt.id, "tokens_a_call": size, "against": against} | compare(
                one, logits_by_call(pipeline.target, sequence, len(ids) - 1, size, capacity))
            out.append(row)
            log(f"{group} {prompt.id}, {size} tokens a call against {against}: logits move up to "
                f"{row['max_logit_change']:.3f}; the top "
                f"two's margin up to {row['margin_move_max']:.3f} (median {row['margin_move_median']:.4f}); top token "
                f"changed at {row['top_token_changed']} of {row['positions']} positions")
    return out


def ops(pipeline, artifact: Path, prompt, tokens: int, sizes: list[int], every_row: bool) -> list[dict]:
    """``op_diff.op_report`` over ``prompt`` (a workload prompt) and its ``tokens`` plain greedy tokens (at least the
    widest size and one more), from the prompt's last token on."""
    from specdeploy import GenerationConfig
    from tools.op_diff import op_report

    ids = pipeline.encode(prompt.for_pipeline(pipeline)).tolist()
    config = GenerationConfig(drafter="none", max_new_tokens=max(tokens, max(sizes) + 1), ignore_eos=True)
    sequence = ids + pipeline.generate([ids], config, suffix_index=None, scope=None)[0].token_ids
    with tempfile.TemporaryDirectory() as work:
        return op_report(pipeline.target, artifact, sequence, len(ids) - 1, sizes, Path(work), every_row)


def kernels(spec, artifact: Path, log=print) -> list[dict]:
    """``op_diff.matmul_nbits_rows`` at two of the target's projection shapes (hidden -> hidden, hidden -> vocabulary;
    hidden = heads x head_dim), for block sizes 32 and 128 and accuracy levels 0 and 4."""
    from tools.op_diff import matmul_nbits_rows

    hidden = spec.num_heads * spec.head_dim
    shapes = [(hidden, hidden), (hidden, spec.vocab_size)]
    rows = []
    for k, n in shapes:
        for block in (32, 128):
            for accuracy in (0, 4):
                row = matmul_nbits_rows(k, n, block, accuracy)
                rows.append(row)
                log(f"K {k} N {n} block {block} accuracy {accuracy}: of {row['rows_compared']} rows (M = 2..9), "
                    f"{len(row['differ_from_one_row_call'])} differ from a one-row call, "
                    f"{len(row['differ_from_row_0_of_two'])} from a two-row call {row['differ_from_row_0_of_two'][:6]}")
    return rows


def export_facts(spec, directory: Path) -> dict:
    """How the target was exported: its manifest's graph form, weights, dtype, capacity and flags, and the int4
    quantizer's settings as its MatMulNBits nodes carry them (the manifest does not record them)."""
    import onnx

    graph = onnx.load(str(directory / spec.file), load_external_data=False).graph
    int4 = set()
    for node in (node for node in graph.node if node.op_type == "MatMulNBits"):
        attributes = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        int4.add((attributes.get("block_size"), attributes.get("accuracy_level", 0)))
    return {"graph": spec.graph, "weights": spec.weights, "dtype": spec.dtype, "capacity": spec.capacity,
            "slot_attention": spec.slot_attention, "architecture": spec.architecture, "layers": spec.num_layers,
            "matmulnbits_block_size_accuracy_level": sorted(int4)}


def main() -> None:
    options = parser(__doc__)
    options.add_argument("--artifact", type=artifact, required=True, help="the artifact whose target to measure")
    options.add_argument("--humaneval", type=integer(0), default=2, help="HumanEval prompts (the first N)")
    options.add_argument("--specbench", type=integer(0), default=1, help="Spec-Bench prompts per group")
    options.add_argument("--tokens", type=integer(2), default=64, help="plain greedy tokens decoded per prompt, then compared")
    options.add_argument("--sizes", type=integers(2, "sizes"), default="5,9",
                         help="comma list of tokens a call to compare with one (K + 1), each >= 2")
    options.add_argument("--threads", type=integer(1), default=2, help="ONNX Runtime threads")
    options.add_argument("--against", type=integer(1), default=1,
                         help="compare with calls of this many tokens (1: plain decoding's; 2: exact mode's)")
    options.add_argument("--provider", default="cpu",
                         help="execution provider of the target: cpu, openvino or openvino:DEVICE:PRECISION")
    options.add_argument("--ops", action="store_true",
                         help="the op-by-op report instead (tools.op_diff): where one position's arithmetic first differs "
                              "between call sizes, over the first prompt")
    options.add_argument("--every-row", action="store_true",
                         help="with --ops: compare every row of each call size, not only rows 1 and T - 1")
    options.add_argument("--kernels", action="store_true",
                         help="instead, one int4 MatMulNBits node at the artifact's target's shapes, each block size "
                              "(32, 128) and accuracy level (0, 4): which rows of an M-row call differ from a one-row "
                              "call and from a two-row call (tools.op_diff.matmul_nbits_rows)")
    options.add_argument("--out", type=Path, default=None, help="write every row and the summary as JSON")
    args = options.parse_args()
    sizes = args.sizes
    from specdeploy import Pipeline
    from specdeploy.workloads import workload

    with refusing(options):  # an artifact or a workload that cannot be had: one line, not a traceback
        pipeline = Pipeline.load(args.artifact, provider=provider_of(args.provider), threads=args.threads)
        prompts = workload(args.humaneval, args.specbench)
    import onnxruntime

    from tools.provenance import provenance

    # where the figures came from: date, command, machine, commit, ONNX Runtime, and how the target was exported
    facts = {"artifact": str(args.artifact), **provenance("tools.bench_exactness"),
             "onnxruntime": onnxruntime.__version__, "provider": pipeline.target.provider.key, "against": args.against,
             "target": export_facts(pipeline.target.spec, args.artifact)}
    if args.kernels:
        rows = kernels(pipeline.target.spec, args.artifact)
        if args.out:
            args.out.write_text(json.dumps(facts | {"kernels": rows}, indent=1))
        return
    if args.ops:
        rows = ops(pipeline, args.artifact, prompts[0][1], args.tokens, sizes, args.every_row)
        if args.out:
            args.out.write_text(json.dumps(facts | {"ops": rows}, indent=1))
        return
    rows = measure(pipeline, prompts, args.tokens, sizes, against=args.against)
    summary = {size: {"max_logit_change": max(r["max_logit_change"] for r in part),
                      "margin_move_max": max(r["margin_move_max"] for r in part),
                      "margin_move_median": statistics.median(r["margin_move_median"] for r in part),
                      "top_token_changed": sum(r["top_token_changed"] for r in part),
                      "positions": sum(r["positions"] for r in part)}
               for size in sizes for part in [[r for r in rows if r["tokens_a_call"] == size]]}
    for size, s in summary.items():
        print(f"all prompts, {size} tokens a call against {args.against}: logits move up to {s['max_logit_change']:.3f}; "
              f"the top two's margin "
              f"up to {s['margin_move_max']:.3f} (median of medians {s['margin_move_median']:.4f}); top token changed "
              f"at {s['top_token_changed']} of {s['positions']} positions")
    if args.out:
        args.out.write_text(json.dumps(facts | {"rows": rows, "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
