"""A layer whose weight its model reads outside the layer's forward stays float, found by quantize's own
calibration pass, listed with the place that read it; the command line says so and the file loads back in
a fresh process. Without calibration the swap cannot know, and the error says what to do."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import slimtorch
from slimtorch.quant import QuantizedWeight
from slimtorch.schemes import SCHEMES
from slimtorch.schemes import scheme as scheme_row
from tests import weight_readers
from tests.weight_readers import (
    ForwardCaller,
    FunctionalProjection,
    FusedEncoder,
    KeyReader,
    RecurrentCast,
    RowLookup,
    TiedHead,
)

ROOT = Path(__file__).resolve().parent.parent
ENCODER_LINEARS = [f"encoder.layers.{i}.{name}" for i in (0, 1) for name in ("linear1", "linear2")]
CASES = {  # the model, its input, the layers it reads the weight of, and the file that reads it
    "key-weight-T": (KeyReader, lambda: torch.randn(2, 5, 32), ["key"], "weight_readers.py"),
    "F.linear": (FunctionalProjection, lambda: torch.randn(4, 32), ["proj"], "weight_readers.py"),
    "tied-head": (TiedHead, lambda: torch.randint(0, 100, (2, 7)), ["embed"], "weight_readers.py"),
    "weight[ids]": (RowLookup, lambda: torch.randint(0, 100, (2, 7)), ["emb"], "weight_readers.py"),
    "lstm-dtype": (RecurrentCast, lambda: torch.randn(2, 5, 32), ["lstm"], "weight_readers.py"),
    "torch-encoder": (FusedEncoder, lambda: torch.randn(2, 5, 32), ENCODER_LINEARS, "transformer.py"),
}


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.detach().flatten(), b.detach().flatten(), dim=0))


@pytest.mark.slow
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("case", list(CASES))
def test_a_layer_read_outside_its_forward_stays_float_with_the_place_named(case: str, scheme: str) -> None:
    build, example, readers, where = CASES[case]
    torch.manual_seed(0)
    model, x = build().eval(), example()
    expected = model(x)
    report = slimtorch.quantize(model, scheme, calibration=[x])
    kept = {layer.name: layer.reason for layer in report.kept_float}
    for reader in readers:
        if isinstance(model.get_submodule(reader), torch.nn.LSTM) and not scheme_row(scheme).quantizes(
            "recurrent"
        ):
            assert (
                f"{scheme} has no LSTM / GRU kernel" in report.skipped[reader]
            )  # its kind stays float, unwatched
        else:
            assert reader in kept and f"read outside its forward ({where}:" in kept[reader], kept
        assert not isinstance(model.get_submodule(reader), QuantizedWeight)
    assert any(isinstance(m, QuantizedWeight) for m in model.modules())  # the others are quantized
    assert _cosine(model(x), expected) > 0.99  # with grad enabled, as a user's first call is
    with torch.no_grad():
        assert _cosine(model(x), expected) > 0.99
    # the watch is gone: each float layer is its own class again, with no hook or wrapper left behind
    for reader in readers:
        layer = model.get_submodule(reader)
        assert type(layer) in (torch.nn.Linear, torch.nn.Embedding, torch.nn.LSTM)
        assert not layer._forward_hooks and not layer._forward_pre_hooks and "forward" not in vars(layer)


@pytest.mark.parametrize("scheme", ["int8-dynamic", "int4-weight"])
def test_a_layer_whose_forward_is_called_by_name_is_quantized(scheme: str) -> None:
    torch.manual_seed(0)
    model, x = ForwardCaller().eval(), torch.randn(4, 32)
    expected = model(x)
    report = slimtorch.quantize(model, scheme, calibration=[x])
    assert {layer.name for layer in report.layers} == {"up", "proj"}, report.kept_float
    assert _cosine(model(x), expected) > 0.99


def test_without_calibration_the_forward_error_says_what_to_do() -> None:
    model = KeyReader().eval()
    slimtorch.quantize(model, "int8-dynamic")
    with pytest.raises(AttributeError, match="quantize with calibration inputs"):
        model(torch.randn(2, 5, 32))


COMMAND_LINE = [  # the model, its --input-shape, the scheme, a layer kept float and one quantized
    *[("KeyReader", "2,5,32", scheme, "key", "query") for scheme in SCHEMES],
    ("FunctionalProjection", "4,32", "int8-weight", "proj", "up"),
    ("TiedHead", "2,7", "int4-weight", "embed", "mix"),
    ("FusedEncoder", "2,5,32", "int8-dynamic", "encoder.layers.0.linear1", "head"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("model", "shape", "scheme", "reader", "quantized"), COMMAND_LINE)
def test_the_command_line_keeps_it_float_and_the_file_loads_back_in_a_fresh_process(
    model: str, shape: str, scheme: str, reader: str, quantized: str, tmp_path
) -> None:
    torch.manual_seed(0)
    torch.save(getattr(weight_readers, model)().state_dict(), tmp_path / "float.pt")
    out = tmp_path / f"{scheme}.safetensors"
    spec = f"{ROOT / 'tests' / 'weight_readers.py'}:{model}"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "slimtorch.cli.main",
            "quantize",
            spec,
            "--weights",
            str(tmp_path / "float.pt"),
            "--input-shape",
            shape,
            "-o",
            str(out),
            "--scheme",
            scheme,
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "Traceback" not in run.stderr
    assert f"kept float: {reader} " in run.stdout and "read outside its forward" in run.stdout, run.stdout
    sizes = tuple(int(n) for n in shape.split(","))
    example = f"torch.randint(0, 100, {sizes})" if model == "TiedHead" else f"torch.randn({sizes})"
    script = (
        "import sys, torch, slimtorch\n"
        f"from tests.weight_readers import {model} as Model\n"
        f"model = slimtorch.load_model({str(out)!r}, Model).model.eval()\n"
        "float_model = Model()\n"
        f"float_model.load_state_dict(torch.load({str(tmp_path / 'float.pt')!r}))\n"
        f"x = {example}\n"
        "got, want = model(x), float_model.eval()(x)\n"
        "c = torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0)\n"
        f"assert type(model.get_submodule({reader!r})).__name__ in ('Linear', 'Embedding')\n"
        f"assert type(model.get_submodule({quantized!r})).__name__ not in ('Linear', 'Embedding')\n"
        "sys.exit(0 if c > 0.99 else 1)\n"
    )
    load = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert load.returncode == 0, load.stderr[-3000:]
