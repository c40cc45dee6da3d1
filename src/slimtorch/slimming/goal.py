"""What ``slimtorch slim`` is asked to reach: a :class:`Goal` parsed from ``size=50MB``, ``size=0.05x``,
``latency=2x`` or ``params=0.5``, and whether a measured model reaches it."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from slimtorch.errors import OptionError
from slimtorch.format.units import format_bytes, parse_size

KINDS = ("size", "latency", "params")
FORMS = "size=50MB, size=0.05x, latency=2x, params=0.5 or params=2M"
_COUNT_UNITS = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9}


@dataclass(frozen=True)
class Goal:
    """A goal: ``kind`` (size, latency or params), ``target`` and whether it is ``relative`` to the
    original model (a share of its file or parameters; a speed-up for latency) or absolute (bytes, a
    parameter count).

    Example:
        >>> parse_goal("size=0.05x")
        Goal(text='size=0.05x', kind='size', target=0.05, relative=True)
    """

    text: str
    kind: str
    target: float
    relative: bool

    def reached(self, before: float, after: float) -> bool:
        """Whether ``after`` (bytes, seconds or parameters) reaches the goal from ``before``."""
        return after <= self.limit(before)

    def limit(self, before: float) -> float:
        """The largest value (bytes, seconds, parameters) that still reaches the goal from ``before``."""
        if not self.relative:
            return self.target
        return before / self.target if self.kind == "latency" else before * self.target

    def describe(self, value: float) -> str:
        """``value`` in the goal's unit, for a person: ``25.1 KiB``, ``1.2 ms``, ``32,170 params``."""
        if self.kind == "size":
            return format_bytes(value)
        if self.kind == "latency":
            return f"{value * 1e3:.3g} ms"
        return f"{int(value):,} params"

    def to_dict(self) -> dict[str, Any]:
        return {"text": self.text, "kind": self.kind, "target": self.target, "relative": self.relative}


def parse_goal(text: str) -> Goal:
    """The :class:`Goal` ``text`` names; anything else is one :class:`OptionError` line.

    Example:
        >>> parse_goal("latency=2x").limit(0.010)
        0.005
        >>> parse_goal("params=2M").target
        2000000.0
    """
    kind, sep, value = str(text).strip().partition("=")
    kind, value = kind.strip().lower(), value.strip().lower()
    if not sep or kind not in KINDS or not value:
        raise OptionError(f"goal {text!r}: expected one of {FORMS}")
    if value.endswith("x"):
        target, relative = _number(text, value[:-1]), True
    elif kind == "size":
        target, relative = float(_size(text, value)), False
    elif kind == "params":
        target, relative = _count(text, value)
    else:
        raise OptionError(f"goal {text!r}: a latency goal is a speed-up, like latency=2x")
    if kind == "latency" and target <= 1:
        raise OptionError(f"goal {text!r}: a speed-up must be above 1x")
    if kind != "latency" and relative and not 0 < target < 1:
        raise OptionError(f"goal {text!r}: a share of the original must be between 0 and 1 (0.05x)")
    return Goal(str(text).strip(), kind, target, relative)


def _number(text: str, value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise OptionError(f"goal {text!r}: {value!r} is not a number; expected one of {FORMS}") from None
    if not math.isfinite(number) or number <= 0:
        raise OptionError(f"goal {text!r}: the target must be a positive number")
    return number


def _size(text: str, value: str) -> int:
    try:
        return parse_size(value)
    except OptionError as error:
        raise OptionError(f"goal {text!r}: {error}") from None


def _count(text: str, value: str) -> tuple[float, bool]:
    """``0.5`` is a share of the parameters; ``2M``, ``500k`` or a whole number of at least 1 a count."""
    match = re.fullmatch(r"([0-9.e+-]+)\s*([kmb]?)", value)
    if match is None:
        raise OptionError(f"goal {text!r}: expected a share (params=0.5) or a count (params=2M)")
    number = _number(text, match.group(1)) * _COUNT_UNITS[match.group(2)]
    if number < 1:
        return number, True
    return float(round(number)), False
