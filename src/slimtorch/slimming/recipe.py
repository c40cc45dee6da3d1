"""``recipe.toml``: every choice of a ``slimtorch slim`` run (the inputs, the resolved options, what the plan
chose), written by a small writer of flat tables and read with :mod:`tomllib`, so ``slimtorch slim --recipe
recipe.toml`` runs it again."""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from slimtorch.errors import OptionError, SlimtorchError
from slimtorch.format.writer import write_atomic_text
from slimtorch.slimming.options import SCHEMES, SlimOptions
from slimtorch.slimming.schema import Invalid, items, number, record, shown, text

HEADER = "# written by slimtorch slim; `slimtorch slim --recipe recipe.toml` runs it again\n"
TABLES = ("inputs", "options", "plan")
MAX_RECIPE_BYTES = 16 * 2**20
"""A recipe holds a few lines, and the name of each layer quantization kept float: 16 MiB is plenty."""
MAX_ATTEMPTS = 64
PATH = text(4096)
INPUTS = record({}, {"model": PATH, "weights": PATH, "data": PATH, "fingerprint": text(64)})
PLAN = record(
    {},
    {
        "ratios": items(number(0, 1, open_high=True), MAX_ATTEMPTS),
        "sparsities": items(number(0, 1, open_high=True), MAX_ATTEMPTS),
        "schemes": items(text(64, choices=("", *SCHEMES)), MAX_ATTEMPTS),
        "chosen": number(-1, MAX_ATTEMPTS, integer=True),
        "kept_float": items(text(1024), 100_000),
    },
)


@dataclass(frozen=True)
class Recipe:
    """What a run was asked (``inputs``, ``options``) and what its plan chose (``plan``: empty until the
    baseline stage has planned).

    Example:
        >>> Recipe({"model": "m.py:Net", "data": "digits"}, SlimOptions(goal="size=0.1x")).identity()["data"]
        'digits'
    """

    inputs: dict[str, Any]
    options: SlimOptions
    plan: dict[str, Any] = field(default_factory=dict)

    def identity(self) -> dict[str, Any]:
        """What must match for a rerun in the same work folder to resume: the inputs and the options."""
        return {**{f"inputs.{k}": v for k, v in self.inputs.items()}, **self.options.to_dict()}

    def text(self) -> str:
        """The recipe as TOML: a comment line, then the tables inputs, options and plan."""
        tables = {"inputs": self.inputs, "options": self.options.to_dict(), "plan": self.plan}
        return HEADER + "\n".join(_table(name, values) for name, values in tables.items())


def write_recipe(recipe: Recipe, path: Path) -> Path:
    """Write ``recipe`` to ``path`` atomically (a temporary file, fsync, renamed over it)."""
    write_atomic_text(path, recipe.text())
    return path


def read_recipe(path: str | Path) -> Recipe:
    """The :class:`Recipe` in a ``recipe.toml``, checked: a missing or oversized file, bad TOML, an unknown
    table or key, a value of the wrong type or out of its bounds is one line naming the file and the field.

    Example:
        >>> read_recipe("slim-work/recipe.toml").options.goal  # doctest: +SKIP
        'size=0.05x'
    """
    path = Path(path)
    try:
        with open(path, "rb") as stream:
            raw = stream.read(MAX_RECIPE_BYTES + 1)
    except OSError as error:
        raise SlimtorchError(f"recipe {path}: cannot read it ({error.strerror or error})") from None
    if len(raw) > MAX_RECIPE_BYTES:
        raise SlimtorchError(f"recipe {path}: more than the {MAX_RECIPE_BYTES:,} bytes a recipe may hold")
    try:
        data = _toml().loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as error:  # tomllib.TOMLDecodeError, UnicodeDecodeError
        raise SlimtorchError(f"recipe {path}: not valid TOML ({str(error)[:200]})") from None
    unknown = sorted(set(data) - set(TABLES))
    if unknown:
        raise SlimtorchError(f"recipe {path}: unknown table [{unknown[0]}] (known: {', '.join(TABLES)})")
    try:
        for name in TABLES:
            if not isinstance(data.get(name, {}), dict):
                raise Invalid(f"[{name}] must be a table, not {shown(data[name])}")
        INPUTS(data.get("inputs", {}), "[inputs]")
        check_plan(data.get("plan", {}), "[plan]")
        known = [f.name for f in fields(SlimOptions)]
        record({}, dict.fromkeys(known, lambda value, where: None))(data.get("options", {}), "[options]")
    except Invalid as error:
        raise OptionError(f"recipe {path}: {error}") from None
    try:
        options = SlimOptions(**data.get("options", {}))
    except OptionError as error:
        raise OptionError(f"recipe {path}: [options] {error}") from None
    return Recipe(dict(data.get("inputs", {})), options, dict(data.get("plan", {})))


def check_plan(plan: Any, where: str = "plan") -> None:
    """Raise :class:`Invalid` unless ``plan`` is a recipe's ``[plan]``: one ratio, sparsity and scheme per
    attempt (all three, or none: then the run plans again), ``chosen`` one of them or -1."""
    PLAN(plan, where)
    lengths = {len(plan.get(key, [])) for key in ("ratios", "sparsities", "schemes")}
    if len(lengths) > 1:
        raise Invalid(f"{where}: ratios, sparsities and schemes must have one entry per attempt")
    if not -1 <= plan.get("chosen", -1) < max(lengths):
        raise Invalid(f"{where}.chosen must be -1 or the index of an attempt, not {plan['chosen']}")


def _toml() -> Any:
    if sys.version_info >= (3, 11):
        import tomllib

        return tomllib
    try:
        import tomli
    except ImportError:
        raise SlimtorchError("reading a recipe on Python 3.10 needs tomli: pip install tomli") from None
    return tomli


def _table(name: str, values: Mapping[str, Any]) -> str:
    lines = [f"[{name}]"]
    lines += [f"{key} = {_value(value)}" for key, value in values.items() if value is not None]
    return "\n".join(lines) + "\n"


def _value(value: Any) -> str:
    """One TOML value: a string, a bool, an int, a finite float, or a list of those."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise SlimtorchError(f"a recipe cannot hold {value}")
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)  # JSON's string escapes are TOML's basic strings'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_value(item) for item in value) + "]"
    raise SlimtorchError(f"a recipe holds strings, numbers, booleans and lists, not {type(value).__name__}")
