"""specdeploy against onnxruntime-genai on this machine: same weights, prompts and ONNX Runtime.

Both systems run the official Qwen2.5-Coder Q4_K_M GGUF pair (1.5B target, 0.5B draft). specdeploy
runs its artifact (``make demo``'s); the peer runs int4 models its own builder makes from the same
weights, converted to an fp16 Hugging Face folder by transformers. The peer's wheel is installed
into ``build/peer/site`` (``--no-deps``: it runs on this environment's onnxruntime, so both use the
same kernels). Greedy, batch 1, each prompt until EOS or ``--max-tokens`` new tokens, ``--threads``
intra-op threads each. Each system runs in a worker process of its own (its memory is its own and
the two thread pools never spin against each other); configurations alternate per prompt, in
rotating order, so drift hits all alike; loading is timed apart.

Reported per configuration: end-to-end tok/s (new tokens over the time from the request to the last
token) and decode tok/s (after the first token), time to first token, tokens per target call,
outputs identical to specdeploy's plain decoding (a speculative output that differs is located with
``Pipeline.first_divergence``: the plain target's margin between the two tokens there), and each
worker's peak resident memory.

    python -m tools.bench_peer --artifact DIR [--artifact DIR2] [--humaneval 8] [--specbench 0] [--conversations 0]
        [--structured 0] [--max-tokens 128] [--k 4] [--peer-graphs] [--out docs/results/bench_peer]

``--peer-graphs`` adds specdeploy driving the peer's own int4 graphs (``specdeploy import`` of the two folders its
builder made): plain decoding and the default speculation, beside the peer's generator on the same graphs; the
column "identical to the peer's target" compares every configuration's output with the peer's own greedy output.

Prompts run in order, each through every configuration before the next (a conversation's turns after each
other); chat prompts (the conversation and structured workloads) are rendered by the first artifact's chat
template, and every system is sent the same token ids.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PEER = "onnxruntime-genai==0.18.0"
SITE = ROOT / "build" / "peer" / "site"
CACHE = Path(os.environ.get("SPECDEPLOY_CACHE", Path.home() / ".cache" / "specdeploy"))
GGUF = {"target": "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", "draft": "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"}


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ---------------------------------------------------------------- the peer: install and build

def peer_env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(SITE), os.environ.get("PYTHONPATH")]))}


def ensure_peer() -> str:
    """Install the peer's wheel into SITE unless it is there; return its version."""
    probe = [sys.executable, "-c", "import onnxruntime_genai as og; print(og.__version__)"]
    done = subprocess.run(probe, env=peer_env(), capture_output=True, text=True)
    if done.returncode != 0 or done.stdout.strip() != PEER.split("==")[1]:
        log(f"installing {PEER} into {SITE} (no dependencies: it uses this environment's onnxruntime)")
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--upgrade",
                        "--target", str(SITE), PEER], check=True)
        done = subprocess.run(probe, env=peer_env(), capture_output=True, text=True, check=True)
    return done.stdout.strip()


CONVERT = """
import sys, torch
from pathlib import Path
from transformers import AutoModelForCausalLM, AutoTokenizer
gguf, out = Path(sys.argv[1]), sys.argv[2]
model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float16)
model.hf_quantizer = None  # the builder refuses a model that still says it is GGUF-quantized
if hasattr(model.config, "quantization_config"):
    del model.config.quantization_config
model.save_pretrained(out)
AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
"""


def peer_model(gguf: Path, block: int, accuracy: int, threads: int) -> Path:
    """The peer's int4 model of ``gguf`` (built once, cached beside the GGUF files)."""
    out = CACHE / "peer" / f"{gguf.stem}-int4-b{block}-a{accuracy}"
    if not (out / "genai_config.json").is_file():
        hf = CACHE / "peer" / f"{gguf.stem}-hf"
        began = time.perf_counter()
        log(f"{gguf.name}: converting to an fp16 Hugging Face folder")
        subprocess.run([sys.executable, "-c", CONVERT, str(gguf), str(hf)], check=True)
        log(f"{gguf.name}: building the peer's int4 model (block {block}, accuracy level {accuracy})")
        subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf), "-o", str(out),
                        "-p", "int4", "-e", "cpu", "-c", str(CACHE / "peer" / "hf-cache"), "--extra_options",
                        f"accuracy_level={accuracy}", f"block_size={block}"], env=peer_env(), check=True,
                       stdout=subprocess.DEVNULL)
        shutil.rmtree(hf)  # gigabytes of intermediate fp16 weights
        log(f"{gguf.name}: built in {time.perf_counter() - began:.0f} s")
    config_path = out / "genai_config.json"
    config = json.loads(config_path.read_text())
    config["model"]["decoder"]["session_options"]["intra_op_num_threads"] = threads
    config_path.write_text(json.dumps(config, indent=4))
    return out


def peer_pair(target: Path, draft: Path, k: int) -> Path:
    """A composite model directory: the target's decoder verifies, the draft's proposes ``k`` tokens."""
    out = CACHE / "peer" / f"{target.name}+{draft.name}-k{k}"
    out.mkdir(parents=True, exist_ok=True)
    for role, source in (("target", target), ("draft", draft)):  # hard links: the peer refuses ".." in paths
        (out / role).mkdir(exist_ok=True)
        for name in ("model.onnx", "model.onnx.data"):
            (out / role / name).unlink(missing_ok=True)
            os.link(source / name, out / role / name)
    config = json.loads((target / "genai_config.json").read_text())
    config["model"]["decoder"]["filename"] = "target/model.onnx"
    config["model"]["draft"] = json.loads((draft / "genai_config.json").read_text())["model"]["decoder"]
    config["model"]["draft"]["filename"] = "draft/model.onnx"
    config["speculative"] = {"max_draft_tokens": k}
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (target / name).is_file():
            (out / name).write_bytes((target / name).read_bytes())
    (out / "genai_config.json").write_text(json.dumps(config, indent=4))
    return out


def peer_artifact(target: Path, draft: Path) -> Path:
    """The peer's own target and draft folders imported as one specdeploy artifact (``specdeploy import``; weights
    hard-linked, so cheap), made afresh each run: the folders' genai_config.json is rewritten per run (threads)."""
    from specdeploy.importer import import_artifact

    out = CACHE / "peer" / f"imported-{target.name}+{draft.name}"
    import_artifact(target, out, draft=draft, force=True)
    return out


# ---------------------------------------------------------------- workers: one process per system

def peak_rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class PeerWorker:
    def __init__(self, models: dict[str, str]):
        """``models``: name -> model folder (their genai_config.json sets the threads)."""
        import onnxruntime_genai as og

        self.og, self.models, self.load_s = og, {}, {}
        for name, path in models.items():
            began = time.perf_counter()
            self.models[name] = og.Model(path)
            self.load_s[name] = time.perf_counter() - began

    def run(self, config: str, ids: list[int], max_tokens: int, measured: bool = True) -> dict:
        og, model = self.og, self.models[config]
        began = time.perf_counter()
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=len(ids) + max_tokens, do_sample=False)
        generator = og.Generator(model, params)
        generator.append_tokens(ids)
        first = None
        while not generator.is_done():
            generator.generate_next_token()
            first = first or time.perf_counter()
        ended = time.perf_counter()
        tokens = [int(t) for t in generator.get_sequence(0)[len(ids):]]
        out = {"tokens": tokens, "seconds": ended - began, "first_s": (first or ended) - began}
        out["target_calls"] = len(tokens)  # the prompt's call gives the first token, each later call one
        if config != "target":
            stats = generator.get_speculative_stats()  # its passes leave out the prompt's call
            out["target_calls"] = stats["target_forward_passes"] + 1
            out["acceptance_rate"] = stats["draft_tokens_accepted"] / max(1, stats["draft_tokens_evaluated"])
        return out


def configurations(k: int) -> dict:
    """specdeploy's configurations: plain decoding, each source of drafts alone under the cost policy, the draft model
    at the peer's fixed K, and the default (the cost policy over the hybrid drafter: the suffix index where it pays,
    the draft model elsewhere); every setting spelled out but the default's."""
    from specdeploy import GenerationConfig

    return {
        "plain": GenerationConfig(drafter="none", temperature=0.0),
        f"fixed k={k}": GenerationConfig(k=k, policy="fixed", drafter="model", temperature=0.0),
        "model, cost k<=8": GenerationConfig(k=8, policy="cost", drafter="model", temperature=0.0),
        "lookup, cost k<=8": GenerationConfig(k=8, policy="cost", drafter="prompt-lookup", temperature=0.0),
        "suffix, cost k<=8": GenerationConfig(k=8, policy="cost", drafter="suffix", temperature=0.0),
        "default (hybrid cost k<=8)": GenerationConfig(temperature=0.0),
    }


# specdeploy's configurations over the peer's own graphs: the target alone and the default
PEER_GRAPH_CONFIGS = ("plain", "default (hybrid cost k<=8)")
PEER_GRAPHS = "specdeploy (the peer's graphs)"


class SpecdeployWorker:
    def __init__(self, artifact: str, threads: int, k: int):
        from specdeploy import Pipeline
        began = time.perf_counter()
        self.pipeline = Pipeline.load(artifact, threads=threads)
        self.load_s = {"artifact": time.perf_counter() - began}
        self.configs = configurations(k)
        # each configuration is a scope of its own (named after it): it drafts from the answers it gave before, and
        # reuses the K/V of its own texts, empty at the start; none may draft from another's answer to the same prompt
        # (that would measure a copy of the answer) or start from its prompt's K/V
        self.plain = {}

    def run(self, config: str, ids: list[int], max_tokens: int, measured: bool = True,
            peer: list[int] | None = None) -> dict:
        """``peer``: the peer's own greedy output for ``ids``; where this output differs, where and by what margin
        (of this pipeline's target between the two tokens there) is reported as ``peer_divergence``."""
        settings = replace(self.configs[config], max_new_tokens=max_tokens)
        began = time.perf_counter()
        first, result = None, None
        for chunk in self.pipeline.stream(ids, settings, **({"scope": config} if measured else {"suffix_index": None})):
            first = first or (time.perf_counter() if chunk.token_ids else None)
            result = chunk.result or result
        ended = time.perf_counter()
        tokens = result.token_ids
        out = {"tokens": tokens, "seconds": ended - began, "first_s": (first or ended) - began,
               "target_calls": result.stats["cycles"]}
        key = tuple(ids)
        if config == "plain":
            self.plain[key] = tokens
        elif key in self.plain and tokens != self.plain[key]:
            out["divergence"] = self.pipeline.first_divergence(ids, self.plain[key], tokens, settings)
        if peer is not None and tokens != peer:
            out["peer_divergence"] = self.pipeline.first_divergence(ids, peer, tokens, settings)
        return out


def worker_main(system: str, spec: str, threads: int, k: int) -> None:
    """Serve requests, one JSON line each on stdin, one JSON line each on stdout."""
    out = sys.stdout
    sys.stdout = sys.stderr  # library chatter must never reach the protocol
    if system == "peer":
        worker = PeerWorker(json.loads(spec))
    else:
        worker = SpecdeployWorker(spec, threads, k)
    out.write(json.dumps({"load_s": worker.load_s, "rss_mb": peak_rss_mb()}) + "\n")
    out.flush()
    for line in sys.stdin:
        request = json.loads(line)
        extra = {"peer": request["peer"]} if request.get("peer") is not None else {}
        result = worker.run(request["config"], request["ids"], request["max_tokens"], request.get("measured", True),
                            **extra)
        result["rss_mb"] = peak_rss_mb()
        out.write(json.dumps(result) + "\n")
        out.flush()


class Worker:
    def __init__(self, system: str, spec: str, threads: int, k: int):
        command = [sys.executable, __file__, "--worker", system, "--spec", spec, "--threads", str(threads), "--k", str(k)]
        began = time.perf_counter()
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                        env=peer_env() if system == "peer" else None)
        self.ready = self._read()
        self.ready["process_s"] = time.perf_counter() - began

    def _read(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"worker {self.process.args[3]} exited with {self.process.wait()}")
        return json.loads(line)

    def run(self, config: str, ids: list[int], max_tokens: int, measured: bool = True,
            peer: list[int] | None = None) -> dict:
        """``measured``: False for a warm-up, which leaves the configuration's suffix index empty; ``peer``: the
        peer's own output to compare with (a specdeploy worker's)."""
        request = {"config": config, "ids": ids, "max_tokens": max_tokens, "measured": measured, "peer": peer}
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=60)


# ---------------------------------------------------------------- the run and its report

def prompt_encoder(artifact: Path) -> Callable:
    """A function from a ``specdeploy.workloads.Prompt`` to the token ids both systems are sent, from ``artifact``'s
    tokenizer and chat template alone (its models are the workers' to load): a chat prompt's messages rendered as
    ``Pipeline.chat_prompt`` renders them (the template places any BOS), a text prompt's text as it is (Qwen: no BOS).
    """
    from specdeploy.contract import Manifest, read_tokenizer
    from specdeploy.runtime.artifact import chat_template

    manifest = Manifest.read(artifact)
    tokenizer = read_tokenizer(artifact / manifest.tokenizer)
    template = chat_template(artifact, manifest, tokenizer)

    def encode(prompt) -> list[int]:
        text = template.render(list(prompt.messages)) if prompt.messages else prompt.text
        return tokenizer.encode(text, add_special_tokens=False).ids

    return encode


def summarize(runs: list[dict], own_plain: list[list[int]], reference: list[list[int]],
              peer: list[list[int]] | None = None) -> dict:
    """``peer``: the peer's own greedy output per prompt (its target alone), where the report compares with it."""
    tokens = [len(r["tokens"]) for r in runs]
    e2e = [n / r["seconds"] for n, r in zip(tokens, runs)]
    decode = [(n - 1) / (r["seconds"] - r["first_s"]) for n, r in zip(tokens, runs) if n > 1]
    divergences = [r["divergence"] for r in runs if r.get("divergence")]
    from_peer = [r["peer_divergence"] for r in runs if r.get("peer_divergence")]
    return {
        "tok_s_e2e": statistics.median(e2e), "tok_s_e2e_total": sum(tokens) / sum(r["seconds"] for r in runs),
        "tok_s_decode": statistics.median(decode) if decode else 0.0,
        "first_token_s": statistics.median(r["first_s"] for r in runs),
        "tokens_per_target_call": sum(tokens) / sum(r["target_calls"] for r in runs),
        "identical_to_own_plain": sum(r["tokens"] == ref for r, ref in zip(runs, own_plain)),
        "identical_to_specdeploy_plain": sum(r["tokens"] == ref for r, ref in zip(runs, reference)),
        "identical_to_peer": None if peer is None else sum(r["tokens"] == ref for r, ref in zip(runs, peer)),
        "prompts": len(runs), "tokens": sum(tokens),
        "divergence_margins": [round(d["margin"], 3) for d in divergences],
        "peer_divergence_margins": [round(d["margin"], 3) for d in from_peer],
        "peak_rss_mb": max(r["rss_mb"] for r in runs),
    }


def markdown(report: dict) -> str:
    setup = report["setup"]
    lines = [
        f"# specdeploy vs onnxruntime-genai ({setup['date']})", "",
        f"`{setup['command']}`", "",
        f"{setup['machine']}; onnxruntime {setup['onnxruntime']}, onnxruntime-genai {setup['peer']}, "
        f"specdeploy {setup['specdeploy']} (commit {setup.get('commit') or 'unknown'}). "
        f"Prompts: {', '.join(f'{g} {n}' for g, n in setup['prompts'].items())}; "
        f"greedy, batch 1, until EOS or "
        f"{setup['max_tokens']} new tokens, {setup['threads']} threads per system; configurations interleaved per prompt.",
        "", f"- peer: {setup['peer_models']}", f"- specdeploy: {setup['artifacts']}",
        f"- reference for identical outputs: {setup['reference']}", "",
        f"The table: {next(iter(setup['prompts']))}; by prompt set below.", "",
        "| system | configuration | tok/s end to end (median) | tok/s decode (median) | first token | "
        "tokens per target call | identical to its own plain | identical to the reference | peak RSS | "
        "identical to the peer's target |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, s in report["results"].items():
        system, config = name.split(": ", 1)
        margins = f" (differing: margins {', '.join(map(str, s['divergence_margins']))})" if s["divergence_margins"] else ""
        lines.append(f"| {system} | {config} | {s['tok_s_e2e']:.1f} | {s['tok_s_decode']:.1f} | "
                     f"{s['first_token_s'] * 1000:.0f} ms | {s['tokens_per_target_call']:.2f} | "
                     f"{s['identical_to_own_plain']}/{s['prompts']}{margins} | "
                     f"{s['identical_to_specdeploy_plain']}/{s['prompts']} | {s['peak_rss_mb'] / 1024:.2f} GB | "
                     + _peer_cell(s) + " |")
    by_group = report.get("by_group", {})
    if len(by_group) > 1:
        names = list(report["results"])
        lines += ["", "By prompt set, tok/s end to end (median):", "",
                  "| prompt set | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
        for group, summaries in by_group.items():
            lines.append(f"| {group} ({summaries[names[0]]['prompts']}) | "
                         + " | ".join(f"{summaries[n]['tok_s_e2e']:.1f}" for n in names) + " |")
    lines += ["", "Loading (not in the figures above): " + "; ".join(
        f"{system} {w['process_s']:.1f} s to ready ({', '.join(f'{k} {v:.1f} s' for k, v in w['load_s'].items())})"
        for system, w in report["workers"].items()), ""]
    return "\n".join(lines)


def _peer_cell(summary: dict) -> str:
    """The "identical to the peer's target" cell: a count, with the margins where specdeploy over the peer's graphs
    located its differences (other systems' differences are not located: their weights differ)."""
    if summary.get("identical_to_peer") is None:
        return "-"
    margins = summary.get("peer_divergence_margins")
    return f"{summary['identical_to_peer']}/{summary['prompts']}" + (
        f" (differing: margins {', '.join(map(str, margins))})" if margins else "")


def main() -> None:
    parser = _parser()
    args = parser.parse_args()
    if args.worker:
        return worker_main(args.worker, args.spec, args.threads, args.k)
    if not args.artifact:
        parser.error("--artifact is required")
    prompts, encode, ids_of = _encoded_prompts(args, parser)
    version = ensure_peer()
    workers, grid = _start_workers(args)
    runs = _run_grid(workers, grid, prompts, ids_of, encode, args.max_tokens)
    for worker in workers.values():
        worker.close()
    report = _report(args, version, prompts, workers, grid, runs)
    text = markdown(report)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        # appended, not with_suffix: an --out named after a version (bench_peer_0.3.1) keeps its dots
        args.out.with_name(args.out.name + ".md").write_text(text)
        args.out.with_name(args.out.name + ".json").write_text(json.dumps(report, indent=1))


def _parser() -> argparse.ArgumentParser:
    try:
        from tools import arguments
    except ImportError:  # a worker runs this file as a script: its folder is on the path, the repository is not
        import arguments

    parser = arguments.parser(__doc__)
    parser.add_argument("--artifact", type=Path, action="append", help="a specdeploy artifact of the pair (make "
                        "demo's); repeat to compare several (the first is the reference)")
    parser.add_argument("--gguf-dir", type=Path, default=CACHE, help="where the two GGUF files are (make demo puts them here)")
    parser.add_argument("--humaneval", type=arguments.integer(0), default=8, help="HumanEval prompts (the first N)")
    parser.add_argument("--specbench", type=arguments.integer(0), default=0, help="Spec-Bench first turns per group (shipped with "
                        "specdeploy; specdeploy.workloads.workload picks them), reported per group")
    parser.add_argument("--specbench-groups", default=None, metavar="GROUP,...",
                        help="only these Spec-Bench groups (comma list of mt_bench, translation, summarization, qa, "
                        "math_reasoning, rag; default all six)")
    parser.add_argument("--conversations", type=arguments.integer(0), default=0,
                        help="code-edit conversations (shipped with specdeploy: 8, of 3 turns each), every turn in "
                        "order; reported as conversation/turn_1 and conversation/later_turns")
    parser.add_argument("--structured", type=arguments.integer(0), default=0,
                        help="structured-output prompts (shipped with specdeploy: 8), asking for JSON records")
    parser.add_argument("--max-tokens", type=arguments.integer(1), default=128, help="new tokens per prompt at most")
    parser.add_argument("--k", type=arguments.integer(1), default=4, help="draft tokens per cycle, both systems' fixed-K runs")
    parser.add_argument("--no-fixed", action="store_true", help="leave specdeploy's fixed-K run out (the peer's stays)")
    parser.add_argument("--threads", type=arguments.integer(1), default=2, help="intra-op threads of each system")
    parser.add_argument("--block-size", type=arguments.integer(1), default=128, help="the peer's int4 block size")
    parser.add_argument("--accuracy-level", type=arguments.integer(0, 4), default=4, help="the peer's MatMulNBits accuracy level")
    parser.add_argument("--peer-graphs", action="store_true", help="also run specdeploy over the peer's own int4 "
                        "graphs (imported with specdeploy import): plain and the default speculation")
    parser.add_argument("--out", type=Path, default=None, help="write OUT.md and OUT.json")
    parser.add_argument("--worker", choices=("peer", "specdeploy"), help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    return parser


def _encoded_prompts(args: argparse.Namespace, parser: argparse.ArgumentParser) -> tuple[list, Callable, list]:
    """The workload's (group, prompt) pairs, the first artifact's encoder and each prompt's ids; a usage error where
    the workload cannot be had or a prompt does not fit an artifact."""
    from specdeploy.contract import Manifest
    from specdeploy.workloads import PromptFileError, workload

    try:  # before the peer's minutes of set-up: a workload that cannot be had is an error, never skipped
        # HumanEval, then Spec-Bench per group, the conversations' turns, the structured prompts
        prompts = workload(args.humaneval, args.specbench, conversation_count=args.conversations,
                           structured_count=args.structured)
        prompts = _only_groups(prompts, args.specbench_groups, parser)
        encode = prompt_encoder(args.artifact[0])  # both systems get the same ids
        ids_of = [encode(prompt) for _, prompt in prompts]
    except (PromptFileError, ValueError, RuntimeError) as exc:  # ContractError, ConfigError; ChatTemplateError
        parser.error(str(exc))
    # a prompt too long (a conversation's later turn) is refused here, not by a worker after the peer's set-up
    for artifact in args.artifact:
        capacity = Manifest.read(artifact).target.capacity
        for (_, prompt), ids in zip(prompts, ids_of):
            if len(ids) + args.max_tokens + 9 > capacity:  # 9: the cost policy's k <= 8 drafts and the bonus token
                parser.error(f"prompt {prompt.id}: {len(ids)} tokens, {args.max_tokens} new and up to 9 speculative "
                             f"need {len(ids) + args.max_tokens + 9} slots; {artifact} has {capacity}")
    return prompts, encode, ids_of


def _only_groups(prompts: list, groups: str | None, parser: argparse.ArgumentParser) -> list:
    """``prompts`` without the Spec-Bench groups ``groups`` (a comma list) leaves out; a usage error naming an unknown one."""
    from specdeploy.workloads import SPEC_BENCH_GROUPS

    if groups is None:
        return prompts
    wanted = groups.split(",")
    unknown = [g for g in wanted if g not in SPEC_BENCH_GROUPS]
    if unknown or not groups:
        parser.error(f"--specbench-groups: got {groups!r}; expected a comma list of {', '.join(SPEC_BENCH_GROUPS)}")
    return [(group, p) for group, p in prompts if not group.startswith("spec_bench/") or group.split("/")[1] in wanted]


def _start_workers(args: argparse.Namespace) -> tuple[dict[str, Worker], list[tuple[str, str]]]:
    """The peer's worker (its models built first) and one per artifact, by system name, and the (system,
    configuration) grid they run."""
    from specdeploy.contract import Manifest

    models = {role: peer_model(args.gguf_dir / name, args.block_size, args.accuracy_level, args.threads)
              for role, name in GGUF.items()}
    pair = peer_pair(models["target"], models["draft"], args.k)
    log("starting the workers")
    workers = {"onnxruntime-genai": Worker("peer", json.dumps({"target": str(models["target"]),
                                                               f"draft k={args.k}": str(pair)}), args.threads, args.k)}
    grid = [("onnxruntime-genai", "target"), ("onnxruntime-genai", f"draft k={args.k}")]
    for artifact in args.artifact:
        specs = Manifest.read(artifact).models
        name = f"specdeploy ({specs['target'].weights} target, {specs['draft'].weights} draft, {specs['target'].graph} graphs)"
        if name in workers:  # two artifacts of the same formats: their folder names tell them apart
            name = f"specdeploy ({artifact.name})"
        workers[name] = Worker("specdeploy", str(artifact), args.threads, args.k)
        grid += [(name, config) for config in configurations(args.k) if not (args.no_fixed and config.startswith("fixed"))]
    if args.peer_graphs:
        log("importing the peer's graphs")
        workers[PEER_GRAPHS] = Worker("specdeploy", str(peer_artifact(models["target"], models["draft"])), args.threads,
                                      args.k)
        grid += [(PEER_GRAPHS, config) for config in PEER_GRAPH_CONFIGS]
    return workers, grid


def _run_grid(workers: dict[str, Worker], grid: list[tuple[str, str]], prompts: list, ids_of: list[list[int]],
              encode: Callable, max_tokens: int) -> dict[str, list[dict]]:
    """Every prompt through every configuration, in rotating order with plain first; the runs by "system: config"."""
    from specdeploy.workloads import Prompt

    for system, config in grid:  # warm-up, unmeasured: first calls allocate
        workers[system].run(config, encode(Prompt("warm-up", "def add(a, b):")), 8, measured=False)
    runs = {f"{s}: {c}": [] for s, c in grid}
    for index, ((group, prompt), ids) in enumerate(zip(prompts, ids_of)):
        order = grid[index % len(grid):] + grid[: index % len(grid)]
        # the peer's target, then plain, first: the others are compared with them
        order.sort(key=lambda sc: {"target": 0, "plain": 1}.get(sc[1], 2))
        for system, config in order:
            peer = runs["onnxruntime-genai: target"][-1]["tokens"] if system == PEER_GRAPHS else None
            runs[f"{system}: {config}"].append(workers[system].run(config, ids, max_tokens, peer=peer) | {"group": group})
        line = ", ".join(f"{name} {len(r[-1]['tokens']) / r[-1]['seconds']:.1f}" for name, r in runs.items())
        log(f"[{index + 1}/{len(prompts)}] {group} {prompt.id}: tok/s {line}")
    return runs


def _report(args: argparse.Namespace, version: str, prompts: list, workers: dict[str, Worker],
            grid: list[tuple[str, str]], runs: dict[str, list[dict]]) -> dict:
    """The report ``markdown`` renders and OUT.json holds: set-up, workers, summaries overall and per group, runs."""
    import onnxruntime

    import specdeploy
    from tools.provenance import provenance  # here: the workers run this file as a script, without the package

    reference_name = f"{grid[2][0]}: plain"
    reference = [r["tokens"] for r in runs[reference_name]]
    own_plain = {system: [r["tokens"] for r in runs[f"{system}: {config}"]] for system, config in grid
                 if config in ("plain", "target")}
    peer = own_plain["onnxruntime-genai"]
    groups = list(dict.fromkeys(group for group, _ in prompts))

    def results(group: str) -> dict:
        keep = [i for i, (g, _) in enumerate(prompts) if g == group]
        return {name: summarize([r[i] for i in keep], [own_plain[name.split(": ")[0]][i] for i in keep],
                                [reference[i] for i in keep], [peer[i] for i in keep]) for name, r in runs.items()}
    facts = provenance("tools.bench_peer")  # date, command, machine, commit
    return {
        "setup": {
            **facts, "machine": f"{facts['machine']}, no GPU", "onnxruntime": onnxruntime.__version__, "peer": version,
            "specdeploy": specdeploy.__version__, "max_tokens": args.max_tokens,
            "prompts": {group: sum(g == group for g, _ in prompts) for group in groups},
            "threads": args.threads, "artifacts": ", ".join(a.name for a in args.artifact), "reference": reference_name,
            "peer_models": f"its builder on the same GGUF weights: int4, block {args.block_size}, accuracy level "
                           f"{args.accuracy_level}, CPU; draft K = {args.k} through genai_config's model.draft",
        },
        "workers": {name: w.ready for name, w in workers.items()},
        "results": results(groups[0]),
        "by_group": {group: results(group) for group in groups},
        "runs": {name: [{k: v for k, v in run.items() if k != "tokens"} | {"tokens": len(run["tokens"])} for run in r]
                 for name, r in runs.items()},
    }


if __name__ == "__main__":
    main()
