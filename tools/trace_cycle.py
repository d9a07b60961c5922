"""Which of the package's modules and functions one greedy batch-1 cycle runs, from ``Generation.step``.

What a newcomer follows to read one cycle (Python frames of ``specdeploy`` code, comprehensions
folded into their function), under the default speculation (the cost policy over the hybrid drafter) unless
told otherwise. Exports a tiny random Llama pair, prefills, runs three cycles to warm up, then traces the fourth.
``--config-walk``: instead, the modules a ``GenerationConfig`` passes through from ``Pipeline.generate`` to the first
engine call (``trace_config``), as a reader following it would open them.

    python -m tools.trace_cycle [--k 8] [--policy cost] [--drafter hybrid] [--config-walk]
"""

from __future__ import annotations

import sys
import tempfile
from dataclasses import replace
from pathlib import Path

from tools import arguments


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


def trace_config(pipeline, prompts, config) -> list[tuple[str, str]]:
    """(module, function) in the order a reader following ``config`` opens them, from ``pipeline.generate(prompts,
    config)`` to its first engine call (the last entry): a function is a stop when the config, or a setting read from
    it (not a number, whose identity says nothing), reaches it as an argument; consecutive stops in one module are one.
    A stop in a module left before is a return. On a pipeline warmed up at ``config.k``, or its warm-up is the call."""
    read: dict[int, object] = {}  # id -> a setting read from the config (kept, so that no id is reused)

    class Followed(type(config)):
        def __getattribute__(self, name):
            value = object.__getattribute__(self, name)
            if not name.startswith("_") and not isinstance(value, (bool, int, float, type(None))):
                read[id(value)] = value
            return value

    followed = Followed(**{name: getattr(config, name) for name in config.__dataclass_fields__})
    walk: list[tuple[str, str]] = []

    def profile(frame, event, arg):
        module = frame.f_globals.get("__name__", "")
        if event != "call" or not module.startswith("specdeploy.") or module == "specdeploy.runtime.config":
            return
        name = getattr(frame.f_code, "co_qualname", frame.f_code.co_name).split(".<locals>")[0]
        if module.startswith("specdeploy.engines.") and module != "specdeploy.engines.base":  # an engine's own code
            walk.append((module, name))
            sys.setprofile(None)
        elif any(_carries(value, Followed, read) for key, value in frame.f_locals.items() if key != "self"):
            if not walk or walk[-1][0] != module:
                walk.append((module, name))

    sys.setprofile(profile)
    try:
        pipeline.generate(prompts, followed)
    finally:
        sys.setprofile(None)
    return walk


def _carries(value, followed: type, read: dict[int, object], depth: int = 0) -> bool:
    """``value`` is the followed config or a setting read from it, or a list or tuple holding one (two levels deep)."""
    if isinstance(value, followed) or read.get(id(value), read) is value:
        return True
    return depth < 2 and isinstance(value, (list, tuple)) and len(value) < 64 and any(
        _carries(item, followed, read, depth + 1) for item in value)


def returns(walk: list[tuple[str, str]]) -> int:
    """Stops in a module the walk had left before."""
    return sum(module in {m for m, _ in walk[:i]} for i, (module, _) in enumerate(walk))


def main() -> None:
    from specdeploy import GenerationConfig, Pipeline
    from tests import tiny

    default = GenerationConfig()
    parser = arguments.parser(__doc__)
    parser.add_argument("--k", type=arguments.integer(0), default=default.k, help="the most drafts a cycle")
    parser.add_argument("--policy", default=default.policy, help="draft-length policy")
    parser.add_argument("--drafter", default=default.drafter, help="drafter")
    parser.add_argument("--config-walk", action="store_true",
                        help="print the modules a GenerationConfig passes through to the first engine call instead")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        pipeline = Pipeline.load(tiny.export_pair(Path(tmp), capacity=256), threads=1)
        config = GenerationConfig(k=args.k, policy=args.policy, drafter=args.drafter, ignore_eos=True)
        if args.config_walk:
            pipeline.generate(["w5"], replace(config, max_new_tokens=2))  # warmed: the first engine call is the batch's
            walk = trace_config(pipeline, ["w5 w6 w7 w8"], replace(config, max_new_tokens=4, stop=["w9"]))
            print(" -> ".join(f"{module.removeprefix('specdeploy.')} ({name})" for module, name in walk))
            print(f"{len(walk)} stops, {returns(walk)} returns")
            return
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
