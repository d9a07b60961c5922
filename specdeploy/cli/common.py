"""What the commands share: the error console, reading a manifest, sizes for people."""

from __future__ import annotations

from pathlib import Path

import click
from rich.console import Console

from ..contract import ContractError, Manifest

console = Console(stderr=True)


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
