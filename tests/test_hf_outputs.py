"""Folders written from Hugging Face folders load in transformers as they load in slimtorch: for every
writer (shrink lossless / int8 / int4 / fp16, quantize int8-dynamic / int8-weight / int4-weight, prune,
prune + int8) and BERT, GPT-2 and Llama, ``from_pretrained`` (compressed-tensors for quantized weights)
and ``slimtorch.load_model`` give equal outputs, or within the scheme's bound, or ``from_pretrained``
refuses the folder. Never random weights."""

from __future__ import annotations

import copy
import json

import pytest
import torch

import slimtorch
from slimtorch.errors import FormatError, SlimtorchError
from slimtorch.format.policy import ShrinkOptions
from slimtorch.models import hub
from slimtorch.quant import QuantizedWeight
from slimtorch.schemes import SCHEMES
from slimtorch.schemes import scheme as scheme_row
from tests.zoo.transformers_models import TRANSFORMERS, example, main_output

transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

MODELS = ("bert", "gpt2", "llama")
INT8_DYNAMIC_BOUND = 0.03
"""Relative L2 between from_pretrained and load_model under int8-dynamic: transformers decodes the weights
as it loads them (``dequantize: true``) and leaves activations float, our kernel rounds them to int8 per
row (measured: about 1% on Llama's logits)."""
INT4_BOUND = 1e-3
"""Relative L2 between from_pretrained and load_model under int4: compressed-tensors decodes
(code - 8) * scale in the scale's float16, slimtorch in float32 (measured: about 1e-4)."""


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> dict:
    """Each model once per module: the model and its save_pretrained folder."""
    torch.manual_seed(0)
    made = {}
    for name in MODELS:
        model = TRANSFORMERS[name]().eval()
        folder = tmp_path_factory.mktemp("base") / name
        model.save_pretrained(folder)
        made[name] = (model, folder)
    return made


def _both(folder, model_class, weight_only: bool = True) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The folder loaded by from_pretrained (float32, as load_model builds it) and by load_model."""
    theirs = model_class.from_pretrained(folder, dtype=torch.float32).eval()
    ours = slimtorch.load_model(folder, hub.model_factory(hub.read_config(folder))).model.eval()
    for module in ours.modules():
        if isinstance(module, QuantizedWeight) and weight_only:
            module.kernel = "dequantize"  # float32 products, as compressed-tensors computes them
    return theirs, ours


def _outputs(name: str, *models: torch.nn.Module) -> list[torch.Tensor]:
    with torch.no_grad():
        return [main_output(model(*example(name))) for model in models]


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0))


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm())


def _quantized_layers(folder) -> dict:
    config = json.loads((folder / "config.json").read_text())
    groups = config.get("quantization_config", {}).get("config_groups", {})
    return {group["format"]: len(group["targets"]) for group in groups.values()}


# -- shrink ------------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("name", MODELS)
def test_lossless_shrink_loads_equal_in_from_pretrained_and_load_model(bases, name, tmp_path) -> None:
    model, folder = bases[name]
    out = tmp_path / "out"
    from slimtorch.cli.main import main

    assert main(["shrink", str(folder), "-o", str(out), "--json"]) == 0  # hf by default from a folder
    theirs, ours = _both(out, type(model))
    got, loaded, want = _outputs(name, theirs, ours, model)
    assert torch.equal(got, want) and torch.equal(loaded, want)


@pytest.mark.slow
@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize(("quantize", "least"), [("int8-weight", 0.99), ("int4-weight", 0.95)])
def test_quantized_shrink_is_read_by_compressed_tensors_as_slimtorch_reads_it(
    bases, name, quantize, least, tmp_path
) -> None:
    model, folder = bases[name]
    out = tmp_path / "out"
    report = slimtorch.shrink(folder, out, options=ShrinkOptions(quantize=quantize))
    written = _quantized_layers(out)
    # int4 is for Linear layers in compressed-tensors: embeddings go int8 (naive-quantized)
    expected = "pack-quantized" if quantize == "int4-weight" else "naive-quantized"
    assert set(written) <= {expected, "naive-quantized"}
    assert expected in written or name == "gpt2"  # GPT-2's Conv1D layers: none to write
    if name == "gpt2":
        assert any("compressed-tensors quantizes nn.Linear" in note for note in report.notes)
    theirs, ours = _both(out, type(model))
    got, loaded, original = _outputs(name, theirs, ours, model)
    assert torch.equal(got, loaded) if quantize == "int8-weight" else _relative(got, loaded) <= INT4_BOUND
    assert _cosine(got, original) >= least


@pytest.mark.slow
@pytest.mark.parametrize("name", MODELS)
def test_float16_shrink_loads_the_same_float16_values_in_both(bases, name, tmp_path) -> None:
    model, folder = bases[name]
    out = tmp_path / "out"
    slimtorch.shrink(folder, out, options=ShrinkOptions(dtype="fp16"))
    assert json.loads((out / "config.json").read_text())["dtype"] == "float16"
    theirs, ours = _both(out, type(model))
    got, loaded, original = _outputs(name, theirs, ours, model)
    assert torch.equal(got, loaded)
    assert _cosine(got, original) >= 0.999


@pytest.mark.slow
def test_90pct_sparse_bert_shrinks_losslessly_and_from_pretrained_reads_every_weight(bases, tmp_path) -> None:
    model, _ = bases["bert"]
    sparse = copy.deepcopy(model)
    with torch.no_grad():
        for parameter in sparse.parameters():
            if parameter.dim() >= 2:
                parameter.mul_(torch.rand_like(parameter) >= 0.9)
    folder = tmp_path / "sparse"
    sparse.save_pretrained(folder)
    out = tmp_path / "out"
    slimtorch.shrink(folder, out)
    theirs, ours = _both(out, type(model))
    got, loaded, want = _outputs("bert", theirs, ours, sparse)
    assert torch.equal(got, want) and torch.equal(loaded, want)


# -- quantize ----------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("scheme", SCHEMES)
def test_quantized_model_folder_loads_in_transformers_and_stays_quantized_in_load_model(
    bases, name, scheme, tmp_path
) -> None:
    """Each layer is written in compressed-tensors' form or, where it has none (GPT-2's Conv1D, grouped
    int8), dense with a note naming it; either way transformers and load_model compute the same."""
    model, folder = bases[name]
    row = scheme_row(scheme)
    quantized = slimtorch.quantize(copy.deepcopy(model), scheme, group_size=32, symmetric=True).model
    layers = [n for n, m in quantized.named_modules() if isinstance(m, QuantizedWeight)]
    out = tmp_path / "out"
    report = slimtorch.save_model(quantized, out, extra_files={"config.json": folder / "config.json"})
    theirs, ours = _both(out, type(model), weight_only=row.weight_only)
    dense = [n for n in report.notes if "written dense" in n]
    kept = [m for m in ours.modules() if isinstance(m, QuantizedWeight)]
    assert layers and len(kept) + len(dense) == len(layers), (len(kept), dense)
    if name != "gpt2" and not (row.codec == "int8" and row.grouped):
        assert kept  # compressed-tensors has per-channel int8 and int4 groups on its grid, not grouped int8
    got, loaded, original = _outputs(name, theirs, ours, model)
    if row.dynamic:
        assert _relative(got, loaded) <= INT8_DYNAMIC_BOUND
    elif row.codec == "int8" or not kept:  # per-row int8 dequantizes alike; dense layers are floats
        assert torch.equal(got, loaded)
    else:
        assert _relative(got, loaded) <= INT4_BOUND
    assert _cosine(loaded, original) >= (0.99 if row.bits == 8 else 0.95)


@pytest.mark.slow
@pytest.mark.parametrize("calibrated", [False, True], ids=["rounded", "gptq"])
def test_int4_with_integer_zero_points_loads_in_transformers_as_it_was_quantized(
    bases, calibrated, tmp_path
) -> None:
    # what `slimtorch quantize` writes into a Hugging Face folder now: asymmetric groups, each zero point
    # on a code of its own (compressed-tensors' weight_zero_point), rounded or chosen by GPTQ
    model, folder = bases["llama"]
    calibration = [example("llama") for _ in range(4)] if calibrated else None
    quantized = slimtorch.quantize(
        copy.deepcopy(model), "int4-weight", group_size=32, integer_zero=True, calibration=calibration
    ).model
    layer = quantized.model.layers[0].mlp.up_proj
    assert layer.encoded().stages[0].get("integer_zero") is True
    out = tmp_path / "out"
    slimtorch.save_model(quantized, out, extra_files={"config.json": folder / "config.json"})
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert {g["weights"]["symmetric"] for g in config["config_groups"].values()} == {False}
    theirs, ours = _both(out, type(model), weight_only=True)
    got, loaded, original = _outputs("llama", theirs, ours, model)
    assert _relative(got, loaded) <= INT4_BOUND and _cosine(loaded, original) >= 0.95


@pytest.mark.slow
def test_cli_quantize_writes_int8_dynamic_activations_in_the_quantization_config(bases, tmp_path) -> None:
    from slimtorch.cli.main import main

    model, folder = bases["bert"]
    out = tmp_path / "out"
    assert main(["quantize", str(folder), "-o", str(out), "--runs", "0", "--samples", "1", "--json"]) == 0
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    activations = [g["input_activations"] for g in config["config_groups"].values()]
    assert {"strategy": "token", "dynamic": True}.items() <= next(a for a in activations if a).items()
    theirs, ours = _both(out, type(model), weight_only=False)
    got, loaded = _outputs("bert", theirs, ours)
    assert float((got - loaded).norm() / loaded.norm()) <= INT8_DYNAMIC_BOUND


def test_load_model_of_hf_int4_folder_maps_the_compressed_tensors_words_as_the_layers_codes(
    bases, tmp_path
) -> None:
    model, _ = bases["llama"]
    quantized = slimtorch.quantize(copy.deepcopy(model), "int4-weight", group_size=32, symmetric=True).model
    out = tmp_path / "out"
    slimtorch.save_model(quantized, out, layout="hf")
    loaded = slimtorch.load_model(out, hub.model_factory(hub.read_config(out))).model
    layer = loaded.model.layers[0].mlp.up_proj
    assert type(layer).__name__ == "Int4WeightLinear"
    original = quantized.model.layers[0].mlp.up_proj
    assert torch.equal(layer.qweight, original.qweight) and torch.equal(
        layer.weight_zero, original.weight_zero
    )


# -- prune -------------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt2", "llama"])
@pytest.mark.parametrize("quantize", [None, "int8-weight"])
def test_pruned_folder_loads_in_both_and_int8_stays_close(bases, name, quantize, tmp_path) -> None:
    model, _ = bases[name]
    pruned = copy.deepcopy(model)
    slimtorch.prune.channels(pruned, example(name), ratio=0.5)
    out = tmp_path / "out"
    slimtorch.save_pretrained(pruned, out, quantize=quantize)
    theirs = type(model).from_pretrained(out, dtype=torch.float32).eval()
    ours = slimtorch.load_model(out, TRANSFORMERS[name]).model.eval()
    got, loaded, want = _outputs(name, theirs, ours, pruned)
    assert torch.equal(got, loaded)
    assert torch.equal(loaded, want) if quantize is None else _cosine(loaded, want) >= 0.99


@pytest.mark.slow
def test_pruned_bert_whose_config_cannot_say_its_head_size_is_refused_by_from_pretrained(bases, tmp_path):
    from slimtorch.cli.main import main

    model, folder = bases["bert"]
    out = tmp_path / "out"
    assert (
        main(
            ["prune", str(folder), "-o", str(out), "--ratio", "0.5", "--runs", "0", "--scheme", "int8-weight"]
        )
        == 0
    )
    with pytest.raises((RuntimeError, ValueError)):
        type(model).from_pretrained(out)
    assert slimtorch.load_model(out, TRANSFORMERS["bert"]).model is not None


# -- the slim layout -----------------------------------------------------------------------------------------
@pytest.mark.slow
def test_slim_layout_folder_is_refused_by_from_pretrained_and_read_by_slimtorch(bases, tmp_path) -> None:
    from slimtorch.cli.main import main

    model, folder = bases["bert"]
    out = tmp_path / "out"
    assert main(["shrink", str(folder), "-o", str(out), "--scheme", "int8-weight", "--layout", "slim"]) == 0
    assert any("::" in name for name in slimtorch.open(out).physical)
    with pytest.raises(ValueError, match="model type `slimtorch`"):
        transformers.AutoModel.from_pretrained(out)
    with pytest.raises(AttributeError, match=r"slimtorch\.load_model"):  # the class would take defaults
        type(model).from_pretrained(out)
    ours = slimtorch.load_model(out, hub.model_factory(hub.read_config(out))).model.eval()
    loaded, original = _outputs("bert", ours, model)
    assert _cosine(loaded, original) >= 0.99
    again = tmp_path / "again"
    slimtorch.shrink(out, again)  # a slim-layout folder is a Hugging Face folder input like any other
    assert "quantization_config" not in json.loads((again / "config.json").read_text())


def test_int8_codes_are_the_same_in_both_layouts_so_load_model_gives_the_same_outputs(
    bases, tmp_path
) -> None:
    _, folder = bases["llama"]
    outputs = []
    for layout in ("hf", "slim"):
        slimtorch.shrink(
            folder, tmp_path / layout, options=ShrinkOptions(quantize="int8-weight"), layout=layout
        )
        loaded = slimtorch.load_model(tmp_path / layout, TRANSFORMERS["llama"]).model.eval()
        outputs += _outputs("llama", loaded)
    assert torch.equal(*outputs)


def test_a_damaged_slimtorch_config_is_one_clear_error(bases, tmp_path) -> None:
    _, folder = bases["bert"]
    out = tmp_path / "out"
    slimtorch.shrink(folder, out, layout="slim")
    (out / "config.json").write_text(json.dumps({"model_type": "slimtorch", "slimtorch": {"note": "x"}}))
    with pytest.raises(FormatError, match="without the model's config"):
        hub.read_config(out)


def test_hf_layout_is_refused_where_it_cannot_be_written(bases, tmp_path) -> None:
    _, folder = bases["bert"]
    with pytest.raises(SlimtorchError, match=r"needs a config\.json"):
        slimtorch.shrink(folder, tmp_path / "one.safetensors", layout="hf")
    with pytest.raises(SlimtorchError, match="--entropy"):
        slimtorch.shrink(folder, tmp_path / "out", options=ShrinkOptions(entropy=True), layout="hf")


def test_symmetric_int4_stays_in_its_bound_and_its_compressed_tensors_words_decode_the_same() -> None:
    from slimtorch.format.codecs import decode, encode
    from slimtorch.format.hf_layout import ct_form

    weight = torch.randn(48, 96) * torch.linspace(0.01, 3, 96)
    encoded = encode(weight, [("int4", {"group_size": 32, "symmetric": True})])
    scale = encoded.parts["scale"].float().repeat_interleave(32, dim=1)
    bound = scale / 2 + 0.03 * weight.abs().reshape(48, 3, 32).amax(2).repeat_interleave(32, dim=1)
    decoded = decode(encoded.parts, encoded.stages, torch.float32, (48, 96))
    assert bool(((decoded - weight).abs() <= bound * (1 + 2**-10)).all())
    coded, keys, scheme = ct_form("fc.weight", encoded)
    assert keys == {"q4": "fc.weight_packed", "scale": "fc.weight_scale", "shape": "fc.weight_shape"}
    assert coded.parts["q4"].dtype == torch.int32 and scheme.format == "pack-quantized"
    assert torch.equal(decode(coded.parts, coded.stages, torch.float32, (48, 96)), decoded)


def test_int4_with_integer_zero_points_stays_in_its_bound_and_compressed_tensors_decodes_it_the_same() -> (
    None
):
    """Issue 45: the Hugging Face layout's int4 keeps a zero point per group, on the code grid, packed as
    compressed-tensors packs it: its own decompressor gives back our decoded weight."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    from slimtorch.format.codecs import decode, encode
    from slimtorch.format.hf_layout import ct_form

    torch.manual_seed(0)
    weight = torch.randn(40, 96) * torch.linspace(0.01, 3, 96) + torch.linspace(-1, 2, 40).unsqueeze(1)
    encoded = encode(weight, [("int4", {"group_size": 32, "integer_zero": True})])
    assert encoded.parts["scale"].dtype == torch.float16 and encoded.parts["zero"].dtype == torch.float32
    decoded = decode(encoded.parts, encoded.stages, torch.float32, (40, 96))
    groups = weight.reshape(40, 3, 32)
    span = (groups.amax(2).clamp(min=0) - groups.amin(2).clamp(max=0)).repeat_interleave(32, dim=1)
    scale = encoded.parts["scale"].float().repeat_interleave(32, dim=1)
    assert bool(((decoded - weight).abs() <= (scale / 2 + 0.03 * span) * (1 + 2**-10)).all())
    coded, keys, scheme = ct_form("fc.weight", encoded)
    assert keys["zp"] == "fc.weight_zero_point" and scheme.group(["Linear"])["weights"]["symmetric"] is False
    assert torch.equal(decode(coded.parts, coded.stages, torch.float32, (40, 96)), decoded)
    codes = unpack_from_int32(coded.parts["q4"], 4, torch.Size([40, 96])).float()  # signed: code - 8
    points = unpack_from_int32(coded.parts["zp"], 4, torch.Size([40, 3]), packed_dim=0).float()
    theirs = (codes.reshape(40, 3, 32) - points.unsqueeze(2)) * encoded.parts["scale"].float().unsqueeze(2)
    assert torch.equal(theirs.reshape(40, 96), decoded)
    symmetric = encode(weight, [("int4", {"group_size": 32, "symmetric": True})])
    ours_error = (decoded - weight).norm()
    assert ours_error < (decode(symmetric.parts, symmetric.stages, torch.float32, (40, 96)) - weight).norm()


def test_int8_with_scales_per_group_has_no_compressed_tensors_form_and_is_written_dense(tmp_path) -> None:
    """compressed-tensors' per-channel int8 would read a (rows, groups) scale as a column of garbage: the
    grouped form is not written as it; the Hugging Face writer stores the values it decodes to instead."""
    from slimtorch.format.codecs import decode, encode
    from slimtorch.format.hf_layout import ct_form
    from slimtorch.format.writer import SlimWriter
    from slimtorch.shrinking.writing import _add
    from slimtorch.sources import open_checkpoint

    weight = torch.randn(24, 72) * torch.linspace(0.01, 3, 72)
    per_row = ct_form("fc.weight", encode(weight, ["int8"]))
    assert per_row is not None and tuple(per_row[0].parts["scale"].shape) == (24, 1)
    grouped = encode(weight, [("int8", {"group_size": 32})])
    assert ct_form("fc.weight", grouped) is None
    schemes: dict = {}
    with SlimWriter(tmp_path / "m.safetensors") as writer:
        _add(writer, "fc.weight", grouped, torch.float32, (24, 72), 8, schemes, frozenset())
    source = open_checkpoint(tmp_path / "m.safetensors")
    assert schemes == {} and source.codec("fc.weight") == "raw"
    assert torch.equal(
        source.get("fc.weight"), decode(grouped.parts, grouped.stages, torch.float32, (24, 72))
    )


def test_a_folder_another_tool_quantized_is_refused_not_copied_as_plain_weights(bases, tmp_path) -> None:
    """A compressed-tensors folder written by another tool (``weight_packed`` codes, a quantization_config)
    would come out of a shrink as codes under names transformers reads as missing: random weights."""
    _, folder = bases["bert"]
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    for file in folder.iterdir():
        (foreign / file.name).write_bytes(file.read_bytes())
    config = json.loads((foreign / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "compressed-tensors", "format": "pack-quantized"}
    (foreign / "config.json").write_text(json.dumps(config))
    with pytest.raises(FormatError, match=r"quantized \(compressed-tensors"):
        slimtorch.shrink(foreign, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    slimtorch.shrink(bases["bert"][1], tmp_path / "ours", options=ShrinkOptions(quantize="int8-weight"))
    slimtorch.shrink(tmp_path / "ours", tmp_path / "again")  # our own hf output shrinks again: it is slim
