"""How far a model's own float32 result is from the exact one: the floor under any export's agreement.

An exported model reorders and fuses operations, so it rounds differently from eager PyTorch. On most
models that difference is far below :data:`~slimtorch.deploy.export.FP32`'s 1e-4; on a model with a
large dynamic range (pitch estimators, log-spectra) eager float32 is itself further than that from the
float64 result, and a fixed tolerance would fail a correct export. :func:`rounding_noise` measures that
floor by running a float64 copy of the model on the same inputs.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

NOISE_FACTOR = 8.0
"""An export may differ from eager float32 by this many times eager float32's own rounding noise. Both
round around the exact result, so their difference reaches twice the noise when the runtimes are alike;
but another runtime may sum a long reduction in a less accurate order than PyTorch's blocked kernels
(onnxruntime on a 256-wide cancelling matmul: 3.9 x eager's noise), and a few samples understate the
worst case. A wrong export is off by far more than rounding."""


def rounding_noise(
    model: nn.Module,
    inputs: Sequence[tuple],
    expected: Sequence[Sequence[torch.Tensor]],
    call: Callable[[nn.Module, tuple], Any],
    flatten: Callable[[Any], list[tuple[str, torch.Tensor]]],
) -> float | None:
    """max |eager float32 - eager float64| over every floating-point output of every sample; None when
    the model cannot run in float64 (its code fixes a dtype, an operator lacks float64, quantized layers).

    The model is deep-copied (the caller's stays as it is); float inputs become float64 too.

    Example:
        >>> model, x = nn.Linear(4, 4), torch.randn(2, 4)
        >>> want = [[model(x).detach()]]
        >>> rounding_noise(model, [(x,)], want, lambda m, a: m(*a), lambda o: [("y", o)]) < 1e-6
        True
    """
    try:
        wide = copy.deepcopy(model).double()
    except Exception:  # an object in the model that does not deep-copy: no float64 copy to run
        return None
    worst = 0.0
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for args, want in zip(inputs, expected, strict=True):
                got = [t for _, t in flatten(call(wide, tuple(_wide(a) for a in args)))]
                if len(got) != len(want):
                    return None
                for narrow, exact in zip(want, got, strict=True):
                    if not narrow.is_floating_point() or narrow.shape != exact.shape:
                        continue
                    if narrow.numel():
                        worst = max(worst, float((narrow.double() - exact.double()).abs().max()))
    except Exception:  # the model's code cannot run in float64: the caller keeps its default tolerance
        return None
    return worst if worst == worst else None  # NaN: no measure


def _wide(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.double()
    return value
