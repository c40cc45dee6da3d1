"""Pruning to a budget (target_params, target_macs), step by step (iterative_steps), by Taylor importance."""

from __future__ import annotations

import pytest
import torch

import slimtorch
from slimtorch.errors import SlimtorchError
from slimtorch.graph.macs import count_macs
from tests.zoo import count_params, resnet18

SMALL = torch.randn(2, 3, 64, 64)


@pytest.mark.slow
def test_target_params_lands_just_under_the_budget() -> None:
    model = resnet18().eval()
    slimtorch.prune.channels(model, SMALL, target_params=5_000_000)
    assert 4_600_000 < count_params(model) <= 5_000_000
    assert model(SMALL).shape == (2, 1000)


@pytest.mark.slow
def test_target_macs_lands_just_under_the_budget() -> None:
    model = resnet18().eval()
    budget = count_macs(model, SMALL) // 3
    slimtorch.prune.channels(model, SMALL, target_macs=budget)
    assert 0.9 * budget < count_macs(model, SMALL) <= budget


@pytest.mark.slow
def test_exactly_one_of_ratio_and_the_targets_is_asked() -> None:
    with pytest.raises(SlimtorchError, match="one of ratio, target_params or target_macs"):
        slimtorch.prune.channels(resnet18(), SMALL)
    with pytest.raises(SlimtorchError, match="one of ratio, target_params or target_macs"):
        slimtorch.prune.channels(resnet18(), SMALL, ratio=0.5, target_params=10)
    with pytest.raises(SlimtorchError, match="cannot reach"):
        slimtorch.prune.channels(resnet18(), SMALL, target_params=1000)


@pytest.mark.slow
def test_iterative_steps_reach_the_same_widths_as_one_shot() -> None:
    one_shot, stepped = resnet18().eval(), resnet18().eval()
    slimtorch.prune.channels(one_shot, SMALL, ratio=0.5)
    slimtorch.prune.channels(stepped, SMALL, ratio=0.5, iterative_steps=3)
    widths = [m.out_channels for m in one_shot.modules() if isinstance(m, torch.nn.Conv2d)]
    assert widths == [m.out_channels for m in stepped.modules() if isinstance(m, torch.nn.Conv2d)]


@pytest.mark.slow
def test_taylor_importance_needs_gradients_and_uses_them() -> None:
    model = resnet18().eval()
    with pytest.raises(SlimtorchError, match="backward"):
        slimtorch.prune.channels(model, SMALL, ratio=0.5, importance="taylor")
    model(SMALL).logsumexp(1).mean().backward()
    block = model.layer4[1]
    with torch.no_grad():  # no gradient anywhere on channels 0..63 of conv1's group: they score zero
        for grad in (block.conv1.weight.grad, block.bn1.weight.grad, block.bn1.bias.grad):
            grad[:64] = 0
        block.conv2.weight.grad[:, :64] = 0
    original = block.conv1.weight.detach().clone()
    others = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Conv2d) and n != "layer4.1.conv1"]
    slimtorch.prune.channels(model, SMALL, ratio=0.5, importance="taylor", ignore=others)
    kept = block.conv1.weight.detach()
    assert kept.shape[0] == 256
    origin = [int((original == row).flatten(1).all(1).nonzero()[0]) for row in kept]
    assert min(origin) >= 64 and origin == sorted(origin)
