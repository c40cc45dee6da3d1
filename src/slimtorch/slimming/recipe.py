"""``recipe.toml``: every choice of a ``slimtorch slim`` run (the inputs, the resolved options, what the plan
chose), written by a small writer of flat tables and read with :mod:`tomllib`, so ``slimtorch slim --recipe
recipe.toml`` runs it again."""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slimtorch.errors import OptionError, SlimtorchError
from slimtorch.format.writer import write_atomic_text
from slimtorch.slimming.options import SlimOptions

HEADER = "# written by slimtorch slim; `slimtorch slim --recipe recipe.toml` runs it again\n"
TABLES = ("inputs", "options", "plan")


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
    """The :class:`Recipe` in a ``recipe.toml``; a missing file, bad TOML or a bad option is one line.

    Example:
        >>> read_recipe("slim-work/recipe.toml").options.goal  # doctest: +SKIP
        'size=0.05x'
    """
    path = Path(path)
    try:
        data = _toml().loads(path.read_text(encoding="utf-8"))
    except OSError as error:
        raise SlimtorchError(f"recipe {path}: cannot read it ({error.strerror or error})") from None
    except ValueError as error:  # tomllib.TOMLDecodeError
        raise SlimtorchError(f"recipe {path}: not valid TOML ({error})") from None
    unknown = sorted(set(data) - set(TABLES))
    if unknown:
        raise SlimtorchError(f"recipe {path}: unknown table [{unknown[0]}] (known: {', '.join(TABLES)})")
    try:
        options = SlimOptions(**data.get("options", {}))
    except TypeError as error:
        raise OptionError(f"recipe {path}: {error}") from None
    return Recipe(dict(data.get("inputs", {})), options, dict(data.get("plan", {})))


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
