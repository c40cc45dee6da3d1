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
from tests.weight_readers import FunctionalProjection, KeyReader, TiedHead

ROOT = Path(__file__).resolve().parent.parent
SCHEMES = ["int8-dynamic", "int8-weight", "int4-weight"]
CASES = {
    "key-weight-T": (KeyReader, lambda: torch.randn(2, 5, 32), "key"),
    "F.linear": (FunctionalProjection, lambda: torch.randn(4, 32), "proj"),
    "tied-head": (TiedHead, lambda: torch.randint(0, 100, (2, 7)), "embed"),
}


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.detach().flatten(), b.detach().flatten(), dim=0))


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("case", list(CASES))
def test_a_layer_read_outside_its_forward_stays_float_with_the_place_named(case: str, scheme: str) -> None:
    build, example, reader = CASES[case]
    torch.manual_seed(0)
    model, x = build().eval(), example()
    expected = model(x)
    report = slimtorch.quantize(model, scheme, calibration=[x])
    kept = {layer.name: layer.reason for layer in report.kept_float}
    assert reader in kept and "read outside its forward (weight_readers.py:" in kept[reader], kept
    assert not isinstance(model.get_submodule(reader), QuantizedWeight)
    assert any(isinstance(m, QuantizedWeight) for m in model.modules())  # the others are quantized
    assert _cosine(model(x), expected) > 0.99
    # the watch is gone: the float layer is its own class again, with no hooks left behind
    layer = model.get_submodule(reader)
    assert type(layer) in (torch.nn.Linear, torch.nn.Embedding)
    assert not layer._forward_hooks and not layer._forward_pre_hooks


def test_without_calibration_the_forward_error_says_what_to_do() -> None:
    model = KeyReader().eval()
    slimtorch.quantize(model, "int8-dynamic")
    with pytest.raises(AttributeError, match="quantize with calibration inputs"):
        model(torch.randn(2, 5, 32))


@pytest.mark.parametrize("scheme", SCHEMES)
def test_the_command_line_keeps_it_float_and_the_file_loads_back_in_a_fresh_process(
    scheme: str, tmp_path
) -> None:
    torch.manual_seed(0)
    torch.save(KeyReader().state_dict(), tmp_path / "float.pt")
    out = tmp_path / f"{scheme}.safetensors"
    spec = f"{ROOT / 'tests' / 'weight_readers.py'}:KeyReader"
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
            "2,5,32",
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
    assert "read outside its forward" in run.stdout, run.stdout[-3000:]
    script = (
        "import sys, torch, slimtorch\n"
        "from tests.weight_readers import KeyReader\n"
        f"model = slimtorch.load_model({str(out)!r}, KeyReader).model.eval()\n"
        "float_model = KeyReader()\n"
        f"float_model.load_state_dict(torch.load({str(tmp_path / 'float.pt')!r}))\n"
        "x = torch.randn(2, 5, 32)\n"
        "got, want = model(x), float_model.eval()(x)\n"
        "c = torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0)\n"
        "assert type(model.key).__name__ == 'Linear' and type(model.query).__name__ != 'Linear'\n"
        "sys.exit(0 if c > 0.99 else 1)\n"
    )
    load = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert load.returncode == 0, load.stderr[-3000:]
