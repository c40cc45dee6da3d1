"""An attempt of a ``slimtorch slim`` run: one plan's stages, and whether its saved result reaches the goal
within the allowed drop."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from slimtorch.slimming.context import Context
from slimtorch.slimming.planning import Candidate
from slimtorch.slimming.report import stage_entry

ATTEMPT_STAGES = ("prune", "sparsify", "recover", "quantize", "save")


@dataclass
class StageRun:
    """A stage's row and result, and its folder (None: skipped)."""

    entry: dict[str, Any]
    result: dict[str, Any]
    folder: str | None


@dataclass
class Attempt:
    """One plan tried to the end: its stages, its saved result, and how it fared."""

    candidate: Candidate
    runs: list[StageRun] = field(default_factory=list)

    def stage(self, name: str) -> StageRun | None:
        return next((r for r in self.runs if r.entry["name"] == name and r.folder), None)


def fares(context: Context, first: dict[str, Any], attempt: Attempt) -> tuple[bool, bool]:
    """(reaches the goal, within the drop) of an attempt's saved result."""
    saved = attempt.stage("save")
    if saved is None:
        return False, False
    result, goal = saved.result, context.goal
    within = first["metric"] - result["metric"] <= context.options.max_drop + 1e-9
    return goal.reached(first["value"], goal_value(goal.kind, result)), within


def goal_value(kind: str, result: Mapping[str, Any]) -> float:
    """A saved result in the goal's unit: bytes, parameters, or its time over the original's."""
    if kind == "size":
        return float(result["file_bytes"])
    if kind == "params":
        return float(result["params"])
    latency = result["latency"]
    return latency["after"]["median_ms"] / latency["before"]["median_ms"]


def not_attempted(first: dict[str, Any], met: bool) -> list[StageRun]:
    """The stage rows of a run that tried no plan: each skipped, saying why."""
    why = "the original already meets the goal" if met else "no plan to try (see the baseline's reason)"
    entry = {"reason": why, "params": first.get("params")}
    return [StageRun(stage_entry(name, "skipped", entry, 0.0), {}, None) for name in ATTEMPT_STAGES]
