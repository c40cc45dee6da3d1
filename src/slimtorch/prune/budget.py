"""Pruning to a budget: the smallest ratio whose pruned model fits a parameter or MAC count."""

from __future__ import annotations

import copy
from collections.abc import Callable

from torch import nn

from slimtorch.errors import SlimtorchError

LARGEST_RATIO = 0.99
STEPS = 14  # bisection steps: the ratio to within 0.99 / 2**14, far below one channel of any group
TRIALS = STEPS + 2
"""Pruned copies measured in the worst case: no pruning, the largest ratio, then the bisection."""


def ratio_for_budget(
    model: nn.Module,
    prune: Callable[[nn.Module, float], object],
    measure: Callable[[nn.Module], int],
    target: int,
    advance: Callable[[int], None] = lambda amount: None,
) -> float:
    """Bisect the ratio on copies of ``model`` (which is left as it is) until ``measure`` fits ``target``.

    ``prune(copy, ratio)`` prunes a copy in place; more pruning never measures more, so the search is a
    bisection. ``advance(1)`` hears of each copy measured (at most :data:`TRIALS`): on a large model each
    takes seconds. Raises when even :data:`LARGEST_RATIO` does not fit.
    """

    def measured(ratio: float) -> int:
        trial = copy.deepcopy(model)
        prune(trial, ratio)
        size = measure(trial)
        advance(1)
        return size

    if measured(0.0) <= target:
        return 0.0
    smallest = measured(LARGEST_RATIO)
    if smallest > target:
        raise SlimtorchError(
            f"cannot reach {target:,}: pruning every prunable group to 1% still leaves {smallest:,}"
        )
    low, high = 0.0, LARGEST_RATIO
    for _ in range(STEPS):
        middle = (low + high) / 2
        if measured(middle) <= target:
            high = middle
        else:
            low = middle
    return high
