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
- In a notebook a report shows itself as a table of its ``to_dict()``: ``_repr_html_`` for Jupyter,
  ``__rich__`` for rich's console (``rich.print(report)``); ``Report._display_rows`` says what a cell shows.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from slimtorch.errors import OptionError
from slimtorch.format.units import format_bytes

if TYPE_CHECKING:
    from rich.table import Table

Options = TypeVar("Options")

NOT_JSON = {"json": False}
"""``field(metadata=NOT_JSON)``: a report field that holds a result (a model, tensors), not a fact."""
SHOWN_ITEMS = 3
"""How many first items of a list or a mapping a report's table shows."""
SHOWN_CHARS = 200
"""The longest value a report's table shows; a longer one is cut, ending in ``...``."""


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

    def _display_rows(self) -> list[tuple[str, str]]:
        """The report as its notebook table shows it: (field, value) for each of ``to_dict()``'s fields.

        A number or a string is shown as it is, a field whose name ends in ``_bytes`` in binary units too
        (``2,337 (2.28 KiB)``), a list or a mapping as its length and first :data:`SHOWN_ITEMS` items; a
        value past :data:`SHOWN_CHARS` characters is cut (``...``). Names come from files: control
        characters (an escape sequence, a bidi override) are written as visible escapes (``\\x1b``); the
        HTML escapes the rest.
        """
        return [
            (_visible(name), _visible(_cut(_shown(name, value))))
            for name, value in self.to_dict().items()
            if name != "schema"
        ]

    def _repr_html_(self) -> str:
        """Jupyter's display: a two-column table titled with :attr:`SCHEMA`, every text HTML-escaped."""
        import html

        cells = "".join(
            f'<tr><th style="text-align:left">{html.escape(name)}</th>'
            f'<td style="text-align:left">{html.escape(value)}</td></tr>'
            for name, value in self._display_rows()
        )
        title = html.escape(_visible(self.SCHEMA))
        return (
            f'<table class="slimtorch-report"><caption style="text-align:left"><b>{title}</b></caption>'
            f"<thead><tr><th>field</th><th>value</th></tr></thead><tbody>{cells}</tbody></table>"
        )

    def __rich__(self) -> Table:
        """rich's display (``rich.print(report)``): the same table, its text never read as markup."""
        from rich.table import Table
        from rich.text import Text

        table = Table(title=Text(_visible(self.SCHEMA)), title_justify="left")
        table.add_column("field", no_wrap=True)
        table.add_column("value", overflow="fold")
        for name, value in self._display_rows():
            table.add_row(Text(name), Text(value))
        return table


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


def _shown(name: str, value: Any) -> str:
    """One value of ``to_dict()`` as a table cell (before it is cut)."""
    if name.endswith("_bytes") and isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,} B" if abs(value) < 1024 else f"{value:,} ({format_bytes(value)})"
    if isinstance(value, Mapping):
        items = [f"{key}: {_inline(item)}" for key, item in list(value.items())[:SHOWN_ITEMS]]
        return _summary(len(value), "entry" if len(value) == 1 else "entries", items)
    if isinstance(value, list):
        items = [_inline(item) for item in value[:SHOWN_ITEMS]]
        return _summary(len(value), "item" if len(value) == 1 else "items", items)
    return str(value)


def _summary(count: int, noun: str, first: list[str]) -> str:
    """``3 items: a, b, c`` and ``, ...`` when there are more than those shown."""
    if not count:
        return f"0 {noun}"
    more = ", ..." if count > len(first) else ""
    return f"{count:,} {noun}: {', '.join(first)}{more}"


def _inline(value: Any) -> str:
    """An item inside a list or a mapping, in one short line (nested data as compact JSON)."""
    import json

    text = value if isinstance(value, str) else json.dumps(value, default=str, ensure_ascii=False)
    return _cut(text, SHOWN_CHARS // SHOWN_ITEMS)


def _cut(text: str, limit: int = SHOWN_CHARS) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _visible(text: str) -> str:
    """``text`` with every character that is not printable (C0 and C1 controls, escape sequences, bidi
    overrides, line separators) written as its escape, ``\\x1b``, ``\\u202e``: a name from a file
    cannot move the cursor or reorder what a reader sees."""
    return "".join(
        c if c.isprintable() or c == " " else c.encode("unicode_escape").decode("ascii") for c in text
    )
