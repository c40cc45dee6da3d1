"""slimtorch.quantize: layers swapped for int8 / int4 ones that agree with the float model, stay quantized
on disk, load back quantized with identical outputs, and never touch torch's deprecated quantization."""

from __future__ import annotations

import copy
import json
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import slimtorch
from slimtorch.cli.main import main
from slimtorch.format.codecs import decode, encode
from slimtorch.quant import kernels
from slimtorch.quant.modules import (
    Int4WeightLinear,
    Int8DynamicLinear,
    Int8WeightLinear,
    int8_dynamic_kernels,
)
from slimtorch.schemes import SCHEMES
from slimtorch.schemes import scheme as scheme_row
from tests.hostile import reseal
from tests.support.models import TokenMLP, token_ids
from tests.zoo.models import MLP

WORST_COSINE = {8: 0.999, 4: 0.98}  # by a scheme's bits: every row of slimtorch.schemes is checked


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(F.cosine_similarity(a.detach().flatten().double(), b.detach().flatten().double(), dim=0))


@pytest.mark.slow
@pytest.mark.parametrize("scheme", SCHEMES)
def test_each_scheme_swaps_every_layer_and_agrees_with_the_float_model(scheme: str) -> None:
    model = TokenMLP().eval()
    expected = model(token_ids())
    report = slimtorch.quantize(model, scheme, calibration=[token_ids()])
    kinds = {type(m).__name__ for m in (model.embed, model.up, model.down, model.head)}
    assert all(kind.startswith("Int") for kind in kinds), kinds
    assert _cosine(model(token_ids()), expected) >= WORST_COSINE[scheme_row(scheme).bits]
    assert report.output_cosine is not None and report.output_cosine >= WORST_COSINE[scheme_row(scheme).bits]
    assert {layer.name for layer in report.layers} == {"embed", "up", "down", "head"}
    assert all(layer.output_error is not None and layer.output_error < 0.15 for layer in report.layers)


def test_int8_shrinks_weights_4x_and_int4_at_most_016x_of_fp32() -> None:
    int8 = slimtorch.quantize(TokenMLP(), "int8-dynamic")
    int4 = slimtorch.quantize(TokenMLP(), "int4-weight", group_size=128)
    assert 0.25 < int8.weight_ratio < 0.26  # one byte a weight plus a float32 scale a row
    assert int4.weight_ratio <= 0.16
    assert int4.after_bytes < int8.after_bytes < 0.3 * int8.before_bytes


@pytest.mark.slow
@pytest.mark.parametrize("scheme", SCHEMES)
def test_save_then_load_model_gives_identical_outputs_and_quantized_layers(scheme: str, tmp_path) -> None:
    model = slimtorch.quantize(TokenMLP().eval(), scheme, group_size=64).model
    expected = model(token_ids())
    report = slimtorch.save_model(model, tmp_path / "q.safetensors")
    chains = {t.name: t.chain for t in report.tensors}
    assert chains["up.weight"] == ("int8" if scheme.startswith("int8") else "int4")
    profile = slimtorch.load_model(tmp_path / "q.safetensors", TokenMLP)
    loaded = profile.model
    assert type(loaded.up) is type(model.up) and type(loaded.embed) is type(model.embed)
    assert torch.equal(loaded(token_ids()), expected)
    parts = sum(len(type(m).SLIM_PARTS) for m in loaded.modules() if hasattr(type(m), "SLIM_PARTS"))
    assert profile.zero_copy >= parts  # codes and scales mapped from the file, not decoded
    assert profile.by_codec.get("raw", 0) <= 2  # the two biases


def test_a_quantized_file_still_decodes_to_float_weights_for_any_slim_reader(tmp_path) -> None:
    model = TokenMLP()
    original = model.up.weight.detach().clone()
    slimtorch.save_model(slimtorch.quantize(model, "int8-weight").model, tmp_path / "q.safetensors")
    weights = slimtorch.load(tmp_path / "q.safetensors").tensors
    assert weights["up.weight"].dtype == torch.float32 and weights["up.weight"].shape == original.shape
    assert (weights["up.weight"] - original).abs().max() <= original.abs().amax(1).max() / 254 + 1e-7


@pytest.mark.slow
def test_hugging_face_bert_and_gpt2_round_trip_quantized(tmp_path) -> None:
    pytest.importorskip("transformers")
    from tests.zoo.transformers_models import TRANSFORMERS, example, main_output

    for name in ("bert", "gpt2"):
        model = TRANSFORMERS[name]().eval()
        expected = main_output(model(*example(name)))
        report = slimtorch.quantize(model, "int8-dynamic")
        assert _cosine(main_output(model(*example(name))), expected) > 0.99
        if name == "gpt2":  # Conv1D layers are quantized; the tied embedding and LM head are not
            assert type(model.transformer.h[0].attn.c_attn) is Int8DynamicLinear
            assert "tied" in report.skipped["transformer.wte"]
        quantized = main_output(model(*example(name)))
        slimtorch.save_model(model, tmp_path / f"{name}.safetensors")
        loaded = slimtorch.load_model(tmp_path / f"{name}.safetensors", TRANSFORMERS[name]).model.eval()
        assert torch.equal(main_output(loaded(*example(name))), quantized)


def test_pruned_zeros_stay_sparse_in_the_codes_and_load_back_exactly(tmp_path) -> None:
    model = TokenMLP().eval()
    slimtorch.prune.weights(model, 0.9, method="layer_magnitude")
    slimtorch.quantize(model, "int8-dynamic", embeddings=False)
    expected = model(token_ids())
    report = slimtorch.save_model(model, tmp_path / "q.safetensors")
    assert {t.name: t.chain for t in report.tensors}["up.weight"] == "int8+sparse"
    loaded = slimtorch.load_model(tmp_path / "q.safetensors", TokenMLP).model
    assert torch.equal(loaded(token_ids()), expected)


def test_each_int8_dynamic_kernel_this_cpu_runs_is_close_to_the_float_layer() -> None:
    """Every kernel this machine admits, checked against the float layer it replaced (kernels take codes of
    their own kinds: oneDNN's 7-bit asymmetric codes on a CPU without VNNI), not
    for bit-identity with another kernel."""
    layer = nn.Linear(256, 384)
    x = torch.randn(33, 256)
    outputs = {}
    for kernel in int8_dynamic_kernels(torch.device("cpu")):
        quantized = slimtorch.quantize(
            nn.Sequential(copy.deepcopy(layer)), "int8-dynamic", kernel=kernel
        ).model
        outputs[kernel] = quantized(x)
    assert set(outputs) >= {"int_mm", "reference"}
    assert torch.equal(outputs["int_mm"], outputs["reference"])  # both the exact product of 8-bit codes
    for kernel, out in outputs.items():
        assert _cosine(out, layer(x)) > 0.9995, kernel


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weight_only_kernels_agree_with_dequantize(dtype: torch.dtype) -> None:
    layer = nn.Linear(256, 192).to(dtype)
    x = torch.randn(5, 256, dtype=dtype)
    for scheme, cls in (("int8-weight", Int8WeightLinear), ("int4-weight", Int4WeightLinear)):
        results = {}
        for kernel in cls.KERNELS:
            quantized = slimtorch.quantize(nn.Sequential(copy.deepcopy(layer)), scheme, kernel=kernel).model
            results[kernel] = quantized(x)
        assert all(r.dtype == dtype for r in results.values())
        reference = results["dequantize"].float()
        for kernel, result in results.items():
            # bfloat16 products of float32 inputs: within 1% (what kernel choice allows them)
            tolerance = 1e-2 if dtype == torch.bfloat16 or kernel.endswith("-bf16") else 1e-5
            error = torch.linalg.vector_norm(result.float() - reference) / torch.linalg.vector_norm(reference)
            assert error < tolerance, (scheme, kernel, float(error))


def test_fused_weight_only_kernels_run_on_weights_mapped_unaligned_from_a_file(tmp_path) -> None:
    # safetensors aligns data to 8 bytes; torch's bfloat16 int8 kernel would crash on such a weight
    model = slimtorch.quantize(TokenMLP().eval(), "int8-weight").model
    slimtorch.save_model(model, tmp_path / "q.safetensors")
    loaded = slimtorch.load_model(tmp_path / "q.safetensors", TokenMLP).model
    assert any(m.qweight.data_ptr() % 64 for m in (loaded.up, loaded.down, loaded.head))
    for layer in (loaded.up, loaded.down, loaded.head):
        layer.kernel = "int8pack-bf16"
        x = torch.randn(3, layer.in_features)
        assert torch.allclose(layer(x), F.linear(x, layer.dequantized(), layer.bias), rtol=0.05, atol=0.05)


@pytest.mark.slow
def test_no_deprecation_or_other_warning_from_quantize_forward_save_and_load(tmp_path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's quantized tensors warn on creation: none may be made
        for scheme in SCHEMES:
            kernels.CHOICES.clear()
            model = slimtorch.quantize(TokenMLP().eval(), scheme, calibration=[token_ids()]).model
            model(token_ids(1, 1))
            model(token_ids(8, 128))
            slimtorch.save_model(model, tmp_path / f"{scheme}.safetensors")
            slimtorch.load_model(tmp_path / f"{scheme}.safetensors", TokenMLP).model(token_ids())


def test_kernel_choice_takes_the_fastest_agreeing_candidate_and_remembers_it() -> None:
    choice = kernels.KernelChoice()
    x = torch.randn(64, 64)
    calls = {"slow": 0}

    def slow() -> torch.Tensor:
        calls["slow"] += 1
        return sum((x @ x for _ in range(20)), torch.zeros(()))

    def broken() -> torch.Tensor:
        raise RuntimeError("no kernel for this shape")

    reference = slow()
    candidates = {
        "slow": slow,
        "wrong": lambda: torch.zeros_like(reference),  # fast, and disagrees: never chosen
        "broken": broken,
        "fast": lambda: reference.clone(),
    }
    assert choice.best("key", candidates, reference="slow") == "fast"
    before = calls["slow"]
    assert choice.best("key", candidates, reference="slow") == "fast"
    assert calls["slow"] == before  # measured once per key


def test_batch_sizes_share_a_measurement_up_to_the_next_power_of_two() -> None:
    assert [kernels.batch_bucket(n) for n in (0, 1, 2, 3, 100, 128, 129)] == [1, 1, 2, 4, 128, 128, 256]


def test_shared_input_codes_follow_in_place_changes() -> None:
    codes = kernels.SharedInputCodes()
    x = torch.randn(4, 8)
    first = codes.codes(x, x)
    assert codes.codes(x, x)[0] is first[0]  # the same tensor again: quantized once
    x.mul_(2)
    again = codes.codes(x, x)
    assert again[0] is not first[0] and torch.allclose(again[1], first[1] * 2)
    with torch.inference_mode():
        y = torch.randn(4, 8)
        assert codes.codes(y, y)[0] is not codes.codes(y, y)[0]  # no version counter: never cached


@pytest.mark.slow
def test_quantized_model_can_be_deep_copied_after_running() -> None:
    model = slimtorch.quantize(TokenMLP().eval(), "int8-dynamic").model
    expected = model(token_ids())
    assert torch.equal(copy.deepcopy(model)(token_ids()), expected)


def test_layers_that_stay_float_are_reported_with_the_reason() -> None:
    model = nn.ModuleDict(
        {
            "conv": nn.Conv2d(3, 8, 3),
            "attn": nn.MultiheadAttention(64, 4),
            "keep": nn.Linear(64, 64),
            "embed": nn.Embedding(10, 64),
            "head": nn.Linear(64, 10),
        }
    )
    tied = nn.Linear(10, 64)
    model["tied"] = tied
    model["tied2"] = nn.Linear(10, 64)
    model["tied2"].weight = tied.weight
    report = slimtorch.quantize(model, "int8-dynamic", skip=["kee*"])
    assert "no convolution kernel" in report.skipped["conv"]
    assert "NonDynamicallyQuantizableLinear" in report.skipped["attn.out_proj"]
    assert "skip pattern 'kee*'" in report.skipped["keep"]
    assert "tied" in report.skipped["tied"] and "tied" in report.skipped["tied2"]
    assert {layer.name for layer in report.layers} == {"embed", "head"}


@pytest.mark.slow
def test_bfloat16_model_stays_bfloat16_and_round_trips(tmp_path) -> None:
    model = slimtorch.quantize(TokenMLP().to(torch.bfloat16).eval(), "int4-weight").model
    out = model(token_ids())
    assert out.dtype == torch.bfloat16
    slimtorch.save_model(model, tmp_path / "bf16.safetensors")
    loaded = slimtorch.load_model(tmp_path / "bf16.safetensors", lambda: TokenMLP().to(torch.bfloat16)).model
    assert torch.equal(loaded(token_ids()), out)


def test_bad_options_are_clear_errors() -> None:
    with pytest.raises(slimtorch.SlimtorchError, match="unknown scheme 'int3'"):
        slimtorch.quantize(MLP(), "int3")
    with pytest.raises(slimtorch.SlimtorchError, match="group size must be even"):
        slimtorch.quantize(MLP(), "int4-weight", group_size=33)
    with pytest.raises(slimtorch.SlimtorchError, match="kernel 'int4pack' does not compute int8-dynamic"):
        slimtorch.quantize(MLP(), "int8-dynamic", kernel="int4pack")


def test_a_float_file_into_a_quantized_model_is_refused_naming_the_layer(tmp_path) -> None:
    slimtorch.save_model(TokenMLP(), tmp_path / "float.safetensors")
    quantized = slimtorch.quantize(TokenMLP(), "int8-dynamic").model
    with pytest.raises(slimtorch.FormatError, match=r"'embed.weight' is stored unquantized.*then quantize"):
        slimtorch.load_model(tmp_path / "float.safetensors", quantized)
    torch.save(TokenMLP().state_dict(), tmp_path / "float.pt")
    with pytest.raises(slimtorch.FormatError, match="load them into the float model, then quantize"):
        slimtorch.load_model(tmp_path / "float.pt", quantized)


def test_an_unknown_scheme_in_a_file_is_refused_with_exit_2(tmp_path, capsys) -> None:
    slimtorch.save_model(slimtorch.quantize(TokenMLP(), "int8-dynamic").model, tmp_path / "q.safetensors")
    from safetensors.torch import load_file, save_file

    from slimtorch.format.container import read_metadata

    metadata = read_metadata(tmp_path / "q.safetensors")
    body = json.loads(metadata["slimtorch"])
    body["delta"]["quantized"]["up"]["scheme"] = "os.system"
    metadata["slimtorch"] = json.dumps(body)
    save_file(load_file(tmp_path / "q.safetensors"), tmp_path / "bad.safetensors", metadata=metadata)
    reseal(tmp_path / "bad.safetensors")  # the checks behind the header seal, as a deliberate edit meets them
    with pytest.raises(slimtorch.FormatError, match="not a known scheme"):
        slimtorch.load_model(tmp_path / "bad.safetensors", TokenMLP)
    assert main(["load", str(tmp_path / "bad.safetensors"), "--model", "tests.support.models:TokenMLP"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not a known scheme" in err[0]


def test_int4_codes_of_a_layer_equal_what_the_codec_writes() -> None:
    layer = nn.Linear(256, 64)
    quantized = slimtorch.quantize(nn.Sequential(layer), "int4-weight", group_size=64).model[0]
    encoded = encode(layer.weight.detach(), [("int4", {"group_size": 64, "flat": False})])
    assert all(torch.equal(quantized.parts()[role], part) for role, part in encoded.parts.items())


@pytest.mark.slow
def test_cli_quantizes_reports_and_writes_a_file_load_model_reads(tmp_path, capsys) -> None:
    out = tmp_path / "mlp.safetensors"
    args = ["quantize", "tests.zoo.models:MLP", "-o", str(out), "--input-shape", "8,64", "--runs", "2"]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "cosine similarity" in text and "Int8DynamicLinear" in text and "wrote" in text
    loaded = slimtorch.load_model(out, MLP).model
    assert type(loaded.layers[0]) is Int8DynamicLinear
    assert main([*args, "--scheme", "int4-weight", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["schema"] == "slimtorch.quantize/1" and data["scheme"] == "int4-weight"
    assert data["output_cosine"] > 0.98 and data["file_bytes"] == out.stat().st_size


def test_cli_bad_group_size_is_a_usage_error_with_exit_2(tmp_path, capsys) -> None:
    args = [
        "quantize",
        "tests.zoo.models:MLP",
        "-o",
        str(tmp_path / "x.safetensors"),
        "--input-shape",
        "2,64",
    ]
    with pytest.raises(SystemExit) as exit_:  # a usage error, found while parsing, before any work
        main([*args, "--scheme", "int4-weight", "--group-size", "33"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        err[-1] == "slimtorch: error: argument --group-size: int4 group size must be even, 32 to 256, not 33"
    )


def _correlated_inputs(rows: int, seed: int) -> torch.Tensor:
    """Inputs near a 16-dimensional subspace of their 128 features, as a layer's real inputs are."""
    generator = torch.Generator().manual_seed(seed)
    basis = torch.randn(16, 128, generator=torch.Generator().manual_seed(7))
    return torch.randn(rows, 16, generator=generator) @ basis + 0.1 * torch.randn(
        rows, 128, generator=generator
    )


@pytest.mark.slow
def test_gptq_codes_cut_the_output_error_of_int4_on_inputs_it_never_saw() -> None:
    layer = nn.Linear(128, 96).requires_grad_(False)
    held_out = _correlated_inputs(256, seed=2)
    expected = layer(held_out)
    rounded = slimtorch.quantize(nn.Sequential(copy.deepcopy(layer)), "int4-weight", group_size=32).model
    calibration = [_correlated_inputs(64, seed=s) for s in (10, 11, 12, 13)]
    gptq = slimtorch.quantize(
        nn.Sequential(copy.deepcopy(layer)), "int4-weight", group_size=32, calibration=calibration
    ).model

    def error(model: nn.Module) -> float:
        difference = torch.linalg.vector_norm(model(held_out) - expected)
        return float(difference / torch.linalg.vector_norm(expected))

    assert error(gptq) < 0.5 * error(rounded)


@pytest.mark.slow
def test_gptq_parts_are_plain_int4_codec_parts_that_decode_to_what_the_layer_computes(tmp_path) -> None:
    model = slimtorch.quantize(
        TokenMLP().eval(), "int4-weight", group_size=64, calibration=[token_ids()], kernel="dequantize"
    ).model
    x = torch.randn(3, 256)
    by_hand = F.linear(x, decode(*_decode_args(model.up)), model.up.bias)
    assert torch.allclose(model.up(x), by_hand, atol=1e-5)
    slimtorch.save_model(model, tmp_path / "gptq.safetensors")
    stored = slimtorch.load(tmp_path / "gptq.safetensors").tensors
    assert torch.equal(stored["up.weight"], model.up.dequantized())


def _decode_args(layer) -> tuple:
    encoded = layer.encoded()
    return encoded.parts, encoded.stages, torch.float32, tuple(encoded.stages[0]["shape"])


def test_gptq_falls_back_to_rounding_where_groups_do_not_tile_the_inputs() -> None:
    layer = nn.Linear(100, 16)  # 100 inputs: not a whole number of groups of 64
    expected = slimtorch.quantize(nn.Sequential(copy.deepcopy(layer)), "int4-weight", group_size=64).model
    with_data = slimtorch.quantize(
        nn.Sequential(copy.deepcopy(layer)), "int4-weight", group_size=64, calibration=[torch.randn(8, 100)]
    ).model
    pairs = zip(expected[0].parts().values(), with_data[0].parts().values(), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)


@pytest.mark.slow
def test_int8_dynamic_outputs_are_bit_identical_after_loading_in_another_process(tmp_path) -> None:
    # The same kernel on the same codes gives the same bits in any process; a kernel a new process measures
    # fastest may take other activation codes (7-bit ones where oneDNN's 8-bit product saturates), so
    # left to choose, it agrees within the kernels' accuracy.
    import subprocess
    import sys

    model = slimtorch.quantize(TokenMLP().eval(), "int8-dynamic").model
    slimtorch.save_model(model, tmp_path / "q.safetensors")
    out = model(token_ids())
    chosen = {
        name: m.kernel_at(token_ids().numel(), torch.float32, torch.device("cpu"))
        for name, m in model.named_modules()
        if isinstance(m, Int8DynamicLinear)
    }
    torch.save({"ids": token_ids(), "out": out, "chosen": chosen}, tmp_path / "expected.pt")
    script = (
        "import sys, torch, slimtorch\n"
        "from tests.support.models import TokenMLP\n"
        f"expected = torch.load({str(tmp_path / 'expected.pt')!r})\n"
        f"model = slimtorch.load_model({str(tmp_path / 'q.safetensors')!r}, TokenMLP).model\n"
        "free = model(expected['ids'])\n"
        "cosine = torch.nn.functional.cosine_similarity(free.flatten(), expected['out'].flatten(), dim=0)\n"
        "for name, kernel in expected['chosen'].items():\n"
        "    model.get_submodule(name).kernel = kernel\n"
        "same = torch.equal(model(expected['ids']), expected['out'])\n"
        "sys.exit(0 if same and cosine > 0.999 else 1)\n"
    )
    root = Path(__file__).resolve().parent.parent
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=root
    )
    assert result.returncode == 0, result.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["int8-weight", "int4-weight"])
def test_weight_only_schemes_quantize_convolutions_and_round_trip_them(scheme: str, tmp_path) -> None:
    from tests.zoo.models import SmallCNN

    model = SmallCNN().eval()
    images = torch.randn(4, 1, 8, 8, generator=torch.Generator().manual_seed(3))
    expected = model(images)
    report = slimtorch.quantize(model, scheme, group_size=32)
    assert {layer.name for layer in report.layers} == {"features.0", "features.3", "head"}
    assert type(model.features[0]).__name__.endswith("WeightConv")
    assert _cosine(model(images), expected) > (0.999 if scheme == "int8-weight" else 0.98)
    quantized = model(images)
    slimtorch.save_model(model, tmp_path / "cnn.safetensors")
    loaded = slimtorch.load_model(tmp_path / "cnn.safetensors", SmallCNN).model.eval()
    assert type(loaded.features[3]) is type(model.features[3])
    assert torch.equal(loaded(images), quantized)


def test_int8_dynamic_leaves_convolutions_float_and_says_why() -> None:
    from tests.zoo.models import SmallCNN

    report = slimtorch.quantize(SmallCNN(), "int8-dynamic")
    assert "no convolution kernel" in report.skipped["features.0"]
    assert [layer.name for layer in report.layers] == ["head"]


def test_a_weight_holding_inf_stays_float_with_the_reason() -> None:
    model = TokenMLP()
    with torch.no_grad():
        model.down.weight[0, 0] = float("inf")
    report = slimtorch.quantize(model, "int8-dynamic")
    assert "cannot be quantized" in report.skipped["down"] and type(model.down) is nn.Linear
    assert type(model.up) is Int8DynamicLinear


@pytest.mark.slow
@pytest.mark.parametrize("scheme", SCHEMES)
def test_quantize_and_run_under_inference_mode(scheme: str) -> None:
    with torch.inference_mode():
        model = TokenMLP().eval()
        expected = model(token_ids())
        slimtorch.quantize(model, scheme)
        assert _cosine(model(token_ids()), expected) > WORST_COSINE[scheme_row(scheme).bits]


def test_a_packed_weight_survives_new_batch_sizes_once_its_kernel_was_chosen() -> None:
    layer = slimtorch.quantize(
        nn.Sequential(nn.Linear(256, 128)), "int4-weight", kernel="int4pack-bf16"
    ).model[0]
    layer.kernel = None
    kernels.CHOICES.clear()
    built = []
    real = kernels.int4pack_weight

    def counting(*args, **kwargs):
        built.append(1)
        return real(*args, **kwargs)

    kernels.int4pack_weight = counting
    try:
        # small batches measured fastest on the fused bf16 kernel, large ones on dequantize-then-matmul
        for rows in (1, 3, 64, 1, 3):
            winner = "int4pack-bf16" if rows < 8 else "dequantize-bf16"
            kernels.CHOICES._best[_key(layer, rows)] = winner
            layer(torch.randn(rows, 256))
    finally:
        kernels.int4pack_weight = real
    assert len(built) == 1  # packed once, kept across buckets


def _key(layer, rows: int) -> tuple:
    shape = tuple(layer.stage["shape"])
    return (
        type(layer).__name__,
        shape,
        layer.stage.get("group_size"),
        kernels.batch_bucket(rows),
        torch.float32,
        "cpu",
        torch.get_num_threads(),
    )
