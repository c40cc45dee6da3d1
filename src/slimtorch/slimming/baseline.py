"""The first stage: the original measured (metric, file, parameters), whether it already meets the goal,
and if not, the plan (:mod:`slimtorch.slimming.planning`) and each prunable layer's sensitivity."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from torch import nn

from slimtorch.prune import scan
from slimtorch.slimming.context import Context
from slimtorch.slimming.measuring import latency_pair
from slimtorch.slimming.planning import Candidate, Probe, apply, choose, probe_size, removed_share, weights_of
from slimtorch.slimming.stages import Result, saved


def baseline(context: Context, folder: Path, forced: list[Candidate] | None) -> tuple[Result, nn.Module]:
    """Save and measure the original; plan the attempts (``forced``: a recipe's, not planned again)."""
    model = context.copy()
    result = saved(context, folder, model, "")
    goal = context.goal
    before = (
        1.0 if goal.kind == "latency" else float(result["file_bytes" if goal.kind == "size" else "params"])
    )
    if goal.kind != "latency" and goal.reached(before, before):
        plan: dict[str, Any] = {"attempts": [], "probes": []}
        result["reason"] = f"the original already meets {goal.text}: {goal.describe(before)}"
    elif forced is not None:
        plan = {"attempts": [c.to_dict() for c in forced], "probes": []}
        result["reason"] = "plan from the recipe: " + ", then ".join(c.label for c in forced)
    else:
        attempts, probes = choose(goal, before, context.options, lambda c: _probe(context, c))
        plan = {"attempts": [p.candidate.to_dict() for p in attempts], "probes": [_row(p) for p in probes]}
        result["reason"] = _planned(context, before, attempts, probes)
    candidates = [Candidate.from_dict(c) for c in plan["attempts"]]
    if any(c.ratio or c.sparsity for c in candidates):
        plan["sensitivity"] = _sensitivity(context, model)
    result["plan"] = plan
    result["value"] = before
    return result, model


def _probe(context: Context, candidate: Candidate) -> Probe:
    """``candidate`` applied to a copy of the original (no recovery) and measured in the goal's unit."""
    original, example = context.original, context.data.example
    weights = weights_of(original)
    if context.goal.kind == "size":
        size, removed = probe_size(original, candidate, example, weights)
        return Probe(candidate, float(size), removed)
    trial = copy.deepcopy(original)
    apply(trial, candidate, example, context.calibration())
    removed = removed_share(trial, candidate, weights)
    if context.goal.kind == "params":
        return Probe(candidate, float(sum(p.numel() for p in trial.parameters())), removed)
    timed = latency_pair(original, trial, example)
    return Probe(candidate, timed["after"]["median_ms"] / timed["before"]["median_ms"], removed)


def _planned(context: Context, before: float, attempts: list[Probe], probes: list[Probe]) -> str:
    """One line: what the probes measured and what the plan tries first."""
    goal = context.goal
    shown = goal.describe if goal.kind != "latency" else (lambda v: f"{v:.2f}x the time")
    if not attempts:
        return f"nothing to try for {goal.text} with the stages allowed"
    first = attempts[0]
    measured = f"{len(probes)} combinations measured on copies"
    if not goal.reached(before, first.value):
        return (
            f"no combination reaches {goal.text} ({measured}; the closest, {first.candidate.label}, "
            f"gives {shown(first.value)}): trying it"
        )
    return f"{measured}; trying {first.candidate.label} first ({shown(first.value)} before recovery)"


def _sensitivity(context: Context, model: nn.Module) -> dict[str, float]:
    """Each prunable layer's metric drop when it alone is pruned to the probe share (``prune.scan``)."""
    probe = context.options.probe
    report = scan(copy.deepcopy(model), context.score, amounts=(probe,))
    return {name: report.baseline - metrics[probe] for name, metrics in report.metrics.items()}


def _row(probe: Probe) -> dict[str, Any]:
    return {"label": probe.candidate.label, "value": probe.value, "removed": probe.removed}
