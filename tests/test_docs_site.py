"""The docs site's machinery, checked without building it (`make docs`, in `make check`, builds it with
--strict): mkdocs.yml's nav against the pages in docs/, the generated reference pages (the hooks in
scripts/docs_hooks.py) against the code, and the docstring clean-up (scripts/griffe_roles.py)."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import re
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
SRC = ROOT / "src"


def _script(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"_test_{name}", ROOT / "scripts" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@cache
def _config() -> dict[str, Any]:
    """mkdocs.yml, its tags (``!relative``) read as None: the test needs the plain keys."""

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_multi_constructor("!", lambda loader, suffix, node: None)
    return yaml.load((ROOT / "mkdocs.yml").read_text(), Loader)


def _nav_pages(nav: list[Any]) -> list[str]:
    pages = []
    for entry in nav:
        values = list(entry.values()) if isinstance(entry, dict) else [entry]
        for value in values:
            pages += _nav_pages(value) if isinstance(value, list) else [value]
    return pages


@cache
def _hooks() -> ModuleType:
    return _script("docs_hooks")


def test_every_page_is_in_the_nav_and_every_nav_entry_is_a_page() -> None:
    nav = _nav_pages(_config()["nav"])
    pages = sorted(path.relative_to(DOCS).as_posix() for path in DOCS.rglob("*.md"))
    assert len(nav) == len(set(nav)), "a page is in the nav twice"
    assert sorted(set(pages) - set(nav)) == [], "pages missing from mkdocs.yml's nav"
    assert sorted(set(nav) - set(pages)) == [], "nav entries without a page in docs/"


def test_the_site_url_is_the_one_the_command_line_prints() -> None:
    from slimtorch.cli.arguments import DOCS_URL

    assert _config()["site_url"] == DOCS_URL


def test_the_cli_reference_has_every_command_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    from slimtorch.cli.main import COMMANDS

    hooks = _hooks()
    assert hooks.CLI_MARKER in (DOCS / "reference" / "cli.md").read_text()
    monkeypatch.setenv("COLUMNS", "40")
    text = hooks.cli_help()
    names = [module.__name__.rpartition(".")[2].removesuffix("_cmd") for module in COMMANDS]
    headings = re.findall(r"^## `slimtorch ?(.*?)`", text, flags=re.M)
    assert headings == ["", *names]
    for name in names:
        assert f"usage: slimtorch {name} " in text
    monkeypatch.setenv("COLUMNS", "200")
    assert hooks.cli_help() == text, "the help is formatted at the hook's width, whatever the terminal's"
    assert text.count("\n\n```text\n") == len(names) + 1


def _report_modules() -> list[str]:
    """The modules of src/slimtorch that define a class deriving (at any depth) from ``Report``, found by
    reading the source, so a report in a new module is found without importing every module."""
    classes = []
    for path in sorted((SRC / "slimtorch").rglob("*.py")):
        module = ".".join(path.relative_to(SRC).with_suffix("").parts).removesuffix(".__init__")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = {ast.unparse(base).rpartition(".")[2] for base in node.bases}
                classes.append((module, node.name, bases))
    known, modules = {"Report"}, set()
    while True:
        new = [(module, name) for module, name, bases in classes if bases & known and name not in known]
        if not new:
            return sorted(modules)
        known.update(name for _, name in new)
        modules.update(module for module, _ in new)


def _all_subclasses(kind: type) -> list[type]:
    return [sub for direct in kind.__subclasses__() for sub in (direct, *_all_subclasses(direct))]


def test_every_report_has_its_schema_on_the_schemas_page() -> None:
    from slimtorch.format.verbs import Report

    hooks = _hooks()
    assert hooks.SCHEMAS_MARKER in (DOCS / "reference" / "json-schemas.md").read_text()
    for module in _report_modules():
        importlib.import_module(module)
    reports = {kind for kind in _all_subclasses(Report) if kind.__module__.startswith("slimtorch.")}
    listed = [hooks.report_class(name) for name in hooks.REPORTS]
    assert len(listed) == len(set(listed))
    missing = sorted(f"{kind.__module__}.{kind.__qualname__}" for kind in reports - set(listed))
    assert missing == [], "reports missing from REPORTS in scripts/docs_hooks.py"
    schemas = [kind.SCHEMA for kind in listed]
    assert len(schemas) == len(set(schemas)), "two reports share a SCHEMA name"
    text = hooks.json_schemas()
    assert re.findall(r"^## `(.*?)`", text, flags=re.M) == schemas
    assert text.count("```json\n") == len(listed)


def test_each_public_module_has_its_api_page() -> None:
    import slimtorch

    text = (DOCS / "reference" / "python.md").read_text()
    assert re.search(r"^::: slimtorch$", text, flags=re.M)
    modules = [name for name in slimtorch.__all__ if (SRC / "slimtorch" / name / "__init__.py").exists()]
    assert modules, "slimtorch.__all__ names its step packages"
    for name in [*modules, "quant"]:  # slimtorch.quantize is the function; its package is slimtorch.quant
        page = DOCS / "reference" / "python" / f"{name}.md"
        assert re.search(rf"^::: slimtorch\.{name}$", page.read_text(), flags=re.M), page


def test_the_api_reference_is_read_statically() -> None:
    options = _config()["plugins"][1]["mkdocstrings"]["handlers"]["python"]["options"]
    assert options["allow_inspection"] is False  # griffe reads the files; nothing (no torch) is imported


@pytest.mark.parametrize(
    ("rest", "markdown"),
    [
        (":func:`open`", "`open`"),
        (":class:`~slimtorch.errors.FormatError`", "`FormatError`"),
        (":meth:`Report.to_dict`, :mod:`slimtorch.prune`", "`Report.to_dict`, `slimtorch.prune`"),
        (":attr:`x` :exc:`~a.B` :data:`SCHEMA`", "`x` `B` `SCHEMA`"),
        (":py:func:`the loader <slimtorch.load>`", "`the loader`"),
        ("``--only-binary=:all:`` and ``x``", "`--only-binary=:all:` and `x`"),
        ("From Python::\n\n    import x\n\nThen.", "From Python:\n\n```text\nimport x\n```\n\nThen."),
        ("Example:\n    >>> 1\n    1", "Examples:\n    >>> 1\n    1"),
        (
            "Args:\n    a, b: shared\n        more.\n    c: own",
            "Args:\n    a: shared\n        more.\n    b: shared\n        more.\n    c: own",
        ),
    ],
)
def test_docstrings_read_as_markdown(rest: str, markdown: str) -> None:
    assert _script("griffe_roles").markdown(rest) == markdown
