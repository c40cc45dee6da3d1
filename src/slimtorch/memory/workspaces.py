"""Storages a fake tensor gets the size of wrong, and their true size.

Fake tensors take their sizes from torch's meta functions, and one of them leaves out a storage that
matters: oneDNN's LSTM layer (``aten.mkldnn_rnn_layer``, what ``nn.LSTM`` runs on the CPU) returns a
workspace the backward pass needs, several times the layer's output, that its meta function makes 0
bytes. oneDNN sizes it by its own rules (padded, page-aligned), which depend only on the shapes, so
:func:`true_sizes` learns it by running the real kernel once per set of shapes, on uninitialised tensors
of those shapes, and remembers it. Another gets a dtype wrong: batch norm under autocast (a bf16 or fp16
input, fp32 weights) keeps its batch's mean and inverse deviation for backward in fp32 on the CPU, its
meta function in the input's dtype; a rule gives their size from the arguments.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch.utils._python_dispatch import _disable_current_modes

from slimtorch.errors import SlimtorchError

# op -> the index of the output whose fake size is wrong
PROBED: dict[Callable[..., Any], int] = {torch.ops.aten.mkldnn_rnn_layer.default: 3}


def true_sizes(func: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> dict[int, int]:
    """Output index -> true bytes, for an op whose fake outputs are sized wrong (none for the others).

    Example:
        >>> true_sizes(torch.ops.aten.mm.default, (), {})
        {}
    """
    if func in RULES:
        return RULES[func](args)
    index = PROBED.get(func)
    if index is None:
        return {}
    # the kernel keeps a workspace only when it may be asked for a backward pass: grad mode is an input
    return {index: _probe(func, index, _signature(args), _signature(kwargs), torch.is_grad_enabled())}


def _batch_norm_statistics(args: tuple) -> dict[int, int]:
    """``native_batch_norm``'s saved mean and inverse deviation (outputs 1 and 2: a value per channel in
    training, none in eval): in the dtype of its weights (or running statistics) when the input's differs
    (mixed precision), else the input's, as its fake outputs already are."""
    tensor, *parameters = args[:5]
    given = next((p for p in parameters if p is not None), None)
    if given is None or given.dtype == tensor.dtype:
        return {}
    nbytes = (tensor.shape[1] if args[5] else 0) * given.element_size()
    return {1: nbytes, 2: nbytes}


# op -> output index -> true bytes, from the arguments alone
RULES: dict[Callable[..., Any], Callable[[tuple], dict[int, int]]] = {
    torch.ops.aten.native_batch_norm.default: _batch_norm_statistics
}


class _Shape(NamedTuple):
    """A tensor argument, as far as the kernel's memory goes."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def _signature(value: Any) -> Any:
    """A hashable stand-in for the op's arguments: a tensor becomes its shape and dtype."""
    if isinstance(value, torch.Tensor):
        return _Shape(tuple(value.shape), value.dtype)
    if isinstance(value, dict):
        return tuple((key, _signature(item)) for key, item in value.items())
    if isinstance(value, list | tuple):
        return tuple(_signature(item) for item in value)
    return value


def _real(signature: Any) -> Any:
    """Uninitialised CPU tensors in place of the signature's shapes; other arguments as they were."""
    if isinstance(signature, _Shape):
        return torch.empty(signature.shape, dtype=signature.dtype)
    if isinstance(signature, tuple):
        return tuple(_real(item) for item in signature)
    return signature


@functools.cache
def _probe(func: Callable[..., Any], index: int, args: tuple, kwargs: tuple, grad: bool) -> int:
    # no fake tensors, no recording: a real kernel (no tensor needs grad, so no graph is made)
    with _disable_current_modes(), torch.set_grad_enabled(grad):
        try:
            out = func(*_real(args), **{key: _real(value) for key, value in kwargs})
        except RuntimeError as exc:  # oneDNN has no LSTM kernel for fp16, nor for bf16 without AVX512-BF16
            raise SlimtorchError(
                f"the real step would fail: {func} cannot run on this CPU for these shapes and dtypes "
                f"({str(exc).split('.')[0]}); oneDNN's LSTM runs fp32 on every CPU, bf16 only on some "
                "(AVX512-BF16 or AMX), fp16 on none"
            ) from None
    return 0 if out[index] is None else out[index].untyped_storage().nbytes()
