"""Run tiny artifacts on ONNX Runtime's OpenVINO execution provider and record what came out: run as a script in the
environment that has the provider (``onnxruntime-openvino`` in place of ``onnxruntime``, which `make test` makes in
build/openvino-venv), never imported by the tests' process, whose onnxruntime has no OpenVINO.

    python tests/engines/openvino_peer.py JOB.json OUT.json

JOB: {"openvino": artifact dir (exported with --provider openvino), "mixed": the same pair with its draft written for
the CPU provider in the fused form (--provider openvino --draft-provider cpu --graph fused), "explicit": one in the plain
explicit form, "prompts": [[ids], ...], "tokens": N, "sampled_rows": N, "cache": a SPECDEPLOY_CACHE dir}. OUT: what
each check saw (``main`` lists them); the tests assert on it.

Each artifact's pipeline is loaded once and every check runs on it (a session's first call on OpenVINO prepares its
kernels, and each new shape costs it a preparation: the checks share them).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import sys
from pathlib import Path

# the speculation settings each pairing is held to: (drafter, k, batch size), the default policy after them
SETTINGS = (("model", 4, 1), ("model", 8, 3), ("hybrid", 4, 2), ("suffix", 1, 2), ("model", 1, 2))
FEWER_SETTINGS = (("model", 4, 1), ("model", 8, 3), ("hybrid", 4, 2))


def decode(pipeline, prompts, config, batch_size: int) -> list[dict]:
    """Each prompt's tokens and the logits each was chosen from, ``batch_size`` prompts at a time."""
    out = []
    for first in range(0, len(prompts), batch_size):
        chosen: dict[int, list] = {}

        def heard(logits, committed, chosen=chosen):
            for b, (index, new) in enumerate(committed):
                chosen.setdefault(index, []).extend(logits[b, : len(new)].tolist())

        run = pipeline.start(prompts[first : first + batch_size], config, on_verified=heard)
        while not run.done:
            run.step()
        out += [{"tokens": request.result.token_ids, "logits": chosen[i],
                 "drafted": sum(record.drafted for record in request.result.records)}
                for i, request in enumerate(run.requests)]
    return out


def greedy(pipeline, prompts, tokens: int, settings=SETTINGS, exact: bool = False) -> dict:
    """Plain greedy decoding and the default mode's speculation (each of ``settings``, then the default policy); with
    ``exact``, exact mode's too."""
    from specdeploy import GenerationConfig

    base = GenerationConfig(max_new_tokens=tokens, ignore_eos=True)
    runs = {"plain": decode(pipeline, prompts, dataclasses.replace(base, drafter="none"), 1)}
    for drafter, k, batch_size in settings:
        config = dataclasses.replace(base, drafter=drafter, k=k, policy="fixed")
        runs[f"{drafter} k={k} batch {batch_size}"] = decode(pipeline, prompts, config, batch_size)
    runs["default policy"] = decode(pipeline, prompts, base, 1)
    if exact:
        runs["exact plain"] = decode(pipeline, prompts, dataclasses.replace(base, drafter="none", exact=True), 1)
        runs["exact model k=4 batch 2"] = decode(pipeline, prompts, dataclasses.replace(
            base, drafter="model", k=4, policy="fixed", exact=True), 2)
    return {"runs": runs, "providers": providers(pipeline), "costs": pipeline.costs.to_dict(),
            "rows_alike": pipeline.target.rows_alike}


def providers(pipeline) -> dict:
    """Each model's provider, as its cost table is remembered under."""
    return {"target": pipeline.target.provider.key, "draft": pipeline.draft.provider.key}


def priced(pipeline, k: int) -> dict:
    """The calls ``warm_up`` makes on a fresh pipeline, each as its engine timed it (with the engine's provider), and
    the cost table it left: what the cost policy prices each model's calls by."""
    calls = []
    for role, engine in (("target", pipeline.target), ("draft", pipeline.draft)):
        infer = engine.infer

        def timed(input_ids, past_len, cache, last=None, widths=None, infer=infer, role=role, engine=engine):
            out = infer(input_ids, past_len, cache, last, widths)
            calls.append({"role": role, "provider": engine.provider.key, "tokens": int(input_ids.shape[1]),
                          "seconds": out.seconds})
            return out

        engine.infer = timed
    try:
        pipeline.warm_up(k)
    finally:
        del pipeline.target.infer, pipeline.draft.infer  # the engines' own method again
    return {"calls": calls, "costs": pipeline.costs.to_dict()}


def sampled(pipeline, prompt, rows: int) -> dict:
    """The first two tokens of ``rows`` rows without a seed (sampled by rejection), plain and speculative (the draft
    model, k = 3). No K/V or text of earlier requests (``scope=None``): each row is the one prompt alone. Each row's
    generator is made repeatable here, plain and speculative rows on streams apart (a row without a seed takes the
    process's entropy): the chi-square test reads the same counts every run instead of failing one run in a thousand."""
    from specdeploy import GenerationConfig
    from specdeploy.runtime import rows as row_state

    settings = dict(temperature=0.8, top_k=6, top_p=0.9, max_new_tokens=4, ignore_eos=True)
    out = {}
    entropy = row_state.unseeded_generator
    configs = (("plain", GenerationConfig(drafter="none", **settings)),
               ("speculative", GenerationConfig(drafter="model", k=3, policy="fixed", **settings)))
    for stream, (name, config) in enumerate(configs):
        row_state.unseeded_generator = _repeatable(stream)
        try:
            results = pipeline.generate([prompt] * rows, config, batch_size=rows, suffix_index=None, scope=None)
        finally:
            row_state.unseeded_generator = entropy
        out[name] = [r.token_ids[:2] for r in results]
        out[f"{name} drafted"] = sum(record.drafted for r in results for record in r.records)
    return out


def _repeatable(stream: int):
    """A stand-in for ``rows.unseeded_generator``: each row without a seed gets the next generator of ``stream``."""
    import numpy as np

    rows = itertools.count()
    return lambda: np.random.default_rng([97, stream, next(rows)])


def refusals(explicit: str, mixed: str) -> dict:
    """What is said where OpenVINO would run a graph in pieces: a fused draft, refused before a session is made; and
    a graph whose nodes it leaves to the CPU provider, refused once the session says where it placed them (the fused
    graph under an explicit graph's name)."""
    from specdeploy.contract import Manifest
    from specdeploy.engines import OrtEngine, ProviderError, load_engine
    from specdeploy.engines.ort import placement
    from specdeploy.engines.providers import Provider

    said = {}
    manifest = Manifest.read(mixed)
    try:
        load_engine(Path(mixed), manifest, "draft", provider="openvino")
        said["fused"] = None
    except ProviderError as exc:
        said["fused"] = str(exc)
    spec = dataclasses.replace(manifest.draft, graph="explicit", takes_seqlens_k=False, trims_logits=False,
                               argmax_ids=False)
    try:
        OrtEngine(Path(mixed) / spec.file, spec, provider="openvino")
        said["in_pieces"] = None
    except ProviderError as exc:
        said["in_pieces"] = str(exc)
    spec = Manifest.read(explicit).target
    said["placement"] = placement(Path(explicit) / spec.file, Provider("openvino"))
    return said


def placement_of(directory: str) -> dict:
    """Where ONNX Runtime places the nodes of an artifact's graphs on OpenVINO."""
    from specdeploy.contract import Manifest
    from specdeploy.engines.ort import placement

    manifest = Manifest.read(directory)
    return {role: placement(Path(directory) / spec.file, "openvino") for role, spec in manifest.models.items()}


def remembered(openvino: str, mixed: str) -> dict:
    """Which cost tables the processes' pipelines kept (``remember_costs``), against the keys of the providers each
    pairing names; and the table recalled for the OpenVINO pair."""
    from specdeploy.engines.providers import Provider
    from specdeploy.runtime.calibration import RememberedCosts, machine_key

    files = sorted(p.name for p in (Path(os.environ["SPECDEPLOY_CACHE"]) / "costs").glob("*.json"))
    keys = {name: machine_key(Path(directory), *providers) for name, directory, providers in (
        ("openvino", openvino, ("openvino", 2)), ("openvino object", openvino, (Provider("openvino"), 2)),
        ("cpu", openvino, ("cpu", 2)), ("openvino bf16", openvino, (Provider("openvino", precision="BF16"), 2)),
        ("openvino, draft on openvino", openvino, ("openvino", 2, "openvino")),
        ("mixed, draft on cpu", mixed, ("openvino", 2, "cpu")), ("mixed, one provider", mixed, ("openvino", 2)))}
    recalled = RememberedCosts(keys["openvino"]).recall()
    answers = RememberedCosts(keys["mixed, draft on cpu"]).recall_answers()  # kept in the provider pair's record
    return {"files": files, "keys": keys, "recalled": None if recalled is None else recalled.to_dict(),
            "mixed answers": None if answers is None else answers.to_list()}


def main() -> None:
    from specdeploy import GenerationConfig, Pipeline
    from specdeploy.contract import Manifest
    from specdeploy.engines import load_engine

    job = json.loads(Path(sys.argv[1]).read_text())
    os.environ["SPECDEPLOY_CACHE"] = job["cache"]
    prompts, tokens = job["prompts"], job["tokens"]
    openvino = Pipeline.load(job["openvino"], provider="openvino", threads=2, remember_costs=True)
    # the target on OpenVINO, its draft (the same pair's, in OpenVINO's form) on the CPU provider: the target's session
    # shared
    draft_on_cpu = Pipeline(openvino.manifest, openvino.tokenizer, openvino.target,
                            load_engine(Path(job["openvino"]), Manifest.read(job["openvino"]), "draft", "cpu", 2),
                            Path(job["openvino"]), chat_template=openvino.chat_template)
    mixed = Pipeline.load(job["mixed"], provider="openvino", draft_provider="cpu", threads=2, remember_costs=True)
    out = {"priced": priced(mixed, 4)}  # first: on a fresh pipeline, warm_up measures every shape
    out |= {
        "greedy": greedy(openvino, prompts, tokens, exact=True),
        "greedy_draft_on_cpu": greedy(draft_on_cpu, prompts, tokens, FEWER_SETTINGS),
        "greedy_mixed": greedy(mixed, prompts, tokens, FEWER_SETTINGS),
        # the OpenVINO pair on ONNX Runtime's CPU provider: a control, whose int4 kernels compute rows apart
        "greedy_cpu": greedy(Pipeline.load(job["openvino"], provider="cpu", threads=2), prompts[:3], tokens),
        "sampled": sampled(openvino, prompts[0], job["sampled_rows"]),
        "refusals": refusals(job["explicit"], job["mixed"]),
        "placement": placement_of(job["openvino"]),
    }
    mixed.generate([prompts[0]], GenerationConfig(max_new_tokens=8, ignore_eos=True))  # keeps its table
    out["remembered"] = remembered(job["openvino"], job["mixed"])
    Path(sys.argv[2]).write_text(json.dumps(out))


if __name__ == "__main__":
    main()
