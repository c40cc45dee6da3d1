"""The end of a ``slimtorch slim`` run: the best result within the drop chosen, exported if asked, measured
before and after (latency, load time, a training step's memory), and the report built and written."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from slimtorch.errors import SlimtorchError
from slimtorch.format.units import format_bytes
from slimtorch.format.writer import write_atomic_text
from slimtorch.loading import load_model
from slimtorch.slimming.attempts import Attempt, StageRun, fares, goal_value, not_attempted
from slimtorch.slimming.charts import CHARTS, unmeasured
from slimtorch.slimming.context import MODEL_FILE, Context
from slimtorch.slimming.measuring import (
    LOAD_RUNS,
    latency_pair,
    layer_params,
    load_times,
    training_step_memory,
)
from slimtorch.slimming.report import SlimReport, layer_rows

LATENCY_HOW = (
    "slimtorch.inspection.measure.compare(original, result, one sample): interleaved rounds, 1 thread"
)


def finish(
    context: Context,
    first: StageRun,
    attempts: list[Attempt],
    command: str,
    export: Callable[[str], StageRun] | None,
) -> tuple[SlimReport, int | None]:
    """The report of the run (written to the work folder) and the index of the attempt kept (None: the
    original was kept)."""
    chosen = _best(context, first.result, attempts)
    best = attempts[chosen] if chosen is not None else None
    kept = best.stage("save") if best is not None else first
    assert kept is not None and kept.folder is not None  # a kept attempt saved its model, as the baseline did
    deliverable = kept.folder
    met, reason = _verdict(context, first.result, best, chosen)
    tried = [run for attempt in attempts for run in attempt.runs]
    runs = [first, *(tried or not_attempted(first.result, met))]
    bundle = None
    if export is not None:
        runs.append(export(deliverable))
        bundle = runs[-1].entry["output"]
    result_model = context.model_of(deliverable)
    values: dict[str, Any] = {
        "version": 1,
        "command": command,
        "model": context.spec or f"{type(context.original).__name__} (a module passed in)",
        "data": context.data.spec,
        "metric": context.data.metric,
        "goal": context.goal.to_dict(),
        "max_drop": context.options.max_drop,
        "met": met,
        "reason": reason,
        "work": str(context.work.root),
        "stages": [run.entry for run in runs],
        "layers": _layers(context, first.result, best, deliverable),
        **_measurements(context, first, best, deliverable),
        "footprint": runs[-1].result.get("footprint") if export is not None else None,
    }
    values["outputs"] = _outputs(values, f"{deliverable}/{MODEL_FILE}", bundle)
    left_out = [key for key in ("latency", "load", "memory") if values[key] is None]
    if (
        left_out and not context.options.timings
    ):  # the report says why a section is null, in the stage's words
        first.entry["reason"] += f"; {', '.join(left_out)} not measured: timings=False (--no-timings)"
    report = SlimReport(**values, result=result_model, notes=tuple(context.notes))
    return _written(report, context), chosen


def _best(context: Context, first: dict[str, Any], attempts: list[Attempt]) -> int | None:
    """The attempt to keep: one reaching the goal within the drop; else, within the drop, the one
    closest to the goal; None when no attempt stayed within the drop."""
    scored = []
    for index, attempt in enumerate(attempts):
        reached, within = fares(context, first, attempt)
        if within:
            saved = attempt.stage("save").result  # type: ignore[union-attr]
            scored.append((not reached, goal_value(context.goal.kind, saved), index))
    return min(scored)[2] if scored else None


def _verdict(
    context: Context, first: dict[str, Any], best: Attempt | None, chosen: int | None
) -> tuple[bool, str]:
    """Whether the goal was met, and one line saying what was reached or why not."""
    goal, options = context.goal, context.options
    if (
        not first["plan"]["attempts"]
        and goal.kind != "latency"
        and goal.reached(first["value"], first["value"])
    ):
        return True, first["reason"]
    if not first["plan"]["attempts"]:
        return False, f"{goal.text} cannot be met: {first['reason']}; the original is kept (01-baseline)"
    if best is None:
        return False, (
            f"{goal.text} cannot be met within a drop of {options.max_drop:g}: no attempt stayed within it; "
            "the original is kept (01-baseline)"
        )
    saved = best.stage("save").result  # type: ignore[union-attr]
    value = goal_value(goal.kind, saved)
    reached = goal.reached(first["value"], value)
    drop = first["metric"] - saved["metric"]
    where = _reached_text(context, first, value)
    line = (
        f"{where} with {context.data.metric} {saved['metric']:.4g} ({-drop:+.3g}) by {best.candidate.label}"
    )
    if reached:
        return True, f"reached {line}"
    kept = f"best kept (attempt {(chosen or 0) + 1})"
    return False, f"{goal.text} not met within a drop of {options.max_drop:g}; {kept}: {line}"


def _reached_text(context: Context, first: dict[str, Any], value: float) -> str:
    goal = context.goal
    if goal.kind == "size":
        return f"{value / first['file_bytes']:.3f}x the original file ({format_bytes(value)})"
    if goal.kind == "params":
        return f"{value / first['params']:.3f}x the parameters ({int(value):,})"
    return f"{1 / value:.2f}x the original's speed"


def _layers(
    context: Context, first: dict[str, Any], best: Attempt | None, deliverable: str
) -> list[dict[str, Any]]:
    """The per-layer table of the kept result."""
    after = layer_params(context.work.root / deliverable / MODEL_FILE)
    before = layer_params(context.work.root / "01-baseline" / MODEL_FILE)
    zeros: dict[str, float] = {}
    quantized = None
    if best is not None:
        sparsified = best.stage("sparsify")
        zeros = sparsified.result.get("zeros", {}) if sparsified else {}
        stage = best.stage("quantize")
        if stage is not None:
            quantized = dict(stage.result.get("quantized", {}))
            quantized.update({name: f"kept: {why}" for name, why in stage.result.get("kept", {}).items()})
    pruned = {}
    for name, count in before.items():
        kept = after.get(name, count) / count if count else 1.0
        pruned[name] = round(1 - kept * (1 - zeros.get(name, 0.0)), 4)
    return layer_rows(context.original, after, first["plan"].get("sensitivity"), pruned, quantized)


def _measurements(
    context: Context, first: StageRun, best: Attempt | None, deliverable: str
) -> dict[str, Any]:
    """latency, load and memory before and after; all None with ``timings=False`` (the latency a latency
    goal measured is kept)."""
    saved = best.stage("save").result if best is not None else {}  # type: ignore[union-attr]
    latency = saved.get("latency")
    if not context.options.timings:
        return {"latency": _latency(latency), "load": None, "memory": None}
    if latency is None:
        latency = latency_pair(context.original, context.model_of(deliverable), context.data.example)
    files = {
        key: context.work.root / folder / MODEL_FILE
        for key, folder in (("before", "01-baseline"), ("after", deliverable))
    }
    load = {
        "command": f"slimtorch.load_model(FILE, factory), {LOAD_RUNS} times each: "
        f"01-baseline/{MODEL_FILE}, then {deliverable}/{MODEL_FILE}",
        **{
            key: load_times(functools.partial(load_model, path, context.factory))
            for key, path in files.items()
        },
    }
    return {"latency": _latency(latency), "load": load, "memory": _memory(context, best)}


def _latency(latency: dict[str, Any] | None) -> dict[str, Any] | None:
    return None if latency is None else {**latency, "command": LATENCY_HOW}


def _memory(context: Context, best: Attempt | None) -> dict[str, Any]:
    """One training step of the original and of the kept result's last float model (quantized layers do
    not train, so a quantized result is measured as it was before its quantization)."""
    example = next(iter(context.data.train))[0]
    after = "01-baseline"
    if best is not None:
        float_only = best.stage("quantize") is None
        for run in best.runs:
            if run.folder and (run.entry["name"] in ("prune", "sparsify", "recover") or float_only):
                after = run.folder
    return {
        "command": f"slimtorch.memory.profile(model, a training batch of {len(example)}, device='cpu'); "
        f"after: the model of {after}",
        "batch": len(example),
        "before": training_step_memory(context.original, example),
        "after": training_step_memory(context.model_of(after), example),
    }


def _outputs(values: dict[str, Any], model: str, bundle: str | None) -> dict[str, Any]:
    charts = [
        f"charts/{chart.name}.png" for chart in CHARTS if unmeasured({**values, "outputs": {}}, chart) is None
    ]
    return {
        "model": model,
        "recipe": "recipe.toml",
        "report_html": "report.html",
        "report_json": "report.json",
        "charts": charts,
        "bundle": bundle,
    }


def _written(report: SlimReport, context: Context) -> SlimReport:
    """The report, with report.json, report.html and the charts written (``slimming.report_files``); without
    matplotlib, report.json alone, and a note saying so."""
    from slimtorch.slimming.report_files import write_report

    try:
        write_report(report.to_dict(), context.work.root)
    except SlimtorchError as error:
        path = context.work.root / "report.json"
        write_atomic_text(path, json.dumps(report.to_dict(), indent=2) + "\n")
        return replace(report, notes=(*report.notes, f"report.html and charts not written: {error}"))
    return report
