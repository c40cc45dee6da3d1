"""The sensitivity scan measures each layer alone, leaves the model as it was, and spends a sparsity
budget where the metric suffers least."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from slimtorch.errors import SlimtorchError
from slimtorch.prune import scan, weights
from slimtorch.prune.unstructured import sparsity_of


class TwoPaths(nn.Module):
    """A fragile layer (every weight matters to the metric) and a robust one (barely used by it)."""

    def __init__(self) -> None:
        super().__init__()
        self.fragile = nn.Linear(32, 32)
        self.robust = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fragile(x) + 1e-3 * self.robust(x)


X = torch.randn(64, 32)


def _metric_against(reference: torch.Tensor):
    return lambda model: -float((model(X) - reference).pow(2).mean())


def test_scan_finds_the_fragile_layer_and_restores_every_weight() -> None:
    model = TwoPaths()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    report = scan(model, _metric_against(model(X).detach()), amounts=(0.5, 0.9))
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())
    assert report.baseline == pytest.approx(0.0)
    assert report.metrics["fragile"][0.9] < report.metrics["robust"][0.9] < 0
    assert report.metrics["fragile"][0.9] < report.metrics["fragile"][0.5]


def test_recommendation_prunes_the_robust_layer_first_and_meets_the_budget() -> None:
    model = TwoPaths()
    report = scan(model, _metric_against(model(X).detach()), amounts=(0.3, 0.5, 0.7, 0.9))
    plan = report.recommend(0.6)
    assert plan["robust"] == 0.9 and plan["fragile"] <= 0.3
    weights(model, plan, method="layer_magnitude")
    assert sparsity_of(model).sparsity == pytest.approx(0.6, abs=1e-3)  # floor(share * n) per layer


def test_bad_amounts_and_targets_are_refused() -> None:
    model = TwoPaths()
    with pytest.raises(SlimtorchError, match="between 0 and 1"):
        scan(model, lambda m: 0.0, amounts=(0.5, 1.0))
    report = scan(model, lambda m: 0.0, amounts=(0.5,))
    with pytest.raises(SlimtorchError, match="beyond the scanned"):
        report.recommend(0.8)
