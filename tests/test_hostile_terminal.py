"""Issue 44, terminals: whatever a file holds reaches the terminal as data. Control characters (escape
sequences, C1 controls, bidi overrides) are shown as visible escapes, rich markup as the characters it is,
and a ``$`` in a chart's text is a dollar sign, not the start of matplotlib's mathtext.

Two layers: the helper every command prints through (:mod:`slimtorch.cli.untrusted_text`), then a corpus
of hostile files run through the CLI the way ``tests/test_hostile_corpus.py`` runs its own (forked
children, the same verdicts), each with a check that no escape sequence and no live markup came out.
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch
from rich.console import Console
from safetensors.torch import save_file

from slimtorch.cli.untrusted_text import as_text, in_markup, printable
from tests.hostile import Case, Invocation, selected_outcomes, strict, write_safetensors_raw

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


# -- the helper ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("raw", "shown"),
    [
        ("\x1b[2J", "\\x1b[2J"),  # C0: ESC
        ("\x07\x00\x08\x0b\x0c\x1f", "\\x07\\x00\\x08\\x0b\\x0c\\x1f"),
        ("a\nb\rc\td", "a\\nb\\rc\\td"),  # even these: a name stays on its line
        ("\x7f", "\\x7f"),  # DEL
        ("\x80\x9b\x9d\x9f", "\\x80\\x9b\\x9d\\x9f"),  # C1: \x9b is a CSI, \x9d an OSC
        ("\u202a\u202e\u2066\u2069", "\\u202a\\u202e\\u2066\\u2069"),  # bidi embeddings, overrides, isolates
        ("\u200e\u200f\u061c", "\\u200e\\u200f\\u061c"),  # bidi marks
        ("\u2028\u2029", "\\u2028\\u2029"),  # line and paragraph separators
    ],
)
def test_each_control_character_class_is_shown_as_a_visible_escape(raw: str, shown: str) -> None:
    assert printable(f"name{raw}.weight") == f"name{shown}.weight"
    assert as_text(raw).plain == shown


@pytest.mark.parametrize(
    "name",
    ["fc1.weight", "encoder.layer.0.attention.self.query.bias", "模型.权重", "C:\\models\\a.pt", "é ü ß"],
)
def test_an_ordinary_name_is_unchanged(name: str) -> None:
    assert printable(name) == name
    assert as_text(name).plain == name
    assert in_markup(name) == name


def _rendered(renderable: object, *, terminal: bool = True) -> str:
    """What a console writes for ``renderable``: on a terminal (links and styles live) by default."""
    out = io.StringIO()
    colours = "truecolor" if terminal else None
    console = Console(file=out, force_terminal=terminal, color_system=colours, width=200, highlight=False)
    console.print(renderable)
    return out.getvalue()


@pytest.mark.parametrize("markup", [LINK, STYLE, "[/]", "[on red]", "[blink]x[/blink]", "trailing\\"])
def test_rich_markup_is_shown_as_the_characters_it_is(markup: str) -> None:
    for shown in (as_text(markup), f"[bold]{in_markup(markup)}[/]", f"{in_markup(markup)}[dim]!"):
        out = _rendered(shown, terminal=False)
        assert out.rstrip("\n").removesuffix("!") == markup, (shown, out)
    assert "\x1b]8;" not in _rendered(as_text(LINK)) and "\x1b]8;" not in _rendered(in_markup(LINK))


def test_markup_would_make_a_live_link_without_the_helper() -> None:
    """The control: rich given the raw name does make the OSC 8 hyperlink the helper prevents."""
    assert "\x1b]8;" in _rendered(LINK)


def test_a_terminal_console_writes_no_control_character_from_the_string() -> None:
    hostile = "".join(HOSTILE)
    for shown in (as_text(hostile), in_markup(hostile)):
        out = _rendered(shown)
        assert OSC52 not in out and TITLE not in out and CLEAR not in out
        assert "\x9b" not in out and "\x07" not in out and not any(c in out for c in BIDI_CONTROLS)
        assert "\\x1b]52;c;ZWNobyBoaQ==\\x07" in out and LINK in out


def test_a_dollar_in_a_slim_report_chart_is_drawn_as_text(tmp_path: Path) -> None:
    """Layer names and the data's path are drawn on the charts: mathtext would fail on ``$_$``."""
    pytest.importorskip("matplotlib")
    from slimtorch.slimming.charts import CHARTS, draw, unmeasured

    report = json.loads((Path(__file__).parent / "fixtures" / "slim_report.json").read_text())
    report["data"] = "data/$_$ price.npz"
    report["layers"][0]["name"] = "features$\\frac$.0"
    drawable = [chart for chart in CHARTS if unmeasured(report, chart) is None]
    assert {"layers", "metric"} <= {chart.name for chart in drawable}
    for chart in drawable:
        assert draw(report, chart, tmp_path / f"{chart.name}.png").stat().st_size > 0


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


@pytest.fixture(scope="module")
def outcomes(request, tmp_path_factory) -> dict:
    """Every selected case run once, before the first test reads (:func:`tests.hostile.selected_outcomes`)."""
    return selected_outcomes(request, tmp_path_factory, CASES)


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_hostile_text_reaches_the_terminal_as_data(outcomes, case):
    outcome = outcomes[case.id]
    assert outcome.passed, outcome.describe()


def test_the_check_sees_what_a_terminal_would_obey():
    """The control: a check that passes everything would pass the corpus."""
    for raw in (OSC52, CLEAR, TITLE, C1_CSI, BIDI, "\x1b]8;;file:///etc/passwd\x1b\\click\x1b]8;;\x1b\\"):
        assert _problem(f"name{raw} {LINK}", (LINK,))
    assert _problem("click", (LINK,))  # the link markup was read, not shown
    shown = tuple(printable(text) for text in HOSTILE)
    assert _problem(f"name\n{printable(''.join(HOSTILE))}\n", shown) is None
