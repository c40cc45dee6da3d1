"""What a model costs: parameters, MACs and CPU latency, measured the same way before and after a change."""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from slimtorch.graph.macs import count_macs


@dataclass(frozen=True)
class ModelCost:
    params: int
    macs: int
    latency_s: float
    """median wall time of one forward pass (no grad) over the timed runs"""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def measure_latency(model: nn.Module, inputs: Sequence[Any], *, runs: int = 10, warmup: int = 2) -> float:
    """Median seconds of ``model(*inputs)`` under no_grad, after ``warmup`` untimed calls.

    Example:
        >>> measure_latency(nn.Linear(64, 64), (torch.randn(8, 64),), runs=3) > 0
        True
    """
    with torch.no_grad():
        for _ in range(warmup):
            model(*inputs)
        times = []
        for _ in range(max(1, runs)):
            start = time.perf_counter()
            model(*inputs)
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(model: nn.Module, inputs: Sequence[Any], *, runs: int = 10) -> ModelCost:
    """Parameters (shared ones once), MACs and median latency of ``model(*inputs)``."""
    return ModelCost(
        params=sum(p.numel() for p in model.parameters()),
        macs=count_macs(model, tuple(inputs)),
        latency_s=measure_latency(model, inputs, runs=runs) if runs else 0.0,
    )
