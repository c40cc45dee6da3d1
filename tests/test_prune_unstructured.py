"""Unstructured and N:M sparsity: exact shares of zeros in plain weights, kept at zero while training,
and the file really shrinks."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.utils import prune as torch_prune

import slimtorch
from slimtorch.errors import SlimtorchError
from slimtorch.prune import GradualPruner, finalize, keep_sparse, weights
from slimtorch.prune.unstructured import sparsity_of
from tests.zoo import MLP, SmallCNN


def _zeros(tensor: torch.Tensor) -> float:
    return float((tensor == 0).float().mean())


def test_global_magnitude_zeroes_the_share_asked_and_leaves_plain_modules() -> None:
    model = MLP((64, 256, 256, 10))
    keys = set(model.state_dict())
    biases = [m.bias.detach().clone() for m in model.modules() if isinstance(m, nn.Linear)]
    report = weights(model, 0.9)
    assert report.sparsity == pytest.approx(0.9, abs=1e-4)
    assert set(model.state_dict()) == keys  # no weight_orig, no weight_mask
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())
    after = [m.bias.detach() for m in model.modules() if isinstance(m, nn.Linear)]
    assert all(torch.equal(a, b) for a, b in zip(after, biases, strict=True))  # biases are not pruned


def test_layer_magnitude_gives_every_layer_its_share() -> None:
    model = MLP((64, 256, 256, 10))
    report = weights(model, 0.5, method="layer_magnitude")
    assert all(share == pytest.approx(0.5, abs=1e-3) for share in report.layers.values())


def test_amounts_by_pattern_prune_only_the_matching_layers() -> None:
    model = MLP((64, 256, 256, 10))
    report = weights(model, {"layers.0": 0.8, "layers.2": 0.4})
    assert report.layers == pytest.approx({"layers.0": 0.8, "layers.2": 0.4}, abs=1e-3)
    assert _zeros(model.layers[4].weight) == 0


@pytest.mark.parametrize("model_factory", [lambda: MLP((64, 128, 128, 8)), SmallCNN])
@pytest.mark.parametrize(("n", "m"), [(2, 4), (1, 4), (4, 8)])
def test_n_of_m_leaves_at_most_n_non_zeros_in_every_group_of_m_inputs(model_factory, n, m) -> None:
    model = model_factory()
    report = weights(model, 0.0, method="n:m", n=n, m=m)
    checked = 0
    for name, module in model.named_modules():
        if not isinstance(module, (nn.Linear, nn.Conv2d)) or name in report.skipped:
            continue
        groups = module.weight.detach().movedim(1, -1).reshape(-1, m)
        assert int((groups != 0).sum(1).max()) <= n
        assert _zeros(module.weight) == pytest.approx(1 - n / m, abs=1e-6)
        checked += 1
    assert checked >= 2
    assert all("multiple of" in why for why in report.skipped.values())  # e.g. a 1-channel input conv


@pytest.mark.slow
def test_keep_sparse_holds_the_zeros_through_training_and_leaves_no_hook() -> None:
    model = MLP((64, 128, 128, 10))
    weights(model, 0.8)
    before = {n: m.weight.detach() == 0 for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    with keep_sparse(model):
        for _ in range(5):
            optimizer.zero_grad()
            model(torch.randn(16, 64)).pow(2).mean().backward()
            optimizer.step()
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            assert torch.equal(module.weight.detach() == 0, before[name]), name
            assert not module._forward_pre_hooks and not module.weight._backward_hooks


def test_without_keep_sparse_training_would_refill_the_zeros() -> None:
    model = MLP((64, 128, 128, 10))
    weights(model, 0.8)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(16, 64)).pow(2).mean().backward()
    optimizer.step()
    assert sparsity_of(model).sparsity < 0.5  # the control: without keep_sparse the zeros come back


def test_gradual_schedule_rises_cubically_to_the_final_share() -> None:
    model = MLP((64, 256, 256, 10))
    pruner = GradualPruner(model, 0.9, start=0, end=10, every=2)
    seen = [s for s in (pruner.step() for _ in range(12)) if s is not None]
    assert seen == sorted(seen) and seen[-1] == pytest.approx(0.9)
    assert pruner.target(5) == pytest.approx(0.9 * (1 - 0.5**3))
    assert abs(_overall(model) - 0.9) < 1e-3


def _overall(model: nn.Module) -> float:
    zeros = sum(int((m.weight == 0).sum()) for m in model.modules() if isinstance(m, nn.Linear))
    return zeros / sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))


def test_finalize_folds_torch_prune_and_the_file_shrinks(tmp_path) -> None:
    model = MLP((64, 256, 256, 10))
    params = [(m, "weight") for m in model.modules() if isinstance(m, nn.Linear)]
    torch_prune.global_unstructured(params, pruning_method=torch_prune.L1Unstructured, amount=0.9)
    effective = [m.weight.detach().clone() for m, _ in params]
    assert finalize(model) == ["layers.0.weight", "layers.2.weight", "layers.4.weight"]
    assert not any(k.endswith(("_orig", "_mask")) for k in model.state_dict())
    assert all(torch.equal(m.weight, w) for (m, _), w in zip(params, effective, strict=True))
    dense = tmp_path / "dense.safetensors"
    slimtorch.save(MLP((64, 256, 256, 10)).state_dict(), dense)
    sparse = tmp_path / "sparse.safetensors"
    slimtorch.save(model.state_dict(), sparse)
    assert sparse.stat().st_size < 0.15 * dense.stat().st_size


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"amount": 1.0}, "below 1"),
        ({"amount": 0.5, "method": "random"}, "method must be"),
        ({"amount": 0.5, "method": "n:m", "n": 4, "m": 4}, "0 < n < m"),
        ({"amount": {"nothing*": 0.5}}, "nothing to prune"),
    ],
)
def test_bad_arguments_are_clear_errors(kwargs, words) -> None:
    with pytest.raises(SlimtorchError, match=words):
        weights(MLP(), **kwargs)
