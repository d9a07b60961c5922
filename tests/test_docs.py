"""The front door holds together: every link in the README and the docs resolves, every file under docs/ is reached
from the README by links, and every tool a page tells the reader to run exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")  # markdown [text](target), anchors dropped
TOOL = re.compile(r"python3? -m (tools\.[a-z0-9_]+)")


def _pages() -> list[Path]:
    return [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _links(page: Path) -> list[Path]:
    targets = [target for target in LINK.findall(page.read_text()) if "://" not in target]
    return [(page.parent / target).resolve() for target in targets]


def test_every_relative_link_resolves():
    broken = [f"{page.relative_to(ROOT)} -> {target}" for page in _pages() for target in _links(page)
              if not target.exists()]
    assert not broken, broken


def test_every_file_under_docs_is_reached_from_the_readme():
    reached, queue = set(), [ROOT / "README.md"]
    while queue:
        page = queue.pop()
        for target in _links(page):
            files = sorted(target.iterdir()) if target.is_dir() else [target]  # a folder's listing shows its files
            for found in files:
                if found.is_file() and found not in reached:
                    reached.add(found)
                    if found.suffix == ".md":
                        queue.append(found)
    docs = {path.resolve() for path in (ROOT / "docs").rglob("*") if path.is_file()}
    assert docs, "docs/ is empty"
    assert not sorted(docs - reached), sorted(str(path.relative_to(ROOT)) for path in docs - reached)


def test_every_tool_the_pages_run_exists():
    named = {tool for page in _pages() for tool in TOOL.findall(page.read_text())}
    assert named, "no page names a tool"
    missing = sorted(tool for tool in named if not (ROOT / (tool.replace(".", "/") + ".py")).exists())
    assert not missing, missing
