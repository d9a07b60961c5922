"""Where a result came from: the date, the command, the machine and the commit, written beside every result."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def cpu_name() -> str:
    """The CPU's model name (Linux's /proc/cpuinfo) and its core count: "AMD EPYC 7571, 2 cores"."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        name = next(line.split(":", 1)[1].strip() for line in lines if line.startswith("model name"))
    except (OSError, StopIteration):
        name = "unknown CPU"
    return f"{name}, {os.cpu_count()} cores"


def commit() -> str:
    """The checkout's commit, with "+changes" where its tracked files differ from it; "" outside git."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
    try:
        head = git("rev-parse", "--short", "HEAD")
        return f"{head}+changes" if head and git("status", "--porcelain", "--untracked-files=no") else head
    except (OSError, subprocess.SubprocessError):
        return ""


def provenance(module: str) -> dict:
    """The date, the command (as ``python -m MODULE ARGS``, the home folder as ~), the CPU and the commit."""
    command = f"python -m {module} " + " ".join(sys.argv[1:])
    return {"date": time.strftime("%Y-%m-%d"), "command": command.replace(str(Path.home()), "~").strip(),
            "machine": cpu_name(), "commit": commit()}


def header(title: str, facts: dict) -> str:
    """A result page's first lines: its title with the date, the command, then the machine and the commit."""
    return (f"# {title} ({facts['date']})\n\n`{facts['command']}`\n\n"
            f"{facts['machine']}; commit {facts['commit'] or 'unknown'}.\n")


def write_page(out: Path, title: str, facts: dict, text: str, record: dict) -> None:
    """A result page: OUT.md (``header`` and ``text``, what the tool printed) and OUT.json (the facts and the record)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(header(title, facts) + "\n" + text + "\n")
    out.with_suffix(".json").write_text(json.dumps({"provenance": facts, **record}, indent=1) + "\n")
