"""The slim report's charts: one PNG each, drawn off-screen (matplotlib's Agg) from the report's dict.

Each :class:`Chart` names its file (``charts/<name>.png``), its title (the one the HTML shows above it)
and the command that measured what it draws. A chart whose data the run did not measure is not drawn:
:func:`unmeasured` says why, in the words of the stage that skipped it, so the page never shows an
empty axis as if it were a result.

Example:
    >>> report = json.loads(Path("tests/fixtures/slim_report.json").read_text())  # doctest: +SKIP
    >>> [c.name for c in CHARTS if unmeasured(report, c) is None]  # doctest: +SKIP
    ['bytes', 'layers', 'latency', 'load', 'memory', 'metric', 'footprint']
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slimtorch.errors import SlimtorchError
from slimtorch.format.units import format_bytes

Data = Mapping[str, Any]
CATEGORY_COLOURS = {
    "weights": "#4c72b0",
    "biases": "#dd8452",
    "norms": "#55a868",
    "embeddings": "#8172b3",
    "other": "#937860",
}
QUANTIZED_COLOURS = {
    "int8": "#4c72b0",
    "int4": "#8172b3",
    "kept precise": "#dd8452",
    "not quantized": "#b0b0b0",
    "other": "#937860",
}
BEFORE, AFTER = "#8c8c8c", "#2a7ab0"
SIZE = (8.0, 4.2)  # inches at DPI: 1000 x 525 pixels, readable at the page's width
DPI = 125


@dataclass(frozen=True)
class Chart:
    """One chart of the report: where it goes, what it is called, and what it is drawn from."""

    name: str
    title: str
    section: str
    """the report's key it draws ("stages", "layers", "latency" ...); its ``command`` measured it"""
    draw: Callable[[Any, Data], None]
    """draws into a matplotlib figure; called only when :func:`unmeasured` found the data"""


def require_pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend (files only, no display), or one line saying what to install.

    ``slim`` may call it before a long run, so a missing matplotlib is known before the work, not after.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib import pyplot
    except ImportError:
        raise SlimtorchError(
            "the slim report's charts need matplotlib: pip install 'slimtorch[charts]'"
        ) from None
    return pyplot


def unmeasured(report: Data, chart: Chart) -> str | None:
    """Why ``chart`` cannot be drawn from ``report`` (the stage's reason where one says), or None."""
    if chart.section == "stages":
        key = "bytes_by_category" if chart.name == "bytes" else "metric"
        if any(stage.get(key) is not None for stage in report["stages"]):
            return None
        return f"no stage recorded its {key.replace('_', ' ')}"
    if chart.section == "layers":
        return None if report["layers"] else "the report lists no prunable or quantizable layer"
    if report[chart.section] is not None:
        return None
    return _stage_reason(report, chart.section)


def _stage_reason(report: Data, section: str) -> str:
    """The reason of the stage that left ``section`` out: one with a clause (between semicolons) naming it
    and "not measured"; else the export's for the footprint (a bundle not asked for); else that none says."""
    named = re.compile(rf"\b{section}\b.*\bnot measured\b")  # "latency, load and memory not measured: why"
    for stage in report["stages"]:
        if any(named.search(clause) for clause in stage["reason"].lower().split(";")):
            return f"{stage['name']}: {stage['reason']}"
    if section == "footprint":
        for stage in report["stages"]:
            if stage["name"] == "export" and stage["status"] in ("skipped", "failed"):
                return f"export {stage['status']}: {stage['reason']}"
        if not any(stage["name"] == "export" for stage in report["stages"]):
            return "no bundle was exported (no export stage ran), so no runtime to weigh"
    return f"the run recorded no {section} and no stage says why"


def draw(report: Data, chart: Chart, path: Path) -> Path:
    """Draw ``chart`` from ``report`` into the PNG ``path``; the figure is closed whatever happens.

    Every text is literal (``text.parse_math`` off): layer names and paths come from the user's files, and
    a ``$`` in one would start matplotlib's mathtext, whose parser fails on most of what follows.
    """
    pyplot = require_pyplot()
    with pyplot.rc_context({"text.parse_math": False, "text.usetex": False}):
        figure = pyplot.figure(figsize=_figure_size(report, chart), dpi=DPI)
        try:
            chart.draw(figure, report)
            figure.suptitle(chart.title, fontsize=12, fontweight="bold")
            figure.tight_layout()
            path.parent.mkdir(parents=True, exist_ok=True)
            figure.savefig(path)
        finally:
            pyplot.close(figure)
    return path


def _figure_size(report: Data, chart: Chart) -> tuple[float, float]:
    """Wider for many layers (a BERT has 70+), so their names stay legible."""
    if chart.name == "layers":
        return (min(16.0, max(SIZE[0], 0.3 * len(report["layers"]))), 5.6)
    return SIZE


def _byte_scale(largest: float) -> tuple[float, str]:
    """A divisor and unit that keep an axis's numbers under 1024."""
    for power, unit in enumerate(("B", "KiB", "MiB", "GiB")):
        if largest < 1024 ** (power + 1) or unit == "GiB":
            return 1024**power, unit
    raise AssertionError("unreachable")


def _bytes(figure: Any, report: Data) -> None:
    """Stacked bars of each stage's bytes by category, each labelled with its file and the ratio so far."""
    axes = figure.add_subplot()
    stages = [s for s in report["stages"] if s.get("bytes_by_category") is not None]
    present = {c for s in stages for c, n in s["bytes_by_category"].items() if n}
    categories = [c for c in CATEGORY_COLOURS if c in present] + sorted(present - set(CATEGORY_COLOURS))
    totals = [sum(s["bytes_by_category"].values()) for s in stages]
    scale, unit = _byte_scale(max(totals))
    xs = range(len(stages))
    bottoms = [0.0] * len(stages)
    for category in categories:
        heights = [s["bytes_by_category"].get(category, 0) / scale for s in stages]
        colour = CATEGORY_COLOURS.get(category, "#c44e52")  # a category this renderer does not know
        axes.bar(xs, heights, 0.6, bottom=bottoms, color=colour, label=category)
        bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]
    first = stages[0].get("file_bytes")
    for x, stage, top in zip(xs, stages, bottoms, strict=True):
        size = stage.get("file_bytes")
        label = "no file" if size is None else format_bytes(size)
        if size is not None and first and x:
            label += f"\n{size / first:.3f}x"
        axes.annotate(label, (x, top), xytext=(0, 3), textcoords="offset points", ha="center", fontsize=8)
    for x in xs[:-1]:  # the waterfall's steps: each stage starts where the last one ended
        axes.plot([x + 0.3, x + 0.7], [bottoms[x], bottoms[x]], color="#555555", linewidth=0.8, ls="--")
    axes.set_xticks(list(xs), [_stage_label(s) for s in stages], fontsize=9)
    axes.set_ylabel(f"bytes by category ({unit})")
    axes.set_ylim(0, max(bottoms) * 1.22)
    axes.set_title("each stage's file, by what its bytes hold; ratio to the first", fontsize=9)
    axes.legend(fontsize=8, loc="upper right")


def _stage_label(stage: Data) -> str:
    return stage["name"] if stage["status"] == "done" else f"{stage['name']}\n({stage['status']})"


def _layers(figure: Any, report: Data) -> None:
    """Top: each layer's sensitivity (the metric lost pruning it alone); bottom: share pruned, coloured by
    how it was quantized (named on the bar too where the layers are few enough to read)."""
    layers = report["layers"]
    xs = list(range(len(layers)))
    top, bottom = figure.subplots(2, 1, sharex=True)
    sensitivity = [layer["sensitivity"] for layer in layers]
    top.bar(xs, [0 if s is None else s for s in sensitivity], 0.6, color="#c44e52")
    unprobed = [x for x, s in zip(xs, sensitivity, strict=True) if s is None]
    if unprobed:
        top.scatter(unprobed, [0] * len(unprobed), marker="x", color="black", label="not probed", zorder=3)
        top.legend(fontsize=8, loc="upper right")
    top.set_ylabel(f"{_metric_unit(report)} lost\npruned alone", fontsize=9)
    pruned = [100 * layer["pruned"] for layer in layers]
    states = [_quantized_state(layer["quantized"]) for layer in layers]
    for state, colour in QUANTIZED_COLOURS.items():
        chosen = [x for x in xs if states[x] == state]
        if chosen:
            heights = [pruned[x] for x in chosen]
            bottom.bar(chosen, heights, 0.6, color=colour, edgecolor=colour, linewidth=1.5, label=state)
    if len(layers) <= 12:
        for x, layer in zip(xs, layers, strict=True):
            mark = layer["quantized"] or "not quantized"
            bottom.annotate(
                mark, (x, pruned[x]), xytext=(0, 2), textcoords="offset points", ha="center", fontsize=7
            )
    bottom.set_ylim(0, 125)
    bottom.set_ylabel("% pruned", fontsize=9)
    bottom.legend(fontsize=8, loc="upper right", ncols=len(set(states)))
    rotation = 0 if len(layers) <= 8 else 60
    names = [layer["name"] for layer in layers]
    bottom.set_xticks(xs, names, rotation=rotation, ha="right" if rotation else "center", fontsize=8)


def _quantized_state(quantized: str | None) -> str:
    """The colour group of a layer's ``quantized``: its scheme, kept (any reason), or not quantized."""
    if quantized is None:
        return "not quantized"
    if quantized.startswith("kept"):
        return "kept precise"
    return quantized if quantized in QUANTIZED_COLOURS else "other"


def _metric_unit(report: Data) -> str:
    return "accuracy points" if report["metric"] == "accuracy" else "cosine"


def _spread(figure: Any, report: Data, section: str, unit: str, subtitle: str) -> None:
    """Before and after as medians with their quartiles as whiskers; a side not measured says so."""
    axes = figure.add_subplot()
    data = report[section]
    scale = (
        1000.0 if unit == "s" and max(_medians(data, unit), default=0) < 1 else 1.0
    )  # seconds under 1 read as ms
    shown = "ms" if unit == "ms" or scale == 1000.0 else "s"
    for x, (side, colour) in enumerate((("before", BEFORE), ("after", AFTER))):
        point = data.get(side)
        if point is None:
            axes.annotate("not measured", (x, 0), ha="center", va="bottom", fontsize=9)
            continue
        median, q1, q3 = (point[f"{k}_{unit}"] * scale for k in ("median", "q1", "q3"))
        axes.bar(x, median, 0.5, color=colour)
        axes.errorbar(x, median, yerr=[[median - q1], [q3 - median]], color="black", capsize=8)
        label = f"{median:.3g} {shown}\n({q1:.3g}-{q3:.3g}, {point['runs']} runs)"
        axes.annotate(label, (x, q3), xytext=(0, 4), textcoords="offset points", ha="center", fontsize=8)
    medians = _medians(data, unit)
    if len(medians) == 2 and all(medians):
        faster = medians[0] >= medians[1]
        ratio = medians[0] / medians[1] if faster else medians[1] / medians[0]
        subtitle += f"; {ratio:.2f}x {'faster' if faster else 'slower'}"
    axes.set_xticks([0, 1], ["before", "after"])
    axes.set_xlim(-0.8, 1.8)
    axes.set_ylim(0, max(_quartile_tops(data, unit)) * scale * 1.35)
    axes.set_ylabel(f"median ({shown}), whiskers: quartiles")
    axes.set_title(subtitle, fontsize=9)


def _medians(data: Data, unit: str) -> list[float]:
    return [data[side][f"median_{unit}"] for side in ("before", "after") if data.get(side)]


def _quartile_tops(data: Data, unit: str) -> list[float]:
    return [data[side][f"q3_{unit}"] for side in ("before", "after") if data.get(side)] or [1.0]


def _latency(figure: Any, report: Data) -> None:
    latency = report["latency"]
    subtitle = f"batch {latency['batch']}, {latency['threads']} thread{'s' * (latency['threads'] != 1)}"
    _spread(figure, report, "latency", "ms", subtitle)


def _load(figure: Any, report: Data) -> None:
    _spread(figure, report, "load", "s", "until the model is ready to run")


def _memory(figure: Any, report: Data) -> None:
    """The live bytes through one training step, before and after, each with its peak marked."""
    axes = figure.add_subplot()
    memory = report["memory"]
    largest = max((side["peak_bytes"] for side in (memory["before"], memory["after"]) if side), default=1)
    scale, unit = _byte_scale(largest)
    for side, colour in (("before", BEFORE), ("after", AFTER)):
        step = memory.get(side)
        if step is None:
            axes.plot([], [], color=colour, label=f"{side}: not measured")
            continue
        xs = [event for event, _ in step["curve"]]
        ys = [nbytes / scale for _, nbytes in step["curve"]]
        axes.plot(
            xs, ys, color=colour, linewidth=1.4, label=f"{side}: peak {format_bytes(step['peak_bytes'])}"
        )
        peak = max(range(len(ys)), key=ys.__getitem__) if ys else None
        if peak is not None:
            axes.scatter([xs[peak]], [step["peak_bytes"] / scale], color=colour, marker="v", s=50, zorder=3)
    axes.set_ylim(0, largest / scale * 1.15)
    axes.set_xlabel("allocations and frees through the step")
    axes.set_ylabel(f"live tensors ({unit})")
    axes.set_title(f"batch {memory['batch']}: forward, backward, optimizer step", fontsize=9)
    axes.legend(fontsize=8, loc="upper left")


def _metric(figure: Any, report: Data) -> None:
    """The metric after each stage, with the band the goal allows below the original. A stage far below
    it (pruned, before recovery) would flatten the band into a line: it sits on the axis's floor with
    its value written, so the band stays readable and no number is hidden."""
    axes = figure.add_subplot()
    stages = [s for s in report["stages"] if s.get("metric") is not None]
    values = [s["metric"] for s in stages]
    base = next((s["metric"] for s in report["stages"] if s["name"] == "baseline"), None)
    drop = report["max_drop"]
    floor = None if base is None else base - drop * 4  # the view: the band and as much again below
    shown = [v if floor is None or v >= floor else floor for v in values]
    xs = list(range(len(stages)))
    axes.plot(xs, shown, color=AFTER, marker="o")
    for x, value, at in zip(xs, values, shown, strict=True):
        text = f"{value:.2f}" if report["metric"] == "accuracy" else f"{value:.4f}"
        if at != value:
            axes.scatter([x], [at], marker="v", s=60, color="#c44e52", zorder=3, clip_on=False)
            text += " (below the axis)"
        axes.annotate(text, (x, at), xytext=(0, 6), textcoords="offset points", ha="center", fontsize=8)
    if base is not None:
        label = f"allowed drop: {drop:g} ({_metric_unit(report)})"
        axes.axhspan(base - drop, base, color="#55a868", alpha=0.15, label=label)
        axes.axhline(base - drop, color="#55a868", linewidth=1, ls="--")
        axes.legend(fontsize=8, loc="lower right")
    low = min([*shown, *([base - drop] if base is not None else [])])
    high = max([*shown, *([base] if base is not None else [])])
    margin = max((high - low) * 0.2, 1e-3)
    clipped = shown != values  # then the floor is the axis's edge, the markers on it
    axes.set_ylim(low if clipped else low - margin, high + margin)
    axes.set_xticks(xs, [_stage_label(s) for s in stages], fontsize=9)
    axes.set_ylabel("accuracy (%)" if report["metric"] == "accuracy" else "output cosine to the original")
    axes.set_title(f"on the held-out data of {report['data']}", fontsize=9)


def _footprint(figure: Any, report: Data) -> None:
    """What a deployment installs (the bundle and its runtime) beside torch's installed size, which is
    measured only where ``slimtorch footprint`` cached it (else that bar says "not measured")."""
    axes = figure.add_subplot()
    footprint = report["footprint"]
    deployed = footprint["bundle_bytes"] + footprint["runtime_bytes"]
    torch_bytes = footprint.get("torch_bytes")
    largest = max(deployed, torch_bytes or 0)
    scale, unit = _byte_scale(largest)
    bundle, runtime = footprint["bundle_bytes"] / scale, footprint["runtime_bytes"] / scale
    axes.barh(1, bundle, 0.5, color=AFTER, label="bundle")
    axes.barh(1, runtime, 0.5, left=bundle, color="#55a868", label=footprint["runtime"])
    bars = [(1, deployed, f"{format_bytes(deployed)} (bundle {format_bytes(footprint['bundle_bytes'])})")]
    if torch_bytes is None:
        bars.append((0, 0, "not measured"))
        subtitle = "torch's installed size not measured (see the export stage)"
    else:
        axes.barh(0, torch_bytes / scale, 0.5, color=BEFORE, label="torch")
        bars.append((0, torch_bytes, format_bytes(torch_bytes)))
        subtitle = f"the bundle's runtime is {deployed / torch_bytes:.2f}x torch's size"
    for y, nbytes, label in bars:
        axes.annotate(
            label, (nbytes / scale, y), xytext=(4, 0), textcoords="offset points", va="center", fontsize=9
        )
    axes.set_yticks([0, 1], ["torch (installed)", f"bundle + {footprint['runtime']}"])
    axes.set_xlim(0, largest / scale * 1.3)
    axes.set_xlabel(f"installed size ({unit})")
    axes.set_title(subtitle, fontsize=9)
    axes.legend(fontsize=8, loc="upper right")


CHARTS = (
    Chart("bytes", "Where the bytes go, by stage", "stages", _bytes),
    Chart("layers", "Per-layer sensitivity and what was done", "layers", _layers),
    Chart("latency", "Latency before and after", "latency", _latency),
    Chart("load", "Load time", "load", _load),
    Chart("memory", "Memory of one training step", "memory", _memory),
    Chart("metric", "Metric at each stage", "stages", _metric),
    Chart("footprint", "Deployment footprint", "footprint", _footprint),
)
"""In the page's order."""
