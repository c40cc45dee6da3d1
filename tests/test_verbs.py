"""The one shape of every verb: options resolved from a dataclass plus overrides, reports with a schema."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest

from slimtorch.errors import OptionError
from slimtorch.format.verbs import NOT_JSON, Report, resolve


@dataclass(frozen=True)
class _Options:
    ratio: float = 0.5
    skip: tuple[str, ...] = ()


@dataclass
class _Part:
    name: str
    bytes: int


@dataclass
class _Report(Report):
    SCHEMA = "slimtorch.demo/1"
    DERIVED = {"half": {"type": "number"}}  # noqa: RUF012

    ratio: float
    parts: list[_Part]
    where: Path | None = None
    kept: set[str] = field(default_factory=set)
    model: object = field(default=None, metadata=NOT_JSON)

    @property
    def half(self) -> float:
        return self.ratio / 2


def test_overrides_replace_fields_and_an_unknown_one_names_the_fields_there_are() -> None:
    assert resolve(_Options, None, {}, "demo") == _Options()
    assert resolve(_Options, _Options(skip=("fc",)), {"ratio": 0.2}, "demo") == _Options(0.2, ("fc",))
    with pytest.raises(OptionError, match="unknown option 'ration'; _Options has: ratio, skip"):
        resolve(_Options, None, {"ration": 0.2}, "demo")
    with pytest.raises(OptionError, match="options must be a _Options, not str"):
        resolve(_Options, "fast", {}, "demo")  # type: ignore[arg-type]


def test_a_report_is_json_without_its_results_and_its_schema_lists_exactly_what_to_dict_gives() -> None:
    report = _Report(0.5, [_Part("fc", 8)], Path("/tmp/x"), {"b", "a"}, model=object())
    data = report.to_dict()
    assert data == {
        "schema": "slimtorch.demo/1",
        "ratio": 0.5,
        "parts": [{"name": "fc", "bytes": 8}],
        "where": "/tmp/x",
        "kept": ["a", "b"],
        "half": 0.25,
    }
    schema = _Report.json_schema()
    assert schema["title"] == "slimtorch.demo/1" and set(schema["properties"]) == set(data)
    assert schema["properties"]["parts"]["items"]["properties"]["bytes"] == {"type": "integer"}
    assert schema["properties"]["where"] == {"anyOf": [{"type": "string"}, {"type": "null"}]}
