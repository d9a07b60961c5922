"""Run tiny artifacts on ONNX Runtime's OpenVINO execution provider and record what came out: run as a script in the
environment that has the provider (``onnxruntime-openvino`` in place of ``onnxruntime``, which `make test` makes in
build/openvino-venv), never imported by the tests' process, whose onnxruntime has no OpenVINO.

    python tests/engines/openvino_peer.py JOB.json OUT.json

JOB: {"openvino": artifact dir (exported with --provider openvino), "explicit": one without, "fused": one in the fused
form, "prompts": [[ids], ...], "tokens": N, "sampled_rows": N, "cache": a SPECDEPLOY_CACHE dir}. OUT: what each check
saw (``main`` lists them); the tests assert on it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path


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


def greedy(directory: str, prompts, tokens: int, provider: str = "openvino", exact: bool = False) -> dict:
    """Plain greedy decoding and the default mode's speculation (each drafter, k, batch size) on ``provider``; with
    ``exact``, exact mode's too."""
    from specdeploy import GenerationConfig, Pipeline

    pipeline = Pipeline.load(directory, provider=provider, threads=2)
    base = GenerationConfig(max_new_tokens=tokens, ignore_eos=True)
    runs = {"plain": decode(pipeline, prompts, dataclasses.replace(base, drafter="none"), 1)}
    for drafter, k, batch_size in (("model", 4, 1), ("model", 8, 3), ("hybrid", 4, 2), ("suffix", 1, 2),
                                   ("model", 1, 2)):
        config = dataclasses.replace(base, drafter=drafter, k=k, policy="fixed")
        runs[f"{drafter} k={k} batch {batch_size}"] = decode(pipeline, prompts, config, batch_size)
    runs["default policy"] = decode(pipeline, prompts, base, 1)
    if exact:
        runs["exact plain"] = decode(pipeline, prompts, dataclasses.replace(base, drafter="none", exact=True), 1)
        runs["exact model k=4 batch 2"] = decode(pipeline, prompts, dataclasses.replace(
            base, drafter="model", k=4, policy="fixed", exact=True), 2)
    return {"runs": runs, "provider": pipeline.target.provider.key, "costs": _costs(pipeline),
            "rows_alike": pipeline.target.rows_alike}


def _costs(pipeline) -> dict:
    """The cost table the runs measured: token counts of the target's calls it has seconds for."""
    table = pipeline.costs.to_dict()
    return {"table": table}


def sampled(directory: str, prompt, rows: int) -> dict:
    """The first two tokens of ``rows`` seeded rows, plain and speculative (the draft model, k = 3), on OpenVINO."""
    from specdeploy import GenerationConfig, Pipeline

    pipeline = Pipeline.load(directory, provider="openvino", threads=2)
    settings = dict(temperature=0.8, top_k=6, top_p=0.9, max_new_tokens=4, ignore_eos=True)
    out = {}
    for name, config in (("plain", GenerationConfig(drafter="none", **settings)),
                         ("speculative", GenerationConfig(drafter="model", k=3, policy="fixed", **settings))):
        # rows without a seed sample by rejection; each row's generator from the process's entropy
        results = pipeline.generate([prompt] * rows, config, batch_size=rows)
        out[name] = [r.token_ids[:2] for r in results]
        out[f"{name} drafted"] = sum(record.drafted for r in results for record in r.records)
    return out


def refusals(explicit: str, fused: str) -> dict:
    """What is said where OpenVINO would run a graph in pieces: the fused form, refused before a session is made; and
    a graph whose nodes it leaves to the CPU provider, refused once the session says where it placed them (the fused
    graph under an explicit graph's name)."""
    from specdeploy.contract import Manifest
    from specdeploy.engines import OrtEngine, ProviderError, load_engine
    from specdeploy.engines.ort import placement
    from specdeploy.engines.providers import Provider

    said = {}
    manifest = Manifest.read(fused)
    try:
        load_engine(Path(fused), manifest, "target", provider="openvino")
        said["fused"] = None
    except ProviderError as exc:
        said["fused"] = str(exc)
    spec = dataclasses.replace(manifest.target, graph="explicit", takes_seqlens_k=False, trims_logits=False,
                               argmax_ids=False)
    try:
        OrtEngine(Path(fused) / spec.file, spec, provider="openvino")
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


def remembered(directory: str) -> dict:
    """Where a process remembers the cost table it measured on OpenVINO, against the CPU provider's record."""
    from specdeploy import GenerationConfig, Pipeline
    from specdeploy.engines.providers import Provider
    from specdeploy.runtime.calibration import RememberedCosts, machine_key

    pipeline = Pipeline.load(directory, provider="openvino", threads=2, remember_costs=True)
    pipeline.generate([[5, 17, 33, 9]], GenerationConfig(max_new_tokens=8, ignore_eos=True))
    files = sorted(p.name for p in (Path(os.environ["SPECDEPLOY_CACHE"]) / "costs").glob("*.json"))
    keys = {name: machine_key(Path(directory), provider, 2) for name, provider in
            (("openvino", "openvino"), ("openvino object", Provider("openvino")), ("cpu", "cpu"),
             ("openvino bf16", Provider("openvino", precision="BF16")))}
    recalled = RememberedCosts(keys["openvino"]).recall()
    return {"files": files, "keys": keys, "recalled": None if recalled is None else recalled.to_dict()}


def main() -> None:
    job = json.loads(Path(sys.argv[1]).read_text())
    os.environ["SPECDEPLOY_CACHE"] = job["cache"]
    out = {
        "greedy": greedy(job["openvino"], job["prompts"], job["tokens"], exact=True),
        # the same artifact on ONNX Runtime's CPU provider: a control, whose int4 kernels compute rows apart
        "greedy_cpu": greedy(job["openvino"], job["prompts"][:3], job["tokens"], provider="cpu"),
        "sampled": sampled(job["openvino"], job["prompts"][0], job["sampled_rows"]),
        "refusals": refusals(job["explicit"], job["fused"]),
        "placement": placement_of(job["openvino"]),
        "remembered": remembered(job["openvino"]),
    }
    Path(sys.argv[2]).write_text(json.dumps(out))


if __name__ == "__main__":
    main()
