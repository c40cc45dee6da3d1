"""Hostile names and text for the terminal: the cases of tests/test_hostile_terminal.py and
benchmarks.hostile."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from safetensors.torch import save_file

from slimtorch.cli.untrusted_text import printable
from tests.hostile import Case, Invocation, strict, write_safetensors_raw

FAMILY = "terminal"


OSC52 = "\x1b]52;c;ZWNobyBoaQ==\x07"  # writes "echo hi" to the clipboard


CLEAR = "\x1b[2J"


TITLE = "\x1b]0;pwned\x07"


C1_CSI = "\x9b31m"


BIDI = "\u202e"


LINK = "[link=file:///etc/passwd]click[/link]"


STYLE = "[bold red]x[/]"


HOSTILE = (OSC52, CLEAR, TITLE, C1_CSI, BIDI, LINK, STYLE)


# The same in a file name, which holds no "/": opening tags only (rich applies them to the rest).
IN_PATH = f"{OSC52}{CLEAR}{TITLE}{C1_CSI}{BIDI}[link=mailto:pwned@example.com]click[bold red]x"


BIDI_CONTROLS = [chr(c) for c in (*range(0x202A, 0x202F), *range(0x2066, 0x206A))]


# -- the corpus ---------------------------------------------------------------------------------------------
def _problem(output: str, shown: tuple[str, ...]) -> str | None:
    """What a terminal would obey in ``output``, or text of ``shown`` it does not show as it is (markup read,
    an escape missing); None when all is data. A long line may be folded: whitespace is not compared."""
    squeezed = "".join(output.split())
    found = [
        what
        for what, bad in (
            ("an OSC 8 hyperlink", "\x1b]8;" in output),
            ("ESC", "\x1b" in output),
            ("BEL", "\x07" in output),
            ("a C1 CSI", "\x9b" in output),
            ("a bidi control", any(c in output for c in BIDI_CONTROLS)),
        )
        if bad
    ]
    found += [f"not shown as it is: {text!r}" for text in shown if "".join(text.split()) not in squeezed]
    return "; ".join(found) or None


def _shown_as_data(*shown: str) -> Callable[[str, str], str | None]:
    """The check of a case: nothing on stdout or stderr a terminal would obey, and ``shown`` shown."""
    return lambda stdout, stderr: _problem(stdout + stderr, shown)


def _names(prefix: str) -> list[str]:
    """One tensor name per hostile string; the tables must show each whole, escaped."""
    return [f"{prefix}{i}{text}.weight" for i, text in enumerate(HOSTILE)]


def _names_and_metadata(path: Path) -> Path:
    """A safetensors file whose tensor names and metadata keys and values hold every hostile string."""
    metadata = {f"note{i}{text}": f"value{text}" for i, text in enumerate(HOSTILE)}
    save_file(
        {name: torch.randn(8, 8) for name in _names("layer")}, path, metadata={"format": "pt", **metadata}
    )
    return path


def _torch_objects(path: Path) -> Path:
    """A torch.save checkpoint: hostile tensor names, and hostile strings as plain-data objects."""
    state = {name: torch.randn(4, 4) for name in _names("block")}
    torch.save({"model": state, "config": {f"key{text}": f"value{text}" for text in HOSTILE}}, path)
    return path


def _bad_offsets(path: Path) -> Path:
    """A hostile name whose tensor claims more bytes than the file holds: the error quotes the name."""
    name = "".join(HOSTILE) + ".weight"
    header = {name: {"dtype": "F32", "shape": [64], "data_offsets": [0, 256]}}
    return write_safetensors_raw(path, header, bytes(16))


COMMANDS = {
    "inspect": lambda path, folder: ["inspect", str(path)],
    "shrink": lambda path, folder: ["shrink", str(path), "-o", str(folder / "out.safetensors")],
    "load": lambda path, folder: ["load", str(path)],
}


SHOWS_NAMES = ("inspect", "shrink")  # load without --model shows the path and counts


def _cases(name: str, expect: str, build: Callable[[Path], Path], names: Sequence[str] = ()) -> list[Case]:
    """One case per command over the file ``build(folder / hostile file name)`` writes: every command
    shows the path (an error line too), inspect and shrink the tensor ``names`` as well."""

    def invocation(folder: Path, command: str) -> Invocation:
        path = build(folder / f"m{IN_PATH}")
        shown = [IN_PATH, *(names if command in SHOWS_NAMES else ())]
        return Invocation(COMMANDS[command](path, folder), check=_shown_as_data(*map(printable, shown)))

    return [
        Case(f"{FAMILY}/{name}/{command}", FAMILY, expect, lambda folder, c=command: invocation(folder, c))
        for command in COMMANDS
    ]


MODEL = """\
import torch

class Net(torch.nn.Module):
    example_input_shape = (2, 8)

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 4)

    def forward(self, x):
        return self.fc(x)
"""


def _dollar_model(folder: Path, name: str = "price $_$ model") -> Invocation:
    """``memory --chart`` titles the chart with the model's path, here one mathtext cannot parse."""
    model = folder / name / "net.py"
    model.parent.mkdir()
    model.write_text(MODEL)
    chart = folder / "memory.png"

    def check(stdout: str, stderr: str) -> str | None:
        return None if chart.is_file() and chart.stat().st_size else "no chart was written"

    argv = ["memory", f"{model}:Net", "--input-shape", "2,8", "--chart", str(chart)]
    return Invocation(argv, check=check)


def corpus() -> list[Case]:
    return [
        *_cases(
            "names-and-metadata",
            "accept",
            lambda stem: _names_and_metadata(Path(f"{stem}.safetensors")),
            _names("layer"),
        ),
        *_cases(
            "torch-names-and-objects",
            "accept",
            lambda stem: _torch_objects(Path(f"{stem}.pt")),
            _names("block"),
        ),
        *_cases("error-quoting-a-name", "refuse", lambda stem: _bad_offsets(Path(f"{stem}.safetensors"))),
        *_cases("missing-path", "refuse", lambda stem: Path(f"{stem}.safetensors")),
        Case(f"{FAMILY}/dollar-in-model-path/memory-chart", FAMILY, "accept", _dollar_model),
    ]


def _plain_model(folder: Path) -> Invocation:
    """The same ``memory --chart`` on a plain path: the command's own start (matplotlib, a drawn chart:
    about 30 MiB), which the ``$`` case is held to."""
    return _dollar_model(folder, "plain model")


CASES = strict(corpus()[:-1]) + strict(corpus()[-1:], start=_plain_model)
