"""The ``specdeploy`` command: thin; each command parses, calls the library and prints."""

from __future__ import annotations

import click

from .. import __version__
from .bench import bench, report
from .build import build
from .doctor import doctor
from .export import export
from .generate import generate
from .inspect import inspect
from .serve import serve


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="specdeploy")
def main():
    """Deploy speculative decoding: export draft/target pairs to ONNX and run them."""


for command in (export, inspect, doctor, generate, bench, report, build, serve):
    main.add_command(command)
