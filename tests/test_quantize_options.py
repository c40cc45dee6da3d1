"""slimtorch.quantize in the one verb shape: QuantizeOptions (or keyword overrides, or the scheme alone) in,
a QuantizeReport holding the model out; a bad option fails when the options are made."""

from __future__ import annotations

import copy
import json

import pytest
import torch

import slimtorch
from slimtorch.cli.main import main
from slimtorch.format.progress import Recorder
from slimtorch.quant import QuantizeOptions, QuantizeReport
from tests.support.models import TokenMLP, token_ids


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    one, other = a.state_dict(), b.state_dict()
    return one.keys() == other.keys() and all(torch.equal(one[k], other[k]) for k in one)


@pytest.mark.slow
def test_options_by_dataclass_by_overrides_and_by_scheme_string_give_the_same_model() -> None:
    base = TokenMLP().eval()
    options = QuantizeOptions("int4-weight", group_size=64, skip=["head"], embeddings=False)
    by_options = slimtorch.quantize(copy.deepcopy(base), options)
    by_overrides = slimtorch.quantize(
        copy.deepcopy(base), scheme="int4-weight", group_size=64, skip=("head",), embeddings=False
    )
    by_scheme = slimtorch.quantize(
        copy.deepcopy(base), "int4-weight", group_size=64, skip=["head"], embeddings=False
    )
    mixed = slimtorch.quantize(
        copy.deepcopy(base),
        QuantizeOptions("int4-weight", group_size=32),
        group_size=64,
        skip=["head"],
        embeddings=False,
    )
    for report in (by_overrides, by_scheme, mixed):
        assert _same_weights(report.model, by_options.model)
        assert report == by_options  # every fact alike; the model is not compared
    assert (
        type(by_options.model.head) is torch.nn.Linear and type(by_options.model.embed) is torch.nn.Embedding
    )
    assert by_options.group_size == 64 and {layer.name for layer in by_options.layers} == {"up", "down"}


def test_an_unknown_override_is_an_option_error_naming_the_fields_and_changes_nothing() -> None:
    model = TokenMLP()
    with pytest.raises(slimtorch.OptionError) as caught:
        slimtorch.quantize(model, "int4-weight", gruop_size=64)
    message = str(caught.value)
    assert "quantize: unknown option 'gruop_size'" in message
    fields = "awq, embeddings, gptq, group_size, integer_zero, keep_sensitive, kernel, scheme, skip, "
    fields += "symmetric"
    assert f"QuantizeOptions has: {fields}" in message
    assert type(model.up) is torch.nn.Linear


def test_the_scheme_given_both_as_string_and_keyword_is_an_option_error() -> None:
    with pytest.raises(slimtorch.OptionError, match="scheme is given twice"):
        slimtorch.quantize(TokenMLP(), "int8-dynamic", scheme="int4-weight")
    with pytest.raises(slimtorch.OptionError, match="options must be a QuantizeOptions, not dict"):
        slimtorch.quantize(TokenMLP(), {"scheme": "int4-weight"})


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"scheme": "int4-weight", "group_size": 33}, "group size must be even, 32 to 256, not 33"),
        ({"scheme": "int8-dynamic", "group_size": 512}, "group size must be even, 32 to 256, not 512"),
        ({"scheme": "int3"}, "unknown scheme 'int3'"),
        ({"kernel": "int4pack"}, "kernel 'int4pack' does not compute int8-dynamic"),
        ({"skip": "head"}, "skip takes a list of patterns, not the string 'head'"),
    ],
)
def test_a_bad_option_fails_when_the_options_are_made(fields: dict, message: str) -> None:
    with pytest.raises(slimtorch.OptionError, match=message):
        QuantizeOptions(**fields)


def test_options_are_frozen_and_hold_skip_patterns_as_a_tuple() -> None:
    options = QuantizeOptions(skip=["head", "*.pooler.*"])
    assert options.skip == ("head", "*.pooler.*") and hash(options) == hash(
        QuantizeOptions(skip=options.skip)
    )
    with pytest.raises(AttributeError):
        options.scheme = "int4-weight"  # type: ignore[misc]


@pytest.mark.slow
def test_the_report_holds_the_model_changed_in_place_and_its_json_fits_its_schema() -> None:
    model = TokenMLP().eval()
    report = slimtorch.quantize(model, "int8-dynamic", calibration=[token_ids()])
    assert report.model is model and type(model.up).__name__ == "Int8DynamicLinear"
    data = report.to_dict()
    properties = QuantizeReport.json_schema()["properties"]
    assert "model" not in data and "model" not in properties and "model=" not in repr(report)
    assert set(data) <= set(properties) and set(QuantizeReport.json_schema()["required"]) <= set(data)
    assert data["schema"] == "slimtorch.quantize/1" == properties["schema"]["const"]
    assert data["samples"] == 1 and data["output_cosine"] > 0.999 and data["ratio"] == report.ratio
    assert json.loads(json.dumps(data)) == data


def test_progress_hears_every_byte_quantized_in_one_task() -> None:
    recorder = Recorder()
    slimtorch.quantize(TokenMLP(), "int4-weight", progress=recorder)
    (_, label, total, unit), *advances, end = recorder.events
    assert (label, unit, end) == ("quantizing", "bytes", ("end",)) and recorder.labels == ["quantizing"]
    assert sum(amount for _, amount in advances) == total > 0


def test_the_cli_refuses_a_bad_group_size_before_it_loads_the_model(tmp_path, capsys) -> None:
    args = ["quantize", str(tmp_path / "never-read.pt"), "-o", str(tmp_path / "out.safetensors")]
    with pytest.raises(SystemExit) as usage:  # a usage error while parsing, as shrink's (one shared rule)
        main([*args, "--scheme", "int8-dynamic", "--group-size", "33"])
    err = capsys.readouterr().err
    assert usage.value.code == 2 and "Traceback" not in err
    assert "argument --group-size: int4 group size must be even, 32 to 256, not 33" in err
