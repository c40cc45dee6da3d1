"""Checks of values read from files a run did not write itself (a stage's ``done.json``, a ``recipe.toml``):
each a function ``check(value, where)`` that returns nothing or raises :class:`Invalid`, naming the field.

Types are exact (a bool is not a number, a string is not a list), numbers finite and within bounds, texts
and collections bounded in length, records closed (an unknown key is refused, naming it).

Example:
    >>> record({"epochs": number(0, 1000, integer=True)})({"epochs": 10**9}, "options")
    Traceback (most recent call last):
    ...
    slimtorch.slimming.schema.Invalid: options.epochs must be an integer from 0 to 1000, not 1000000000
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

Check = Callable[[Any, str], None]


class Invalid(ValueError):
    """A value that does not fit its schema: ``where`` (a dotted path) and what is wrong, in one line."""


def shown(value: Any, limit: int = 60) -> str:
    """``value`` as a message shows it: its repr, cut to ``limit`` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def is_number(value: Any, *, integer: bool = False) -> bool:
    """Whether ``value`` is an int (or, unless ``integer``, a float): never a bool, never a string."""
    if isinstance(value, bool):
        return False
    return isinstance(value, int) if integer else isinstance(value, (int, float))


def number(
    low: float = -math.inf,
    high: float = math.inf,
    *,
    integer: bool = False,
    optional: bool = False,
    open_low: bool = False,
    open_high: bool = False,
) -> Check:
    """A finite number from ``low`` to ``high`` (bounds excluded where ``open_*``); an int if ``integer``;
    None too if ``optional``."""
    kind = "an integer" if integer else "a number"
    above = f"{'above' if open_low else 'at least'} {low:g}"
    below = f"{'below' if open_high else 'at most'} {high:g}"
    if math.isfinite(low) and math.isfinite(high):
        span = f" from {low:g} to {high:g}" if not (open_low or open_high) else f" {above} and {below}"
    else:
        span = f" {above}" if math.isfinite(low) else f" {below}" if math.isfinite(high) else ""
    expected = f"{kind}{span}" if span else f"a finite {kind[2:]}"

    def check(value: Any, where: str) -> None:
        if value is None and optional:
            return
        if not is_number(value, integer=integer) or not math.isfinite(value):
            raise Invalid(f"{where} must be {expected}, not {shown(value)}")
        if value < low or value > high or (open_low and value == low) or (open_high and value == high):
            raise Invalid(f"{where} must be {expected}, not {shown(value)}")

    return check


def text(max_chars: int = 4096, *, choices: tuple[str, ...] | None = None, optional: bool = False) -> Check:
    """A string of at most ``max_chars`` characters (one of ``choices`` if given); None too if
    ``optional``."""

    def check(value: Any, where: str) -> None:
        if value is None and optional:
            return
        if not isinstance(value, str):
            raise Invalid(f"{where} must be a string, not {shown(value)}")
        if len(value) > max_chars:
            raise Invalid(f"{where} is {len(value):,} characters, more than the {max_chars:,} allowed")
        if choices is not None and value not in choices:
            raise Invalid(f"{where}: unknown {shown(value)} (known: {', '.join(map(repr, choices))})")

    return check


def flag(value: Any, where: str) -> None:
    """A bool."""
    if not isinstance(value, bool):
        raise Invalid(f"{where} must be true or false, not {shown(value)}")


def items(each: Check, max_items: int, *, min_items: int = 0) -> Check:
    """A list (a tuple too) of ``min_items`` to ``max_items`` values, each checked by ``each``."""

    def check(value: Any, where: str) -> None:
        if not isinstance(value, (list, tuple)):
            raise Invalid(f"{where} must be a list, not {shown(value)}")
        if not min_items <= len(value) <= max_items:
            raise Invalid(f"{where} holds {len(value):,} entries; {min_items} to {max_items:,} allowed")
        for index, item in enumerate(value):
            each(item, f"{where}[{index}]")

    return check


def table(values: Check, max_items: int, max_key: int = 1024) -> Check:
    """A mapping of at most ``max_items`` string keys (each at most ``max_key`` characters) to values
    checked by ``values``: a per-layer table, whose keys are not known in advance."""

    def check(value: Any, where: str) -> None:
        if not isinstance(value, Mapping):
            raise Invalid(f"{where} must be a table, not {shown(value)}")
        if len(value) > max_items:
            raise Invalid(f"{where} holds {len(value):,} entries, more than the {max_items:,} allowed")
        for key, item in value.items():
            if not isinstance(key, str) or len(key) > max_key:
                raise Invalid(f"{where} has the key {shown(key)}, not a name of at most {max_key} characters")
            values(item, f"{where}[{shown(key)}]")

    return check


def record(required: Mapping[str, Check], optional: Mapping[str, Check] | None = None) -> Check:
    """A mapping with exactly the ``required`` keys and any of the ``optional`` ones, each checked."""
    optional = optional or {}

    def check(value: Any, where: str) -> None:
        if not isinstance(value, Mapping):
            raise Invalid(f"{where} must be a table, not {shown(value)}")
        unknown = sorted(str(key) for key in value if key not in required and key not in optional)
        if unknown:
            known = ", ".join([*required, *optional])
            raise Invalid(f"{where}: unknown key {shown(unknown[0])} (known: {known})")
        missing = [key for key in required if key not in value]
        if missing:
            raise Invalid(f"{where}: missing key {missing[0]!r}")
        for key, item in value.items():
            (required.get(key) or optional[key])(item, f"{where}.{key}")

    return check
