"""What a verification costs a mixture of experts (issue 68): a call of T = 1..9 tokens against one token's, on a random
mixture as wide as a real one (Qwen3-30B-A3B's routing: 128 experts, 8 chosen a token, each expert 3/8 of the hidden
size wide, norms and attention as Qwen3's) at a hidden size that fits a small machine, in both graph forms.

One token reads its 8 experts' weights; a verification of T tokens reads those of every expert any of its tokens
chose, up to 8 T. ONNX Runtime's MoE / QMoE (the fused form) runs each chosen expert once over the tokens that chose
it; the explicit form gathers each token's 8 (T x 8 experts' weights a call, duplicates included). The router's weights
are transformers' initialisation (std 0.02), so a token's choice is nearly uniform: each verified token adds as many
new experts as it can, the most a verification can cost (a trained router's neighbouring tokens share experts more).

Beside it, measured in the same rounds (interleaved, so the machine's load hits both alike), a dense Qwen3 of the
same active size: the same attention, one MLP as wide as the top_k experts together. Prints, per form, the median
(``--quickest``: the quickest round, the least disturbed where other work loads the machine) seconds of a call at
T = 1..9 after a past of 384 (and the ratio to T = 1) of both, and the K the cost policy chooses
(``runtime.cost_policy``: the K of the most expected tokens a second) at acceptance rates 0.5 .. 0.9, for drafts that
cost no model call (prompt lookup, the suffix index) and for the draft model's, for both and for the dense pair's
recorded table (``--traces``: Qwen2.5-Coder 1.5B / 0.5B, another machine). ``--out DIR`` writes each form's cost table in
tools/replay.py's format (``costs_MODEL_FORM_WEIGHTS.json``, the mixture's and the dense model's): its measured target
calls, and the recorded pair's
draft calls scaled by the ratio of the two targets' one-token calls (a draft that costs what the recorded draft costs
against its target). Then ``python -m tools.replay run --traces TRACES --costs DIR/costs_mixture_fused_int4.json``
replays the recorded texts at the mixture's costs.

    python -m tools.bench_moe_cost [--experts 128] [--top-k 8] [--hidden 512] [--layers 8] [--vocab 32000]
        [--forms fused,explicit] [--weights int4] [--rounds 5] [--quickest] [--threads 2] [--out DIR] [--work DIR]
"""

from __future__ import annotations

import json
import statistics
import tempfile
from pathlib import Path

from tools import arguments

ACCEPTANCE = (0.5, 0.6, 0.7, 0.8, 0.9)
PAST = 384  # the past the printed curve and the policy's K are read at (one of tools.replay's PASTS)


def build(work: Path, experts: int, top_k: int, hidden: int, layers: int, vocab: int, capacity: int) -> Path:
    """A random Qwen3-MoE checkpoint of these sizes (head_dim 64, 4 query heads to a key/value head, experts 3/8 of the
    hidden size wide) with a word-level tokenizer, saved under ``work``; with ``experts`` 0, the dense Qwen3 of the same
    active size (its MLP ``top_k`` experts wide)."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoConfig, AutoModelForCausalLM

    sizes = dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=hidden // 64,
                 num_key_value_heads=max(1, hidden // 256), head_dim=64, max_position_embeddings=capacity,
                 tie_word_embeddings=False, eos_token_id=2, bos_token_id=1)
    if experts:
        config = AutoConfig.for_model("qwen3_moe", **sizes, moe_intermediate_size=3 * hidden // 8,
                                      intermediate_size=3 * hidden, num_experts=experts, num_experts_per_tok=top_k,
                                      norm_topk_prob=True)
        directory = work / f"qwen3_moe-{experts}x{top_k}-h{hidden}-l{layers}"
    else:
        config = AutoConfig.for_model("qwen3", **sizes, intermediate_size=top_k * 3 * hidden // 8)
        directory = work / f"qwen3-dense-{top_k}x-h{hidden}-l{layers}"
    torch.manual_seed(0)
    if not (directory / "config.json").is_file():
        AutoModelForCausalLM.from_config(config).save_pretrained(directory)
        words = {f"w{i}": i for i in range(vocab)}
        tokenizer = Tokenizer(models.WordLevel(words, unk_token="w0"))
        tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        tokenizer.save(str(directory / "tokenizer.json"))
    return directory


def exported(checkpoint: Path, work: Path, form: str, weights: str, capacity: int) -> Path:
    from specdeploy.exporter import export_artifact

    out = work / f"{checkpoint.name}-{form}-{weights}"
    if not (out / "manifest.json").is_file():
        export_artifact(checkpoint, out, graph=form, weights=weights, capacity=capacity, force=True,
                        progress=lambda step: print(f"  {step}", flush=True))
    return out


def policy_k(target_full: dict, draft_full: dict | None, pasts: list[int], rate: float, model: bool) -> int:
    """The cost policy's K at acceptance ``rate`` at every position, from a cost table's calls at ``PAST``."""
    from specdeploy.runtime.cost_policy import Costs, best_k, cycle_prices, expected_rates

    at = pasts.index(PAST)
    costs = Costs(verify={(1, int(t)): seconds[at] for t, seconds in target_full.items()})
    if model:
        costs.draft = {(1, int(t)): seconds[at] for t, seconds in draft_full.items()}
    rates = expected_rates([rate] * 8, cycle_prices(costs, 1, 8, model))
    return best_k(rates)


def scaled_draft(recorded: dict, target: dict) -> dict:
    """The recorded pair's draft costs times (this target's one-token call / the recorded target's), past by past."""
    ratio = [ours / theirs for ours, theirs in zip(target["full"]["1"], recorded["target"]["full"]["1"])]
    return {kind: {t: [s * r for s, r in zip(seconds, ratio)] for t, seconds in calls.items()}
            for kind, calls in recorded["draft"].items()}


def main() -> None:
    from specdeploy.contract import Manifest
    from specdeploy.engines import load_engine
    from tools.replay import PASTS, measure_engines

    args = _parser().parse_args()
    recorded = json.loads(args.traces.read_text())["costs"]
    capacity = max(PASTS) + 512 + 16
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-moe-"))
    checkpoints = {"target": build(work, args.experts, args.top_k, args.hidden, args.layers, args.vocab, capacity),
                   "dense": build(work, 0, args.top_k, args.hidden, args.layers, args.vocab, capacity)}
    tables, rows = {}, {"dense pair (recorded)": recorded}  # tables: (model, form) -> a cost table
    for form in args.forms:
        engines = {}
        for role, checkpoint in checkpoints.items():
            directory = exported(checkpoint, work, form, args.weights, capacity)
            engines[role] = load_engine(directory, Manifest.read(directory), "target", threads=args.threads)
            print(f"{form} {args.weights} {role}: {', '.join(engines[role].spec.features)}", flush=True)
        table = measure_engines(engines, args.rounds, log=lambda line: print(f"  {line}", flush=True),
                                statistic=min if args.quickest else statistics.median)
        for model, role in (("mixture", "target"), ("dense", "dense")):
            tables[model, form] = {"pasts": table["pasts"], "target": table[role],
                                   "draft": scaled_draft(recorded, table[role])}
        rows[f"mixture {form} {args.weights}"] = tables["mixture", form]
        rows[f"dense, same active {form}"] = tables["dense", form]
        del engines
    print(f"\n{'quickest' if args.quickest else 'median'} seconds of one batch-1 call after a past of {PAST}, and against "
          "one token:")
    for label, table in rows.items():
        full, at = table["target"]["full"], table["pasts"].index(PAST)
        cells = "  ".join(f"T={t}: {full[str(t)][at] * 1e3:6.1f} ms ({full[str(t)][at] / full['1'][at]:.2f}x)"
                          for t in range(1, 10))
        print(f"  {label:<28} {cells}")
    print("\nthe cost policy's K by acceptance a draft keeps (at every position):")
    print(f"  {'':<28} " + "  ".join(f"a={rate}" for rate in ACCEPTANCE) + "   (free drafts | draft model's)")
    for label, table in rows.items():
        free = [policy_k(table["target"]["full"], None, table["pasts"], rate, False) for rate in ACCEPTANCE]
        model = [policy_k(table["target"]["full"], table["draft"]["full"], table["pasts"], rate, True)
                 for rate in ACCEPTANCE]
        print(f"  {label:<28} " + "  ".join(f"{f:>2} | {m:<2}" for f, m in zip(free, model)))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        for (model, form), table in tables.items():
            what = (f"a random Qwen3-MoE ({args.experts} experts, top-{args.top_k}" if model == "mixture" else
                    f"a random dense Qwen3 of the mixture's active size (its MLP {args.top_k} experts wide")
            note = (f"{what}, hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}), {form} form, {args.weights} "
                    f"weights, {args.threads} threads: its target calls measured by tools/bench_moe_cost.py; the "
                    "draft's are the recorded pair's (tools/replay_data/traces.json) scaled by the ratio of the two "
                    "targets' one-token calls")
            path = args.out / f"costs_{model}_{form}_{args.weights}.json"
            path.write_text(json.dumps({"note": note, "costs": table}, indent=1))
            print(f"wrote {path}")


def _parser():
    parser = arguments.parser(__doc__)
    parser.add_argument("--experts", type=arguments.integer(2), default=128, help="experts a layer")
    parser.add_argument("--top-k", type=arguments.integer(1), default=8, help="experts chosen a token")
    parser.add_argument("--hidden", type=arguments.integer(64), default=512, help="hidden size (a multiple of 64)")
    parser.add_argument("--layers", type=arguments.integer(1), default=8, help="layers, all sparse")
    parser.add_argument("--vocab", type=arguments.integer(16), default=32000, help="vocabulary")
    parser.add_argument("--forms", type=lambda text: [f for f in text.split(",") if f], default="fused,explicit",
                        help="comma list of graph forms (fused, explicit)")
    parser.add_argument("--weights", default="int4", choices=["full", "int8", "int4"], help="weight format")
    parser.add_argument("--rounds", type=arguments.integer(1), default=5, help="measured rounds of each call")
    parser.add_argument("--threads", type=arguments.integer(1), default=2, help="ONNX Runtime threads")
    parser.add_argument("--quickest", action="store_true", help="each call's quickest round instead of its median: on "
                        "a machine others load, the least disturbed measurement")
    parser.add_argument("--traces", type=Path, default=Path("tools/replay_data/traces.json"),
                        help="the recorded dense pair's traces, whose cost table is compared and whose draft is scaled")
    parser.add_argument("--out", type=Path, default=None, help="a folder for each form's cost table")
    parser.add_argument("--work", type=Path, default=None, help="where the checkpoint and artifacts go (kept; reused)")
    return parser


if __name__ == "__main__":
    main()
