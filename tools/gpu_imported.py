"""The imported-graph check of tools/gpu_check.py: the tiny target as onnxruntime-genai's model builder writes it for
CUDA in fp16 (built where the check is built, so the machine under test needs no onnxruntime-genai; the CPU EP runs it
too), run through ``specdeploy import`` and the genai adapter (engines/genai.py) on the provider under test: greedy
speculative decoding (the suffix index, the hybrid drafter at a fixed K, the default speculation) against plain
decoding on a ragged batch, a second turn reusing the first's K/V, exact mode, and ``Engine.infer``'s latency; and its
plain output against the builder's fp32 CPU build of the same weights on the CPU (they may part at a near-tie:
margins).
"""

from __future__ import annotations

import importlib.util
import shutil
import tempfile
import time
from pathlib import Path

from tools.gpu_decoding import compare, config, exact_mode, prefix_reuse, speculative_cases
from tools.gpu_timing import CAPACITY, PAST, engine_latency, guard

GENAI_PRECISIONS = ("fp16", "fp32")  # the builder's CUDA graph and its CPU graph
EXECUTION = {"fp16": "cuda", "fp32": "cpu"}


def build_genai(checkpoint: Path, directory: Path, precision: str) -> int:
    """Write ``checkpoint`` (a Hugging Face folder) as onnxruntime-genai's builder does for ``precision`` into
    ``directory / f"genai-{precision}"``; return its bytes. Needs onnxruntime-genai (its builder) and torch."""
    from onnxruntime_genai.models.builder import create_model, parse_extra_options

    out = directory / f"genai-{precision}"
    shutil.rmtree(out, ignore_errors=True)
    with tempfile.TemporaryDirectory() as cache:
        args = ("", str(checkpoint), str(out), precision, EXECUTION[precision], cache)
        create_model(*args, **parse_extra_options(*args, []))
    return sum(p.stat().st_size for p in out.iterdir())


def check_imported(directory: Path, provider: str, prompts: list[list[int]], left, save=lambda: None) -> dict:
    """The genai build of ``provider``'s precision under ``directory``, imported and checked on ``provider`` (module
    docstring); each part's failure recorded in its part (``{"error": ...}``), parts begun with no time ``left()``
    skipped."""
    built = [p for p in GENAI_PRECISIONS if (directory / f"genai-{p}" / "genai_config.json").is_file()]
    if not built:
        return {"skipped": f"no genai-fp16 or genai-fp32 in {directory}: build them here with tools.gpu_check --build "
                           "DIR --genai fp16,fp32 (needs onnxruntime-genai)"}
    folder = directory / f"genai-{built[0]}"  # fp16 where it was built: the form a GPU runs
    record = {"folder": folder.name}
    work = Path(tempfile.mkdtemp(prefix="gpu-check-imported-"))
    try:
        loaded = guard(lambda: _load(folder, work / "artifact", provider, record))
        if isinstance(loaded, dict):
            record["load"] = loaded
            return record
        pipeline = loaded
        parts = {"exactness": lambda: _exactness(pipeline, prompts, provider, directory, work),
                 "prefix": lambda: guard(lambda: prefix_reuse(pipeline, prompts[2])),
                 "exact": lambda: guard(lambda: exact_mode(pipeline, prompts)),
                 "latency": lambda: {"engine": guard(lambda: engine_latency(pipeline.target, CAPACITY, PAST))}}
        for name, part in parts.items():
            if left() <= 0:
                record[name] = {"skipped": "budget spent"}
                continue
            record["stage"] = name
            save()
            record[name] = part()
        record.pop("stage", None)
        record["costs"] = pipeline.costs.to_dict()
        return record
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _load(folder: Path, artifact: Path, provider: str, record: dict):
    """``folder`` imported into ``artifact`` and loaded on ``provider``; what the manifest says and the seconds into
    ``record``."""
    from specdeploy import Pipeline
    from specdeploy.importer import import_artifact

    began = time.perf_counter()
    manifest = import_artifact(folder, artifact, capacity=CAPACITY)
    spec = manifest.target
    record["manifest"] = {"source": spec.imported.source, "cache": spec.imported.cache, "dtype": spec.dtype,
                          "weights": spec.weights, "rewrites": list(spec.imported.rewrites)}
    pipeline = Pipeline.load(artifact, provider=provider)
    record["load_s"] = round(time.perf_counter() - began, 2)
    return pipeline


def _exactness(pipeline, prompts, provider: str, directory: Path, work: Path) -> dict:
    """Every drafter the import has (no draft model: the suffix index, the default) against its plain output on
    ``provider``; an fp16 build's plain output against the fp32 build's on the CPU (same weights, margins reported)."""
    plain = guard(lambda: pipeline.generate(prompts, config()))
    if isinstance(plain, dict):
        return {f"plain {provider}": plain}
    tokens = [r.token_ids for r in plain]
    cases = speculative_cases(pipeline, prompts, tokens, provider)
    cpu_build = directory / "genai-fp32"
    fp16 = pipeline.target.spec.dtype == "float16"
    if fp16 and (cpu_build / "genai_config.json").is_file() and importlib.util.find_spec("tokenizers"):
        def against_cpu() -> dict:
            from specdeploy import Pipeline
            from specdeploy.importer import import_artifact

            import_artifact(cpu_build, work / "artifact-fp32", capacity=CAPACITY)
            reference = Pipeline.load(work / "artifact-fp32", provider="cpu")
            reference_tokens = [r.token_ids for r in reference.generate(prompts, config())]
            return compare(reference, prompts, reference_tokens, plain, config())

        cases[f"plain cpu fp32 vs {provider} fp16"] = guard(against_cpu)
    return cases

