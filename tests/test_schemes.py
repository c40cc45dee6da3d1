"""The quantization schemes' table, :mod:`slimtorch.schemes`: every row's layer classes exist and agree with
it, the codec it names stores its weights, and the API and every command offer what the rows allow, read
from the table and from no copy of it. A new scheme is one row and its classes: these checks, and every
test parametrized over ``SCHEMES``, then cover it."""

from __future__ import annotations

import argparse
import dataclasses
import re
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
from slimtorch.quant.build import layer_class, quantized_from, quantized_on_meta


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
        with pytest.raises(
            OptionError, match=rf"unknown scheme .* \(known: {re.escape(', '.join(schemes.SCHEMES))}\)$"
        ):
            schemes.scheme(bad)  # type: ignore[arg-type]  # a recipe's value can be anything
    with pytest.raises(OptionError, match="unknown scheme 'int3-weight'"):
        QuantizeOptions("int3-weight")


def test_the_api_and_every_command_offer_what_the_rows_allow() -> None:
    """``quantize`` offers every scheme; ``shrink`` and ``prune``, which write files, the weight-only ones
    they store as their rows say; the slim planner tries them all (weight-only first, for a size goal);
    QuantizeOptions takes each with its classes' kernels. All read from the table."""
    from slimtorch.deploy import ExportOptions
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
    assert tuple(offered["shrink"]) == tuple(offered["prune"]) == schemes.WRITTEN
    for name in offered["export"]:  # export takes the row's codec (quantize_to="int8")
        assert ExportOptions(quantize_to=schemes.scheme(name).codec).quantize_to == schemes.scheme(name).codec
    assert set(SlimOptions().schemes) == set(schemes.SCHEMES)
    for row in schemes.ROWS:
        linear = layer_class(row.name, "linear")
        assert QuantizeOptions(row.name, kernel=linear.KERNELS[0]).scheme == row.name


@pytest.mark.parametrize("row", schemes.ROWS, ids=lambda row: row.name)
def test_each_scheme_quantizes_the_layers_its_row_names_and_leaves_the_rest_float(row) -> None:
    import slimtorch

    model = nn.Sequential(nn.Embedding(64, 64), nn.Linear(64, 64), nn.Conv1d(3, 3, 1), nn.LSTM(64, 64))
    report = slimtorch.quantize(model, row.name, keep_sensitive=False)
    kinds = {"0": "embedding", "1": "linear", "2": "conv", "3": "recurrent"}
    for name, kind in kinds.items():
        layer = report.model.get_submodule(name)
        if row.quantizes(kind):
            assert type(layer) is layer_class(row.name, kind), (name, type(layer))
        else:  # a kind the row leaves out is named in one line, never a KeyError from the table
            assert not isinstance(layer, QuantizedWeight), (name, type(layer))
            assert f"{row.name} has no " in report.skipped[name], (name, report.skipped)


def test_the_writers_store_each_scheme_they_take_in_the_form_the_table_says() -> None:
    """shrink, prune and save take a written scheme's name and store by its row's codec form: each form is
    what ``WRITER_FORMS`` says (the CLI reads it there, without torch) and the row's own, and they take no
    other name."""
    from slimtorch.format.policy import TensorPolicy, encode_tensor

    weight = torch.randn(64, 128)
    assert {schemes.scheme(name).writer_form for name in schemes.WRITTEN} == set(schemes.WRITER_FORMS)
    for name in schemes.WRITTEN:
        row, policy = schemes.scheme(name), TensorPolicy(quantize=name, sparse="off")
        codec, grouped = schemes.WRITER_FORMS[policy.codec]  # type: ignore[index]
        assert (codec, grouped) == (row.codec, row.grouped)
        stage = encode_tensor("fc.weight", weight, "parameters", policy).stages[0]
        assert stage["codec"] == codec and ("group_size" in stage) == grouped, (name, stage)
    for other in set(schemes.SCHEMES) - set(schemes.WRITTEN) | set(schemes.WRITER_FORMS):
        with pytest.raises(OptionError, match="quantize takes a scheme name"):
            TensorPolicy(quantize=other)


def test_a_row_the_writers_cannot_store_as_it_says_is_not_offered_by_them() -> None:
    """A grouped int8 row (made here, not in the table) would be stored per row by the writers' int8 form: it
    has no writer form, so shrink and prune would not offer it; ``quantize`` takes it, its stage grouped."""
    grouped_int8 = dataclasses.replace(schemes.scheme("int8-weight"), name="int8-grouped", grouped=True)
    assert grouped_int8.writer_form is None
    assert schemes.scheme("int8-weight").writer_form == "int8"
    chain = grouped_int8.codec_chain(32, grid="integer_zero")  # int4's grid means nothing to int8
    assert chain == [("int8", {"group_size": 32})]
    assert encode(torch.randn(4, 80), chain).parts["scale"].shape == (4, 3)


@pytest.mark.parametrize("row", schemes.ROWS, ids=lambda row: row.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_layer_built_empty_for_loading_has_the_parts_and_stage_of_one_quantized(row, dtype) -> None:
    """``load_model`` fills the layer ``quantized_on_meta`` builds from the file: its buffers must be shaped
    as the codec makes them (a grouped int8 scale is (rows, groups), not (rows,))."""
    linear = nn.Linear(72, 24).to(dtype)  # 72 inputs: groups of 32 leave a short last one
    made = quantized_from(linear, row.name, 32)
    empty = quantized_on_meta(linear, row.name, 32, dtype)
    assert empty.stage == made.stage
    assert {k: (b.shape, b.dtype) for k, b in empty.named_buffers()} == {
        k: (b.shape, b.dtype) for k, b in made.named_buffers()
    }


def test_the_int8_embedding_class_serves_an_int8_row_with_scales_per_group() -> None:
    """One embedding class serves every int8 scheme (its ``SCHEME`` is the codec): with a scale per group
    it looks rows up as the codec decodes them."""
    from slimtorch.quant.modules import Int8Embedding

    table = torch.randn(50, 40) * torch.linspace(0.01, 3, 40)
    encoded = encode(table, [("int8", {"group_size": 16})])
    layer = Int8Embedding(50, 40, None, encoded)
    ids = torch.tensor([[3, 0, 49], [7, 7, 1]])
    want = decode(encoded.parts, encoded.stages, table.dtype, table.shape)[ids]
    assert torch.equal(layer(ids), want)
    assert torch.equal(layer.dequantized(), decode(encoded.parts, encoded.stages, table.dtype, table.shape))


def test_the_table_imports_no_torch() -> None:
    """``slimtorch --help`` lists the schemes from the table: importing it must not pull torch in."""
    code = "import sys, slimtorch.schemes; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr
