"""What :func:`slimtorch.slim` is told: :class:`SlimOptions`, the choices a recipe records, checked when
made (types, finite numbers within :data:`BOUNDS`), so a recipe with a bad value fails where it is read,
not halfway through a run, and no number in one can make a run go on without end."""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from typing import Any

from slimtorch.errors import OptionError
from slimtorch.schemes import SCHEMES as ALL_SCHEMES
from slimtorch.schemes import scheme as scheme_row
from slimtorch.slimming.goal import parse_goal
from slimtorch.slimming.schema import Check, Invalid, flag, items, number, text

STAGES = ("prune", "sparsify", "recover", "quantize")
"""the stages the plan may use (baseline and save always run; export with ``export=True``)"""
SCHEMES = tuple(sorted(ALL_SCHEMES, key=lambda name: scheme_row(name).dynamic))
"""every quantization scheme (:mod:`slimtorch.schemes`), weight-only ones first (those a size goal tries):
the plan quantizes layers and saves them as they are (``save_model``), so it takes any row, not only those
the file writers' ``quantize`` stores (:data:`slimtorch.schemes.WRITTEN`)"""


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
    """the quantization schemes the plan may use: the weight-only ones (int8-weight, int4-weight) for size,
    those that quantize activations too (int8-dynamic) for latency"""
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
            if isinstance(value, Iterable) and not isinstance(value, (bytes, Mapping)):
                object.__setattr__(self, name, tuple(_plain(v) for v in value))
        for f in fields(self):
            value = _plain(getattr(self, f.name))
            if f.name in REALS:  # 2 and 2.0 are one choice: the recipe and the stages' digests agree
                value = tuple(map(_real, value)) if isinstance(value, tuple) else _real(value)
            object.__setattr__(self, f.name, value)
            try:
                BOUNDS[f.name](getattr(self, f.name), f.name)
            except Invalid as error:
                raise OptionError(str(error)) from None
        if self.goal:
            parse_goal(self.goal)

    def to_dict(self) -> dict[str, Any]:
        """The options as plain values (lists for tuples), in field order: what the recipe records."""
        return {f.name: list(v) if isinstance(v := getattr(self, f.name), tuple) else v for f in fields(self)}


REALS = ("max_drop", "ratios", "sparsities", "probe", "lr")
"""the fields whose numbers are reals: a whole number given there is kept as a float, so the Python API's
``max_drop=2`` and the command line's ``--max-drop 2`` (2.0) make the same recipe, and one resumes the
other's work"""


def _real(value: Any) -> Any:
    return float(value) if isinstance(value, int) and not isinstance(value, bool) else value


def _plain(value: Any) -> Any:
    """A number of another type (numpy's, torch's) as Python's int or float, which a recipe can hold."""
    if isinstance(value, (bool, str, tuple, list)) or value is None:
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    return value


SHARE = number(0, 1, open_low=True, open_high=True)
MAX_CHOICES = 16
"""Each ratio and each sparsity is a candidate the plan measures on a copy of the model, once per scheme:
16 of each is already hours on a large model."""
BOUNDS: dict[str, Check] = {
    "goal": text(256),
    "max_drop": number(0, 100),  # points of accuracy (0..100) or of cosine (0..1): more means nothing
    "stages": items(text(64, choices=STAGES), MAX_CHOICES),
    "schemes": items(text(64, choices=SCHEMES), MAX_CHOICES),
    "ratios": items(SHARE, MAX_CHOICES),  # removing no channel, or all of them, is no plan
    "sparsities": items(SHARE, MAX_CHOICES),
    "probe": SHARE,
    "recover_epochs": number(0, 1000, integer=True),  # a recovery is a few passes; 1000 is days on digits
    "lr": number(0, 1, open_low=True),  # AdamW moves each weight by about lr a step: beyond 1 is no fine-tune
    "seed": number(0, 2**63 - 1, integer=True),  # what torch's generators take
    "batch": number(1, 65536, integer=True),  # samples in one batch, held in memory at once
    "attempts": number(1, 64, integer=True),  # each a full prune, recover, quantize and save
    "export": flag,
    "timings": flag,
}
"""Each option's type and bounds, checked when the options are made (from a recipe, the command line or
Python): a value out of them is an :class:`OptionError` naming the field."""
