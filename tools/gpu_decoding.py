"""The decoding checks of tools/gpu_check.py, through the public API on one provider: greedy speculative decoding
against plain decoding for each drafter (the draft model at a fixed K, the suffix index, the default's hybrid drafter
at a fixed K and the default itself: that drafter under the cost policy, which prices by the costs this pipeline
measured on the provider) on a ragged batch and at batch 1; a conversation's second turn reusing the first's K/V (the
prefix cache, kept where the engine computes) against the same turn cold; exact mode (``GenerationConfig.exact``),
whose speculative output must be its plain output bit for bit; a verification rolled back to every length it can
leave (``rollback``), the next token's logits against a fresh prefill's on the CPU.

Where two greedy outputs part, the target's margin there is reported (``Pipeline.first_divergence``): the CPU and
a GPU, or a reused and a recomputed K/V, may part at a near-tie (|margin| <= NEAR_TIE); a larger margin is a bug.
Imported by tools.gpu_check (and its imported-graph check); needs numpy and onnxruntime.
"""

from __future__ import annotations

import statistics

import numpy as np

from tools.gpu_timing import guard

NEW_TOKENS = 24
NEAR_TIE = 0.1  # logit units: an fp16 target's logits (|x| ~ 10) carry errors of ~1e-2 between kernels
# case -> (k, batch_size: None = all prompts, drafter, policy); "default" is GenerationConfig's own speculation, whose
# cost policy drafts or not by the times it measured (a busy host's one slow call can price drafting out of a short
# run), so "hybrid-k4" drafts from the default's drafter whatever the costs. The suffix index is the pipeline's, which
# holds the earlier runs' answers to the same prompts: a random model's text does not repeat itself, so its own text
# alone would draft nothing
SPECULATIVE = {"k4": (4, None, "model", "fixed"), "k2": (2, None, "model", "fixed"), "k4-batch1": (4, 1, "model", "fixed"),
               "suffix-k4": (4, None, "suffix", "fixed"), "hybrid-k4": (4, None, "hybrid", "fixed"),
               "default": (8, None, "hybrid", "cost")}


def config(k: int = 0, drafter: str = "none", policy: str = "fixed", **settings):
    """A greedy GenerationConfig of NEW_TOKENS that ignores EOS (the tiny models' texts are random)."""
    from specdeploy import GenerationConfig

    return GenerationConfig(max_new_tokens=NEW_TOKENS, k=k or 8, drafter=drafter, policy=policy, ignore_eos=True,
                            **settings)


def speculative_cases(pipeline, prompts, plain_tokens: list[list[int]], label: str, cases=SPECULATIVE,
                      **settings) -> dict:
    """Each case of ``cases`` on ``pipeline`` against ``plain_tokens`` (its own plain output), as
    ``{f"spec {name} {label} vs plain": comparison}``; a drafter the artifact lacks (the model drafter without a draft
    model) is left out."""
    out = {}
    for name, (k, batch, drafter, policy) in cases.items():
        if drafter == "model" and pipeline.draft is None:
            continue
        run = config(k, drafter, policy, **settings)
        out[f"spec {name} {label} vs plain"] = guard(lambda c=run, b=batch: compare(
            pipeline, prompts, plain_tokens, pipeline.generate(prompts, c, batch_size=b), c))
    return out


def exactness(ref, dev, prompts: list[list[int]], provider: str, cases=SPECULATIVE) -> dict:
    """Greedy tokens: plain CPU vs plain ``provider``; each of ``cases``' speculative output vs plain on ``provider``
    (and the model drafter's on the CPU)."""
    plain = config()
    names = {"reference": "cpu", "device": provider if provider != "cpu" else "cpu (2nd pipeline)"}
    outputs = {side: guard(lambda p=p: p.generate(prompts, plain)) for side, p in zip(("reference", "device"), (ref, dev))}
    failed = {f"plain {names[side]}": o for side, o in outputs.items() if isinstance(o, dict)}
    if failed:
        return failed
    plain_tokens = {side: [r.token_ids for r in results] for side, results in outputs.items()}
    found = {f"plain {names['reference']} vs {names['device']}":
             compare(ref, prompts, plain_tokens["reference"], outputs["device"], plain)}
    found |= speculative_cases(dev, prompts, plain_tokens["device"], names["device"], cases)
    found |= speculative_cases(ref, prompts, plain_tokens["reference"], "cpu", {"k4": SPECULATIVE["k4"]})
    return found


def compare(pipeline, prompts, reference: list[list[int]], results, config) -> dict:
    """Prompts whose tokens equal ``reference``; where each other one diverges, with the target's margin there; the
    cycles that drafted from the draft model and from text (the suffix index), the mean accepted length, and how many
    drafted cycles accepted each number of drafts (each a rollback to that length)."""
    other = [r.token_ids for r in results]
    case = {"equal": sum(a == b for a, b in zip(reference, other)), "of": len(prompts), "diverged": [], "tokens": other}
    for i, (prompt, a, b) in enumerate(zip(prompts, reference, other)):
        if a != b:
            where = pipeline.first_divergence(prompt, a, b, config) or {"position": min(len(a), len(b)),
                                                                         "lengths": [len(a), len(b)]}
            case["diverged"].append({"prompt": i, **where})
    errors = [r.error for r in results if r.error]
    if errors:
        case["row_errors"] = errors[:3]
    records = [rec for r in results for rec in r.records]
    accepted = [r.stats["mean_accepted_length"] for r in results if r.stats.get("cycles")]
    if config.speculative and accepted:
        case["mean_accepted_length"] = round(statistics.fmean(accepted), 3)
        case["cycles"] = {"model": sum(rec.drafted > 0 and not rec.free for rec in records),
                          "text": sum(rec.drafted > 0 and rec.free for rec in records),
                          "plain": sum(rec.drafted == 0 for rec in records)}
        drafted = [rec for rec in records if rec.drafted]
        case["accepted_counts"] = [sum(rec.accepted == n for rec in drafted)
                                   for n in range(max((rec.drafted for rec in drafted), default=0) + 1)]
        case["rejected_cycles"] = sum(rec.accepted < rec.drafted for rec in drafted)  # a draft rolled back
    return case


def prefix_reuse(pipeline, prompt: list[int]) -> dict:
    """A conversation's second turn (the first turn's prompt and answer, then more) three ways on ``pipeline``: cold
    (no K/V reused: the reference), plain reusing the first turn's K/V, and speculative (the draft model if there is
    one, else the suffix index, K 4) reusing it; the prompt tokens each reused, where the kept K/V lives (on a GPU:
    "cupy.ndarray") and the bytes each turn moved between host and device (the engines' ``transfers``: inputs in,
    what acceptance reads out)."""
    from specdeploy.engines.memory import transfers

    def moved(work):  # (work's result, bytes it moved to the device and back)
        before = transfers.to_device, transfers.to_host
        done = work()
        return done, {"to_device": transfers.to_device - before[0], "to_host": transfers.to_host - before[1]}

    first = pipeline.generate([prompt], config())[0]
    second = [*prompt, *first.token_ids, *prompt[:5]]
    cold, cold_bytes = moved(lambda: pipeline.generate([second], config(), scope=None)[0])
    record = {"first_turn_tokens": len(prompt) + len(first.token_ids), "second_turn_prompt": len(second),
              "kept_bytes": pipeline.prefix_cache.bytes, "kept_in": sorted(pipeline.prefix_cache.held_in()),
              "cold_bytes_moved": cold_bytes}
    drafter = "model" if pipeline.draft is not None else "suffix"
    for name, run in (("plain", config()), (f"spec {drafter}-k4", config(4, drafter))):
        results, bytes_moved = moved(lambda run=run: pipeline.generate([second], run))
        case = compare(pipeline, [second], [cold.token_ids], results, run)
        case["cached_prompt_tokens"] = results[0].stats["cached_prompt_tokens"]
        case["bytes_moved"] = bytes_moved
        record[f"{name} reused vs cold"] = case
    return record


def exact_mode(pipeline, prompts: list[list[int]], default_plain: list[list[int]] | None = None,
               cases=SPECULATIVE) -> dict:
    """Exact mode on ``pipeline``: its plain output, and each of ``cases``' speculative output against it (equal bit
    for bit, its promise); its plain output against the default mode's (``default_plain``; they may part at a
    near-tie: margins). Every call then carries an even number of tokens a row (``engines.even``), so each position
    runs the same kernels (on CUDA: GroupQueryAttention's and MatMulNBits') whichever call computes it. A target
    exact mode refuses: ``{"refused": why}``."""
    from specdeploy.runtime.config import ConfigError

    plain = config(exact=True)
    try:
        pipeline.check_config(plain)
    except ConfigError as exc:
        return {"refused": str(exc)}
    outputs = pipeline.generate(prompts, plain)
    tokens = [r.token_ids for r in outputs]
    found = {}
    if default_plain is not None:
        found["plain exact vs plain default"] = compare(pipeline, prompts, default_plain, outputs, config())
    return found | speculative_cases(pipeline, prompts, tokens, "exact", cases, exact=True)


def rollback(ref, dev, prompt: list[int], k: int = 4) -> dict:
    """A verification of k + 1 tokens on ``dev``'s target (a row's last token and k drafts, at its length), rolled back
    to each length a cycle can leave (n = 0 .. k drafts accepted: the length moves to past + 1 + n), then the next
    token: its logits against a fresh prefill of the same text on ``ref``'s target (the CPU). Rollback moves a length,
    so K/V and a hybrid's recurrent states (``StateSpec``: a ring of the last positions' states, or one a slot) must be
    there for every position the verification wrote. The verification runs again before each length (the token after
    a rollback overwrites the next position). Per length: the largest logit difference, the argmax on each side and,
    where they differ, the fresh prefill's margin there; and how far the fresh logits one position shorter lie (what a
    state one position behind would show)."""
    from specdeploy.engines.base import prefill

    rng = np.random.default_rng(7)
    target, vocab = dev.target, dev.target.spec.vocab_size
    block, after = rng.integers(0, vocab, k + 1).tolist(), int(rng.integers(0, vocab))
    past = len(prompt)
    cache = target.allocate_cache(1, past + k + 8)
    prefill(target, cache, np.array([prompt]), [past])

    def fresh(text: list[int]) -> np.ndarray:  # the next-token logits after ``text``, prefilled in one call
        cache = ref.target.allocate_cache(1, len(text) + 2)
        return ref.target.infer(np.array([text]), np.zeros(1, np.int64), cache, 1).logits[0, -1].astype(np.float64)

    references = [fresh([*prompt, *block[:m], after]) for m in range(k + 2)]  # m = n + 1 at length past + 1 + n
    lengths = []
    for n in range(k + 1):
        target.infer(np.array([block]), np.array([past], np.int64), cache)
        got = target.infer(np.array([[after]]), np.array([past + 1 + n], np.int64), cache).logits[0, -1].astype(np.float64)
        want, wrong = references[n + 1], references[n]  # its own length's, and one position short of it
        case = {"length": past + 1 + n, "max_abs_diff": float(np.abs(got - want).max()),
                "max_abs": float(np.abs(want).max()), "one_behind_diff": float(np.abs(wrong - want).max()),
                "argmax": [int(want.argmax()), int(got.argmax())]}
        if case["argmax"][0] != case["argmax"][1]:
            case["margin"] = float(want.max() - want[got.argmax()])
        lengths.append(case)
    return {"k": k, "past": past, "lengths": lengths}


def failures(record: dict) -> list[str]:
    """The cases of a decoding record that raised or whose tokens part where they must not: speculative output
    against plain output on one provider, and in exact mode, must be equal; a reused K/V must be reused, and its turn
    may part from the cold turn's at a near-tie only; a plain comparison across providers or modes may part (its
    margin is reported)."""
    found = []
    for section in ("exactness", "prefix", "exact"):
        for case, result in record.get(section, {}).items():
            if not isinstance(result, dict):
                continue
            label = f"{section}: {case}"
            if "error" in result or result.get("row_errors"):
                found.append(label)
            elif case.startswith("spec") and result.get("equal") != result.get("of"):
                found.append(label)
            elif "cached_prompt_tokens" in result and (result["cached_prompt_tokens"] == 0 or any(
                    abs(d.get("margin", np.inf)) > NEAR_TIE for d in result["diverged"])):
                found.append(label)
    rolled = record.get("rollback", {})
    if "error" in rolled:
        found.append("rollback")
    for case in rolled.get("lengths", []):  # the argmax parts only at a near-tie, the logits nearer their own length's
        if case.get("margin", 0.0) > NEAR_TIE or case["max_abs_diff"] >= case["one_behind_diff"] / 2:
            found.append(f"rollback: length {case['length']}")
    return found
