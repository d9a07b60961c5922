"""`specdeploy report`: PNG plots and a self-contained HTML page (plus Markdown) from a bench dir."""

from __future__ import annotations

import base64
import html
import json
from collections import defaultdict
from pathlib import Path

from .bench import read_records

PLOTS = ("speedup_vs_k.png", "acceptance_by_position.png", "accepted_length.png", "time_split.png")
SIZE_INCHES, DPI = (8, 5), 100  # every plot is 800 x 500 pixels


def write_report(directory: Path) -> list[Path]:
    """Plots and report.html / report.md for the bench results in ``directory``; returns the files."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory = Path(directory)
    summary = json.loads((directory / "summary.json").read_text())["all"]
    records = [r for r in read_records(directory / "records.jsonl") if r["type"] == "cycle"]
    speculative = {name: e for name, e in summary.items() if e["k"] > 0}
    written = []
    for name, draw, data in zip(PLOTS, (_speedup_vs_k, _acceptance_by_position, _accepted_length, _time_split),
                                (speculative, speculative, records, summary)):
        fig, ax = plt.subplots()
        draw(ax, data)
        fig.set_size_inches(*SIZE_INCHES)
        fig.tight_layout()
        fig.savefig(directory / name, dpi=DPI)
        plt.close(fig)
        written.append(directory / name)
    header, rows = summary_table(summary)
    (directory / "report.md").write_text(_markdown(header, rows))
    (directory / "report.html").write_text(_html(header, rows, directory))
    return written + [directory / "report.md", directory / "report.html"]


def _speedup_vs_k(ax, speculative: dict) -> None:
    """Measured and predicted speedup against K, one line pair per configuration less its K."""
    series = defaultdict(list)
    for name, entry in speculative.items():
        series[name.rsplit(" k=", 1)[0] + " " + name.rsplit(" ", 1)[-1]].append(entry)
    for label, entries in series.items():
        entries.sort(key=lambda e: e["k"])
        ks = [e["k"] for e in entries]
        ax.plot(ks, [_nan(e["speedup_median"]) for e in entries], "o-", label=f"{label} measured")
        ax.plot(ks, [_nan(e["predicted_speedup"]) for e in entries], "x--", label=f"{label} predicted")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set(xlabel="draft length K", ylabel="speedup over plain decoding", title="Speedup versus K")
    ax.legend(fontsize=7)


def _acceptance_by_position(ax, speculative: dict) -> None:
    """Each speculative configuration's acceptance rate per draft position."""
    for name, entry in speculative.items():
        rates = [_nan(a) for a in entry["acceptance_by_position"]]
        ax.plot(range(1, len(rates) + 1), rates, "o-", label=name)
    ax.set(xlabel="draft position", ylabel="P(accepted | reached)", ylim=(0, 1.05), title="Acceptance by position")
    ax.legend(fontsize=7)


def _accepted_length(ax, records: list[dict]) -> None:
    """A histogram of the tokens each drafted cycle committed, per configuration."""
    lengths = defaultdict(list)
    for r in records:
        if r["drafted"] > 0:
            lengths[r["config"]].append(r["accepted"] + 1)
    if lengths:
        top = max(max(v) for v in lengths.values())
        ax.hist(list(lengths.values()), bins=range(1, top + 2), label=list(lengths), align="left")
        ax.legend(fontsize=7)
    ax.set(xlabel="tokens committed per cycle", ylabel="cycles", title="Accepted length per cycle")


def _time_split(ax, summary: dict) -> None:
    """Each configuration's cycle time split into draft, verify, accept and cache, as stacked bars."""
    names = list(summary)
    bottom = [0.0] * len(names)
    for phase in ("draft", "verify", "accept", "cache"):
        shares = [summary[n]["time_share"][phase] for n in names]
        ax.barh(names, shares, left=bottom, label=phase)
        bottom = [b + s for b, s in zip(bottom, shares)]
    ax.set(xlabel="share of cycle time", title="Time split per cycle")
    ax.tick_params(axis="y", labelsize=7)
    ax.legend(fontsize=7)


def _nan(value):
    return float("nan") if value is None else value


HEADER = ["configuration", "tok/s", "speedup (min-max)", "predicted", "efficiency", "mean acc. len", "acceptance by position",
          "draft / verify / accept / cache", "identical"]
VERSUS_REFERENCE = "vs first artifact's plain"  # a column of its own where several artifacts ran


def _num(value, fmt: str = ".2f", suffix: str = "") -> str:
    return "-" if value is None else f"{value:{fmt}}{suffix}"


def summary_table(summary: dict) -> tuple[list[str], list[list[str]]]:
    """The header and one row per configuration of a summary segment (``reports.bench.summarize``)."""
    versus = any("speedup_vs_reference_median" in e for e in summary.values())
    rows = []
    for name, e in summary.items():
        row = [
            name, _num(e["tokens_per_s"]),
            f"{_num(e['speedup_median'], suffix='x')} ({_num(e['speedup_min'])}-{_num(e['speedup_max'])})",
            _num(e["predicted_speedup"], suffix="x"), _num(e["efficiency"]), _num(e["mean_accepted_length"]),
            " ".join(_num(a) for a in e["acceptance_by_position"]) or "-",
            " / ".join(f"{e['time_share'][p]:.0%}" for p in ("draft", "verify", "accept", "cache")),
            _identical(e),
        ]
        if versus:
            row.insert(3, _num(e.get("speedup_vs_reference_median"), suffix="x") if "reference" in e else "-")
        rows.append(row)
    header = HEADER[:3] + [VERSUS_REFERENCE] + HEADER[3:] if versus else list(HEADER)
    return header, rows


def _identical(entry: dict) -> str:
    """Identical outputs of a greedy configuration, and the largest plain-target margin where one differed."""
    if entry["identical_to_baseline"] is None:
        return "-"
    cell = f"{entry['identical_to_baseline']}/{entry['runs']}"
    margins = [d["margin"] for d in entry.get("divergences", [])]
    return cell + (f" (differing: margin <= {max(margins):.2f})" if margins else "")


def _markdown(header, rows) -> str:
    lines = ["# specdeploy bench report", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    lines += [""] + [f"![{name}]({name})" for name in PLOTS]
    return "\n".join(lines) + "\n"


def _html(header, rows, directory: Path) -> str:
    cells = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows)
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    images = "".join(
        f'<figure><img alt="{name}" src="data:image/png;base64,'
        f'{base64.b64encode((directory / name).read_bytes()).decode()}"></figure>' for name in PLOTS
    )
    style = "body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:4px 8px}"
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>specdeploy bench report</title><style>{style}</style>"
            f"</head><body><h1>specdeploy bench report</h1><table><tr>{head}</tr>{cells}</table>{images}</body></html>\n")
