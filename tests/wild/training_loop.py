"""A real training loop on a wild model, its memory counted by a tracker that is not slimtorch's own: the
reference ``memory.estimate``'s steady-state peak is held to (issue 20).

The loop is the plainest one a user writes: AdamW over the trainable parameters, then three times
``zero_grad(set_to_none=True)``, forward, the loss, ``backward()``, ``step()``. Its live tensor bytes are
counted op by op by ``tests/test_steady_state.py``'s :class:`LiveBytes` (a dispatch mode that holds every
output storage until its last tensor is collected), step by step: step 1 makes the optimizer's state, and
from step 2 on the state is alive through the forward and backward passes, so step 3 is the steady one.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from tests.support.steady import LiveBytes

STEPS = 3


def first_float(output: Any) -> torch.Tensor:
    """The loss: the sum of the output's first floating-point tensor (what ``estimate`` takes by default,
    written again here so the measurement does not lean on slimtorch's code)."""
    tensor = next(v for v in tree_leaves(output) if isinstance(v, torch.Tensor) and v.is_floating_point())
    return tensor.float().sum()


def step_peaks(network: nn.Module, args: tuple[Any, ...]) -> list[int]:
    """Each step's peak live tensor bytes over :data:`STEPS` steps of the plain loop on ``args``
    (weights, buffers and the inputs counted from the start, as ``estimate`` counts them)."""
    optimizer = torch.optim.AdamW([p for p in network.parameters() if p.requires_grad])
    inputs = [value for value in tree_leaves(args) if isinstance(value, torch.Tensor)]
    tracker = LiveBytes([*network.parameters(), *network.buffers(), *inputs])
    peaks = []
    with tracker:
        for _ in range(STEPS):
            tracker.mark()
            optimizer.zero_grad(set_to_none=True)
            loss = first_float(network(*args))
            loss.backward()
            optimizer.step()
            del loss
            peaks.append(tracker.high)
    return peaks
