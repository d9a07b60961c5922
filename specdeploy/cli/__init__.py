"""The ``specdeploy`` command: thin; each command parses, calls the library and prints.

Commands load when they run (a lazy click group): ``specdeploy export`` never loads the runtime, and
``specdeploy --help`` loads nothing heavy.
"""

from __future__ import annotations

import importlib

import click

from ..version import __version__

# command name -> (module, attribute), in the order ``--help`` lists them
COMMANDS = {"export": ("export", "export"), "import": ("imports", "import_"), "inspect": ("inspect", "inspect"),
            "doctor": ("doctor", "doctor"), "generate": ("generate", "generate"), "bench": ("bench", "bench"),
            "report": ("bench", "report"), "build": ("build", "build"), "serve": ("serve", "serve")}


class LazyGroup(click.Group):
    """A group whose commands are imported when one is run or its help asked for."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in COMMANDS:
            return None
        module, attribute = COMMANDS[name]
        return getattr(importlib.import_module(f"{__name__}.{module}"), attribute)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="specdeploy")
def main():
    """Deploy speculative decoding: export draft/target pairs to ONNX and run them."""
