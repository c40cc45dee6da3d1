""":class:`SlimReport`: what ``slimtorch slim`` did, in the shape ``report.json`` holds (version 1; h23's
schema), with the deliverable model kept out of the JSON."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from torch import nn

from slimtorch.format.verbs import NOT_JSON, Report

STAGE_KEYS = ("metric", "params", "file_bytes", "bytes_by_category", "output")


@dataclass(frozen=True)
class SlimReport(Report):
    """The run: goal, whether it was met and why, each stage, each layer, the measurements before and after,
    and the files written. ``to_dict()`` is ``report.json`` (every key present, ``None`` where not measured).

    Example:
        >>> report = slimtorch.slim(model, "digits", goal="size=0.05x")  # doctest: +SKIP
        >>> report.met, report.outputs["model"]  # doctest: +SKIP
        (True, '06-save/model.safetensors')
    """

    SCHEMA: ClassVar[str] = "slimtorch.slim/1"

    version: int
    command: str
    model: str
    data: str
    metric: str
    goal: dict[str, Any]
    max_drop: float
    met: bool
    reason: str
    work: str
    stages: list[dict[str, Any]]
    layers: list[dict[str, Any]]
    latency: dict[str, Any] | None
    load: dict[str, Any] | None
    memory: dict[str, Any] | None
    footprint: dict[str, Any] | None
    outputs: dict[str, Any]
    result: nn.Module | None = field(default=None, repr=False, compare=False, metadata=NOT_JSON)
    """the deliverable, loaded back from its file"""
    notes: tuple[str, ...] = field(default=(), compare=False, metadata=NOT_JSON)
    """what the run could not do besides its goal (a report file not written), one line each"""

    def to_dict(self) -> dict[str, Any]:
        """The report as ``report.json`` holds it: exactly the schema's keys (``version`` tags it)."""
        values = super().to_dict()
        values.pop("schema")
        return values


def stage_entry(name: str, status: str, result: dict[str, Any], seconds: float) -> dict[str, Any]:
    """One row of ``stages``: the schema's keys from a stage's result (``None`` where it has none)."""
    return {
        "name": name,
        "status": status,
        "reason": result.get("reason", ""),
        "seconds": round(seconds, 3),
        **{key: result.get(key) for key in STAGE_KEYS},
    }


def layer_rows(
    original: nn.Module,
    after: dict[str, int],
    sensitivity: dict[str, float] | None,
    pruned: dict[str, float],
    quantized: dict[str, str] | None,
) -> list[dict[str, Any]]:
    """One row per Linear, Conv and Embedding layer of the original: parameters before and after, its
    sensitivity, the share pruned, and how it was quantized or why it was kept float."""
    rows = []
    for name, module in original.named_modules():
        if not isinstance(module, (nn.Linear, nn.Embedding, nn.modules.conv._ConvNd)):
            continue
        before = sum(p.numel() for p in module.parameters(recurse=False))
        rows.append(
            {
                "name": name,
                "kind": type(module).__name__,
                "params_before": before,
                "params_after": after.get(name, before),
                "sensitivity": None if sensitivity is None else sensitivity.get(name),
                "pruned": pruned.get(name, 0.0),
                "quantized": None
                if quantized is None
                else quantized.get(name, "kept: not a quantizable layer"),
            }
        )
    return rows
