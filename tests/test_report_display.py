"""Reports in notebooks (issue 48): every report shows itself as a table of its ``to_dict()``, as HTML in
Jupyter (``_repr_html_``) and through rich's console (``__rich__``). Names in a report come from files,
so the table escapes them: HTML as text, never markup; control characters as visible escapes."""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from typing import ClassVar

import pytest
import torch
from rich.console import Console

import slimtorch
from slimtorch.format.units import format_bytes
from slimtorch.format.verbs import NOT_JSON, SHOWN_CHARS, SHOWN_ITEMS, Report

HOSTILE = "<script>alert(1)</script>"


@dataclass(frozen=True)
class Demo(Report):
    SCHEMA: ClassVar[str] = "slimtorch.demo/1"

    name: str
    names: list[str]
    sizes: dict[str, int]
    model_bytes: int
    small_bytes: int
    ratio: float
    empty: list[str] = field(default_factory=list)
    model: object = field(default=None, metadata=NOT_JSON)


def demo(**changes) -> Demo:
    values = {
        "name": "fc1.weight",
        "names": [f"layer{i}.weight" for i in range(1000)],
        "sizes": {"fc1.weight": 4096, "fc2.weight": 1024},
        "model_bytes": 3 * 2**20,
        "small_bytes": 184,
        "ratio": 0.25,
        "model": object(),
    }
    return Demo(**{**values, **changes})


def rich_text(report: Report) -> str:
    console = Console(record=True, width=100, file=io.StringIO())
    console.print(report)
    return console.export_text()


def cells(report: Report) -> dict[str, str]:
    return dict(report._display_rows())


# -- a real report ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def inspected(tmp_path_factory) -> Report:
    path = tmp_path_factory.mktemp("display") / "model.pt"
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    torch.save(model.state_dict(), path)
    return slimtorch.inspect(path)


def test_a_real_report_renders_as_html_and_in_rich(inspected) -> None:
    data = inspected.to_dict()
    html = inspected._repr_html_()
    assert html.startswith('<table class="slimtorch-report">') and html.endswith("</table>")
    assert "<b>slimtorch.inspect/1</b>" in html
    for name in data.keys() - {"schema"}:
        assert f">{name}</th>" in html, name
    assert f"{data['file_bytes']:,} ({format_bytes(data['file_bytes'])})" in html  # over 1 KiB: both
    text = rich_text(inspected)
    assert "slimtorch.inspect/1" in text and "file_bytes" in text and "torch-zip" in text
    assert f"{len(data['tensors'])} items: " in text


# -- what the cells show ------------------------------------------------------------------------------------
def test_scalars_as_they_are_and_sizes_in_binary_units_too() -> None:
    shown = cells(demo())
    assert shown["name"] == "fc1.weight" and shown["ratio"] == "0.25"
    assert shown["model_bytes"] == "3,145,728 (3 MiB)"
    assert shown["small_bytes"] == "184 B"
    assert "schema" not in shown and "model" not in shown  # the title; a result, not a fact


def test_lists_and_mappings_are_their_length_and_first_items() -> None:
    shown = cells(demo())
    first = ", ".join(f"layer{i}.weight" for i in range(SHOWN_ITEMS))
    assert shown["names"] == f"1,000 items: {first}, ..."
    assert shown["sizes"] == "2 entries: fc1.weight: 4096, fc2.weight: 1024"
    assert shown["empty"] == "0 items"
    nested = cells(demo(names=[{"deep": list(range(500))}]))["names"]
    assert nested.startswith('1 item: {"deep": [0, 1, 2,') and nested.endswith("...")


def test_a_long_value_is_cut() -> None:
    shown = cells(demo(name="x" * 10_000))["name"]
    assert len(shown) == SHOWN_CHARS and shown.endswith("...")
    assert len(cells(demo(name="x" * SHOWN_CHARS))["name"]) == SHOWN_CHARS  # at the limit: whole


# -- names from files ---------------------------------------------------------------------------------------
def test_a_hostile_name_is_escaped_in_the_html() -> None:
    # in a value, a list's item and a mapping's key; the model is a result, not shown
    report = demo(name=HOSTILE, names=[HOSTILE, 'a"b'], sizes={HOSTILE: 1}, model=HOSTILE)
    html = report._repr_html_()
    assert "<script>" not in html and "alert(1)</script>" not in html
    assert html.count("&lt;script&gt;alert(1)&lt;/script&gt;") == 3
    assert "a&quot;b" in html


def test_control_characters_are_visible_escapes_in_html_and_rich() -> None:
    report = demo(name="fc\x1b[2J.weight", names=["a\u202eb", "c\nd", "e\x9bf"])
    for shown in (report._repr_html_(), rich_text(report)):
        assert "fc\\x1b[2J.weight" in shown and "a\\u202eb" in shown and "c\\nd" in shown
        assert "e\\x9bf" in shown
        assert not {"\x1b", "\u202e", "\x9b"} & set(shown)


def test_rich_shows_markup_in_a_name_as_the_characters_it_is() -> None:
    text = rich_text(demo(name="[bold red]x[/] [link=file:///etc/passwd]y[/link]"))
    assert "[bold red]x[/] [link=file:///etc/passwd]y[/link]" in text
    assert HOSTILE in rich_text(demo(name=HOSTILE))  # a terminal shows it as text: nothing to escape
