"""The plan: which prune / sparsify / quantize combination to try first, chosen from measured facts.

Each candidate is applied to a copy of the original (no recovery: sizes, parameter counts and latency do
not depend on it) and measured: its saved file, its parameters or its latency. Cheap candidates are
measured first (quantization alone, then channels, then zeros); the first level where some candidate
reaches the goal gives the plan, least aggressive first: the fewest weights removed, then the most bits.
"""

from __future__ import annotations

import copy
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from slimtorch.prune import channels
from slimtorch.prune import weights as zero_weights
from slimtorch.quant import quantize as quantize_model
from slimtorch.schemes import scheme as scheme_row
from slimtorch.shrinking import save_model
from slimtorch.slimming.goal import Goal
from slimtorch.slimming.measuring import file_bytes
from slimtorch.slimming.options import SlimOptions


@dataclass(frozen=True)
class Candidate:
    """One combination: a share of channels removed, a share of weights zeroed, a scheme (or none)."""

    ratio: float = 0.0
    sparsity: float = 0.0
    scheme: str | None = None

    @property
    def label(self) -> str:
        """``channels 0.5 + int4-weight``, ``zeros 0.9 + int8-weight``, ``int8-weight``."""
        parts = [f"channels {self.ratio:g}"] if self.ratio else []
        parts += [f"zeros {self.sparsity:g}"] if self.sparsity else []
        parts += [self.scheme] if self.scheme else []
        return " + ".join(parts) or "unchanged"

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "scheme": self.scheme or ""}

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> Candidate:
        """The candidate :meth:`to_dict` wrote (a done marker's JSON: missing fields mean none)."""
        return cls(
            float(values.get("ratio", 0.0)), float(values.get("sparsity", 0.0)), values.get("scheme") or None
        )


@dataclass(frozen=True)
class Probe:
    """A candidate measured on a copy: ``value`` in the goal's unit, and the share of weights removed."""

    candidate: Candidate
    value: float
    removed: float

    def order(self) -> tuple[float, int]:
        bits = scheme_row(self.candidate.scheme).bits if self.candidate.scheme else 32
        return round(self.removed, 4), -bits


def levels(goal: Goal, options: SlimOptions) -> list[list[Candidate]]:
    """The candidates the options allow for ``goal``, cheapest level first."""
    quantize = "quantize" in options.stages
    schemes = [s for s in options.schemes if scheme_row(s).dynamic == (goal.kind == "latency")]
    schemes = schemes if quantize and goal.kind != "params" else []
    with_bits: list[str | None] = [None, *schemes]
    found = [[Candidate(scheme=s) for s in schemes]]
    if "prune" in options.stages:
        found.append([Candidate(ratio=r, scheme=s) for r in options.ratios for s in with_bits])
    if "sparsify" in options.stages and goal.kind == "size":
        found.append([Candidate(sparsity=z, scheme=s) for z in options.sparsities for s in with_bits])
    return [level for level in found if level]


def choose(
    goal: Goal, before: float, options: SlimOptions, measure: Callable[[Candidate], Probe]
) -> tuple[list[Probe], list[Probe]]:
    """The candidates to try, in order, and every probe measured: those that reach the goal, least
    aggressive first, then the closest of the rest (a back-off: within the drop, it is the best kept)."""
    measured: list[Probe] = []
    for level in levels(goal, options):
        measured += [measure(candidate) for candidate in level]
        if any(goal.reached(before, p.value) for p in measured):
            break
    reaching = sorted((p for p in measured if goal.reached(before, p.value)), key=Probe.order)
    rest = sorted(
        (p for p in measured if not goal.reached(before, p.value)), key=lambda p: (p.value, p.order())
    )
    return reaching + rest[:1], measured


def apply(model: nn.Module, candidate: Candidate, example: torch.Tensor, calibration: list) -> Any:
    """``candidate`` applied to ``model`` in place, without recovery; returns the quantize report (or
    None)."""
    if candidate.ratio:
        channels(model, example, ratio=candidate.ratio)
    if candidate.sparsity:
        zero_weights(model, candidate.sparsity)
    if candidate.scheme:
        return quantize_model(model, candidate.scheme, calibration=calibration or None)
    return None


def probe_size(
    original: nn.Module, candidate: Candidate, example: torch.Tensor, weights_before: int
) -> tuple[int, float]:
    """Bytes of ``candidate``'s saved file (on a copy of ``original``) and the share of weights it
    removed."""
    trial = copy.deepcopy(original)
    apply(trial, candidate, example, [])
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "probe.safetensors"
        save_model(trial, path)
        size = file_bytes(path)
    return size, removed_share(trial, candidate, weights_before)


def removed_share(model: nn.Module, candidate: Candidate, weights_before: int) -> float:
    """The share of the original's weights a candidate removed: channels gone, then zeros among the rest."""
    kept = weights_of(model) / weights_before if weights_before else 1.0
    return 1 - kept * (1 - candidate.sparsity)


def weights_of(model: nn.Module) -> int:
    """Weight elements of Linear, Conv and Embedding layers, a quantized one by its float shape."""
    total = 0
    for module in model.modules():
        stage = getattr(module, "stage", None)
        if isinstance(stage, dict) and "shape" in stage:
            total += int(torch.Size(stage["shape"]).numel())
        elif isinstance(module, (nn.Linear, nn.Embedding, nn.modules.conv._ConvNd)):
            total += module.weight.numel()
    return total
