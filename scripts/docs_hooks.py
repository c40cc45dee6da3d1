"""MkDocs hooks (mkdocs.yml ``hooks:``): the reference pages' generated parts, made when the site is built.

A page's Markdown source holds a marker; :func:`on_page_markdown` replaces it, so the page cannot drift from
the code:

- ``<!-- slimtorch:cli-help -->`` (docs/reference/cli.md): the ``--help`` of ``slimtorch`` and of each
  command, in ``COMMANDS`` order, from ``slimtorch.cli.main.build_parser()`` at a fixed width of 100 columns.
- ``<!-- slimtorch:json-schemas -->`` (docs/reference/json-schemas.md): each public report's
  ``json_schema()``, titled by its ``SCHEMA`` name.

tests/test_docs_site.py calls :func:`cli_help` and :func:`json_schemas` without building the site.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

CLI_MARKER = "<!-- slimtorch:cli-help -->"
SCHEMAS_MARKER = "<!-- slimtorch:json-schemas -->"
COLUMNS = 100
"""the terminal width the help is formatted for, so the page is the same on every machine"""

REPORTS = (
    "slimtorch.InspectReport",
    "slimtorch.ShrinkReport",
    "slimtorch.LoadReport",
    "slimtorch.prune.PruneReport",
    "slimtorch.prune.SparsityReport",
    "slimtorch.prune.SensitivityReport",
    "slimtorch.QuantizeReport",
    "slimtorch.RecoverReport",
    "slimtorch.SlimReport",
    "slimtorch.memory.MemoryReport",
    "slimtorch.memory.RankMemory",
    "slimtorch.memory.GenerationMemory",
    "slimtorch.memory.HostMemory",
    "slimtorch.memory.FitPlan",
    "slimtorch.memory.BatchSizeResult",
    "slimtorch.data.TuneReport",
    "slimtorch.deploy.ExportReport",
    "slimtorch.deploy.FootprintReport",
    "slimtorch.deploy.OperatorList",
)
"""Every public report (a ``Report`` subclass), by its public name, in the order of the commands; a report
missing here fails tests/test_docs_site.py."""


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    if CLI_MARKER in markdown:
        markdown = markdown.replace(CLI_MARKER, cli_help())
    if SCHEMAS_MARKER in markdown:
        markdown = markdown.replace(SCHEMAS_MARKER, json_schemas())
    return markdown


def cli_help(columns: int = COLUMNS) -> str:
    """A section per command (``slimtorch`` first): one line of what it does, its page, its ``--help``."""
    from slimtorch.cli.main import build_parser

    with _environment(COLUMNS=str(columns), NO_COLOR="1", PYTHON_COLORS="0"):
        parser = build_parser()
        sections = [_section("slimtorch", "slimtorch", parser.description or "", parser.format_help())]
        commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        summaries = {action.dest: action.help or "" for action in commands._choices_actions}
        for name, command in commands.choices.items():
            summary = summaries.get(name, "").rstrip(".")
            summary = f"{summary[:1].upper()}{summary[1:]}. How-to: [{name}](../how-to/{name}.md)."
            sections.append(_section(f"slimtorch {name}", name, summary, command.format_help()))
    return "\n\n".join(sections)


def _section(title: str, anchor: str, summary: str, text: str) -> str:
    fence = "`" * max([3, *(len(run) + 1 for run in re.findall(r"`+", text))])
    return f"## `{title}` {{ #{anchor} }}\n\n{summary.strip()}\n\n{fence}text\n{text.rstrip()}\n{fence}"


@contextlib.contextmanager
def _environment(**values: str) -> Iterator[None]:
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def json_schemas() -> str:
    """A section per report of :data:`REPORTS`: its ``SCHEMA`` name, its class, its ``json_schema()``."""
    roles = _sibling("griffe_roles")
    sections = []
    for name in REPORTS:
        kind = report_class(name)
        summary = roles.markdown((kind.__doc__ or "").strip().split("\n\n")[0])
        summary = " ".join(summary.split())
        text = compact_json(kind.json_schema())
        sections.append(
            f"## `{kind.SCHEMA}` {{ #{anchor(kind.SCHEMA)} }}\n\n"
            f"[`{name}`][{name}]: {summary}\n\n```json\n{text}\n```"
        )
    return "\n\n".join(sections)


def compact_json(value: Any, indent: str = "", lead: int = 0, width: int = 80) -> str:
    """``value`` as indented JSON where a value fitting on its line (``width`` columns, ``lead`` of them
    taken by its key) stays on one line."""
    flat = json.dumps(value)
    if len(indent) + lead + len(flat) <= width or not isinstance(value, (dict, list)) or not value:
        return flat
    inner = indent + "  "
    if isinstance(value, dict):
        rows = []
        for key, item in value.items():
            name = f"{json.dumps(key)}: "
            rows.append(inner + name + compact_json(item, inner, len(name), width))
        return "{\n" + ",\n".join(rows) + f"\n{indent}}}"
    rows = [inner + compact_json(item, inner, 0, width) for item in value]
    return "[\n" + ",\n".join(rows) + f"\n{indent}]"


def report_class(name: str) -> Any:
    """The class a public name (``slimtorch.prune.PruneReport``) is."""
    module, _, attribute = name.rpartition(".")
    return getattr(importlib.import_module(module), attribute)


def anchor(schema: str) -> str:
    """``slimtorch.memory.rank/1`` -> ``memory-rank-1``: the heading's id on the schemas page."""
    return re.sub(r"[^a-z0-9]+", "-", schema.removeprefix("slimtorch.").lower()).strip("-")


def _sibling(name: str) -> Any:
    path = Path(__file__).with_name(f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"_slimtorch_docs_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
