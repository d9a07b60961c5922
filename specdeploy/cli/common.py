"""What the commands share: the console (wrapping only at a terminal), reading a manifest, sizes for people."""

from __future__ import annotations

from pathlib import Path

import click
from rich.console import Console, ConsoleDimensions
from rich.rule import Rule

from ..contract import ContractError, Manifest

# wide enough that no line a command prints is wrapped, narrow enough that rich's layout arithmetic stays cheap; a
# table takes the width its cells need, not this
PIPED_WIDTH = 10_000
PIPED_RULE_WIDTH = 112


class CliConsole(Console):
    """rich's console, wrapping only for a person at a terminal. Into a pipe or a file (``specdeploy doctor ART |
    grep``, a CI log, a test's runner) a line is never wrapped and a table is as wide as its cells, whatever COLUMNS
    says: a path or a figure cut in two cannot be searched for."""

    @property
    def soft_wrap(self) -> bool:
        return self._soft_wrap_asked or not self.is_terminal

    @soft_wrap.setter
    def soft_wrap(self, value: bool) -> None:
        self._soft_wrap_asked = value

    @property
    def size(self) -> ConsoleDimensions:
        size = Console.size.fget(self)
        return size if self.is_terminal else ConsoleDimensions(PIPED_WIDTH, size.height)

    @size.setter
    def size(self, new_size: tuple[int, int]) -> None:
        Console.size.fset(self, new_size)

    def log(self, *objects, **options) -> None:
        # rich's log line spans the console's width (time, text, then the caller's file at the right edge)
        if self.is_terminal:
            super().log(*objects, **options)
        else:
            self.print(*objects)

    def rule(self, title="", **options) -> None:
        # a rule spans the console's width: into a pipe, that of a wide terminal
        if self.is_terminal:
            super().rule(title, **options)
        else:
            self.print(Rule(title, **options), width=PIPED_RULE_WIDTH)


console = CliConsole(stderr=True)


def speculation_options(k_help: str):
    """--k, --policy, --drafter, --confidence-threshold and --exact, as ``generate`` and ``serve`` take them, with
    ``GenerationConfig``'s defaults (one default everywhere: the cost policy over the hybrid drafter)."""
    from ..runtime.config import GenerationConfig
    from ..runtime.registry import DRAFTERS, POLICIES

    default = GenerationConfig()
    options = [
        click.option("--k", "--num-speculative-tokens", "k", type=int, default=default.k, show_default=True, help=k_help),
        click.option("--policy", type=click.Choice(list(POLICIES)), default=default.policy, show_default=True,
                     help="Draft-length policy. cost: the length (0 = plain decoding) with the most tokens per second, "
                          "from measured engine costs and acceptance; fixed: always --k; confidence: up to --k, stopping "
                          "where the draft is unsure; heuristic: transformers' +2 / -1 schedule."),
        click.option("--drafter", type=click.Choice(list(DRAFTERS)), default=default.drafter, show_default=True,
                     help="model: the artifact's draft; suffix: a suffix index over the request's text and earlier "
                          "answers (no model call); prompt-lookup: the request's latest n-gram; hybrid: the suffix index "
                          "where the policy prices its drafts above the draft model's, the draft model elsewhere (the index "
                          "alone on an artifact without a draft model); none: plain target decoding."),
        click.option("--confidence-threshold", type=float, default=default.confidence_threshold, show_default=True,
                     help="--policy confidence: stop drafting once the draft's top probability falls below this."),
        click.option("--exact", is_flag=True,
                     help="Exact mode: every target call carries an even number of tokens a row (a plain step padded "
                          "with one dummy), so every position runs the same kernels and greedy speculative output equals "
                          "greedy plain output bit for bit; plain steps cost more. An explicit-form target exported "
                          "before slot attention (its manifest lacks slot_attention) is refused: re-export it."),
    ]

    def apply(command):
        for option in reversed(options):
            command = option(command)
        return command

    return apply


def suffix_file_option(help_text: str):
    """--suffix-file (``help_text``): a file of the suffix indexes, kept across runs."""
    return click.option("--suffix-file", type=click.Path(path_type=Path, dir_okay=False), default=None, help=help_text)


def provider_options(default: str | None = "cpu", draft: bool = False):
    """--provider, --device and --precision, given to the command as one ``provider`` (a ``Provider``; None where
    ``default`` is None and no --provider is given): OpenVINO's device and precision are refused with another
    provider, in one line. With ``draft``, also --draft-provider, given as ``draft_provider`` (a ``Provider``; None:
    the target's); OpenVINO's device and precision then go to whichever model runs on it."""
    from ..engines.providers import OPENVINO_DEVICES, OPENVINO_PRECISIONS, PROVIDERS

    options = [
        click.option("--provider", "provider_name", type=click.Choice(list(PROVIDERS)), default=default,
                     show_default=default is not None,
                     help="ONNX Runtime execution provider" + (" (the target's, and the draft's unless --draft-provider "
                                                               "says otherwise)" if draft else "")
                          + ". openvino needs onnxruntime-openvino in place of onnxruntime, and a graph it runs whole "
                            "(specdeploy export --provider openvino)."),
        click.option("--device", type=click.Choice(OPENVINO_DEVICES), default=None,
                     help="--provider openvino: the device OpenVINO computes on [default: CPU]."),
        click.option("--precision", type=click.Choice(OPENVINO_PRECISIONS), default=None,
                     help="--provider openvino: its inference precision [default: FP32, what the graph says; BF16 and "
                          "FP16 trade accuracy for speed where the device has the units]."),
    ]
    if draft:
        options.append(click.option(
            "--draft-provider", "draft_provider_name", type=click.Choice(list(PROVIDERS)), default=None,
            help="The draft model's execution provider, where it differs from the target's [default: --provider's]. "
                 "A draft's calls are mostly one token, where the CPU provider is quicker than OpenVINO, whose "
                 "verifications scale better: --provider openvino --draft-provider cpu. The cost policy prices each "
                 "model's calls as its own provider ran them."))

    def apply(command):
        import functools

        @functools.wraps(command)
        def run(*args, provider_name, device, precision, draft_provider_name=None, **kwargs):
            from ..engines.providers import Provider, ProviderError

            if provider_name is None and (device or precision):
                raise click.UsageError("--device and --precision go with --provider openvino")
            names = (provider_name, draft_provider_name)
            try:
                def provider_of(name):
                    # OpenVINO's options go to the model on it; with none there, Provider refuses them in one line
                    own = name == "openvino" or "openvino" not in names
                    return Provider(name, device if own else None, precision if own else None)

                provider = None if provider_name is None else provider_of(provider_name)
                draft_provider = None if draft_provider_name is None else provider_of(draft_provider_name)
            except ProviderError as exc:
                raise click.UsageError(str(exc)) from exc
            return command(*args, provider=provider, **({"draft_provider": draft_provider} if draft else {}), **kwargs)

        for option in reversed(options):
            run = option(run)
        return run

    return apply


def _threads(ctx: click.Context, param: click.Parameter, value: int | None) -> int | None:
    """--threads checked as ``Pipeline.load`` checks it (the runtime is loaded only by commands that run models)."""
    from ..runtime.config import ConfigError, checked_threads

    try:
        return checked_threads(value)
    except ConfigError as exc:
        raise click.BadParameter(str(exc).split(": ", 1)[1], ctx=ctx, param=param) from exc


threads_option = click.option(
    "--threads", type=int, default=None, callback=_threads,
    help="Threads of one ONNX Runtime pool that both models share, for the whole process (default: a pool per model "
         "of ONNX Runtime's size, one thread per physical core, whose threads stop spinning when a call ends); at most "
         "4 per core: more only oversubscribe the cores.")


def read_manifest(directory: Path) -> Manifest:
    try:
        return Manifest.read(directory)
    except ContractError as exc:
        raise click.ClickException(str(exc)) from exc


def human(size: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return str(size)
