"""One short check of the CUDA path: tiny random artifacts built here, run once on a GPU machine.

    .venv/bin/python -m tools.gpu_check --build .gpucheck --vendor-tokenizers        # here (torch, transformers)
    python3 -m tools.gpu_check --run .gpucheck --out $OUT/gpu_check.json --big 0.5b,1.5b,7b --peer 0.5b,1.5b \
        --budget 240 --results $OUT --commit <sha>                                              # there (~4 minutes)

(docs/results/gpu/README.md: the whole procedure.) ``--build`` exports one tiny Qwen2-shaped target with a perturbed
copy as its draft (partial, ragged acceptance) in each graph form and weight format, a tiny Gemma 2 (soft-capped
attention on GroupQueryAttention, a windowed layer), a tiny Granite 4.0-H (a hybrid: Mamba-2's states in rings the
engine owns) and a tiny Qwen3-MoE (routed experts on ONNX Runtime's MoE op) in the fused fp16 form (``ARTIFACTS``, one
entry a case), with specdeploy's own exporter; and the Qwen2 target as onnxruntime-genai's builder writes it, fp16 for
CUDA and fp32 for the CPU (``--genai``; tools/gpu_imported.py).
``--run`` needs only numpy, onnx and onnxruntime(-gpu) (and torch for ``--big``, CuPy for CUDA): per artifact it
reports (tools/gpu_decoding.py)
- exactness through the public API: greedy plain decoding on the CPU against ``--provider`` token for token, then
  greedy speculative decoding against plain decoding on ``--provider`` for every drafter the artifact's case list
  names (the draft model at a fixed K on a ragged batch of 3 and at batch 1, the suffix index, the default's hybrid
  drafter at a fixed K, and the default speculation at the costs it measured there);
- a second turn reusing the first's K/V (the prefix cache; a hybrid's recurrent states resumed) against the same turn
  cold; exact mode, whose speculative output must be its plain output bit for bit (every call an even number of tokens
  a row, so each position runs the same CUDA kernels); a verification of K + 1 tokens rolled back to every length it
  can leave, the next token's logits against a fresh prefill's on the CPU;
- where the engine keeps its cache, on which execution provider each node of the target ran (ONNX Runtime's
  profile; a copy inside a call of a fused fp16 graph on CUDA fails), and one call's logits, cache and recurrent states
  against the CPU's (a fused float32 artifact is refused on CUDA: checked);
- ``Engine.infer`` latency at batch 1, T = 1, 5 and 9 after a past of 256, with CUDA graphs where the engine
  captures them and without;
then the genai fp16 build, imported (``specdeploy import``) and checked alike on ``--provider``, against the fp32
build on the CPU. ``--big`` writes Qwen2.5-shaped fused fp16 targets with random weights through the exporter's own
fused writer and times them alike (past 1024), the bytes a greedy cycle moves between host and device, and
tools/replay.py's cost tables of the 1.5B and 7B-shaped targets with the 0.5B draft, at which the real pair's recorded
traces (tools/replay_data/traces.json) are replayed through the real runtime: plain against speculative tokens per
second. ``--peer`` builds the same shapes with onnxruntime-genai's model builder (the peer; its wheel carried like
onnxruntime-gpu) over the same random weights and times its graphs alike, with and without CUDA graphs.
``--out`` (JSON) and ``--results DIR`` (the report named after the GPU and the commit, and its summary) are rewritten
after each part, each artifact's seconds per part among them; ``--budget`` skips the parts left once it is spent (and
an artifact, the import, a big shape or a peer build with less left than it needs: ``NEEDS``), each with its reason;
``--only none`` runs the big shapes and the peer alone (a rerun of what the first run skipped). Where a part fails,
the last line names it and the exit status is 1.
``Pipeline.load`` reads the tokenizer with ``tokenizers``: where it is missing and no vendored wheel
(``--vendor-tokenizers``) is in the dir, the pipeline is built from its engines and prompts are token ids.
A graph whose IR version this onnxruntime refuses is run from a copy with the IR version lowered (reported).
The timings and the big shapes live in tools/gpu_timing.py beside this file (carried with the tree).
"""

from __future__ import annotations

import argparse
import faulthandler
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections import Counter
from pathlib import Path

import numpy as np

from tools import arguments
from tools.gpu_decoding import SPECULATIVE, exact_mode, exactness, failures, prefix_reuse, rollback
from tools.gpu_imported import GENAI_PRECISIONS, build_genai, check_imported
from tools.gpu_report import (
    print_artifact,
    print_big,
    print_environment,
    print_imported,
    print_pair,
    print_peer,
    print_skipped,
    write_results,
)
from tools.gpu_timing import (
    BIG,
    CAPACITY,
    PAST,
    check_big,
    check_peer,
    cost_tables,
    cycle_bytes,
    engine_latency,
    guard,
    last_logits,
    replay_speedups,
    scratch,
)
from tools.provenance import commit

ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT / "tools" / "replay_data" / "traces.json"
PROMPT_LENGTHS = (5, 9, 14)  # a ragged batch of 3 rows
ARTIFACTS = {  # name -> export options ("family": the tiny model's, FAMILIES, default qwen2; "cases": the speculative
    # cases it runs, gpu_decoding.SPECULATIVE's names, default all)
    "fused-fp16": {"graph": "fused", "dtype": "float16"},
    "fused-fp16-int4": {"graph": "fused", "dtype": "float16", "weights": "int4"},
    "explicit-fp16": {"graph": "explicit", "dtype": "float16"},
    "explicit-fp32": {"graph": "explicit", "dtype": "float32"},
    "fused-int4": {"graph": "fused", "dtype": "float32", "weights": "int4"},  # `make demo`'s form: refused on CUDA
    # a family of its own: Gemma 2's soft-capped attention (GroupQueryAttention's softcap), sliding windows on every
    # other layer, soft-capped logits
    "gemma2-fused-fp16": {"graph": "fused", "dtype": "float16", "family": "gemma2"},
    # a hybrid (#68): Granite 4.0-H's Mamba-2 before attention, its convolution and scan states in rings the engine owns
    # (their slots filled by the engine), written in place by ScatterND, rolled back by length; the draft model and
    # the suffix index at K 4 on the ragged batch
    "granite4h-fused-fp16": {"graph": "fused", "dtype": "float16", "family": "granitemoehybrid",
                             "cases": ("k4", "suffix-k4")},
    # a mixture of experts (#68): Qwen3-MoE's routed experts (8, top-2, renormalized) on ONNX Runtime's MoE op, whose
    # verification routes each of its K + 1 tokens apart; the draft model and the suffix index at K 4 on the ragged batch
    "qwen3moe-fused-fp16": {"graph": "fused", "dtype": "float16", "family": "qwen3_moe", "cases": ("k4", "suffix-k4")},
}
WINDOW = 8  # the tiny Gemma 2's window: shorter than the check's texts (5-14 prompt tokens + 24)
FAMILIES = {  # family -> (model_type, config overrides, the draft's noise: partial, ragged acceptance); head_dim 64, as
    # the 0.5B draft's: GroupQueryAttention's CUDA kernels choose by head size
    "qwen2": ("qwen2", {}, 0.01),
    "gemma2": ("gemma2", {"query_pre_attn_scalar": 64, "attn_logit_softcapping": 20.0, "final_logit_softcapping": 15.0,
                          "sliding_window": WINDOW, "layer_types": ["sliding_attention", "full_attention"],
                          "tie_word_embeddings": False}, 0.05),
    # Mamba-2 (2 groups of 2 heads of 32, state 16, kernel 4) before an attention layer without RoPE, no experts
    "granitemoehybrid": ("granitemoehybrid", {"layer_types": ["mamba", "attention"], "num_local_experts": 0,
                                              "mamba_n_heads": 4, "mamba_d_head": 32, "mamba_n_groups": 2,
                                              "mamba_d_state": 16, "mamba_d_conv": 4, "mamba_expand": 2,
                                              "shared_intermediate_size": 128, "position_embedding_type": None}, 0.01),
    # 8 experts of 64, top-2, renormalized, on both layers (Qwen3's per-head q/k norms with them)
    "qwen3_moe": ("qwen3_moe", {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                                "norm_topk_prob": True, "mlp_only_layers": []}, 0.01),
}
SPEC_FIELDS = ("graph", "dtype", "weights", "num_layers", "num_heads", "kv_heads", "head_dim", "vocab_size", "capacity")
PAIRS = {"1.5b": "0.5b", "7b": "0.5b", "test": "test"}  # target -> draft of the replayed pairs
# seconds a part needs at least: one begun with less of the budget left would outrun the command's limit and lose the
# report's last parts (docs/results/gpu/README.md: the whole run's estimate). A tiny artifact (every part: exactness,
# prefix, exact mode, rollback, placement, cache, latency with and without CUDA graphs) took 1.8-3.6 s, the import ~5 s,
# in the CPU dry run (tests/tools/test_gpu_check.py, a 2-core host under a load of 13); on a GPU each also opens ~4 CUDA
# sessions and captures a graph per call shape: room of 4-5x. A big shape (written, timed with and without CUDA
# graphs, its pair's cost table and replays) or the peer's build of it: from the H200 run of 2026-12-04 (1.5B written
# in 12.9 s, 0.5B in 4.6 s), with room
NEEDS = {"artifact": 15, "imported": 25, "big": {"0.5b": 30, "1.5b": 60, "7b": 150, "test": 0},
         "peer": {"0.5b": 60, "1.5b": 120, "7b": 300, "test": 0}}


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    only = args.only.split(",") if args.only else None
    big, peer = [b for b in args.big.split(",") if b], [b for b in args.peer.split(",") if b]
    if any(b not in BIG for b in big + peer):
        parser.error(f"--big/--peer: got {args.big!r}/{args.peer!r}; expected names among {', '.join(BIG)}")
    if args.build:
        if only and any(n not in ARTIFACTS for n in only):
            parser.error(f"--only: got {args.only!r}; expected names among {', '.join(ARTIFACTS)}")
        precisions = [p for p in args.genai.split(",") if p]
        if any(p not in GENAI_PRECISIONS for p in precisions):
            parser.error(f"--genai: got {args.genai!r}; expected names among {', '.join(GENAI_PRECISIONS)}")
        build(args.build, only or list(ARTIFACTS), args.vendor_tokenizers, precisions)
        return 0
    options = {"big": big, "peer": peer, "replay_tokens": args.replay_tokens,
               "replay_ks": [int(k) for k in args.replay_ks.split(",")], "loader": args.loader, "budget": args.budget,
               "results": args.results, "commit": args.commit or commit()}
    report = run(args.run, args.out, args.provider, only, options)
    failed = [f"{name} ({'; '.join(_failures(r))})" for name, r in report["artifacts"].items() if _failures(r)]
    failed += [f"imported ({'; '.join(found)})" for found in [_failures(report["imported"])] if found]
    failed += [f"{part} {name}" for part in ("big", "peer") for name, r in report[part].items() if "error" in r]
    skipped = [name for part in ("artifacts", "big", "peer") for name, r in report[part].items() if "skipped" in r]
    skipped += ["imported"] * ("skipped" in report["imported"])
    print(f"done in {report['seconds']:.0f} s; " + (f"FAILURES in {', '.join(failed)}" if failed else "no failures")
          + (f"; skipped (budget or absent): {', '.join(skipped)}" if skipped else ""))
    return 1 if failed else 0


def _parser() -> argparse.ArgumentParser:
    parser = arguments.parser(__doc__)
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--build", type=Path, metavar="DIR", help="export the tiny artifacts into DIR (needs the export extra)")
    mode.add_argument("--run", type=Path, metavar="DIR", help="check the artifacts in DIR on --provider")
    parser.add_argument("--out", type=Path, help="--run: write the results here as JSON (rewritten after each part)")
    parser.add_argument("--provider", default="cuda", choices=("cuda", "cpu"),
                        help="the provider under test; the reference is always the CPU")
    parser.add_argument("--only", help="comma list of artifact names (default: all of ARTIFACTS / all built); --run: "
                                       "'none' checks no artifact and no import (a rerun of the big shapes and the peer)")
    parser.add_argument("--big", default="", help=f"--run: comma list of {', '.join(BIG)}: random-weight fused fp16 "
                                                  "targets written and timed on the machine (needs torch)")
    parser.add_argument("--peer", default="", help="--run: comma list of the --big shapes to build and time with "
                                                   "onnxruntime-genai's model builder too")
    parser.add_argument("--replay-tokens", type=arguments.integer(1), default=128,
                        help="--run: new tokens a replayed request asks for")
    parser.add_argument("--replay-ks", default="1,2,3,4", help="--run: the fixed K replayed beside plain and the cost policy")
    parser.add_argument("--results", type=Path, help="--run: also write the report into this folder (docs/results/gpu)")
    parser.add_argument("--commit", default="", help="--run: the commit under test, for --results (default: git's)")
    parser.add_argument("--loader", default="auto", choices=("auto", "pipeline", "engines"),
                        help="Pipeline.load (needs tokenizers), the Pipeline built from its engines, or auto")
    parser.add_argument("--budget", type=arguments.number(0), default=280.0, help="--run: seconds after which the rest is skipped")
    parser.add_argument("--genai", default=",".join(GENAI_PRECISIONS),
                        help="--build: the precisions of the onnxruntime-genai builds of the tiny target to write "
                             "(fp16: its CUDA graph, run with --provider cuda; fp32: its CPU graph, run with cpu)")
    parser.add_argument("--vendor-tokenizers", action="store_true",
                        help="--build: put the tokenizers wheel (cp312 manylinux x86_64) into DIR/wheels")
    return parser


# --- build (here, with the export extra) ----------------------------------------------------------------------


def build(directory: Path, names: list[str], vendor_tokenizers: bool, genai: list[str]) -> None:
    """Export ``names`` (keys of ARTIFACTS), each from one seeded tiny target of its family and a perturbed copy as its
    draft, into ``directory``; and the qwen2 target as onnxruntime-genai's builder writes it in each precision of
    ``genai`` (``gpu_imported.build_genai``; imported on the machine under test)."""
    from specdeploy import export

    tiny = _tests_tiny()
    directory.mkdir(parents=True, exist_ok=True)
    families = {ARTIFACTS[name].get("family", "qwen2") for name in names} | ({"qwen2"} if genai else set())
    with tempfile.TemporaryDirectory() as tmp:
        checkpoints = {family: _checkpoints(tiny, family, Path(tmp) / family) for family in sorted(families)}
        for name in names:
            began = time.perf_counter()
            options = {k: v for k, v in ARTIFACTS[name].items() if k not in ("family", "cases")}
            target_dir, draft_dir = checkpoints[ARTIFACTS[name].get("family", "qwen2")]
            export(target_dir, directory / name, draft=draft_dir, capacity=CAPACITY, force=True, **options)
            size = sum(p.stat().st_size for p in (directory / name).iterdir())
            print(f"{name}: {size / 1e3:.0f} kB in {time.perf_counter() - began:.1f} s")
        for precision in genai:
            began = time.perf_counter()
            size = build_genai(checkpoints["qwen2"][0], directory, precision)
            print(f"genai-{precision}: {size / 1e3:.0f} kB in {time.perf_counter() - began:.1f} s")
    if vendor_tokenizers:
        from importlib.metadata import version

        wheels = directory / "wheels"
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", f"tokenizers=={version('tokenizers')}",
                        "--no-deps", "--only-binary=:all:", "--python-version", "3.12", "--platform",
                        "manylinux2014_x86_64", "-d", str(wheels)], check=True)
        print("vendored: " + ", ".join(p.name for p in wheels.glob("*.whl")))


def _checkpoints(tiny, family: str, folder: Path) -> tuple[Path, Path]:
    """A seeded tiny target of ``family`` (FAMILIES) and a perturbed copy as its draft, saved under ``folder``."""
    kind, overrides, noise = FAMILIES[family]
    config = tiny.llama_config(kind, hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1,
                               head_dim=64, max_position_embeddings=CAPACITY, **overrides)
    target = tiny.build_model(config, seed=0)
    draft = tiny.build_model(config, seed=1, perturb_from=target, noise=noise)
    return tiny.save_checkpoint(target, folder / "target"), tiny.save_checkpoint(draft, folder / "draft")


def _tests_tiny():
    """tests/tiny.py (the suite's tiny models), loaded from its file: the tests are no installed package."""
    spec = importlib.util.spec_from_file_location("tiny", ROOT / "tests" / "tiny.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --- run (on the machine under test) --------------------------------------------------------------------------


def run(directory: Path, out: Path | None, provider: str, only: list[str] | None, options: dict) -> dict:
    """Check every artifact of ``directory``, then the big shapes, the replays and the peer, on ``provider``."""
    began = time.perf_counter()
    budget = options["budget"]
    faulthandler.enable()  # a crash inside ONNX Runtime still prints where Python was; the JSON names the stage
    os.environ.setdefault("SPECDEPLOY_CACHE", tempfile.mkdtemp(prefix="gpu-check-cache-"))
    report = {"environment": _environment(directory, provider), "artifacts": {}, "imported": {}, "big": {}, "pairs": {},
              "peer": {}}
    print_environment(report["environment"])
    # the report and its summary rewritten after each part: a run its command's limit kills keeps what it measured
    save = lambda: _write(out, report, began, options.get("results"), options.get("commit", ""))  # noqa: E731
    built = sorted((p.name for p in directory.iterdir() if (p / "manifest.json").is_file()),
                   key=lambda n: (list(ARTIFACTS).index(n) if n in ARTIFACTS else len(ARTIFACTS), n))
    left = lambda: budget - (time.perf_counter() - began)  # noqa: E731
    for name in [] if only == ["none"] else only or built:
        if left() < NEEDS["artifact"]:
            report["artifacts"][name] = {"skipped": _spent(budget, left(), name, NEEDS["artifact"])}
            print_skipped(name, report["artifacts"][name])
            continue
        record = report["artifacts"][name] = {}
        check_artifact(directory / name, provider, options["loader"], record, save, left)
        print_artifact(name, record)
        save()
    if only == ["none"]:
        report["imported"] = {"skipped": "--only none"}
    elif left() < NEEDS["imported"]:
        report["imported"] = {"skipped": _spent(budget, left(), "the import", NEEDS["imported"])}
    else:
        report["imported"] = check_imported(directory, provider, _prompts(), left, save)
    print_imported(report["imported"])
    save()
    workdir = scratch("gpu-check-big-")
    try:
        check_big_shapes(report, provider, options, workdir, left, save)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    save()
    return report


def _spent(budget: float, left: float, name: str, need: float) -> str:
    """Why a part was not begun: the budget spent, or less of it left than the part needs (``NEEDS``)."""
    return f"budget of {budget:.0f} s spent" if left <= 0 else f"budget spent: {left:.0f} s left, {name} needs {need} s"


def check_pair(target, draft, record: dict, options: dict, left) -> dict:
    """A target and draft's bytes per greedy cycle, cost table, and the real pair's traces replayed at that table."""
    pair = {"cycle_bytes": guard(lambda: cycle_bytes(target, draft, record["capacity"], record["past"])),
            "costs": guard(lambda: cost_tables(target, draft))}
    if TRACES.is_file() and "error" not in pair["costs"] and left() > 0:
        pair["replay"] = guard(lambda: replay_speedups(TRACES, pair["costs"], options["replay_tokens"], options["replay_ks"]))
    return pair


def check_big_shapes(report: dict, provider: str, options: dict, workdir: Path, left, save) -> None:
    """The big shapes (smallest first: the 0.5B draft stays loaded for the pairs' cost tables), each pair's cost table,
    cycle bytes and replayed speedups, then the peer's graphs."""
    engines = {}
    for name in sorted(options["big"], key=lambda n: BIG[n]["layers"] * BIG[n]["hidden"]):
        if left() < NEEDS["big"][name] or left() <= 0:
            report["big"][name] = {"skipped": f"budget spent: {max(0, left()):.0f} s left, {name} needs "
                                              f"{NEEDS['big'][name]} s"}
            print_skipped(f"big {name}", report["big"][name])
            continue
        print(f"== big {name}: writing and loading it ...", flush=True)
        record = report["big"][name] = guard(lambda name=name: check_big(name, provider, workdir, keep=True))
        engine = record.pop("engine", None)
        if engine is not None:
            engines[name] = engine
        print_big(name, record)
        draft = PAIRS.get(name)
        if name in engines and draft in engines:
            report["pairs"][f"{name}+{draft}"] = check_pair(engines[name], engines[draft], record, options, left)
            print_pair(f"{name}+{draft}", report["pairs"][f"{name}+{draft}"])
        if name != "0.5b" and name != "test":
            engines.pop(name, None)  # its GPU memory back before the next shape
        for path in workdir.glob(f"{name}.onnx*"):
            path.unlink()
        save()
    engines.clear()
    for name in options["peer"]:
        if left() < NEEDS["peer"][name] or left() <= 0:
            report["peer"][name] = {"skipped": f"budget spent: {max(0, left()):.0f} s left, {name} needs "
                                               f"{NEEDS['peer'][name]} s"}
            print_skipped(f"peer {name}", report["peer"][name])
            continue
        print(f"== peer {name}: building it with onnxruntime-genai's builder ...", flush=True)
        report["peer"][name] = guard(lambda name=name: check_peer(name, provider, workdir))
        print_peer(name, report["peer"][name])
        save()


def _write(out: Path | None, report: dict, began: float, results: Path | None = None, sha: str = "") -> None:
    report["seconds"] = time.perf_counter() - began
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=1, default=str))
    if results is not None:
        write_results(report, results, sha)


def _environment(directory: Path, provider: str) -> dict:
    """Versions, providers, the GPU, optional modules; vendored wheels put on sys.path; CUDA's DLLs preloaded."""
    env = {"python": sys.version.split()[0], "machine": platform.machine(), "numpy": np.__version__,
           "vendored": _vendor(directory)}
    env["modules"] = {m: importlib.util.find_spec(m) is not None
                      for m in ("tokenizers", "click", "rich", "jinja2", "cupy", "torch", "transformers")}
    import onnx
    import onnxruntime as ort

    env.update(onnx=onnx.__version__, onnx_ir_version=onnx.IR_VERSION, onnxruntime=ort.__version__,
               ort_device=ort.get_device(), available_providers=ort.get_available_providers())
    if provider != "cpu":  # onnxruntime-gpu >= 1.21: load the CUDA and cuDNN libraries before the first session
        env["preload_dlls"] = guard(lambda: ort.preload_dlls() or "called") if hasattr(ort, "preload_dlls") else "absent"
    env["probe_session_providers"] = guard(lambda: _probe(provider))
    try:
        query = ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,compute_cap", "--format=csv,noheader"]
        env["gpu"] = subprocess.run(query, capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError) as exc:
        env["gpu"] = f"nvidia-smi: {exc}"
    return env


def _probe(provider: str) -> list[str]:
    """The providers a one-node session on ``provider`` really got (ONNX Runtime logs why at warning level if it
    fell back to the CPU)."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from specdeploy.contract import IR_VERSION
    from specdeploy.engines.ort import PROVIDERS

    value = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1]) for n in "xy"]
    model = helper.make_model(helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "probe", value[:1], value[1:]),
                              opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = IR_VERSION
    chain = list(dict.fromkeys([PROVIDERS[provider], "CPUExecutionProvider"]))
    return ort.InferenceSession(model.SerializeToString(), providers=chain).get_providers()


def _vendor(directory: Path) -> list[str]:
    """Unpack DIR/wheels/*.whl (tokenizers) onto sys.path where the module is not installed."""
    wheels = sorted((directory / "wheels").glob("*.whl"))
    names = [w for w in wheels if importlib.util.find_spec(w.name.split("-")[0]) is None]
    if not names:
        return []
    site = Path(tempfile.mkdtemp(prefix="gpu-check-site-"))
    for wheel in names:
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(site)
    sys.path.insert(0, str(site))
    return [w.name for w in names]


def check_artifact(directory: Path, provider: str, loader: str, record: dict, save=lambda: None,
                   left=lambda: float("inf")) -> None:
    """Exactness, prefix reuse, exact mode, placement, cache and latency of one artifact into ``record``; each part's
    failure is recorded, not raised, and a part begun with no time ``left()`` is skipped (``{"skipped": why}``).
    ``record["stage"]`` names the part under way at each ``save()`` (removed when all are done). A fused float32
    artifact on CUDA must be refused before any session (``record["refused"]``)."""
    from specdeploy.contract import Manifest
    from specdeploy.engines import ProviderError
    from specdeploy.engines.ort import check_provider

    def stage(name: str) -> None:
        record["stage"] = name
        save()

    record["manifest"] = guard(lambda: {k: getattr(Manifest.read(directory).target, k) for k in SPEC_FIELDS})
    stage("load")
    usable = guard(lambda: _readable_copy(directory, record))
    if isinstance(usable, dict):
        record["load"] = usable
        return
    try:
        for spec in Manifest.read(usable).models.values():
            check_provider(usable / spec.file, spec, provider)
    except ProviderError as exc:
        record["refused"] = str(exc)
        del record["stage"]
        return
    loaded = {}
    for side, name in (("reference", "cpu"), ("device", provider)):
        start = time.perf_counter()
        loaded[side] = guard(lambda name=name: _pipeline(usable, name, loader))
        record.setdefault("load", {})[side] = (loaded[side] if isinstance(loaded[side], dict) else
                                               {"provider": name, "via": loaded[side][1],
                                                "seconds": round(time.perf_counter() - start, 3)})
    if any(isinstance(v, dict) for v in loaded.values()):
        return
    cases = ARTIFACTS.get(directory.name, {}).get("cases", SPECULATIVE)
    _check_pipelines(usable, loaded["reference"][0], loaded["device"][0], provider, record, stage, left,
                     {name: SPECULATIVE[name] for name in cases})
    del record["stage"]


def _check_pipelines(usable: Path, ref, dev, provider: str, record: dict, stage, left, cases=SPECULATIVE) -> None:
    """Exactness (each of ``cases``' drafters), prefix reuse, exact mode, rollback, placement, cache and latency of an
    artifact's pipelines on the CPU (``ref``) and on ``provider`` (``dev``) into ``record``; ``stage(name)`` marks
    each part before it runs, its seconds go to ``record["seconds"]``, and a part begun with no time ``left()`` is
    skipped."""
    prompts = _prompts()

    def part(name: str, work, key: str | None = None) -> None:
        if left() <= 0:
            record[key or name] = {"skipped": "budget spent"}
            return
        stage(name)
        began = time.perf_counter()
        record[key or name] = work()
        record.setdefault("seconds", {})[key or name] = round(time.perf_counter() - began, 2)

    part("exactness", lambda: exactness(ref, dev, prompts, provider, cases))
    # the costs the default speculation priced by: measured on ``provider`` (its warm-up and its cycles)
    record["costs"] = dev.costs.to_dict()
    part("prefix", lambda: guard(lambda: prefix_reuse(dev, prompts[2])))
    plain = record.get("exactness", {}).get(next(iter(record.get("exactness", {})), ""), {}).get("tokens")
    part("exact", lambda: guard(lambda: exact_mode(dev, prompts, plain, cases)))
    part("rollback", lambda: guard(lambda: rollback(ref, dev, prompts[2])))
    part("placement", lambda: guard(lambda: placement(usable / dev.target.spec.file, dev.target.spec, provider)))
    ids = np.random.default_rng(3).integers(0, dev.target.spec.vocab_size, (1, PAST + 5))
    part("cache", lambda: guard(lambda: cache_check(ref.target, dev.target, ids)))
    part("latency", lambda: {"engine": guard(lambda: engine_latency(dev.target)), "captures": dev.target.graphs is not None})
    if dev.target.graphs is not None and "engine" in record["latency"] and left() > 0:  # without CUDA graphs
        from specdeploy.engines.ort import OrtEngine

        stage("latency without CUDA graphs")
        began = time.perf_counter()
        record["latency"]["plain"] = guard(lambda: engine_latency(OrtEngine(
            usable / dev.target.spec.file, dev.target.spec, provider=provider, cuda_graphs=False)))
        record["seconds"]["latency"] += round(time.perf_counter() - began, 2)


def _prompts() -> list[list[int]]:
    """The check's prompts: a ragged batch of random token ids, one row of each of PROMPT_LENGTHS."""
    return [np.random.default_rng(n).integers(4, 120, n).tolist() for n in PROMPT_LENGTHS]


def _readable_copy(directory: Path, record: dict) -> Path:
    """``directory``, or a copy whose graphs carry an IR version this onnxruntime reads (manifest rehashed)."""
    import onnxruntime as ort

    from specdeploy.contract import Manifest, sha256_file

    manifest = Manifest.read(directory)
    try:
        ort.InferenceSession(str(directory / manifest.target.file), providers=["CPUExecutionProvider"])
        return directory
    except Exception as exc:
        if "IR version" not in str(exc):
            raise
        record["ir_lowered"] = str(exc).strip().splitlines()[-1][-200:]
    copy = Path(tempfile.mkdtemp(prefix="gpu-check-ir-")) / directory.name
    shutil.copytree(directory, copy)
    for spec in manifest.models.values():
        _lower_ir(copy / spec.file)
        manifest.files[spec.file] = sha256_file(copy / spec.file)
    manifest.write(copy)
    return copy


def _lower_ir(path: Path) -> None:
    import onnx

    from specdeploy.contract import IR_VERSION

    model = onnx.load(str(path), load_external_data=False)  # external weights stay where they are
    model.ir_version = min(model.ir_version, IR_VERSION)
    onnx.save_model(model, str(path))


class _IdTokenizer:
    """Stands in for ``tokenizers.Tokenizer`` where that is missing: prompts are token ids, a text is its ids."""

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return " ".join(map(str, ids))

    def token_to_id(self, token: str) -> None:
        return None


def _pipeline(directory: Path, provider: str, loader: str):
    """(Pipeline, how it was made): ``Pipeline.load`` where ``tokenizers`` imports, else from its engines."""
    from specdeploy import Pipeline
    from specdeploy.contract import ContractError, Manifest, verify_files
    from specdeploy.engines import load_engine

    if loader == "pipeline" or (loader == "auto" and importlib.util.find_spec("tokenizers") is not None):
        return Pipeline.load(directory, provider=provider), "Pipeline.load"

    manifest = Manifest.read(directory)
    problems = verify_files(directory, manifest)
    if problems:
        raise ContractError("; ".join(problems))
    target = load_engine(directory, manifest, "target", provider)
    draft = load_engine(directory, manifest, "draft", provider) if manifest.draft is not None else None
    return Pipeline(manifest, _IdTokenizer(), target, draft, directory), "Pipeline(engines), token ids"


def placement(path: Path, spec, provider: str) -> dict:
    """Nodes (of the optimised graph, as ONNX Runtime's profiler saw them run) per execution provider and op, and the
    copies ONNX Runtime put inside a call (Memcpy nodes): a fused float16 graph on CUDA must have none (every compute
    node on the CUDA EP, no value crossing inside a call, so that it can be captured as a CUDA graph)."""
    import onnx

    from specdeploy.engines.base import prefill
    from specdeploy.engines.ort import OrtEngine

    with tempfile.TemporaryDirectory() as tmp:
        engine = OrtEngine(path, spec, provider=provider, profile=Path(tmp) / "profile")
        cache = engine.allocate_cache(1, 64)
        ids = np.arange(4, 24, dtype=np.int64)[None]
        prefill(engine, cache, ids, [12])
        engine.infer(ids[:, 12:13], np.array([12], np.int64), cache)
        engine.infer(ids[:, 13:18], np.array([13], np.int64), cache)
        events = json.loads(Path(engine.session.end_profiling()).read_text())
        providers = engine.session.get_providers()
    nodes = {e["name"][: -len("_kernel_time")]: (e.get("args", {}).get("provider", "?"), e.get("args", {}).get("op_name", "?"))
             for e in events if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")}
    ops: dict[str, Counter] = {}
    for where, op in nodes.values():
        ops.setdefault(where, Counter())[op] += 1
    graph_nodes = len(onnx.load(str(path), load_external_data=False).graph.node)
    return {"session_providers": providers, "graph_nodes": graph_nodes,
            "nodes_per_provider": {p: sum(c.values()) for p, c in ops.items()},
            "ops_per_provider": {p: dict(c.most_common()) for p, c in ops.items()},
            "copies_inside": sum(n for c in ops.values() for op, n in c.items() if op.startswith("Memcpy")),
            "copies_allowed": not (provider == "cuda" and spec.graph == "fused" and spec.dtype != "float32")}


def cache_check(ref, dev, ids: np.ndarray) -> dict:
    """Where ``dev``'s cache lives; ``ids`` [1, PAST + 5] run on both engines as a prefill of PAST tokens and one call
    of 5: the call's logits and the caches compared (the device's cache copied here for that alone), a hybrid's
    recurrent states too (the slots holding the text's positions: all of a ring, a positional buffer's prefix)."""
    from specdeploy.engines.memory import on_host

    cache = dev.allocate_cache(1, CAPACITY)
    info = {"handle": type(cache).__name__, "buffer": f"{type(cache.stacked).__module__}.{type(cache.stacked).__name__}",
            "on_host": isinstance(cache.stacked, np.ndarray), "memory": dev.memory.name}
    logits, caches, states = [], [], []
    for engine, c in ((ref, ref.allocate_cache(1, CAPACITY)), (dev, cache)):
        logits.append(last_logits(engine, ids, c))
        caches.append(on_host(c.stacked).astype(np.float32))
        states.append([on_host(group)[:, :, : PAST + 5].astype(np.float32) for group in c.states])
    valid = slice(0, PAST + 5)
    beyond = caches[1][:, :, :, PAST + 5 :]
    info.update(logits_max_abs_diff=float(np.abs(logits[0] - logits[1]).max()),
                logits_max_abs=float(np.abs(logits[0]).max()),
                cache_max_abs_diff=float(np.abs(caches[0][:, :, :, valid] - caches[1][:, :, :, valid]).max()),
                new_slots_written=bool(np.abs(caches[1][:, :, :, PAST : PAST + 5]).max() > 0),
                beyond_valid_nonzero=float((beyond != 0).mean()), beyond_valid_finite=bool(np.isfinite(beyond).all()))
    if states[0]:
        info["states_max_abs_diff"] = {state.name: float(np.abs(a - b).max())
                                       for state, a, b in zip(dev.spec.states, *states)}
        info["states_max_abs"] = {state.name: float(np.abs(a).max()) for state, a in zip(dev.spec.states, states[0])}
    return info


def _failures(record: dict) -> list[str]:
    """The parts of an artifact's record that raised, and its decoding cases that part where they must not
    (``gpu_decoding.failures``)."""
    found = [key for key, value in record.items() if isinstance(value, dict) and "error" in value]
    found += failures(record)
    place = record.get("placement", {})
    if place.get("copies_inside") and not place.get("copies_allowed", True):
        found.append(f"placement: {place['copies_inside']} copies inside a call")
    found += [f"latency {kind}" for kind, value in record.get("latency", {}).items() if isinstance(value, dict)
              and "error" in value]
    return found


if __name__ == "__main__":
    sys.exit(main())
