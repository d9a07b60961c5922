"""Which of the package's modules and functions one greedy batch-1 cycle runs, from ``Generation.step``.

What a newcomer follows to read one cycle (Python frames of ``specdeploy`` code, comprehensions
folded into their function). Exports a tiny random Llama pair, prefills, runs three cycles to warm
up, then traces the fourth.

    python tools/trace_cycle.py [--k 4] [--drafter model]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


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

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--drafter", default="model")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        pipeline = Pipeline.load(tiny.export_pair(Path(tmp), capacity=256), threads=1)
        run = pipeline.start(["w5 w6 w7 w8 w5 w6"], GenerationConfig(k=args.k, drafter=args.drafter, ignore_eos=True))
        run.prefill()
        for _ in range(3):
            run.step()
        visited = trace_step(run)
    for module, functions in visited.items():
        print(f"{module}: {', '.join(functions)}")
    print(f"{len(visited)} modules, {sum(map(len, visited.values()))} functions")


if __name__ == "__main__":
    main()
