"""Multiply-accumulates of one forward pass, counted the way pruning papers count them: convolutions
(transposed too) and linear layers (Hugging Face's ``Conv1D`` included). Element-wise work, norms and the
attention's own matrix products are left out.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from slimtorch.graph.capture import as_args
from slimtorch.graph.layers import is_hf_conv1d


def _conv(module: nn.modules.conv._ConvNd, inputs: tuple, output: torch.Tensor) -> int:
    kernel = math.prod(module.kernel_size)
    if isinstance(module, nn.modules.conv._ConvTransposeNd):
        return inputs[0].numel() * (module.out_channels // module.groups) * kernel
    return output.numel() * (module.in_channels // module.groups) * kernel


def _linear(module: nn.Linear, inputs: tuple, output: torch.Tensor) -> int:
    return output.numel() * module.in_features


def _conv1d_hf(module: nn.Module, inputs: tuple, output: torch.Tensor) -> int:
    weight = module.weight  # [in, out]
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"a Hugging Face Conv1D whose weight is not a tensor: {type(weight).__name__}")
    return output.numel() * weight.shape[0]


# a counter takes a module of its key's type, which a dict's value type cannot say: hence `...`
COUNTERS: dict[type[nn.Module], Callable[..., int]] = {
    nn.Conv1d: _conv,
    nn.Conv2d: _conv,
    nn.Conv3d: _conv,
    nn.Linear: _linear,
}
COUNTERS.update({nn.ConvTranspose1d: _conv, nn.ConvTranspose2d: _conv, nn.ConvTranspose3d: _conv})


def count_macs(
    model: nn.Module, example_inputs: Sequence[Any] | Any, example_kwargs: Mapping[str, Any] | None = None
) -> int:
    """MACs of ``model(*example_inputs)`` (for the batch given), measured by running it under no_grad.

    Example:
        >>> count_macs(nn.Linear(10, 20), torch.randn(4, 10))
        800
    """
    total = 0

    def hook(module: nn.Module, inputs: tuple, output: torch.Tensor) -> None:
        nonlocal total
        counter = _counter(module)
        if counter is not None:
            total += counter(module, inputs, output)

    args = as_args(example_inputs)
    handles = [m.register_forward_hook(hook) for m in model.modules() if _counter(m) is not None]
    try:
        with torch.no_grad():
            model(*args, **dict(example_kwargs or {}))
    finally:
        for handle in handles:
            handle.remove()
    return total


def _counter(module: nn.Module) -> Callable[..., int] | None:
    counter = COUNTERS.get(type(module))
    if counter is None and is_hf_conv1d(module):
        return _conv1d_hf
    return counter
