"""Sensitivity scan: how much each layer's pruning costs the metric, and how much to prune each layer.

:func:`scan` prunes one layer at a time to each of a few sparsities (its magnitude-smallest weights),
measures the user's metric, and puts the weights back. :meth:`SensitivityReport.recommend` then spends a
global sparsity budget where it hurts least: it raises, step by step, the layer whose next step loses the
least metric per weight removed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch
from torch import nn

from slimtorch.errors import OptionError, SlimtorchError
from slimtorch.prune.unstructured import PRUNABLE, magnitude_threshold, zero_up_to

DEFAULT_AMOUNTS = (0.3, 0.5, 0.7, 0.8, 0.9, 0.95)


@dataclass(frozen=True)
class SensitivityReport:
    """The metric unpruned, and for each layer the metric at each scanned sparsity."""

    baseline: float
    metrics: dict[str, dict[float, float]]
    sizes: dict[str, int]
    """weights per layer, to turn shares into counts"""

    def recommend(self, target: float) -> dict[str, float]:
        """Per-layer sparsities (from the scanned grid) whose weighted total reaches ``target`` of all the
        scanned layers' weights, losing the least metric.

        Example:
            >>> report.recommend(0.8)  # doctest: +SKIP
            {'features.0': 0.5, 'features.3': 0.9, 'classifier': 0.95}
        """
        total = sum(self.sizes.values())
        if not 0 <= target <= max(max(m) for m in self.metrics.values()):
            raise OptionError(f"target {target} is beyond the scanned sparsities")
        chosen = dict.fromkeys(self.metrics, 0.0)

        def metric(layer: str, amount: float) -> float:
            return self.baseline if amount == 0 else self.metrics[layer][amount]

        while sum(chosen[n] * self.sizes[n] for n in chosen) < target * total:
            steps = []
            for layer, amount in chosen.items():
                higher = [a for a in sorted(self.metrics[layer]) if a > amount]
                if higher:
                    removed = (higher[0] - amount) * self.sizes[layer]
                    loss = metric(layer, amount) - metric(layer, higher[0])
                    steps.append((loss / removed, layer, higher[0]))
            if not steps:
                break
            _, layer, amount = min(steps)
            chosen[layer] = amount
        return chosen

    def to_dict(self) -> dict:
        return asdict(self)


def scan(
    model: nn.Module,
    eval_fn: Callable[[nn.Module], float],
    *,
    amounts: Sequence[float] = DEFAULT_AMOUNTS,
    layers: Sequence[str] | None = None,
) -> SensitivityReport:
    """Measure ``eval_fn(model)`` (higher is better) with each layer pruned alone to each of ``amounts``;
    the model is left as it was.

    Example:
        >>> report = scan(model, accuracy)  # doctest: +SKIP
        >>> slimtorch.prune.weights(model, report.recommend(0.9), method="layer_magnitude")  # doctest: +SKIP
    """
    if not amounts or not all(0 < a < 1 for a in amounts):
        raise OptionError("amounts must be shares between 0 and 1")
    modules = {
        n: m for n, m in model.named_modules() if isinstance(m, PRUNABLE) and (layers is None or n in layers)
    }
    if not modules:
        raise SlimtorchError("no Linear or Conv layer to scan")
    was_training = model.training
    model.eval()
    with torch.no_grad():
        baseline = float(eval_fn(model))
        metrics: dict[str, dict[float, float]] = {}
        for name, module in modules.items():
            original = module.weight.detach().clone()
            metrics[name] = {}
            for amount in sorted(amounts):
                zero_up_to(module.weight, magnitude_threshold([original], amount))
                metrics[name][float(amount)] = float(eval_fn(model))
                module.weight.copy_(original)
    model.train(was_training)
    return SensitivityReport(baseline, metrics, {n: m.weight.numel() for n, m in modules.items()})
