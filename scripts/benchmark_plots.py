"""Draw the plots of docs/benchmarks.md from the numbers in scripts/benchmark_plots.json.

The numbers are the page's tables, measured by the benchmarks and copied by hand: a plot shows what the
page says, never a newer run it does not quote. Each chart is one SVG in docs/benchmarks/, drawn as
horizontal bars in one or more panels side by side, slimtorch's bars in the highlight colour, a range
where the table gives one, and a dashed line for a reference (fp32, the dense file). The SVGs are
written without dates or random ids, so drawing the same numbers again gives the same bytes.

    .venv/bin/python scripts/benchmark_plots.py            # write docs/benchmarks/*.svg
    .venv/bin/python scripts/benchmark_plots.py --check    # exit 1 if an SVG is not what the numbers draw
"""

from __future__ import annotations

import argparse
import io
import json
import math
import sys
import textwrap
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "scripts" / "benchmark_plots.json"
OUT = ROOT / "docs" / "benchmarks"

HIGHLIGHT = "#d9480f"  # slimtorch
PEER = "#868e96"  # everything else
REFERENCE = "#343a40"
PANEL_WIDTH = 4.6  # inches
LABELS = 2.6  # inches for a panel's bar labels
COLUMNS = 2  # panels side by side at most
BAR_HEIGHT = 0.32  # inches per bar
FOOTER = 0.9  # inches for the title and the source line


def bar_values(bar: list[Any]) -> tuple[str, float, float | None, float | None]:
    """``[label, median]`` or ``[label, median, min, max]`` as (label, median, min, max)."""
    if len(bar) == 2:
        return str(bar[0]), float(bar[1]), None, None
    if len(bar) == 4:
        return str(bar[0]), float(bar[1]), float(bar[2]), float(bar[3])
    raise ValueError(f"a bar is [label, median] or [label, median, min, max], not {bar!r}")


def label_of(value: float) -> str:
    """The number as the tables print it: no trailing zeros, at most three decimals."""
    return f"{value:.3f}".rstrip("0").rstrip(".") if value % 1 else f"{value:.0f}"


def draw(chart: dict[str, Any]) -> plt.Figure:
    """One chart: its panels in rows of at most :data:`COLUMNS`; where every panel has the same bars, only
    the first column names them."""
    panels = chart["panels"]
    labels = [[bar_values(bar)[0] for bar in panel["bars"]] for panel in panels]
    shared = all(names == labels[0] for names in labels)
    columns = min(COLUMNS, len(panels))
    rows_of_panels = math.ceil(len(panels) / columns)
    panel_height = max(len(names) for names in labels) * BAR_HEIGHT + 0.6
    width = PANEL_WIDTH * columns + LABELS * (1 if shared else columns)
    height = panel_height * rows_of_panels + FOOTER
    figure, axes = plt.subplots(rows_of_panels, columns, figsize=(width, height), squeeze=False)
    reference = chart.get("reference")
    for index, ax in enumerate(axes.flat):
        if index >= len(panels):
            ax.set_visible(False)
            continue
        panel = panels[index]
        bars = [bar_values(bar) for bar in panel["bars"]]
        rows = range(len(bars))
        colours = [HIGHLIGHT if label.startswith("slimtorch") else PEER for label, *_ in bars]
        ax.barh(rows, [median for _, median, _, _ in bars], color=colours, height=0.62)
        for row, (_, median, low, high) in zip(rows, bars, strict=True):
            if low is not None and high is not None:
                ax.plot([low, high], [row, row], color=REFERENCE, linewidth=1)
            ax.annotate(
                label_of(median),
                (high if high is not None else median, row),
                xytext=(4, 0),
                textcoords="offset points",
                va="center",
                fontsize=8,
            )
        if reference is not None:
            ax.axvline(reference["value"], color=REFERENCE, linestyle="--", linewidth=1)
        largest = max(high if high is not None else median for _, median, _, high in bars)
        ax.set_xlim(0, max(largest, reference["value"] if reference else 0) * 1.18)
        ax.set_ylim(len(bars) - 0.5, -0.5)  # the first bar on top
        names = [label for label, *_ in bars] if not shared or index % columns == 0 else []
        ax.set_yticks(list(rows), names or [""] * len(bars), fontsize=8)
        ax.set_title(panel["title"], fontsize=9)
        ax.tick_params(axis="x", labelsize=8)
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
    note = chart["source"]
    if reference is not None:
        note = f"dashed line: {reference['label']} ({label_of(reference['value'])}). {note}"
    figure.suptitle(chart["title"], fontsize=10, x=0.01, ha="left")
    wrapped = textwrap.fill(note, width=int(width * 17))
    figure.text(0.01, 0.01, wrapped, fontsize=7, color=REFERENCE, ha="left", va="bottom")
    figure.tight_layout(rect=(0, FOOTER * 0.6 / height, 1, 1))
    return figure


def svg(figure: plt.Figure) -> bytes:
    """The figure as SVG, the same bytes for the same numbers: text kept as text, no date, fixed ids."""
    buffer = io.BytesIO()
    with plt.rc_context({"svg.fonttype": "none", "svg.hashsalt": "slimtorch"}):
        figure.savefig(buffer, format="svg", metadata={"Date": None}, facecolor="white")
    plt.close(figure)
    return buffer.getvalue()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DATA, help=f"the numbers (default {DATA})")
    parser.add_argument("--out", type=Path, default=OUT, help=f"where the SVGs go (default {OUT})")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if an SVG is stale")
    args = parser.parse_args(argv)
    charts = json.loads(args.data.read_text())["charts"]
    stale = []
    for name, chart in charts.items():
        path = args.out / f"{name}.svg"
        drawn = svg(draw(chart))
        if args.check:
            if not path.exists() or path.read_bytes() != drawn:
                stale.append(path)
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(drawn)
        print(f"wrote {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")
    for path in stale:
        print(f"stale: {path} (run scripts/benchmark_plots.py)", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
