"""Which of the package's modules and functions one greedy batch-1 cycle runs, from ``Generation.step``.

What a newcomer follows to read one cycle (Python frames of ``specdeploy`` code, comprehensions
folded into their function), under the default speculation (the cost policy over the hybrid drafter) unless
told otherwise. Exports a tiny random Llama pair, prefills, runs three cycles to warm up, then traces the fourth.

    python -m tools.trace_cycle [--k 8] [--policy cost] [--drafter hybrid]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path


def trace_step(run) -> dict[str, list[str]]:
    """module -> functions (qualified names) that ``run.step()`` enters, in the order first entered."""
    seen: dict[str, list[str]] = {}

    def profile(frame, event, arg):
        module = frame.f_globals.get("__name__", "")
        if event == "call" and module.startswith("specdeploy") and not frame.f_code.co_filename.startswith("<"):
            name = getattr(frame.f_code, "co_qualname", frame.f_code.co_name).split(".<locals>")[0]
            if name not in seen.setdefault(module, []):
                seen[module].append(name)

    sys.setprofile(profile)
    try:
        run.step()
    finally:
        sys.setprofile(None)
    return seen


def main() -> None:
    from specdeploy import GenerationConfig, Pipeline
    from tests import tiny

    default = GenerationConfig()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--k", type=int, default=default.k, help="the most drafts a cycle")
    parser.add_argument("--policy", default=default.policy, help="draft-length policy")
    parser.add_argument("--drafter", default=default.drafter, help="drafter")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        pipeline = Pipeline.load(tiny.export_pair(Path(tmp), capacity=256), threads=1)
        config = GenerationConfig(k=args.k, policy=args.policy, drafter=args.drafter, ignore_eos=True)
        run = pipeline.start(["w5 w6 w7 w8 w5 w6"], config)
        run.prefill()
        for _ in range(3):
            run.step()
        visited = trace_step(run)
    for module, functions in visited.items():
        print(f"{module}: {', '.join(functions)}")
    print(f"{len(visited)} modules, {sum(map(len, visited.values()))} functions")


if __name__ == "__main__":
    main()
