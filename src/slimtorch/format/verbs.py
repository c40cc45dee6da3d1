"""The one shape every public verb has: ``verb(model_or_path, /, options=None, **overrides) -> Report``.

- ``options`` is the step's frozen options dataclass (``QuantizeOptions``, ``LoadOptions`` ...), or None
  for its defaults; keyword ``overrides`` replace single fields (``quantize(model, scheme="int4-weight")``).
  :func:`resolve` builds the options a verb runs with, and an unknown keyword is an
  :class:`~slimtorch.errors.OptionError` naming the fields there are, never silently ignored.
- The data a verb works on (a model, a path, example inputs, calibration batches) and ``progress`` are
  arguments of their own, not options: options say *how*, and are what a recipe records.
- The verb returns a report dataclass that subclasses :class:`Report`: what was done, with the result
  itself where the verb makes one (a loaded model, a state dict) in a field that stays out of the JSON.
  ``to_dict()`` is the ``--json`` output, tagged with the report's ``SCHEMA`` name, and ``json_schema()``
  describes it (JSON Schema, derived from the dataclass's fields, so it cannot drift from them).
- A verb that changes a model changes it in place, like torch's ``quantize_``, and its report holds it too.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from slimtorch.errors import OptionError

Options = TypeVar("Options")

NOT_JSON = {"json": False}
"""``field(metadata=NOT_JSON)``: a report field that holds a result (a model, tensors), not a fact."""


def resolve(kind: type[Options], options: Options | None, overrides: Mapping[str, Any], verb: str) -> Options:
    """The options ``verb`` runs with: ``options`` (None: ``kind()``) with ``overrides`` replacing fields.

    Example:
        >>> from dataclasses import dataclass
        >>> @dataclass(frozen=True)
        ... class Demo:
        ...     ratio: float = 0.5
        >>> resolve(Demo, None, {"ratio": 0.3}, "demo")
        Demo(ratio=0.3)
    """
    if options is None:
        options = kind()
    elif not isinstance(options, kind):
        raise OptionError(f"{verb}: options must be a {kind.__name__}, not {type(options).__name__}")
    if not overrides:
        return options
    known = {f.name for f in dataclasses.fields(kind)}  # type: ignore[arg-type]
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise OptionError(
            f"{verb}: unknown option {unknown[0]!r}; {kind.__name__} has: {', '.join(sorted(known))}"
        )
    return dataclasses.replace(options, **overrides)  # type: ignore[type-var]


class Report:
    """What every verb's report dataclass subclasses: ``to_dict()`` for JSON, ``json_schema()`` for tools.

    ``SCHEMA`` names the JSON's shape and version (``"slimtorch.quantize/1"``); ``DERIVED`` lists values
    ``to_dict`` adds beyond the fields (properties such as ``ratio``) with their JSON types.
    """

    SCHEMA: ClassVar[str] = "slimtorch.report/1"
    DERIVED: ClassVar[dict[str, dict[str, Any]]] = {}

    def to_dict(self) -> dict[str, Any]:
        """The report as JSON-ready data: every field except results (``NOT_JSON``), plus ``DERIVED``."""
        values = {
            f.name: _plain(getattr(self, f.name))
            for f in dataclasses.fields(self)  # type: ignore[arg-type]
            if f.metadata.get("json", True)
        }
        derived = {name: _plain(getattr(self, name)) for name in self.DERIVED}
        return {"schema": self.SCHEMA, **values, **derived}

    @classmethod
    def json_schema(cls) -> dict[str, Any]:
        """A JSON Schema (draft 2020-12) of :meth:`to_dict`'s output."""
        return {
            "$schema": "https://json-schema.org/draft/2020-12/schema",
            "title": cls.SCHEMA,
            **_object_schema(cls),
        }


def _object_schema(kind: type) -> dict[str, Any]:
    hints = typing.get_type_hints(kind)
    properties: dict[str, Any] = {"schema": {"const": kind.SCHEMA}} if issubclass(kind, Report) else {}
    for f in dataclasses.fields(kind):
        if f.metadata.get("json", True):
            properties[f.name] = _type_schema(hints[f.name])
    properties.update(getattr(kind, "DERIVED", {}))
    return {"type": "object", "properties": properties, "required": sorted(properties)}


def _type_schema(hint: Any) -> dict[str, Any]:
    """JSON Schema of one annotated type (what :func:`_plain` turns a value of it into)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return {"anyOf": [_type_schema(arg) for arg in args]}
    if hint is type(None):
        return {"type": "null"}
    if hint is bool:
        return {"type": "boolean"}
    if hint is int:
        return {"type": "integer"}
    if hint is float:
        return {"type": "number"}
    if hint in (str, Path) or (isinstance(hint, type) and issubclass(hint, Path)):
        return {"type": "string"}
    if origin in (list, tuple, set, frozenset) or hint in (list, tuple):
        items = [a for a in args if a is not Ellipsis]
        return {"type": "array", **({"items": _type_schema(items[0])} if len(set(items)) == 1 else {})}
    if origin is typing.Literal:
        return {"enum": list(args)}
    if origin in (dict, Mapping) or hint is dict:
        return {"type": "object", **({"additionalProperties": _type_schema(args[1])} if args else {})}
    if dataclasses.is_dataclass(hint):
        return _object_schema(hint)  # type: ignore[arg-type]
    return {}  # Any, or a type JSON has no word for: no constraint


def _plain(value: Any) -> Any:
    """``value`` as JSON data: dataclasses as objects, tuples and sets as lists, paths as strings."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        if isinstance(value, Report):
            return value.to_dict()
        to_dict = getattr(value, "to_dict", None)
        if callable(to_dict):
            return to_dict()
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        items = [_plain(v) for v in value]
        return sorted(items, key=str) if isinstance(value, (set, frozenset)) else items
    if isinstance(value, Path):
        return str(value)
    return value
