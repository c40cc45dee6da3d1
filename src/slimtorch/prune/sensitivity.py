"""Sensitivity scan: how much each layer's pruning costs the metric, and how much to prune each layer.

:func:`scan` prunes one layer at a time to each of a few sparsities (its magnitude-smallest weights),
measures the user's metric, and puts the weights back. :meth:`SensitivityReport.recommend` then spends a
global sparsity budget where it hurts least: it raises, step by step, the layer whose next step loses the
least metric per weight removed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from slimtorch.errors import OptionError, SlimtorchError
from slimtorch.format.progress import Progress, task
from slimtorch.format.verbs import Report, resolve
from slimtorch.prune.unstructured import PRUNABLE, magnitude_threshold, zero_up_to

DEFAULT_AMOUNTS = (0.3, 0.5, 0.7, 0.8, 0.9, 0.95)


@dataclass(frozen=True)
class ScanOptions:
    """What :func:`scan` measures: the sparsities each layer is tried at, and which layers.

    Example:
        >>> ScanOptions(amounts=[0.5, 0.9]).amounts
        (0.5, 0.9)
    """

    amounts: tuple[float, ...] = DEFAULT_AMOUNTS
    """the sparsities each layer is pruned to, one at a time, each between 0 and 1"""
    layers: tuple[str, ...] | None = None
    """the Linear and Conv layers to scan, by name (None: every one)"""

    def __post_init__(self) -> None:
        object.__setattr__(self, "amounts", tuple(float(a) for a in self.amounts))
        if self.layers is not None:
            layers = (self.layers,) if isinstance(self.layers, str) else tuple(self.layers)
            object.__setattr__(self, "layers", layers)
        if not self.amounts or not all(0 < a < 1 for a in self.amounts):
            raise OptionError("amounts must be shares between 0 and 1")


@dataclass(frozen=True)
class SensitivityReport(Report):
    """The metric unpruned, and for each layer the metric at each scanned sparsity (in JSON, the
    sparsities are the keys' text: ``"0.5"``)."""

    SCHEMA = "slimtorch.sensitivity/1"

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


def scan(
    model: nn.Module,
    eval_fn: Callable[[nn.Module], float],
    /,
    options: ScanOptions | None = None,
    *,
    progress: Progress | None = None,
    **overrides: Any,
) -> SensitivityReport:
    """Measure ``eval_fn(model)`` (higher is better) with each layer pruned alone to each of the
    ``amounts``; the model is left as it was. ``progress`` is told of each measurement (None: silent).

    Example:
        >>> report = scan(model, accuracy, amounts=(0.5, 0.9))  # doctest: +SKIP
        >>> slimtorch.prune.weights(model, report.recommend(0.9), method="layer_magnitude")  # doctest: +SKIP
    """
    options = resolve(ScanOptions, options, overrides, "prune.scan")
    wanted = options.layers
    modules = {
        n: m for n, m in model.named_modules() if isinstance(m, PRUNABLE) and (wanted is None or n in wanted)
    }
    if not modules:
        raise SlimtorchError("no Linear or Conv layer to scan")
    was_training = model.training
    model.eval()
    total = len(modules) * len(options.amounts)
    with torch.no_grad(), task(progress, "scanning sensitivity", total, unit="steps") as advance:
        baseline = float(eval_fn(model))
        metrics: dict[str, dict[float, float]] = {}
        for name, module in modules.items():
            original = module.weight.detach().clone()
            metrics[name] = {}
            for amount in sorted(options.amounts):
                zero_up_to(module.weight, magnitude_threshold([original], amount))
                metrics[name][amount] = float(eval_fn(model))
                module.weight.copy_(original)
                advance(1)
    model.train(was_training)
    return SensitivityReport(baseline, metrics, {n: m.weight.numel() for n, m in modules.items()})
