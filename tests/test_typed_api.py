"""A user's type checker sees our annotations: ``mypy --strict`` on a script that calls the public API.

Without ``py.typed`` mypy refuses to read an installed package and types every call into it as ``Any``;
with it, a report is a report, and a wrong call fails before it runs. mypy reads slimtorch as the venv
installed it (in editable mode, this tree's ``src``), as it would in a user's project.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.slow  # every test shares one mypy run over user scripts (20 s)

pytest.importorskip("mypy", reason="mypy comes with slimtorch[dev]")

USER_SCRIPT = """
    import torch

    import slimtorch
    import slimtorch.memory
    from slimtorch.prune import channels

    def small() -> torch.nn.Module:
        return torch.nn.Linear(4, 4)

    x = torch.randn(2, 4)

    reveal_type(slimtorch.inspect("model.pt"))  # -> slimtorch.inspection.breakdown.InspectReport
    reveal_type(slimtorch.open("model.pt"))  # -> slimtorch.format.source.TensorSource
    reveal_type(slimtorch.load_model("model.safetensors", small))  # -> slimtorch.loading.options.LoadReport
    reveal_type(slimtorch.quantize(small(), "int8-dynamic"))  # -> slimtorch.quant.convert.QuantizeReport
    reveal_type(slimtorch.memory.estimate(small(), x))  # -> slimtorch.memory.estimating.MemoryReport
    reveal_type(channels(small(), x, ratio=0.5))  # -> slimtorch.prune.structured.PruneReport
    size: int = slimtorch.quantize(small()).after_bytes
    wrong: int = slimtorch.inspect("model.pt")  # error: assignment (a report is not an int)
    slimtorch.quantize(small(), 8)  # error: arg-type (an int is not options)
    slimtorch.load_model("model.safetensors", small, progress=True)  # error: arg-type (True draws nothing)
"""


def _expected(marker: str) -> dict[int, str]:
    """Line number -> what follows ``marker`` in that line's comment: what mypy must say there."""
    lines = textwrap.dedent(USER_SCRIPT).lstrip().splitlines()
    return {n: line.partition(marker)[2].strip() for n, line in enumerate(lines, 1) if marker in line}


REVEALED = _expected("# -> ")
WRONG = {line: said.split()[0] for line, said in _expected("# error: ").items()}  # the error code


@pytest.fixture(scope="module")
def mypy_says(tmp_path_factory: pytest.TempPathFactory) -> dict[int, list[str]]:
    """mypy's lines about the user's script, by line number."""
    folder = tmp_path_factory.mktemp("user")
    (folder / "script.py").write_text(textwrap.dedent(USER_SCRIPT).lstrip())
    command = [sys.executable, "-m", "mypy", "--strict", "--no-incremental", "--no-color-output", "script.py"]
    done = subprocess.run(command, capture_output=True, text=True, cwd=folder, timeout=600)
    said: dict[int, list[str]] = {}
    for line in done.stdout.splitlines():
        found = re.match(r"script\.py:(\d+): (.*)", line)
        if found:
            said.setdefault(int(found[1]), []).append(found[2])
    assert said, done.stdout + done.stderr
    return said


def test_mypy_reads_slimtorch_instead_of_calling_it_untyped(mypy_says: dict[int, list[str]]) -> None:
    everything = "\n".join(line for lines in mypy_says.values() for line in lines)
    assert "import-untyped" not in everything and "py.typed" not in everything


def test_each_verb_returns_its_report_class_to_the_type_checker(mypy_says: dict[int, list[str]]) -> None:
    for line, wanted in REVEALED.items():
        assert mypy_says.get(line) == [f'note: Revealed type is "{wanted}"'], (line, mypy_says.get(line))


def test_a_wrongly_typed_call_fails_the_check_and_a_right_one_passes(mypy_says: dict[int, list[str]]) -> None:
    for line, code in WRONG.items():
        assert any(said.startswith("error:") and f"[{code}]" in said for said in mypy_says.get(line, [])), (
            line,
            mypy_says.get(line),
        )
    errors = {line for line, lines in mypy_says.items() if any(s.startswith("error:") for s in lines)}
    assert errors == set(WRONG), {line: mypy_says[line] for line in errors - set(WRONG)}
