"""shrink, save, save_model and save_pretrained in one shape: one ShrinkOptions (or its fields as keywords),
one planner, one report; inspect with its InspectOptions."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

import slimtorch
from slimtorch import schemes
from slimtorch.errors import OptionError
from slimtorch.format.policy import ShrinkOptions
from slimtorch.inspection import InspectOptions, InspectReport
from slimtorch.shrinking import ShrinkReport


def _slim_header(path) -> dict:
    """The file's slim metadata without the random id each save draws (parts are compared by CRC)."""
    with safe_open(path, "pt") as f:
        header = json.loads(f.metadata()["slimtorch"])
    del header["checkpoint"]
    return header


def _state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64))
    return model.state_dict()


def test_options_as_a_dataclass_and_as_keywords_write_equal_files(tmp_path):
    state = _state()
    torch.save(state, tmp_path / "dense.pt")
    options = ShrinkOptions(quantize="int4-weight", group_size=64, skip=["2.*"])
    keywords = {"quantize": "int4-weight", "group_size": 64, "skip": ["2.*"]}

    slimtorch.save(state, tmp_path / "a.safetensors", options)
    slimtorch.save(state, tmp_path / "b.safetensors", **keywords)
    slimtorch.shrink(tmp_path / "dense.pt", tmp_path / "c.safetensors", options)
    slimtorch.shrink(tmp_path / "dense.pt", tmp_path / "d.safetensors", ShrinkOptions(), **keywords)

    assert _slim_header(tmp_path / "a.safetensors") == _slim_header(tmp_path / "b.safetensors")
    assert _slim_header(tmp_path / "c.safetensors") == _slim_header(tmp_path / "d.safetensors")
    assert _slim_header(tmp_path / "a.safetensors")["tensors"]["0.weight"]["stages"][0]["codec"] == "int4"


@pytest.mark.parametrize("name", schemes.WRITTEN)
def test_the_writers_take_each_written_schemes_name_and_store_its_weights_as_its_row_says(tmp_path, name):
    """``quantize`` takes the names ``--scheme`` and :func:`slimtorch.quantize` use; the weight is stored in
    the row's codec and grouping, and the file's provenance and the report say the scheme's name."""
    row = schemes.scheme(name)
    torch.save(_state(), tmp_path / "dense.pt")
    path = tmp_path / "q.safetensors"
    report = slimtorch.shrink(tmp_path / "dense.pt", path, ShrinkOptions(quantize=name, quantize_all=True))
    with slimtorch.open(path) as source:
        chain, stage = source.codec("0.weight"), source.stages("0.weight")[-1]
    assert chain == row.codec and stage["codec"] == row.codec and ("group_size" in stage) == row.grouped
    assert {t.name: t.chain for t in report.tensors}["0.weight"] == row.codec
    assert _slim_header(path)["provenance"]["options"]["quantize"] == name


@pytest.mark.parametrize(
    ("value", "hint"),
    [
        ("int8", "(int8 is int8-weight)"),  # the codec names the option took before 0.1.0
        ("int4", "(int4 is int4-weight)"),
        ("int8-dynamic", "quantizes activations as the model runs, which no file holds"),
        ("int8-group-weight", "is a form the writers cannot store as it says"),
    ],
)
def test_a_name_the_writers_do_not_store_is_one_line_saying_what_to_write(tmp_path, value, hint):
    with pytest.raises(OptionError) as caught:
        ShrinkOptions(quantize=value)
    message = str(caught.value)
    accepted = " or ".join(schemes.WRITTEN)
    assert message.startswith(f"quantize takes a scheme name: {accepted}, not {value!r}"), message
    assert hint in message and "\n" not in message
    if value in schemes.SCHEMES:  # a scheme the writers cannot store: quantize the model, then save it
        assert f"slimtorch.quantize(model, {value!r}), then save_model" in message
    with pytest.raises(OptionError, match="quantize takes a scheme name"):
        slimtorch.save(_state(), tmp_path / "x.safetensors", quantize=value)
    assert not (tmp_path / "x.safetensors").exists()


@pytest.mark.parametrize(
    "call",
    [
        lambda path: slimtorch.save(_state(), path / "x.safetensors", quantise="int8"),
        lambda path: slimtorch.save_model(torch.nn.Linear(2, 2), path / "x.safetensors", quantise="int8"),
        lambda path: slimtorch.shrink(path / "dense.pt", path / "x.safetensors", quantise="int8"),
    ],
    ids=["save", "save_model", "shrink"],
)
def test_an_unknown_keyword_is_an_option_error_listing_the_fields(tmp_path, call):
    torch.save(_state(), tmp_path / "dense.pt")
    with pytest.raises(OptionError, match=r"unknown option 'quantise'; ShrinkOptions has: .*quantize,"):
        call(tmp_path)
    assert not (tmp_path / "x.safetensors").exists()


def test_inspect_takes_its_options_or_their_fields_and_refuses_an_unknown_one(tmp_path):
    torch.save(_state(), tmp_path / "dense.pt")

    by_options = slimtorch.inspect(tmp_path / "dense.pt", InspectOptions(depth=1, top=2, scan=False))
    by_keywords = slimtorch.inspect(tmp_path / "dense.pt", depth=1, top=2, scan=False)

    assert by_options.tree == by_keywords.tree and len(by_options.largest) == 2 and not by_options.scanned
    assert {node.depth for node in by_options.tree} == {1}
    with pytest.raises(OptionError, match=r"unknown option 'deep'; InspectOptions has: allow_globals, depth"):
        slimtorch.inspect(tmp_path / "dense.pt", deep=2)
    with pytest.raises(OptionError, match="depth must be an integer, 1 or more"):
        InspectOptions(depth=0)


def test_inspect_of_an_open_source_refuses_allow_globals_it_could_not_apply(tmp_path):
    torch.save(_state(), tmp_path / "dense.pt")
    refused = pytest.raises(OptionError, match="allow_globals applies when inspect opens a path")
    with slimtorch.open(tmp_path / "dense.pt") as source, refused:
        slimtorch.inspect(source, allow_globals=["mypkg.Config"])


@pytest.mark.parametrize(
    ("reading", "value"),
    [("keep_optimizer", True), ("keep_names", True), ("keep_objects", False), ("allow_globals", ["a.B"])],
)
def test_a_reading_choice_of_shrink_given_to_a_save_verb_is_refused_by_name(tmp_path, reading, value):
    with pytest.raises(OptionError, match=rf"save: {reading} is a choice of shrink"):
        slimtorch.save(_state(), tmp_path / "x.safetensors", **{reading: value})
    with pytest.raises(OptionError, match=rf"save_model: {reading} is a choice of shrink"):
        slimtorch.save_model(
            torch.nn.Linear(2, 2), tmp_path / "x.safetensors", ShrinkOptions(**{reading: value})
        )
    assert not (tmp_path / "x.safetensors").exists()


def test_a_state_dict_saved_and_the_same_tensors_shrunk_from_a_file_are_planned_alike(tmp_path):
    shared = torch.randn(64, 64)
    bias = torch.randn(64, 64)
    state = {
        "embed.weight": shared,
        "encoder.bias": bias,
        "norm.running_mean": torch.randn(64),
        "head.weight": shared,  # a tie: the same tensor
        "decoder.bias": bias.clone(),  # a copy: equal values, its own tensor
        "fc.weight_orig": torch.randn(64, 64),
        "fc.weight_mask": (torch.rand(64, 64) > 0.5).float(),
        "steps": torch.tensor(7),
    }
    torch.save(state, tmp_path / "dense.pt")

    saved = slimtorch.save(state, tmp_path / "saved.safetensors")
    shrunk = slimtorch.shrink(tmp_path / "dense.pt", tmp_path / "shrunk.safetensors")

    assert saved.ties == shrunk.ties == {"head.weight": "embed.weight"}
    assert saved.copies == shrunk.copies == {"decoder.bias": "encoder.bias"}
    assert saved.folded == shrunk.folded == ["fc.weight"]
    planned = [(t.name, t.category, t.chain, t.after_bytes) for t in saved.tensors]
    assert planned == [(t.name, t.category, t.chain, t.after_bytes) for t in shrunk.tensors]
    assert [(n, c) for n, c, _, _ in planned] == [
        ("embed.weight", "parameters"),
        ("encoder.bias", "parameters"),
        ("norm.running_mean", "buffers"),
        ("fc.weight", "parameters"),
        ("steps", "buffers"),
    ]
    loaded = slimtorch.load(tmp_path / "saved.safetensors").tensors
    assert loaded["head.weight"] is loaded["embed.weight"]
    assert loaded["decoder.bias"] is not loaded["encoder.bias"]
    assert torch.equal(loaded["decoder.bias"], bias)
    assert torch.equal(loaded["fc.weight"], state["fc.weight_orig"] * state["fc.weight_mask"])


def test_reports_fit_their_json_schema(tmp_path):
    torch.save(_state(), tmp_path / "dense.pt")
    reports = [
        slimtorch.shrink(tmp_path / "dense.pt", tmp_path / "a.safetensors", quantize="int8-weight"),
        slimtorch.save(_state(), tmp_path / "b.safetensors"),
        slimtorch.save_model(torch.nn.Linear(64, 64), tmp_path / "c.safetensors"),
        slimtorch.inspect(tmp_path / "dense.pt"),
    ]
    for report in reports:
        data = report.to_dict()
        schema = type(report).json_schema()
        assert set(data) <= set(schema["properties"]), type(report).__name__
        assert data["schema"] == type(report).SCHEMA
    shrunk, inspected = reports[0].to_dict(), reports[3].to_dict()
    assert isinstance(reports[0], ShrinkReport) and isinstance(reports[3], InspectReport)
    assert shrunk["schema"] == "slimtorch.shrink/1" and inspected["schema"] == "slimtorch.inspect/1"
    assert set(shrunk["before"]) >= {"parameters"} and shrunk["before"]["parameters"]["tensors"] == 4
    assert shrunk["config_update"] is None and shrunk["ratio"] == reports[0].ratio
    assert inspected["savings"]["estimates"] is False and "parameters" in inspected["categories"]
    assert schema["properties"]["savings"]["properties"]["actions"]["type"] == "array"


def test_shard_bytes_shards_a_save_and_its_pre_0_1_0_name_is_refused(tmp_path):
    saved = slimtorch.save(_state(), tmp_path / "new", shard_bytes=40_000)
    assert len([f for f in saved.files if f.endswith(".safetensors")]) > 1
    with pytest.raises(OptionError, match="shard_size"):
        slimtorch.save(_state(), tmp_path / "old", shard_size=40_000)


def test_shrink_options_keep_their_positional_and_keyword_spellings(tmp_path):
    torch.save(_state(), tmp_path / "dense.pt")
    options = ShrinkOptions(quantize="int8-weight", skip=["2.bias"])

    assert options.skip == ("2.bias",) and options.dtype is None
    keyword = slimtorch.shrink(tmp_path / "dense.pt", tmp_path / "a.safetensors", options=options)
    positional = slimtorch.shrink(tmp_path / "dense.pt", tmp_path / "b.safetensors", options)

    assert [t.chain for t in keyword.tensors] == [t.chain for t in positional.tensors]
    assert ShrinkOptions(dtype="bf16").dtype == torch.bfloat16
    with pytest.raises(OptionError, match="skip takes a list"):
        ShrinkOptions(skip="fc.*")
