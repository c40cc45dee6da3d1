"""The import order of slimtorch's packages: each package imports only from the layers below it.

The layers are the user's journey on top of a format core (see docs/ARCHITECTURE.md). An import anywhere
in a module counts, at the top or inside a function: an import deferred into a function is still a
dependency, and a cycle hidden that way is still a cycle. The checker is tested on planted imports, so a
checker that stopped seeing them would fail here too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import slimtorch

SRC = Path(slimtorch.__file__).parent

LAYERS: list[set[str]] = [
    {"errors", "_version"},
    {"graph"},
    {"format"},
    {"sources"},
    {"inspection", "memory"},
    {"models"},
    {"prune", "quant"},
    {"recovery", "shrinking", "loading"},
    {"deploy"},
    {"cli"},
]
"""Lowest first. A package may import its own modules and any package of a lower layer, never one of
its own layer or above. ``slimtorch/__init__.py`` (the public API, re-exporting every step) sits on top."""

RANK = {package: rank for rank, layer in enumerate(LAYERS) for package in layer}


def package_of(module: str) -> str | None:
    """``slimtorch.format.codecs.chain`` -> ``format``; None for ``slimtorch`` itself."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "slimtorch" else None


def module_name(path: Path, src: Path) -> str:
    parts = list(path.relative_to(src.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(source: str, module: str, is_package: bool) -> list[tuple[str, int]]:
    """Every ``slimtorch`` module that ``source`` imports, with the line, from any depth of the tree."""
    here = module.split(".") if is_package else module.split(".")[:-1]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target == "slimtorch":  # from slimtorch import deploy: a step's package, or the public API
                found += [
                    (f"slimtorch.{alias.name}" if alias.name in RANK else target, node.lineno)
                    for alias in node.names
                ]
            else:
                found.append((target, node.lineno))
    return [(name, line) for name, line in found if name == "slimtorch" or name.startswith("slimtorch.")]


def violations(src: Path) -> list[str]:
    """One line per import that goes sideways or up, or from a package into ``slimtorch`` itself."""
    found = []
    for path in sorted(src.rglob("*.py")):
        module = module_name(path, src)
        package = package_of(module)
        if package is None:
            continue  # slimtorch/__init__.py: the public API may import every step
        if package not in RANK:
            found.append(f"{path.relative_to(src)}: {package!r} is in no layer (add it to LAYERS)")
            continue
        for target, line in imported_modules(path.read_text(), module, path.name == "__init__.py"):
            other = package_of(target)
            where = f"{path.relative_to(src)}:{line} imports {target}"
            if other is None:
                found.append(f"{where}: import the step's own package, not slimtorch")
            elif other != package and RANK.get(other, len(LAYERS)) >= RANK[package]:
                found.append(f"{where}: {other} is not below {package}")
    return found


def test_every_import_goes_down() -> None:
    assert violations(SRC) == []


def test_every_package_has_a_layer() -> None:
    packages = {p.name for p in SRC.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    modules = {p.stem for p in SRC.glob("*.py")} - {"__init__"}
    assert packages | modules <= set(RANK)


def test_no_loose_modules() -> None:
    assert {p.name for p in SRC.glob("*.py")} <= {"__init__.py", "errors.py", "_version.py"}


def _planted(tmp_path: Path, package: str, module: str, text: str) -> Path:
    """A copy of the package's tree with one file written into it."""
    tree = tmp_path / "slimtorch"
    for path in SRC.rglob("*.py"):
        copy = tree / path.relative_to(SRC)
        copy.parent.mkdir(parents=True, exist_ok=True)
        copy.write_text(path.read_text())
    (tree / package / module).write_text(text)
    return tree


@pytest.mark.parametrize(
    ("package", "text", "complaint"),
    [
        ("format", "from slimtorch.loading import load_model\n", "loading is not below format"),
        ("sources", "def late():\n    from slimtorch.cli import main\n", "cli is not below sources"),
        ("prune", "import slimtorch.quant.modules\n", "quant is not below prune"),
        ("graph", "from ..format.codecs import encode\n", "format is not below graph"),
        ("deploy", "from slimtorch import __version__\n", "import the step's own package"),
    ],
)
def test_a_planted_upward_import_is_caught(tmp_path: Path, package: str, text: str, complaint: str) -> None:
    tree = _planted(tmp_path, package, "planted.py", text)
    found = violations(tree)
    assert len(found) == 1 and complaint in found[0] and "planted.py" in found[0]


def test_a_planted_loose_module_has_no_layer(tmp_path: Path) -> None:
    tree = _planted(tmp_path, "format", "ok.py", "")
    (tree / "helpers").mkdir()
    (tree / "helpers" / "__init__.py").write_text("")
    assert violations(tree) == ["helpers/__init__.py: 'helpers' is in no layer (add it to LAYERS)"]
