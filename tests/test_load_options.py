"""load and load_model in the one verb shape: options as a frozen dataclass or keywords, a report that holds
the result."""

from __future__ import annotations

import json

import pytest
import torch

import slimtorch
from slimtorch.cli.main import main
from slimtorch.errors import OptionError
from slimtorch.format.progress import Recorder
from slimtorch.loading import LoadOptions, LoadReport
from tests.zoo import MLP, SmallCNN, TinyGPT


@pytest.fixture
def wrapped(tmp_path):
    """A training checkpoint: the model under ``net.``, its ``0.`` layer renamed ``first.``."""
    state = {k.replace("layers.0.", "layers.first.", 1): v for k, v in MLP().state_dict().items()}
    path = tmp_path / "wrapped.pt"
    torch.save({**{f"net.{k}": v for k, v in state.items()}, "net.extra": torch.ones(2)}, path)
    return path


def _same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(
        torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    )


def test_options_by_dataclass_and_by_keyword_load_the_same(wrapped) -> None:
    options = LoadOptions(
        dtype=torch.float64, strict=False, threads=1, prefix="net.", rename={"layers.first.": "layers.0."}
    )
    by_dataclass = slimtorch.load_model(wrapped, MLP, options)
    by_keyword = slimtorch.load_model(
        wrapped,
        MLP,
        dtype=torch.float64,
        strict=False,
        threads=1,
        prefix="net.",
        rename=[("layers.first.", "layers.0.")],
    )
    overridden = slimtorch.load_model(
        wrapped,
        MLP,
        LoadOptions(threads=1),
        dtype=torch.float64,
        strict=False,
        prefix="net.",
        rename=["layers.first.=layers.0."],
    )
    assert options.rename == (("layers.first.", "layers.0."),)  # a mapping becomes pairs, in order
    assert _same(by_dataclass.model, by_keyword.model) and _same(by_dataclass.model, overridden.model)
    assert by_dataclass.model.layers[0].weight.dtype == torch.float64
    assert by_dataclass.unmatched == by_keyword.unmatched == overridden.unmatched == ["net.extra"]


def test_options_normalise_what_the_caller_may_spell_otherwise() -> None:
    options = LoadOptions(device=torch.device("cpu"), allow_globals=["collections.OrderedDict"])
    assert options.device == "cpu" and options.allow_globals == ("collections.OrderedDict",)
    assert LoadOptions(rename={"": "bert."}).rename == (("", "bert."),)


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("threads", 0, "threads must be 1 or more"),
        ("dtype", "bf16", "takes a torch.dtype"),
        ("allow_globals", "collections.OrderedDict", "takes a list"),
        ("rename", ["lstm."], r"rename takes \(old, new\)"),
    ],
)
def test_a_bad_option_value_is_an_option_error_when_the_options_are_made(field, value, words) -> None:
    with pytest.raises(OptionError, match=words):
        LoadOptions(**{field: value})


def test_an_unknown_option_names_the_fields_there_are(tmp_path) -> None:
    path = tmp_path / "mlp.safetensors"
    slimtorch.save(MLP().state_dict(), path)
    with pytest.raises(
        OptionError, match="unknown option 'stict'; LoadOptions has: allow_globals, device"
    ) as caught:
        slimtorch.load_model(path, MLP, stict=False)
    assert "rename, strict, threads, verify" in str(caught.value)
    with pytest.raises(OptionError, match="load: unknown option 'model'"):
        slimtorch.load(path, model=MLP)
    with pytest.raises(OptionError, match="options must be a LoadOptions"):
        slimtorch.load(path, {"verify": False})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("field", "value"), [("strict", False), ("prefix", "net."), ("rename", {"lstm.": "rnn."})]
)
def test_load_refuses_the_options_that_match_names_to_a_model(tmp_path, field, value) -> None:
    path = tmp_path / "mlp.safetensors"
    slimtorch.save(MLP().state_dict(), path)
    with pytest.raises(OptionError, match=f"load: '{field}' applies to a model.*load_model"):
        slimtorch.load(path, **{field: value})
    with pytest.raises(OptionError, match=f"'{field}'"):
        slimtorch.load(path, LoadOptions(**{field: value}))


def test_load_converts_floats_to_a_dtype_and_keeps_ties_without_a_model(tmp_path) -> None:
    cnn, gpt = SmallCNN(), TinyGPT()
    slimtorch.save(cnn.state_dict(), tmp_path / "cnn.safetensors", quantize="int8-weight")
    tensors = slimtorch.load(tmp_path / "cnn.safetensors", dtype=torch.bfloat16, device="cpu").tensors
    assert set(tensors) == set(cnn.state_dict())
    assert {t.dtype for n, t in tensors.items() if "num_batches" not in n} == {torch.bfloat16}
    assert tensors["features.1.num_batches_tracked"].dtype == torch.int64  # integers stay as stored
    slimtorch.save(gpt.state_dict(), tmp_path / "gpt.safetensors")
    tied = slimtorch.load(tmp_path / "gpt.safetensors", dtype=torch.float16).tensors
    assert tied["head.weight"] is tied["embed.weight"] and tied["head.weight"].dtype == torch.float16


def test_the_report_holds_the_model_or_tensors_and_its_json_fits_the_schema(tmp_path) -> None:
    mlp = MLP()
    path = tmp_path / "mlp.safetensors"
    slimtorch.save(mlp.state_dict(), path, quantize="int8-weight")
    recorder = Recorder()
    loaded = slimtorch.load_model(path, MLP, progress=recorder)
    stored = slimtorch.load(path)
    assert isinstance(loaded, LoadReport)
    assert isinstance(loaded.model, MLP) and loaded.tensors is None
    assert stored.model is None and list(stored.tensors) == list(mlp.state_dict())
    assert recorder.labels == ["loading"]
    schema = LoadReport.json_schema()
    for report in (loaded, stored):
        data = json.loads(json.dumps(report.to_dict()))
        assert set(data) == set(schema["properties"]) == set(schema["required"])
    # the schema's names from before the report held its results: "model" a class name, "tensors" a count
    assert loaded.to_dict()["model"] == "MLP" and stored.to_dict()["model"] is None
    assert loaded.to_dict()["tensors"] == stored.to_dict()["tensors"] == len(mlp.state_dict())
    assert schema["properties"]["tensors"] == {"type": "integer"}
    assert list(loaded.to_dict())[:7] == ["schema", "path", "format", "device", "threads", "model", "tensors"]


def test_cli_load_without_a_model_takes_dtype_and_refuses_name_matching(tmp_path, capsys) -> None:
    path = tmp_path / "mlp.safetensors"
    slimtorch.save(MLP().state_dict(), path)
    assert main(["load", str(path), "--dtype", "bf16", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["bytes"] == sum(
        t.numel() * 2 for t in MLP().state_dict().values()
    )
    for flags in (["--non-strict"], ["--prefix", "net."], ["--rename", "a.=b."]):
        assert main(["load", str(path), *flags]) == 2
        assert "they need --model" in capsys.readouterr().err
