"""Which device a memory function means when none is named: the one this machine has.

Every ``device=None`` in :mod:`slimtorch.memory` is :func:`default_device`: CUDA when torch sees a CUDA
device, else the CPU. :func:`runnable_device` is for functions that run real steps here (``profile``,
``find_batch_size``, ``fit``): naming CUDA on a machine without it is one clear error, not torch's bare
AssertionError ("Torch not compiled with CUDA enabled") from deep inside a step. ``estimate`` runs on
fake tensors, so it may plan for CUDA anywhere.
"""

from __future__ import annotations

import torch

from slimtorch.errors import SlimtorchError


def default_device() -> str:
    """``"cuda"`` if torch sees a CUDA device, else ``"cpu"``.

    Example:
        >>> default_device() in ("cuda", "cpu")
        True
    """
    return "cuda" if torch.cuda.is_available() else "cpu"


def runnable_device(device: str | None, what: str) -> str:
    """``device`` (None: :func:`default_device`), refused when it is CUDA and this machine has none.

    Example:
        >>> runnable_device(None, "profile") == default_device()
        True
    """
    chosen = default_device() if device is None else str(device)
    if _is_cuda(chosen) and not torch.cuda.is_available():
        raise SlimtorchError(
            f"{what} runs real steps on {chosen!r}, and this machine has no CUDA device: "
            "use device='cpu' (the default here), or estimate(..., device='cuda') to plan for a GPU"
        )
    return chosen


def _is_cuda(device: str) -> bool:
    try:
        return torch.device(device).type == "cuda"
    except RuntimeError:
        return False  # not a device at all: the caller's own check names it
