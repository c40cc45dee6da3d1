"""The quantization schemes' table, :mod:`slimtorch.schemes`: every row's layer classes exist and agree with
it, the codec it names stores its weights, and the API and every command offer what the rows allow, read
from the table and from no copy of it. A new scheme is one row and its classes: these checks, and every
test parametrized over ``SCHEMES``, then cover it."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest
import torch
from torch import nn

from slimtorch import schemes
from slimtorch.cli.main import build_parser
from slimtorch.errors import OptionError
from slimtorch.format.codecs import decode, encode
from slimtorch.quant import QuantizedWeight, QuantizeOptions
from slimtorch.quant.build import layer_class


@pytest.mark.parametrize("row", schemes.ROWS, ids=lambda row: row.name)
def test_each_row_names_layer_classes_that_agree_with_it(row: schemes.Scheme) -> None:
    """Each class exists at its dotted path, is a quantized layer, and says which scheme it is: the row's own
    name, or its codec where one class serves every scheme of that codec (int8 embedding rows)."""
    assert row.layers and set(row.layers) <= set(schemes.LAYER_KINDS)
    assert "linear" in row.layers  # the layer every model has: a scheme without it quantizes nothing
    for kind in row.layers:
        cls = layer_class(row.name, kind)
        assert issubclass(cls, QuantizedWeight), (row.name, kind, cls)
        assert cls.SCHEME in (row.name, row.codec), (row.name, kind, cls.SCHEME)
    assert row.bits in (4, 8) and row.summary and ";" not in row.summary  # ";" separates them in --help


@pytest.mark.parametrize("row", schemes.ROWS, ids=lambda row: row.name)
def test_each_rows_codec_chain_stores_weights_in_its_bits(row: schemes.Scheme) -> None:
    weight = torch.randn(16, 64)
    encoded = encode(weight, row.codec_chain(group_size=32))
    assert encoded.stages[-1]["codec"] == row.codec
    codes = max(encoded.parts.values(), key=lambda part: part.nbytes)  # beside them: scales, zero points
    assert codes.nbytes * 8 == weight.numel() * row.bits  # two int4 codes a byte
    error = (
        decode(encoded.parts, encoded.stages, weight.dtype, weight.shape) - weight
    ).norm() / weight.norm()
    assert error < (0.01 if row.bits == 8 else 0.15)


def test_a_kind_a_scheme_leaves_float_is_a_key_error_and_listed_by_quantizing() -> None:
    dynamic = schemes.scheme("int8-dynamic")
    assert dynamic.dynamic and not dynamic.weight_only and not dynamic.quantizes("conv")
    with pytest.raises(KeyError):
        layer_class("int8-dynamic", "conv")
    assert schemes.quantizing("conv") == tuple(r.name for r in schemes.ROWS if "conv" in r.layers)
    assert "int8-dynamic" not in schemes.quantizing("conv")


def test_an_unknown_scheme_is_one_line_naming_the_known_ones() -> None:
    for bad in ("int3-weight", "", None, 8):
        with pytest.raises(OptionError, match=r"unknown scheme .* \(known: int8-dynamic, int8-weight, int4-"):
            schemes.scheme(bad)  # type: ignore[arg-type]  # a recipe's value can be anything
    with pytest.raises(OptionError, match="unknown scheme 'int3-weight'"):
        QuantizeOptions("int3-weight")


def test_the_api_and_every_command_offer_what_the_rows_allow() -> None:
    """``quantize`` offers every scheme; ``shrink`` and ``prune``, which write files, the weight-only ones;
    the slim planner tries them all (weight-only first, for a size goal); QuantizeOptions takes each with
    its classes' kernels. All read from the table."""
    from slimtorch.quant import SCHEMES
    from slimtorch.slimming.options import SlimOptions

    assert SCHEMES == schemes.SCHEMES == tuple(row.name for row in schemes.ROWS)
    assert tuple(row.name for row in schemes.ROWS if not row.dynamic) == schemes.WEIGHT_ONLY
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    actions = {
        name: next(a for a in parser._actions if a.dest == "scheme")
        for name, parser in commands.choices.items()
        if any(a.dest == "scheme" for a in parser._actions)
    }
    offered = {name: action.choices for name, action in actions.items()}
    for action in actions.values():  # --help explains each scheme it offers by its row
        assert all(schemes.scheme(name).summary in " ".join(action.help.split()) for name in action.choices)
    assert tuple(offered["quantize"]) == schemes.SCHEMES
    assert tuple(offered["shrink"]) == tuple(offered["prune"]) == schemes.WEIGHT_ONLY
    assert set(SlimOptions().schemes) == set(schemes.SCHEMES)
    for row in schemes.ROWS:
        linear = layer_class(row.name, "linear")
        assert QuantizeOptions(row.name, kernel=linear.KERNELS[0]).scheme == row.name


@pytest.mark.parametrize("row", schemes.ROWS, ids=lambda row: row.name)
def test_each_scheme_quantizes_the_layers_its_row_names_and_leaves_the_rest_float(row) -> None:
    import slimtorch

    model = nn.Sequential(nn.Embedding(64, 64), nn.Linear(64, 64), nn.Conv1d(3, 3, 1))
    report = slimtorch.quantize(model, row.name, keep_sensitive=False)
    kinds = {"0": "embedding", "1": "linear", "2": "conv"}
    for name, kind in kinds.items():
        layer = report.model.get_submodule(name)
        if row.quantizes(kind):
            assert type(layer) is layer_class(row.name, kind), (name, type(layer))
        else:
            assert not isinstance(layer, QuantizedWeight) and name in report.skipped, (name, report.skipped)


def test_the_table_imports_no_torch() -> None:
    """``slimtorch --help`` lists the schemes from the table: importing it must not pull torch in."""
    code = "import sys, slimtorch.schemes; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr
