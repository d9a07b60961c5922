"""How the tools take their arguments: a bad one is refused in one line, with exit status 2, before any work.

``parser(doc)`` is an argparse parser whose errors are one line (``tools.x: error: argument --k: got 0; expected an
integer >= 1``), without the usage block. The types below check a value as argparse reads it, so that a missing
artifact, a corrupt file or a count of 0 is refused before a model is loaded or a server started; ``refusing(parser)``
gives the errors specdeploy raises once a tool runs (a manifest that is not one, a context too small) the same line.
"""

from __future__ import annotations

import argparse
import contextlib
import json
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path


class ToolParser(argparse.ArgumentParser):
    """An argparse parser whose usage errors are one line on stderr (``prog: error: message``), exit status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())}\n")


def parser(doc: str | None) -> ToolParser:
    """A tool's parser, its module docstring as the description (kept as written)."""
    return ToolParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


def integer(minimum: int | None = None, maximum: int | None = None) -> Callable[[str], int]:
    """An integer in [minimum, maximum] (either bound may be open)."""
    def parse(text: str) -> int:
        try:
            number = int(text)
        except ValueError:
            number = None
        if number is None or (minimum is not None and number < minimum) or (maximum is not None and number > maximum):
            raise argparse.ArgumentTypeError(f"got {_shown(text)}; expected {_range('an integer', minimum, maximum)}")
        return number
    return parse


def number(minimum: float | None = None) -> Callable[[str], float]:
    """A finite number >= minimum."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = None
        if value is None or value != value or value in (float("inf"), float("-inf")) or (
                minimum is not None and value < minimum):
            raise argparse.ArgumentTypeError(f"got {_shown(text)}; expected {_range('a finite number', minimum, None)}")
        return value
    return parse


def integers(minimum: int | None = None, what: str = "integers") -> Callable[[str], list[int]]:
    """A comma list of at least one integer, each >= minimum; ``what`` they are, for the message."""
    def parse(text: str) -> list[int]:
        try:
            numbers = [int(part) for part in text.split(",")]
        except ValueError:
            numbers = None
        if not numbers or (minimum is not None and min(numbers) < minimum):
            raise argparse.ArgumentTypeError(f"got {_shown(text)}; expected a comma list of "
                                             f"{_range(what, minimum, None, plural=True)}")
        return numbers
    return parse


def names(choices: Iterable[str]) -> Callable[[str], list[str]]:
    """A comma list of at least one of ``choices``."""
    choices = list(choices)

    def parse(text: str) -> list[str]:
        given = text.split(",")
        if not text or any(name not in choices for name in given):
            raise argparse.ArgumentTypeError(f"got {_shown(text)}; expected a comma list of {', '.join(choices)}")
        return given
    return parse


def artifact(text: str) -> Path:
    """An artifact directory (one holding the manifest ``specdeploy export`` writes)."""
    path = Path(text)
    if not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: {'not a directory' if path.exists() else 'no such directory'}; "
                                         "expected an artifact directory (specdeploy export's --out)")
    if not (path / "manifest.json").is_file():
        raise argparse.ArgumentTypeError(f"{text}: no manifest.json; expected an artifact directory "
                                         "(specdeploy export's --out)")
    return path


def json_object(expected: str, *keys: str) -> Callable[[str], dict]:
    """The JSON object in a file (bounded as specdeploy bounds the files it reads), holding ``keys``; ``expected``
    says what the file should be, for the message."""
    def parse(text: str) -> dict:
        from specdeploy.files import MAX_JSON_BYTES, FileRefused, read_regular

        try:
            data = json.loads(read_regular(Path(text), 64 * MAX_JSON_BYTES))
        except FileRefused as exc:  # what the file is, then what it should be
            raise argparse.ArgumentTypeError(f"{exc.path}: {exc.reason.split('; expected')[0]}; expected {expected}") from None
        except (ValueError, RecursionError) as exc:  # not UTF-8, not JSON, nested past the parser's depth
            raise argparse.ArgumentTypeError(f"{text}: not JSON ({type(exc).__name__}: {_first_line(exc)}); "
                                             f"expected {expected}") from None
        missing = [key for key in keys if not isinstance(data, dict) or key not in data]
        if missing:
            raise argparse.ArgumentTypeError(f"{text}: no {', '.join(missing)}; expected {expected}")
        return data
    return parse


def prompt_file(text: str) -> Path:
    """A prompt file (text, JSONL or Spec-Bench) that ``specdeploy.workloads.load_prompts`` reads: read once here, so
    that a missing, unreadable or malformed one is refused before any work (the tool reads it again)."""
    from specdeploy.files import FileRefused
    from specdeploy.workloads import PromptFileError, load_prompts

    try:
        load_prompts(Path(text))
    except (PromptFileError, FileRefused, OSError) as exc:
        raise argparse.ArgumentTypeError(_first_line(exc)) from None
    return Path(text)


@contextlib.contextmanager
def refusing(parser: argparse.ArgumentParser) -> Iterator[None]:
    """Inside, an error specdeploy raises about what the user gave (a setting, a file, an artifact) is the parser's
    one-line refusal rather than a traceback."""
    from specdeploy.contract import ContractError
    from specdeploy.engines import EngineInputError, ProviderError
    from specdeploy.files import FileRefused
    from specdeploy.runtime.cache import CapacityError
    from specdeploy.runtime.chat import ChatTemplateError
    from specdeploy.runtime.errors import ConfigError
    from specdeploy.workloads import PromptFileError

    try:
        yield
    except (ConfigError, CapacityError, ContractError, FileRefused, PromptFileError, EngineInputError, ProviderError,
            ChatTemplateError) as exc:
        parser.error(_first_line(exc))


def _range(what: str, low, high, plural: bool = False) -> str:
    each = " each" if plural else ""
    if low is not None and high is not None:
        return f"{what} in [{low}, {high}]{each}"
    if low is not None:
        return f"{what} >= {low}{each}"
    return f"{what} <= {high}{each}" if high is not None else what


def _shown(text: str) -> str:
    """A value as the user typed it; quoted where it is empty or holds spaces or control characters."""
    return text if text and text.isprintable() and " " not in text else repr(text)


def _first_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:500]
