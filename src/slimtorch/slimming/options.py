"""What :func:`slimtorch.slim` is told: :class:`SlimOptions`, the choices a recipe records, checked when
made, so a recipe with a bad value fails where it is read, not halfway through a run."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from slimtorch.errors import OptionError
from slimtorch.slimming.goal import parse_goal

STAGES = ("prune", "sparsify", "recover", "quantize")
"""the stages the plan may use (baseline and save always run; export with ``export=True``)"""
SCHEMES = ("int8-weight", "int4-weight", "int8-dynamic")


@dataclass(frozen=True)
class SlimOptions:
    """How :func:`slimtorch.slim` works toward its goal; every field is written to ``recipe.toml``.

    Example:
        >>> SlimOptions(goal="size=0.05x", max_drop=0.5).stages
        ('prune', 'sparsify', 'recover', 'quantize')
    """

    goal: str = ""
    """``size=50MB``, ``size=0.05x``, ``latency=2x``, ``params=0.5`` (see :func:`parse_goal`)"""
    max_drop: float = 1.0
    """the largest metric loss allowed, in the metric's unit (points of accuracy, or of cosine 0..1)"""
    stages: tuple[str, ...] = STAGES
    """the stages the plan may use, of prune, sparsify, recover and quantize"""
    schemes: tuple[str, ...] = SCHEMES
    """the quantization schemes the plan may use (int8-weight and int4-weight for size, int8-dynamic for
    latency)"""
    ratios: tuple[float, ...] = (0.25, 0.5, 0.75)
    """the shares of channels structured pruning tries, each below 1"""
    sparsities: tuple[float, ...] = (0.5, 0.75, 0.9)
    """the shares of weights unstructured pruning tries (a size goal that channels cannot reach)"""
    probe: float = 0.5
    """the sparsity each layer is pruned to alone to measure its sensitivity"""
    recover_epochs: int = 10
    """passes over the training data after pruning (distilled from the original)"""
    lr: float = 1e-3
    """the recovery's learning rate (AdamW)"""
    seed: int = 0
    """seeds the data order and every random choice, so a recipe reproduces the run"""
    batch: int = 64
    """the data's batch size (training, evaluation, the memory step)"""
    attempts: int = 3
    """plans tried, least aggressive first, before giving up: each a prune / quantize combination"""
    export: bool = False
    """also export an ONNX bundle of the result and measure its runtime's footprint"""
    timings: bool = True
    """measure latency, load time and a training step's memory before and after (False: those report
    sections are null, and the report says so)"""

    def __post_init__(self) -> None:
        for name in ("stages", "schemes", "ratios", "sparsities"):
            value = getattr(self, name)
            if isinstance(value, str):
                raise OptionError(f"{name} takes a list, not the string {value!r}")
            object.__setattr__(self, name, tuple(value))
        if self.goal:
            parse_goal(self.goal)
        _known("stages", self.stages, STAGES)
        _known("schemes", self.schemes, SCHEMES)
        for name in ("ratios", "sparsities"):
            if not all(0 < float(v) < 1 for v in getattr(self, name)):
                raise OptionError(f"{name} must be shares between 0 and 1, not {list(getattr(self, name))}")
        if not 0 < self.probe < 1:
            raise OptionError(f"probe must be between 0 and 1, not {self.probe}")
        if self.max_drop < 0:
            raise OptionError(f"max_drop must be at least 0, not {self.max_drop}")
        for name in ("recover_epochs", "batch", "attempts"):
            minimum = 0 if name == "recover_epochs" else 1
            if int(getattr(self, name)) < minimum:
                raise OptionError(f"{name} must be at least {minimum}, not {getattr(self, name)}")
        if self.lr <= 0:
            raise OptionError(f"lr must be positive, not {self.lr}")

    def to_dict(self) -> dict[str, Any]:
        """The options as plain values (lists for tuples), in field order: what the recipe records."""
        return {f.name: list(v) if isinstance(v := getattr(self, f.name), tuple) else v for f in fields(self)}


def _known(name: str, values: tuple[str, ...], allowed: tuple[str, ...]) -> None:
    unknown = [v for v in values if v not in allowed]
    if unknown:
        raise OptionError(f"{name}: unknown {unknown[0]!r} (known: {', '.join(allowed)})")
