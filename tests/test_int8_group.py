"""int8-group-weight: int8 weights with a scale per group of inputs, a row of the scheme table and one layer
class. What every scheme must do (swap the layers its row names, save, load back in a fresh process, build
empty for loading, export, be offered by the commands that can store it) is checked by the tests
parametrized over ``slimtorch.schemes.SCHEMES``; here, what this scheme is for."""

from __future__ import annotations

import copy

import torch
from torch import nn

import slimtorch
from slimtorch.quant.kernels import BF16_AGREEMENT
from slimtorch.quant.modules import Int8GroupWeightLinear
from slimtorch.schemes import WEIGHT_ONLY, WRITTEN


def _with_outliers() -> nn.Sequential:
    """A linear layer whose rows each hold one large weight among small ones, as LLM projections do."""
    torch.manual_seed(0)
    linear = nn.Linear(256, 64)
    with torch.no_grad():
        linear.weight.normal_(0, 0.02)
        linear.weight[torch.arange(64), torch.randint(0, 256, (64,))] = 1.0
    return nn.Sequential(linear).eval()


def _error_away_from_the_outliers(model: nn.Module, float_model: nn.Module) -> float:
    """Relative error of the weights outside each row's group of 32 that holds its outlier."""
    want = float_model[0].weight.detach()
    outlier_group = (want.abs() == 1.0).float().argmax(dim=1, keepdim=True) // 32
    away = torch.arange(want.shape[1]) // 32 != outlier_group
    got = model[0].dequantized(torch.float32)
    return float((got - want)[away].norm() / want[away].norm())


def test_a_scale_per_group_keeps_an_outlier_from_coarsening_its_whole_row() -> None:
    float_model = _with_outliers()
    per_row = slimtorch.quantize(copy.deepcopy(float_model), "int8-weight").model
    grouped = slimtorch.quantize(copy.deepcopy(float_model), "int8-group-weight", group_size=32).model
    # a scale of 1/127 per row rounds the small weights by up to 0.004, a fifth of their size; a group of
    # them alone gets a scale near 0.06/127 (the largest of 32 normal draws of 0.02, over 127)
    assert (
        _error_away_from_the_outliers(grouped, float_model)
        < _error_away_from_the_outliers(per_row, float_model) / 8
    )


def test_its_layer_holds_a_scale_per_group_and_runs_float_and_bfloat16_inputs() -> None:
    float_model = _with_outliers()
    model = slimtorch.quantize(copy.deepcopy(float_model), "int8-group-weight", group_size=32).model
    layer = model[0]
    assert type(layer) is Int8GroupWeightLinear and layer.grouped and layer.codec == "int8"
    assert tuple(layer.weight_scale.shape) == (64, 8) and layer.stage["group_size"] == 32
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = nn.functional.linear(x, layer.dequantized(torch.float32), float_model[0].bias)
        layer.kernel = "dequantize"  # float32 all through: the product of the decoded weight
        assert torch.allclose(model(x), want, rtol=1e-5, atol=1e-5)
        layer.kernel = None  # chosen by timing here, bfloat16 products admitted within BF16_AGREEMENT
        outputs = [model(x), model(x.bfloat16())]
    assert [out.dtype for out in outputs] == [torch.float32, torch.bfloat16]
    for out in outputs:
        assert float((out.float() - want).norm() / want.norm()) < BF16_AGREEMENT


def test_it_is_a_weight_only_scheme_that_shrink_and_prune_do_not_offer() -> None:
    # the file writers store int8 with a scale per row: offered there, this row would come out coarser
    assert "int8-group-weight" in WEIGHT_ONLY and "int8-group-weight" not in WRITTEN
