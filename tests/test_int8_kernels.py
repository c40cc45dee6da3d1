"""int8-dynamic's kernels: the row quantization, each kernel against the float64 reference, and the layer's
fast path (a kernel remembered per batch size) under every grad mode. No timings are asserted here."""

from __future__ import annotations

import copy
import gc
import math
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import slimtorch
from slimtorch.quant import kernels, modules, rowcodes
from slimtorch.quant.modules import Int8DynamicLinear

# the kernels this CPU runs (oneDNN's 8-bit product only where it does not saturate: VNNI)
AVAILABLE = modules.int8_dynamic_kernels(torch.device("cpu"))
FAST = [k for k in AVAILABLE if k != "reference"]
EXACT = {"reference", "int_mm", "onednn", "onednn-u7"}  # the product of their codes, exactly
MODES = {"grad": torch.enable_grad, "no_grad": torch.no_grad, "inference_mode": torch.inference_mode}
SHAPES = [(1, 7, 5), (3, 64, 33), (128, 384, 384), (17, 100, 1)]  # rows, in, out: odd sizes and batch 1


def _layer(inputs: int, outputs: int, bias: bool = True, kernel: str | None = None) -> Int8DynamicLinear:
    torch.manual_seed(inputs * 1000 + outputs)
    model = slimtorch.quantize(nn.Sequential(nn.Linear(inputs, outputs, bias=bias)), "int8-dynamic").model
    layer = model[0]
    layer.kernel = kernel
    return layer


def _reference(layer: Int8DynamicLinear, x: torch.Tensor, codes: str = "uint8") -> torch.Tensor:
    """The exact product of ``x``'s row codes of that kind and the weight's, in float64."""
    values, params = kernels.quantize_rows(x.reshape(-1, layer.in_features), codes)
    q, weight_scale = layer.qweight.double(), layer.weight_scale.double()
    if codes in rowcodes.ASYMMETRIC:  # codes minus each row's zero point: scale * codes - shift
        scale, shift = params.double().unbind(1)
        product = scale[:, None] * (values.double() @ q.t()) - shift[:, None] * q.sum(dim=1)
    else:
        signed = values.double() - (0 if codes == "int8" else 128)
        product = params.double() * (signed @ q.t())
    out = (product * weight_scale).float() + (0 if layer.bias is None else layer.bias)
    return out.reshape(*x.shape[:-1], layer.out_features)


def _expected(layer: Int8DynamicLinear, x: torch.Tensor) -> torch.Tensor:
    """What the kernel the layer runs on ``x`` gives: the exact product of the codes it takes, or for
    the kernels' codes differ only in kind (8-bit, signed, 7-bit asymmetric)."""
    x2d = x.reshape(-1, layer.in_features)
    kernel = layer.kernel or layer.kernel_at(x2d.shape[0], x.dtype, x.device)
    return _reference(layer, x, modules.CODES_OF[kernel])


def _float_error(layer: Int8DynamicLinear, x: torch.Tensor, out: torch.Tensor) -> float:
    """``out``'s L2 error against the float product of ``x`` and the dequantized weight."""
    truth = nn.functional.linear(x, layer.dequantized(torch.float32), layer.bias)
    return float(torch.linalg.vector_norm(out - truth))


@pytest.mark.slow
def test_row_codes_are_rounded_values_over_a_symmetric_per_row_scale() -> None:
    x = torch.randn(9, 31) * torch.logspace(-3, 3, 9).unsqueeze(1)
    codes, scale = kernels.quantize_rows(x)
    assert codes.dtype == torch.uint8 and codes.shape == x.shape and scale.shape == (9, 1)
    assert torch.allclose(scale, x.abs().amax(dim=1, keepdim=True) / 127)
    signed = codes.int() - 128
    assert signed.abs().max() == 127 and signed.min() >= -127
    # the nearest code, up to float rounding of the product at a tie
    assert (signed - x / scale).abs().max() <= 0.5 + 1e-4


def test_a_zero_row_gets_zero_codes_and_no_nan() -> None:
    x = torch.randn(3, 8)
    x[1] = 0
    codes, scale = kernels.quantize_rows(x)
    assert torch.equal(codes[1], torch.full((8,), 128, dtype=torch.uint8))
    assert torch.isfinite(scale).all() and scale[1] > 0


@pytest.mark.parametrize("kernel", FAST)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("bias", [True, False])
def test_each_kernel_computes_its_codes_exactly_or_within_the_accuracy_rule(
    kernel: str, shape: tuple[int, int, int], bias: bool
) -> None:
    rows, inputs, outputs = shape
    layer = _layer(inputs, outputs, bias, kernel)
    x = torch.randn(rows, inputs)
    out = layer(x)
    assert out.shape == (rows, outputs) and out.dtype == torch.float32
    if kernel in EXACT:
        assert torch.allclose(out, _reference(layer, x, modules.CODES_OF[kernel]), rtol=1e-4, atol=1e-5)
    else:  # codes of its own: judged as the kernel choice admits it, against the float product
        allowed = kernels.ACCURACY_FACTOR * _float_error(layer, x, _reference(layer, x))
        assert _float_error(layer, x, out) <= allowed + 1e-3 * float(torch.linalg.vector_norm(out))


@pytest.mark.parametrize("mode", list(MODES))
def test_every_grad_mode_gives_the_same_output_without_a_graph(mode: str) -> None:
    layer = _layer(48, 24)
    x = torch.randn(2, 5, 48)
    expected = _expected(layer, x)
    with MODES[mode]():
        for _ in range(2):  # the first call chooses the kernel, the second takes the fast path
            out = layer(x)
            assert out.shape == (2, 5, 24) and not out.requires_grad
            assert torch.allclose(out, expected, rtol=1e-4, atol=1e-5)


def test_a_kernel_forced_after_the_first_call_takes_effect(monkeypatch) -> None:
    layer = _layer(32, 16)
    x = torch.randn(4, 32)
    layer(x)
    calls = []
    real = kernels.reference_int8_linear
    monkeypatch.setattr(kernels, "reference_int8_linear", lambda *a: calls.append(1) or real(*a))
    layer.kernel = "reference"
    layer(x)
    assert calls == [1]


def test_kernels_are_timed_in_turns_over_weights_of_their_own_and_the_copies_are_dropped(monkeypatch) -> None:
    from slimtorch.quant import modules

    kernels.CHOICES.clear()
    monkeypatch.setattr(kernels, "SLOW", math.inf)  # int_mm stays in every round, however slow here
    layer = _layer(256, 128)  # 32 KiB of codes: the turn holds MAX_TWINS copies and the layer
    seen: list[int] = []
    real = kernels.int_mm_int8_linear
    monkeypatch.setattr(
        kernels, "int_mm_int8_linear", lambda c, s, q, *a: seen.append(q.data_ptr()) or real(c, s, q, *a)
    )
    x = torch.randn(16, 256)
    out = layer(x)
    assert torch.allclose(out, _expected(layer, x), rtol=1e-4, atol=1e-5)
    own, turn = layer.qweight.data_ptr(), modules.MAX_TWINS + 1
    # int_mm packs nothing, so no copy runs it before it is timed (modules.PACKED)
    assert seen[0] == own  # the agreement check: the turn's first call, on the layer itself
    rounds = next(iter(kernels.CHOICES.decisions().values())).rounds
    timed = seen[1 : 1 + rounds]  # then one call a round, each on the next weight of the turn
    assert len(timed) == rounds and len(set(timed)) == min(rounds, turn)
    assert [ptr == own for ptr in timed] == [i % turn == 0 for i in range(1, rounds + 1)]
    assert seen[1 + rounds :] in ([], [own])  # the forward itself, on the layer's own weight
    gc.collect()
    alive = [
        v for v in kernels._LAYERS.values() if v is not layer and getattr(v, "qweight", None) is not None
    ]
    assert not [v for v in alive if v.qweight.shape == layer.qweight.shape]  # no copy outlives the choice


def test_a_shape_timed_already_or_a_forced_kernel_makes_no_copies(monkeypatch) -> None:
    from slimtorch.quant import modules

    kernels.CHOICES.clear()
    made: list[int] = []
    real = modules.Int8DynamicLinear._twins
    monkeypatch.setattr(
        modules.Int8DynamicLinear, "_twins", lambda self, *a: made.append(1) or real(self, *a)
    )
    first, second, forced = _layer(96, 48), _layer(96, 48), _layer(96, 48, kernel="reference")
    x = torch.randn(8, 96)
    for layer in (first, second, forced):
        layer(x)
    assert made == [1]  # the first layer's choice; the second found it made, the forced one timed nothing


@pytest.mark.parametrize("kernel", FAST)
def test_new_weights_written_in_place_are_used_by_the_next_call(kernel: str) -> None:
    layer = _layer(64, 32, kernel=kernel)
    x = torch.randn(8, 64)
    before = layer(x)
    layer.qweight.neg_()  # a packed copy of the old weight must not survive this
    after = layer(x)
    assert torch.allclose(after, _expected(layer, x), rtol=1e-4, atol=1e-5)
    assert not torch.allclose(after, before)


def test_query_key_and_value_share_one_quantization_of_their_input_under_no_grad(monkeypatch) -> None:
    layers = [_layer(40, 40) for _ in range(3)]
    x = torch.randn(6, 40)
    for layer in layers:
        layer(x)  # the first call of a batch size chooses its kernel, on codes of its own
    quantized = []
    real = kernels.quantize_rows
    monkeypatch.setattr(kernels, "quantize_rows", lambda *a: quantized.append(1) or real(*a))
    kernels.SHARED_INPUTS.clear()
    with torch.no_grad():
        outs = [layer(x) for layer in layers]
    assert len(quantized) == 1
    for layer, out in zip(layers, outs, strict=True):
        assert torch.allclose(out, _expected(layer, x), rtol=1e-4, atol=1e-5)
    kernels.SHARED_INPUTS.clear()


def test_a_copy_made_after_running_computes_the_same() -> None:
    layer = _layer(32, 16)
    x = torch.randn(3, 32)
    expected = layer(x)
    assert torch.equal(copy.deepcopy(layer)(x), expected)


# -- the fused row quantization (numba), against torch's operations ---------------------------------------
def _edge_inputs() -> dict[str, torch.Tensor]:
    torch.manual_seed(21)
    wide = torch.randn(64, 257) * torch.logspace(-30, 30, 64).unsqueeze(1)
    ties = torch.arange(-300, 301, dtype=torch.float32).reshape(1, -1) / 2  # halves: round to even
    tiny = torch.full((2, 5), 1e-42)  # subnormal rows
    zeros = torch.randn(4, 9)
    zeros[1:3] = 0
    zeros[3] = -0.0
    return {
        "random": torch.randn(128, 384),
        "large batch": torch.randn(2048, 96),
        "wide range": wide,
        "ties": torch.cat([ties, ties * 3.7]),
        "subnormal": tiny,
        "zero rows": zeros,
        "one element": torch.tensor([[-2.5]]),
        "no rows": torch.empty(0, 16),
        "odd size": torch.randn(3, 7),
    }


@pytest.mark.parametrize("codes_kind", list(rowcodes.CODES))
@pytest.mark.parametrize("name", list(_edge_inputs()))
def test_fused_row_codes_equal_torch_ops_bit_for_bit(name: str, codes_kind: str) -> None:
    pytest.importorskip("numba")
    x = _edge_inputs()[name]
    fused = rowcodes.quantize_rows_fused(x, codes_kind)
    assert fused is not None, rowcodes.describe()
    codes, scale = kernels.quantize_rows_torch(x, codes_kind)
    assert fused[0].dtype == codes.dtype
    assert fused[1].dtype == torch.float32
    assert torch.equal(fused[0], codes) and torch.equal(fused[1], scale)


def test_a_million_random_row_maxima_give_the_same_scales_and_codes() -> None:
    pytest.importorskip("numba")
    torch.manual_seed(3)
    x = torch.randn(2**17, 8) * torch.exp(torch.randn(2**17, 1) * 20)
    fused = rowcodes.quantize_rows_fused(x)
    assert fused is not None
    codes, scale = kernels.quantize_rows_torch(x)
    assert torch.equal(fused[1], scale) and torch.equal(fused[0], codes)


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan, -math.nan])
def test_rows_with_inf_or_nan_leave_the_fused_kernel_for_torch_ops(bad: float) -> None:
    x = torch.randn(4, 16)
    x[2, 5] = bad
    assert rowcodes.quantize_rows_fused(x) is None
    assert rowcodes.quantize_rows_fused(x, "uint7") is None
    codes, scale = kernels.quantize_rows(x)
    expected = kernels.quantize_rows_torch(x)
    assert torch.equal(codes, expected[0])
    torch.testing.assert_close(scale, expected[1], rtol=0, atol=0, equal_nan=True)


def test_inputs_the_kernel_does_not_take_get_torch_ops_with_the_same_codes() -> None:
    x = torch.randn(16, 40)
    for other in (x.t().contiguous().t(), x[:, ::2], x.double(), x.bfloat16()):
        assert rowcodes.quantize_rows_fused(other) is None
        codes, scale = kernels.quantize_rows(other)
        expected = kernels.quantize_rows_torch(other.float().contiguous())
        assert torch.equal(codes, expected[0]) and torch.equal(scale, expected[1])


def test_an_input_that_requires_grad_is_quantized_without_a_graph() -> None:
    x = torch.randn(5, 12, requires_grad=True)
    codes, scale = kernels.quantize_rows(x)
    assert not scale.requires_grad
    assert torch.equal(codes, kernels.quantize_rows_torch(x.detach())[0])


@pytest.mark.slow
def test_without_numba_the_layer_runs_torch_ops_and_says_so(monkeypatch) -> None:
    layer = _layer(64, 32)
    x = torch.randn(7, 64)
    expected = layer(x)
    monkeypatch.setattr(rowcodes, "_loaded", lambda: (None, "torch ops (numba is not installed)"))
    assert not rowcodes.prepare() and rowcodes.describe().startswith("torch ops")
    assert rowcodes.quantize_rows_fused(x) is None
    assert torch.equal(layer(x), expected)
    report = slimtorch.quantize(torch.nn.Sequential(torch.nn.Linear(64, 32)), "int8-dynamic")
    assert "activation rows quantized with torch ops (numba is not installed)" in report.kernels


def test_many_threads_on_a_large_input_leave_it_to_torchs_parallel_ops(monkeypatch) -> None:
    monkeypatch.setattr(torch, "get_num_threads", lambda: 16)
    assert rowcodes.quantize_rows_fused(torch.randn(2048, 384)) is None
    small = torch.randn(128, 384)
    assert (rowcodes.quantize_rows_fused(small) is None) == (not rowcodes.prepare())


def test_the_kernel_is_compiled_when_a_layer_is_made(monkeypatch) -> None:
    calls = []
    monkeypatch.setattr(rowcodes, "prepare", lambda: calls.append(1) or True)
    layer = _layer(8, 4)
    copy.deepcopy(layer)
    assert len(calls) == 2


@pytest.mark.parametrize("shape", [(128, 384), (3, 5), (1, 1)])
@pytest.mark.parametrize("bias", [True, False])
def test_fused_scaling_of_an_int32_product_equals_mul_then_scale_back(
    shape: tuple[int, int], bias: bool
) -> None:
    pytest.importorskip("numba")
    torch.manual_seed(shape[0])
    product = torch.randint(-(2**24), 2**24, shape, dtype=torch.int32)
    weight_scale, row_scale = torch.rand(shape[1]) / 100, torch.rand(shape[0], 1) / 10
    b = torch.randn(shape[1]) if bias else None
    fused = rowcodes.scale_product_fused(product, weight_scale, row_scale, b)
    assert fused is not None
    assert torch.equal(fused, kernels.scale_back(torch.mul(product, weight_scale), row_scale, b))


def test_scaling_shapes_that_do_not_fit_are_left_to_torch() -> None:
    product = torch.ones(4, 6, dtype=torch.int32)
    assert rowcodes.scale_product_fused(product, torch.ones(5), torch.ones(4, 1), None) is None
    assert rowcodes.scale_product_fused(product, torch.ones(6), torch.ones(4, 1), torch.ones(3)) is None
    assert rowcodes.scale_product_fused(product, torch.ones(6).double(), torch.ones(4, 1), None) is None


# -- signed codes for torch._int_mm, and codes shared inside one attention call ---------------------------
@pytest.mark.parametrize("name", list(_edge_inputs()))
def test_signed_codes_are_the_unsigned_ones_less_128_by_both_paths(name: str) -> None:
    x = _edge_inputs()[name]
    codes, scale = kernels.quantize_rows_torch(x)
    signed, signed_scale = kernels.quantize_rows_torch(x, "int8")
    assert signed.dtype == torch.int8 and torch.equal(signed_scale, scale)
    assert torch.equal(signed.int(), codes.int() - 128)
    if rowcodes.prepare():
        fused = rowcodes.quantize_rows_fused(x, "int8")
        assert fused is not None and fused[0].dtype == torch.int8
        assert torch.equal(fused[0], signed) and torch.equal(fused[1], scale)


def test_the_fused_kernel_refuses_inputs_it_does_not_take_without_raising() -> None:
    x = torch.randn(6, 10)
    for other in (x.t(), x[:, ::3], x.double(), x.unsqueeze(0), x.to(torch.float16)):
        assert rowcodes.quantize_rows_fused(other, "int8") is None
    scales = torch.ones(10), torch.ones(6, 1)
    for product in (torch.ones(10, 6, dtype=torch.int32).t(), torch.ones(6, 10, dtype=torch.int64)):
        assert rowcodes.scale_product_fused(product, *scales, None) is None


def _tiny_bert(layers: int = 2) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=99, hidden_size=32, num_hidden_layers=layers, num_attention_heads=4, intermediate_size=64
    )
    return transformers.BertModel(config, add_pooling_layer=False).eval()


def _counting(monkeypatch) -> list[int]:
    calls: list[int] = []
    real = kernels.quantize_rows
    monkeypatch.setattr(kernels, "quantize_rows", lambda *a: calls.append(1) or real(*a))
    return calls


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_bert_attention_quantizes_its_input_once_for_query_key_and_value(mode: str, monkeypatch) -> None:
    model = slimtorch.quantize(_tiny_bert(), "int8-dynamic").model
    for layer in model.modules():  # every layer on a kernel that takes row codes (whichever this CPU runs)
        if isinstance(layer, Int8DynamicLinear):
            layer.kernel = "int_mm"
    ids = torch.randint(0, 99, (2, 9))
    with MODES[mode]():
        model(ids)  # each batch size chooses its kernels first
        calls = _counting(monkeypatch)
        shared = model(ids).last_hidden_state
        assert len(calls) == 2 * 4  # per layer: q/k/v once, attention output, intermediate, output
        monkeypatch.setattr(kernels.SHARED_INPUTS, "open", lambda: None)  # no scope: every layer its own
        alone = model(ids).last_hidden_state
    assert torch.equal(shared, alone)
    assert getattr(kernels.SHARED_INPUTS._local, "depth", 0) == 0


def test_inside_no_scope_an_inference_input_changed_in_place_is_quantized_again() -> None:
    class Residual(nn.Module):  # changes its input in place between its layers' calls: never a sharing parent
        def __init__(self) -> None:
            super().__init__()
            self.first, self.second = nn.Linear(16, 16), nn.Linear(16, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x += self.first(x)
            x += self.second(x)
            return x

    torch.manual_seed(1)
    model = Residual()
    quantized = slimtorch.quantize(copy.deepcopy(model), "int8-dynamic").model
    x = torch.randn(3, 16)
    with torch.inference_mode():
        expected = x.clone()
        expected = expected + quantized.first(expected)
        expected = expected + quantized.second(expected)
        got = quantized(x.clone())
    assert torch.equal(got, expected)


def test_a_forward_that_raises_closes_its_sharing_scope() -> None:
    model = slimtorch.quantize(_tiny_bert(1), "int8-dynamic").model
    attention = model.encoder.layer[0].attention.self
    with torch.inference_mode(), pytest.raises(RuntimeError):
        attention(torch.randn(1, 3, 31))  # the wrong width
    assert getattr(kernels.SHARED_INPUTS._local, "depth", 0) == 0
    assert getattr(kernels.SHARED_INPUTS._local, "last", None) is None


@pytest.mark.slow
def test_codes_cached_in_one_call_are_not_reused_after_the_input_changes_between_calls() -> None:
    model = slimtorch.quantize(_tiny_bert(1), "int8-dynamic").model
    attention = model.encoder.layer[0].attention.self
    with torch.inference_mode():
        x = torch.randn(1, 5, 32)
        attention(x)
        x.mul_(3).add_(1)  # in place, outside the call: the next call must quantize it anew
        again = attention(x)[0]
        fresh = attention(x.clone())[0]
    assert torch.equal(again, fresh)


def test_sharing_is_set_up_once_per_parent_and_again_in_a_loaded_model(tmp_path) -> None:
    from slimtorch.quant import recorded, sharing

    model = slimtorch.quantize(_tiny_bert(), "int8-dynamic").model
    assert sharing.share_input_codes(model) == 2  # set up by quantize already: no second hooks
    attention = model.encoder.layer[0].attention.self
    assert list(attention._forward_pre_hooks.values()).count(sharing._open_sharing) == 1
    fresh = _tiny_bert()
    layers = {
        n: {"scheme": "int8-dynamic", "dtype": "float32"}
        for n in ("encoder.layer.0.attention.self.query", "encoder.layer.0.attention.self.key")
    }
    recorded.restore(fresh, layers)
    assert sharing._open_sharing in fresh.encoder.layer[0].attention.self._forward_pre_hooks.values()
    assert not fresh.encoder.layer[1].attention.self._forward_pre_hooks


# -- right on every CPU: saturation, the accuracy rule, the 7-bit asymmetric codes -------------------------
def test_asymmetric_codes_hold_zero_exactly_and_each_value_within_half_a_step() -> None:
    x = torch.cat([torch.nn.functional.gelu(torch.randn(6, 300)), -torch.rand(1, 300), torch.rand(1, 300)])
    x[:, 0] = 0
    codes, params = kernels.quantize_rows(x, "uint7")
    scale, shift = params.unbind(1)
    assert codes.dtype == torch.uint8 and int(codes.max()) <= 127 and params.shape == (8, 2)
    values = codes.float() * scale[:, None] - shift[:, None]
    assert torch.all(values[:, 0] == 0)  # a zero (padding, a ReLU's) stays zero
    assert torch.all((values - x).abs() <= scale[:, None] * 0.5 * (1 + 1e-5) + 1e-7)
    # a GELU's skewed rows get about twice the resolution of symmetric codes of the same width
    gelu = x[:6]
    assert torch.all(scale[:6] < 0.6 * gelu.abs().amax(dim=1) / 63)


@pytest.mark.slow
def test_every_kernel_here_is_close_to_the_float_layer() -> None:
    """Each kernel this CPU admits, against the float layer it replaced (not against another kernel): on
    symmetric and on skewed (GELU) rows, the int8 layer's output within cosine 0.9995 of nn.Linear's."""
    torch.manual_seed(43)
    linear = nn.Linear(384, 1536)
    for rows in (torch.randn(128, 384), torch.nn.functional.gelu(torch.randn(128, 384) * 2)):
        expected = linear(rows).detach()
        for kernel in AVAILABLE:
            layer = slimtorch.quantize(nn.Sequential(copy.deepcopy(linear)), "int8-dynamic", kernel=kernel)
            out = layer.model(rows)
            cosine = torch.nn.functional.cosine_similarity(out.flatten(), expected.flatten(), dim=0)
            assert cosine > 0.9995, (kernel, float(cosine))


def test_a_saturating_onednn_product_is_never_a_candidate(monkeypatch) -> None:
    """Where the CPU adds byte products in saturating int16 (no VNNI), oneDNN's 8-bit kernel is left out;
    its 7-bit one is kept where it is exact. Saturation is simulated on any CPU."""
    if not kernels.onednn_available():
        pytest.skip("no oneDNN in this build")
    real = kernels.onednn_product

    def saturating(codes, packed, weight_scale, zero_point=128):
        out = real(codes, packed, weight_scale, zero_point)
        return out if int(codes.max()) < 128 else out * 0.9  # what int16 clipping does to a large sum

    monkeypatch.setattr(kernels, "onednn_product", saturating)
    kernels.onednn_exact.cache_clear()
    try:
        assert not kernels.onednn_exact("uint8") and kernels.onednn_exact("uint7")
        here = modules.int8_dynamic_kernels(torch.device("cpu"))
        assert "onednn" not in here and "onednn-u7" in here
    finally:
        kernels.onednn_exact.cache_clear()


def test_forcing_a_kernel_this_cpu_does_not_run_right_warns_and_runs_the_reference(monkeypatch) -> None:
    monkeypatch.setattr(modules, "int8_dynamic_kernels", lambda device: ("reference", "int_mm"))
    modules._warn_once.cache_clear()
    layer = _layer(24, 12, kernel="onednn")
    x = torch.randn(3, 24)
    with pytest.warns(RuntimeWarning, match="'onednn' does not run right here"):
        out = layer(x)
    assert torch.allclose(out, _reference(layer, x), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_quantize_says_which_kernel_each_shape_got_and_why() -> None:
    kernels.CHOICES.clear()
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 32))
    report = slimtorch.quantize(model, "int8-dynamic", calibration=[torch.randn(16, 64)])
    lines = [line for line in report.kernels if " rows: " in line]
    assert any(line.startswith("64->256 at 16 rows: ") for line in lines), report.kernels
    assert any(line.startswith("256->32 at 16 rows: ") for line in lines), report.kernels
    chosen = {line.split(": ", 1)[1].split(",")[0].split(" ")[0] for line in lines}
    assert chosen <= set(AVAILABLE)
    if kernels.onednn_available() and not kernels.onednn_exact("uint8"):
        assert any("saturates on this CPU" in line for line in report.kernels)


CAPPED = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}


@pytest.mark.slow
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="the ISA caps are x86's")
def test_the_kernel_tests_pass_again_on_a_cpu_without_vnni(tmp_path) -> None:
    """Every test of this module and of the kernel choice, once more in a fresh process with the ISA capped
    to AVX2 (no VNNI), as on an AVX2 EPYC: there oneDNN's 8-bit product saturates and must be left out."""
    if os.environ.get("ONEDNN_MAX_CPU_ISA"):
        pytest.skip("already running under an ISA cap")
    env = {**os.environ, **CAPPED}
    probe = subprocess.run(
        [sys.executable, "-c", "from slimtorch.quant import kernels; print(kernels.onednn_exact('uint8'))"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert probe.returncode == 0 and probe.stdout.strip() in ("False", ""), probe.stderr[-2000:]
    tests = Path(__file__).parent
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-x",
            str(tests / "test_int8_kernels.py"),
            str(tests / "test_kernel_choice.py"),
            "-k",
            "not test_the_kernel_tests_pass_again",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        cwd=tmp_path,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
