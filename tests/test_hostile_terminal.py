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
from pathlib import Path

import pytest
from rich.console import Console

from slimtorch.cli.untrusted_text import as_text, in_markup, printable
from tests.hostile import selected_outcomes
from tests.support.hostile_terminal import (
    BIDI,
    BIDI_CONTROLS,
    C1_CSI,
    CASES,
    CLEAR,
    HOSTILE,
    LINK,
    OSC52,
    STYLE,
    TITLE,
    _problem,
)


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


@pytest.mark.slow
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


@pytest.fixture(scope="module")
def outcomes(request, tmp_path_factory) -> dict:
    """Every selected case run once, before the first test reads (:func:`tests.hostile.selected_outcomes`)."""
    return selected_outcomes(request, tmp_path_factory, CASES)


@pytest.mark.slow
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
