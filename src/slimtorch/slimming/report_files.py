"""The slim report as files: ``report.json`` (the dict, exactly), ``charts/*.png`` and ``report.html``.

The HTML is one self-contained file: its CSS inline, its charts inlined as ``data:`` URIs, no script and
nothing from the network, so it opens the same from a mail attachment, a CI artifact or a laptop offline.
Every string from the report is escaped (a model's name is the user's input), every chart says the command
that measured it, and a chart the run did not measure says "not measured" and why instead of being drawn.

Example:
    >>> paths = write_report(report.to_dict(), Path("work/digits"))  # doctest: +SKIP
    >>> sorted(paths)  # doctest: +SKIP
    ['charts/bytes', 'charts/footprint', ..., 'html', 'json']
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable, Iterable, Mapping
from html import escape
from pathlib import Path
from typing import Any

from slimtorch.errors import SlimtorchError
from slimtorch.format.units import format_bytes
from slimtorch.format.writer import write_atomic_text
from slimtorch.slimming.charts import CHARTS, Chart, draw, require_pyplot, unmeasured

Data = Mapping[str, Any]
VERSION = 1
KEYS = (
    *("version", "command", "model", "data", "metric", "goal", "max_drop", "met", "reason", "work"),
    *("stages", "layers", "latency", "load", "memory", "footprint", "outputs"),
)


def write_report(report: Data, folder: Path) -> dict[str, Path]:
    """report.json, charts/*.png and report.html (self-contained: PNGs inlined as data: URIs, inline CSS,
    no network) in ``folder``; returns their paths by key ("json", "html", "charts/<name>").

    A chart not drawn this time has its PNG from an earlier run removed (and the page is written last),
    so the folder never shows an old chart or page beside a new report. A missing matplotlib is one
    error line before anything is written.
    """
    _check(report)
    require_pyplot()
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = {"json": folder / "report.json", "html": folder / "report.html"}
    paths["html"].unlink(missing_ok=True)  # an earlier run's page must not outlive a failed drawing
    charts = folder / "charts"
    if charts.is_symlink() or (charts.exists() and not charts.is_dir()):
        charts.unlink()  # the charts go into the work folder, never through a link out of it
    write_atomic_text(paths["json"], json.dumps(report, indent=2) + "\n")
    images: dict[str, bytes] = {}
    for chart in CHARTS:
        png = folder / "charts" / f"{chart.name}.png"
        if unmeasured(report, chart) is None:
            paths[f"charts/{chart.name}"] = draw(report, chart, png)
            images[chart.name] = png.read_bytes()
        else:
            png.unlink(missing_ok=True)
    write_atomic_text(paths["html"], render_html(report, images))
    return paths


def _check(report: Data) -> None:
    """One line for a dict this renderer cannot draw: a newer version, or keys the contract promises."""
    if report.get("version") != VERSION:
        raise SlimtorchError(
            f"slim report version {report.get('version')!r}: this slimtorch renders {VERSION}"
        )
    missing = [key for key in KEYS if key not in report]
    if missing:
        raise SlimtorchError(f"slim report lacks {', '.join(missing)}: not a report slimtorch.slim wrote")


def render_html(report: Data, images: Mapping[str, bytes]) -> str:
    """The page: ``images`` are the charts' PNG bytes by name; a chart without one says why it is missing."""
    title = f"slimtorch slim: {report['model']}"
    body = [
        _header(report),
        _summary(report),
        *(_figure(report, chart, images.get(chart.name)) for chart in CHARTS),
        _layer_table(report),
        _stage_table(report),
        _outputs(report),
    ]
    return (
        f'<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f'<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        f"<title>{escape(title)}</title>\n<style>{STYLE}</style>\n</head>\n<body>\n<main>\n"
        + "\n".join(body)
        + "\n</main>\n</body>\n</html>\n"
    )


def _header(report: Data) -> str:
    goal = report["goal"]
    verdict = (
        '<span class="met">goal met</span>' if report["met"] else '<span class="unmet">goal not met</span>'
    )
    drop = report["max_drop"]
    unit = f"point{'s' * (drop != 1)} of accuracy" if report["metric"] == "accuracy" else "of cosine"
    allowed = f"at most {drop:g} {unit} lost, on {report['data']}"
    return (
        f"<header>\n<h1>slimtorch slim: {escape(report['model'])}</h1>\n"
        f'<p class="goal">goal <b>{escape(goal["text"])}</b> ({escape(goal["kind"])}), '
        f"{escape(allowed)}: {verdict}</p>\n"
        f'<p class="reason">{escape(report["reason"])}</p>\n'
        f'<p class="how">command: <code>{escape(report["command"])}</code><br>'
        f"work folder: <code>{escape(report['work'])}</code></p>\n</header>"
    )


def final_stage(report: Data) -> Data:
    """The stage whose output is the deliverable (``outputs.model``); else the last one that finished."""
    for stage in report["stages"]:
        if stage.get("output") and stage["output"] == report["outputs"].get("model"):
            return stage
    finished = [s for s in report["stages"] if s["status"] in ("done", "resumed") and s.get("file_bytes")]
    return (finished or report["stages"])[-1]


def _summary(report: Data) -> str:
    """Before (the baseline stage) and after (the deliverable's stage), each row with its change."""
    before: Data = next((s for s in report["stages"] if s["name"] == "baseline"), {})
    after = final_stage(report)
    metric = report["metric"]
    rows: list[tuple[str, Any, Any, Callable[[Any], str], Callable[[Any, Any], str]]] = [
        ("file size", before.get("file_bytes"), after.get("file_bytes"), format_bytes, _ratio),
        ("parameters", before.get("params"), after.get("params"), "{:,}".format, _ratio),
        (metric, before.get("metric"), after.get("metric"), _metric_text(metric), _points(metric)),
    ]
    for name, unit, label in (("latency", "ms", "latency, median"), ("load", "s", "load, median")):
        section = report[name] or {}
        before_ms, after_ms = (_median(section.get(side), unit) for side in ("before", "after"))
        rows.append((label, before_ms, after_ms, _time, _speed))
    cells = "\n".join(
        f"<tr><th>{escape(name)}</th><td>{_cell(a, show)}</td><td>{_cell(b, show)}</td>"
        f"<td>{escape(change(a, b)) if a is not None and b is not None else ''}</td></tr>"
        for name, a, b, show, change in rows
    )
    caption = (
        f"before: baseline; after: {escape(after['name'])} (<code>{escape(str(after.get('output')))}</code>)"
    )
    return (
        f'<section>\n<h2>Before and after</h2>\n<table class="summary">\n<caption>{caption}</caption>\n'
        f"<tr><th></th><th>before</th><th>after</th><th>change</th></tr>\n{cells}\n</table>\n</section>"
    )


def _cell(value: Any, show: Callable[[Any], str]) -> str:
    return '<span class="missing">not measured</span>' if value is None else escape(show(value))


def _median(point: Data | None, unit: str) -> float | None:
    if point is None:
        return None
    return point[f"median_{unit}"] * (1 if unit == "ms" else 1000)  # both rows in milliseconds


def _time(ms: float) -> str:
    return f"{ms:.3g} ms" if ms < 1000 else f"{ms / 1000:.3g} s"


def _ratio(a: float, b: float) -> str:
    return f"{b / a:.3f}x" if a else ""


def _speed(a: float, b: float) -> str:
    return f"{a / b:.2f}x faster" if b and a >= b else (f"{b / a:.2f}x slower" if a else "")


def _metric_text(metric: str) -> Any:
    return (lambda v: f"{v:.2f}%") if metric == "accuracy" else (lambda v: f"{v:.4f}")


def _points(metric: str) -> Any:
    if metric == "accuracy":
        return lambda a, b: f"{b - a:+.2f} points"
    return lambda a, b: f"{b - a:+.4f}"


def _figure(report: Data, chart: Chart, png: bytes | None) -> str:
    """The chart inlined, or "not measured" and why; under it, the command that measured its numbers."""
    if png is not None:
        data = base64.b64encode(png).decode("ascii")
        shown = f'<img src="data:image/png;base64,{data}" alt="{escape(chart.title)}">'
    else:
        why = unmeasured(report, chart) or "matplotlib did not draw it"
        shown = f'<p class="missing">not measured: {escape(why)}</p>'
    how = _how(report, chart)
    caption = f'<figcaption class="how">how measured: {how}</figcaption>\n' if how else ""
    return f'<figure id="chart-{chart.name}">\n<h2>{escape(chart.title)}</h2>\n{shown}\n{caption}</figure>'


def _how(report: Data, chart: Chart) -> str | None:
    """The command behind the chart's numbers: its section's own, or slim's (None: nothing was measured)."""
    section = report[chart.section]
    if chart.section == "stages":
        return f"<code>{escape(report['command'])}</code> (each stage's output in the work folder)"
    if chart.section == "layers":
        return f"<code>{escape(report['command'])}</code> (its sensitivity scan and plan)"
    if section is None:
        return None
    command = section.get("command")
    return f"<code>{escape(command)}</code>" if command else "not recorded in the report"


def _layer_table(report: Data) -> str:
    unit = "points" if report["metric"] == "accuracy" else "cosine"
    rows = "\n".join(
        "<tr>"
        + "".join(f"<td>{escape(text)}</td>" for text in (layer["name"], layer["kind"]))
        + f"<td class=n>{layer['params_before']:,}</td><td class=n>{layer['params_after']:,}</td>"
        + f"<td class=n>{_cell(layer['sensitivity'], '{:.3g}'.format)}</td>"
        + f"<td class=n>{layer['pruned']:.0%}</td>"
        + f"<td>{escape(layer['quantized'] or 'not quantized')}</td></tr>"
        for layer in report["layers"]
    )
    return (
        f"<section>\n<h2>Layers</h2>\n<table>\n<tr><th>layer</th><th>kind</th><th>parameters before</th>"
        f"<th>after</th><th>sensitivity ({unit} lost pruned alone)</th><th>pruned</th>"
        f"<th>quantized</th></tr>\n"
        f"{rows}\n</table>\n</section>"
    )


def _stage_table(report: Data) -> str:
    show = _metric_text(report["metric"])
    rows = "\n".join(
        f'<tr class="{escape(stage["status"])}"><td>{escape(stage["name"])}</td>'
        f"<td>{escape(stage['status'])}</td><td>{escape(stage['reason'])}</td>"
        f"<td class=n>{stage['seconds']:.1f} s</td><td class=n>{_cell(stage.get('metric'), show)}</td>"
        f"<td class=n>{_cell(stage.get('params'), '{:,}'.format)}</td>"
        f"<td class=n>{_file(stage.get('file_bytes'))}</td>"
        f"<td><code>{_path(stage.get('output') or '')}</code></td></tr>"
        for stage in report["stages"]
    )
    return (
        "<section>\n<h2>Stages</h2>\n<table>\n<tr><th>stage</th><th>status</th><th>why</th><th>time</th>"
        f"<th>{escape(report['metric'])}</th><th>parameters</th><th>file</th><th>output</th></tr>\n"
        f"{rows}\n</table>\n</section>"
    )


def _path(text: str) -> str:
    """A path that wraps after its slashes, not inside a name."""
    return escape(text).replace("/", "/<wbr>")


def _file(size: int | None) -> str:
    return "no file" if size is None else escape(format_bytes(size))


def _outputs(report: Data) -> str:
    items = _items((key, value) for key, value in report["outputs"].items())
    where = "<p class=how>relative to the work folder</p>"
    return f"<section>\n<h2>Outputs</h2>\n{where}\n<ul>\n{items}\n</ul>\n</section>"


def _items(pairs: Iterable[tuple[str, Any]]) -> str:
    lines = []
    for key, value in pairs:
        shown = ", ".join(value) if isinstance(value, list) else ("none" if value is None else str(value))
        lines.append(f"<li>{escape(key)}: <code>{escape(shown)}</code></li>")
    return "\n".join(lines)


STYLE = """
body { font: 15px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; color: #222; background: #fff;
       margin: 0; }
main { max-width: 980px; margin: 0 auto; padding: 24px; }
h1 { font-size: 24px; margin: 0 0 8px; }
h2 { font-size: 18px; margin: 28px 0 8px; }
header { border-bottom: 1px solid #ddd; padding-bottom: 12px; }
.met, .unmet { padding: 2px 8px; border-radius: 4px; color: #fff; font-weight: 600; }
.met { background: #2e7d32; } .unmet { background: #c62828; }
.reason { font-size: 17px; margin: 6px 0; }
.how { color: #666; font-size: 12px; }
code { font: 12px ui-monospace, "DejaVu Sans Mono", monospace; overflow-wrap: anywhere; }
table { border-collapse: collapse; width: 100%; font-size: 13px; }
th, td { border-bottom: 1px solid #e4e4e4; padding: 4px 8px; text-align: left; vertical-align: top; }
td.n, .summary td, .summary th + th { text-align: right; font-variant-numeric: tabular-nums;
  white-space: nowrap; }
table.summary { width: auto; min-width: 60%; }
td code { font-size: 11px; overflow-wrap: normal; }
caption { text-align: left; color: #666; font-size: 12px; padding-bottom: 4px; }
tr.skipped td { color: #888; } tr.failed td { color: #c62828; }
figure { margin: 0; }
figure img { display: block; width: 100%; height: auto; border: 1px solid #eee; }
.missing { color: #b26a00; font-style: italic; }
"""
