"""The import order of slimtorch's packages: each package imports only from the layers below it.

The layers are the user's journey on top of a format core (see docs/ARCHITECTURE.md). An import anywhere
in a module counts, at the top or inside a function: an import deferred into a function is still a
dependency, and a cycle hidden that way is still a cycle. The checker is tested on planted imports, so a
checker that stopped seeing them would fail here too.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "slimtorch"

LAYERS: list[set[str]] = [
    {"errors", "_version"},
    {"schemes"},  # the quantization schemes' table: no torch, read by quant and every command
    {"graph"},
    {"format"},
    {"sources"},
    {"inspection", "memory", "data"},
    {"models", "calibration"},  # calibration: what layers see of sample inputs, block by block
    {"prune", "quant"},
    {"recovery", "shrinking", "loading"},
    {"deploy"},
    {"slimming"},  # slimtorch slim: every step above, chained toward a goal, and its report
    {"cli"},
    {"__main__"},  # python -m slimtorch: the command line, run as a module
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
    """Every ``slimtorch`` module that ``source`` imports, with the line, from any depth of the tree
    (``from pkg import name`` gives ``pkg.name``, which is the module when ``name`` is one)."""
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
                found += [(f"{target}.{alias.name}", node.lineno) for alias in node.names]
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


def import_graph(src: Path) -> dict[str, set[str]]:
    """Module -> the slimtorch modules it imports (an imported name resolves to the longest module prefix)."""
    paths = {module_name(path, src): path for path in src.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in paths}
    for name, path in paths.items():
        for target, _ in imported_modules(path.read_text(), name, path.name == "__init__.py"):
            parts = target.split(".")
            while parts and ".".join(parts) not in paths:
                parts.pop()
            if len(parts) > 1 and ".".join(parts) != name:
                graph[name].add(".".join(parts))
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles: strongly connected groups of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in sorted(graph[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            group = []
            while not group or group[-1] != node:
                group.append(stack.pop())
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


@pytest.mark.slow
def test_every_import_goes_down() -> None:
    assert violations(SRC) == []


def test_no_modules_import_each_other_in_a_circle() -> None:
    """Inside a package too: a cycle (codecs' chain and entropy once) means neither can be read alone."""
    assert cycles(import_graph(SRC)) == []


def test_every_package_has_a_layer() -> None:
    packages = {p.name for p in SRC.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    modules = {p.stem for p in SRC.glob("*.py")} - {"__init__"}
    assert packages | modules <= set(RANK)


def test_no_loose_modules() -> None:
    """Beside the API and its errors, one table every layer reads: the quantization schemes."""
    allowed = {"__init__.py", "__main__.py", "errors.py", "_version.py", "schemes.py"}
    assert {p.name for p in SRC.glob("*.py")} <= allowed


def _planted(tmp_path: Path, package: str, module: str, text: str) -> Path:
    """A copy of the package's tree with one file written into it."""
    tree = tmp_path / "slimtorch"
    for path in SRC.rglob("*.py"):
        copy = tree / path.relative_to(SRC)
        copy.parent.mkdir(parents=True, exist_ok=True)
        copy.write_text(path.read_text())
    (tree / package / module).write_text(text)
    return tree


@pytest.mark.slow
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


@pytest.mark.slow
def test_a_planted_loose_module_has_no_layer(tmp_path: Path) -> None:
    tree = _planted(tmp_path, "format", "ok.py", "")
    (tree / "helpers").mkdir()
    (tree / "helpers" / "__init__.py").write_text("")
    assert violations(tree) == ["helpers/__init__.py: 'helpers' is in no layer (add it to LAYERS)"]


@pytest.mark.slow
def test_a_planted_cycle_inside_a_package_is_caught(tmp_path: Path) -> None:
    tree = _planted(tmp_path, "format", "ping.py", "def late():\n    from slimtorch.format import pong\n")
    (tree / "format" / "pong.py").write_text("from slimtorch.format.ping import late\n")
    assert cycles(import_graph(tree)) == [["slimtorch.format.ping", "slimtorch.format.pong"]]


def reader_classes_named_outside_sources(src: Path) -> list[str]:
    """Modules outside ``sources/`` that name a reader's class: they should ask the reader protocol
    (``TensorSource.coded``, ``ties()``, ``delta()``, ``stages()`` ...) instead of testing for a format."""
    found = []
    for path in sorted(src.rglob("*.py")):
        if path.relative_to(src).parts[0] == "sources":
            continue
        nodes = list(ast.walk(ast.parse(path.read_text())))
        names = {n.id for n in nodes if isinstance(n, ast.Name)}
        imported = (n for n in nodes if isinstance(n, ast.ImportFrom))
        names |= {alias.asname or alias.name for n in imported for alias in n.names}
        if "SlimSource" in names:
            found.append(str(path.relative_to(src)))
    return found


@pytest.mark.slow
def test_only_the_readers_know_their_own_classes(tmp_path: Path) -> None:
    assert reader_classes_named_outside_sources(SRC) == []
    tree = _planted(tmp_path, "loading", "planted.py", "def f(s):\n    return isinstance(s, SlimSource)\n")
    assert reader_classes_named_outside_sources(tree) == ["loading/planted.py"]


ROOT = SRC.parents[1]
TEST_MODULE_IMPORT = re.compile(
    r"\b(?:from|import)\s+tests\.test_\w+|\bfrom\s+tests\s+import\s+test_\w+"
    r"|\btests\.test_\w+:\w"  # a spec the command line imports as a user's module (MODULE:NAME)
)


def imports_of_test_modules(root: Path) -> list[str]:
    """``file: line`` of each import of a ``tests.test_*`` module under ``tests/`` and ``benchmarks/`` of
    ``root``, in code, in the text of a script run in a fresh process, or as a spec a command imports."""
    found = []
    for folder in ("tests", "benchmarks"):
        for path in sorted((root / folder).rglob("*.py")):
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if TEST_MODULE_IMPORT.search(line):
                    found.append(f"{path.relative_to(root)}:{number}")
    return found


def test_no_test_or_benchmark_imports_a_test_module() -> None:
    """What more than one file uses lives in ``tests/support/``: a test module is imported by pytest alone
    (importing one runs its module-level code and ties two test files together)."""
    assert imports_of_test_modules(ROOT) == []


def test_a_planted_import_of_a_test_module_is_caught(tmp_path: Path) -> None:
    for folder, text in [
        ("tests", "from tests." + "test_memory import Blocks\n"),  # split: this file is scanned too
        ("benchmarks", 'SCRIPT = "import tests.' + 'test_quantize"\n'),
        ("tests", "from tests import " + "test_hostile_inputs\n"),
        ("tests", 'main(["quantize", "tests.' + 'test_cli_inputs:linear"])\n'),
    ]:
        (tmp_path / folder).mkdir(exist_ok=True)
        (tmp_path / folder / "planted.py").write_text(text)
        assert imports_of_test_modules(tmp_path) == [f"{folder}/planted.py:1"]
        (tmp_path / folder / "planted.py").unlink()
    fine = 'from tests.support.models import Blocks\nSPEC = "tests.support.specs:Hinted"\n'
    (tmp_path / "tests" / "fine.py").write_text(fine)
    assert imports_of_test_modules(tmp_path) == []


IMPORT_PATH_EDIT = re.compile(
    r"\bsys\s*\.\s*path\b|\bfrom\s+sys\s+import\b.*\bpath\b|\baddsitedir\b|\bPYTHONPATH\b"
)


def import_path_edits(root: Path) -> list[str]:
    """``file: line`` of each place a file under ``benchmarks/`` of ``root`` reaches for the import path, in
    code or in the text of a script run in a fresh process: ``sys.path`` (``sys`` imported under another
    name too), ``from sys import path``, ``site.addsitedir``, ``PYTHONPATH``. A benchmark runs as ``python -m
    benchmarks.NAME`` from the repository's root, where ``benchmarks``, ``tests`` and ``examples`` import as
    they are, and slimtorch is installed."""
    found = []
    for path in sorted((root / "benchmarks").rglob("*.py")):
        text = path.read_text()
        lines = {number for number, line in enumerate(text.splitlines(), 1) if IMPORT_PATH_EDIT.search(line)}
        nodes = list(ast.walk(ast.parse(text)))
        names = {a.asname for n in nodes if isinstance(n, ast.Import) for a in n.names if a.name == "sys"}
        names = {name or "sys" for name in names}  # import sys as system: system.path
        lines |= {
            node.lineno
            for node in nodes
            if isinstance(node, ast.Attribute) and node.attr == "path"
            if isinstance(node.value, ast.Name) and node.value.id in names
        }
        found += [f"{path.relative_to(root)}:{number}" for number in sorted(lines)]
    return found


def test_no_benchmark_edits_the_import_path() -> None:
    assert import_path_edits(ROOT) == []


def test_a_planted_import_path_edit_in_a_benchmark_is_caught(tmp_path: Path) -> None:
    (tmp_path / "benchmarks").mkdir()
    planted = tmp_path / "benchmarks" / "planted.py"
    for text in [
        "import sys\nsys.path.insert(0, str(ROOT))\n",
        "import sys\n\nsys.path[:0] = ['src']\n",
        'SCRIPT = """import sys; sys.path.append({src!r})"""\n',  # a script for a fresh process
        "import os\nos.environ['PYTHON" + "PATH'] = '.'\n",
        "import site\nsite.addsitedir('src')\n",
    ]:
        planted.write_text(text)
        assert import_path_edits(tmp_path) == [f"benchmarks/planted.py:{len(text.splitlines())}"], text
    planted.write_text("import sys as system\n\nsystem.path.append('src')\n")
    assert import_path_edits(tmp_path) == ["benchmarks/planted.py:3"]
    planted.write_text("from sys import path\n")
    assert import_path_edits(tmp_path) == ["benchmarks/planted.py:1"]
    planted.write_text("import sys\nfrom pathlib import Path\n\nsys.exit(Path('x').exists())\n")
    assert import_path_edits(tmp_path) == []
