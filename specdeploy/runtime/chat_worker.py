"""A child process that renders chat templates: run as a script, it needs nothing but the standard library and jinja2.

A chat template is the artifact's code, and Jinja's sandbox keeps it from Python's internals but not from
spending time or memory without end (nested loops, ``10 ** 10 ** 8``, ``'x' * 10 ** 9``), and a thread
cannot be stopped from outside. So templates render here, one request at a time, and the parent
(``chat.TemplateRenderer``) kills the process when a render overruns. Within it, the limits fail fast
with a clear reason where they can: powers, products and repetitions past a size are refused before
they are computed, and the output is counted as it is produced. Time is counted as the CPU time the render
uses (``ITIMER_PROF``), so a busy machine is not blamed on the template; memory is capped by ``RLIMIT_AS``, and
an alarm ends the process if a render outlives its parent's wall-clock backstop (an orphaned child stops by
itself).

Protocol: one JSON object a line each way. In: ``{"template", "variables", "max_chars", "seconds", "wall_seconds"}``
(``seconds``: CPU time; ``wall_seconds``: the parent's backstop).
Out: ``{"text": ...}``, ``{"refused": message}`` (the template's own ``raise_exception``: a refusal of the
messages) or ``{"error": kind, "message": ...}`` (the template failed on its own; SecurityError: the sandbox
refused what it tried).
"""

from __future__ import annotations

import json
import math
import signal
import sys
from datetime import datetime

if __package__:
    from ..chat_syntax import SETTINGS, extensions
    from ..values import is_integer, short
else:  # run as a script, as ``chat`` starts it: the package's leaf modules by their files, the package not imported
    import importlib.util
    from pathlib import Path

    def _leaf(name: str):
        spec = importlib.util.spec_from_file_location(f"_{name}", Path(__file__).resolve().parents[1] / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    _values, _syntax = _leaf("values"), _leaf("chat_syntax")
    is_integer, short = _values.is_integer, _values.short
    SETTINGS, extensions = _syntax.SETTINGS, _syntax.extensions

MEMORY_BYTES = 2 * 2**30  # address space: far above what jinja2 and the interpreter need, far below a runaway's
MAX_INT_BITS = 2**16  # integers a template computes: a tower of powers would take minutes and the memory
ALARM_GRACE = 2.0  # seconds past the parent's deadline before the process ends itself
COMPILED_KEPT = 8  # templates kept compiled


class Refusal(Exception):
    """``raise_exception`` in a template: it refuses the messages it was given."""


class CpuLimit(BaseException):
    """The render used its CPU time (raised by the profiling timer's signal; a BaseException, so that no
    ``except Exception`` on the way swallows it)."""


def _over_cpu(signum, frame):
    raise CpuLimit()


def environment(max_chars: list[int]):
    """A sandboxed Jinja environment with transformers' settings, filters and globals, and size limits on ``**``
    and ``*`` (``max_chars[0]``: the characters a repeated string or list may reach)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Limited(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset(["**", "*"])

        def call_binop(self, context, operator, left, right):
            _check_binop(operator, left, right, max_chars[0])
            return super().call_binop(context, operator, left, right)

    def raise_exception(message):
        raise Refusal(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    sandbox = Limited(**SETTINGS, extensions=extensions())
    sandbox.filters["tojson"] = tojson
    sandbox.globals["raise_exception"] = raise_exception
    sandbox.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return sandbox


def _check_binop(operator: str, left, right, max_chars: int) -> None:
    """Refuse (OverflowError) a ``**`` or ``*`` whose result would pass the bounds: ``MAX_INT_BITS`` for integers,
    ``max_chars`` items for a repeated string or list."""
    if operator == "**" and is_integer(left) and is_integer(right) and right > 0 and abs(left) > 1 \
            and right * math.log2(abs(left)) > MAX_INT_BITS:
        raise OverflowError(f"{short(left, 40)} ** {short(right, 40)} has more than {MAX_INT_BITS} bits")
    if operator == "*":
        if is_integer(left) and is_integer(right) and left.bit_length() + right.bit_length() > MAX_INT_BITS:
            raise OverflowError(f"a product of more than {MAX_INT_BITS} bits")
        sized, times = (left, right) if isinstance(left, (str, list, tuple)) else (right, left)
        if isinstance(sized, (str, list, tuple)) and is_integer(times) and len(sized) * times > max_chars:
            raise OverflowError(f"{type(sized).__name__} of {len(sized):,} repeated {times:,} times: over "
                                f"{max_chars:,} items")


def render(sandbox, compiled: dict, request: dict, max_chars: list[int]) -> dict:
    """One request's answer: the text, the template's refusal, or why it failed."""
    max_chars[0] = request["max_chars"]
    try:
        template = compiled.get(request["template"])
        if template is None:
            template = sandbox.from_string(request["template"])
            compiled[request["template"]] = template
            while len(compiled) > COMPILED_KEPT:
                del compiled[next(iter(compiled))]
        pieces, size = [], 0
        for piece in template.generate(**request["variables"]):
            size += len(piece)
            if size > max_chars[0]:
                return {"error": "OutputLimit", "message": f"its output passed {max_chars[0]:,} characters"}
            pieces.append(piece)
        return {"text": "".join(pieces)}
    except Refusal as exc:
        return {"refused": str(exc)}
    except CpuLimit:
        return {"error": "TimeLimit", "message": f"it used more than {request['seconds']:g} s of CPU time"}
    except RecursionError:
        return {"error": "RecursionError", "message": "it recursed without end"}
    except MemoryError:
        return {"error": "MemoryError", "message": f"it took more than {MEMORY_BYTES // 2**30} GiB"}
    except Exception as exc:  # the template's own failure, whatever its kind (SecurityError: the sandbox refused it)
        return {"error": type(exc).__name__, "message": short(str(exc), 300, quoted=False)}


def main() -> None:
    try:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_BYTES, MEMORY_BYTES))
    except (ImportError, ValueError, OSError):  # a system without it, or a lower limit already
        pass
    max_chars = [0]
    sandbox, compiled = environment(max_chars), {}
    signal.signal(signal.SIGPROF, _over_cpu)
    for line in sys.stdin:
        request = json.loads(line)
        signal.setitimer(signal.ITIMER_REAL, request.get("wall_seconds", request["seconds"]) + ALARM_GRACE)  # ends us
        signal.setitimer(signal.ITIMER_PROF, request["seconds"])
        try:
            answer = render(sandbox, compiled, request, max_chars)
            signal.setitimer(signal.ITIMER_PROF, 0)
        except CpuLimit:  # the (one-shot) timer fired after the render, before it was stopped: its time was used
            answer = {"error": "TimeLimit", "message": f"it used more than {request['seconds']:g} s of CPU time"}
        signal.setitimer(signal.ITIMER_REAL, 0)
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
