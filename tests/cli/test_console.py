"""What the CLI prints into a pipe is never wrapped: a path or a figure stays whole for grep, whatever the
terminal's width (COLUMNS) or the length of the path."""

from __future__ import annotations

import os
import shutil

from click.testing import CliRunner
from rich.table import Table

from specdeploy.cli import main
from specdeploy.cli.common import PIPED_RULE_WIDTH, CliConsole


def test_doctor_prints_a_long_path_and_its_verdict_on_one_line_at_40_columns(pair_dir, tmp_path):
    artifact = tmp_path / ("a-folder-name-long-enough-to-wrap-" * 4) / "art"
    shutil.copytree(pair_dir, artifact)
    checked = CliRunner(env={"COLUMNS": "40"}).invoke(main, ["doctor", str(artifact)])
    assert checked.exit_code == 0, checked.output
    assert f"ok {artifact}: no problem found\n" in checked.output, checked.output


def test_a_piped_console_wraps_no_line_and_sizes_tables_rules_and_logs_to_their_content(monkeypatch, capsys):
    monkeypatch.setitem(os.environ, "COLUMNS", "40")
    console = CliConsole()
    assert not console.is_terminal  # pytest's captured stdout
    words = " ".join(f"figure-{i}" for i in range(40))
    console.print(words)
    table = Table()
    table.add_column("configuration")
    table.add_row("x" * 90)
    console.print(table)
    console.rule("section")
    console.log("step")
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == words
    assert len(lines[1]) == 90 + 4 and "x" * 90 in lines[4]  # the cell whole, the table as wide as it
    assert len(lines[-2]) == PIPED_RULE_WIDTH and "section" in lines[-2]
    assert lines[-1] == "step"


def test_a_console_at_a_terminal_still_wraps_at_its_width(monkeypatch):
    monkeypatch.setitem(os.environ, "COLUMNS", "40")
    console = CliConsole(force_terminal=True, record=True, color_system=None)
    console.print(" ".join(f"figure-{i}" for i in range(40)))
    assert max(len(line) for line in console.export_text().splitlines()) <= 40
