"""An independent count of live tensor bytes, op by op, and the plain loops it measures: the reference
the memory estimates are checked against."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveBytes(TorchDispatchMode):
    """Bytes of tensor storage alive, op by op: every output's untyped storage is counted from the op that
    made it until the last tensor viewing it is collected (``weakref.finalize``), with the highest total
    since :meth:`mark` kept."""

    def __init__(self, held: list[torch.Tensor]) -> None:
        super().__init__()
        self.views: dict[int, int] = {}  # storage address -> tensors alive that view it
        self.sizes: dict[int, int] = {}
        self.total = self.high = 0
        for tensor in held:
            self.hold(tensor)

    def hold(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        address = storage.data_ptr() if storage.nbytes() else id(storage)
        if address not in self.views:
            self.views[address], self.sizes[address] = 0, storage.nbytes()
            self.total += storage.nbytes()
            self.high = max(self.high, self.total)
        self.views[address] += 1
        weakref.finalize(tensor, self.drop, address)

    def drop(self, address: int) -> None:
        self.views[address] -= 1
        if not self.views[address]:
            del self.views[address]
            self.total -= self.sizes.pop(address)

    def mark(self) -> None:
        """Count the highest total from now on."""
        self.high = self.total

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for value in tree_leaves(out):
            if isinstance(value, torch.Tensor):
                self.hold(value)
        return out


def measured_peaks(
    model: nn.Module,
    batch: torch.Tensor,
    optimizer: str,
    loss_fn: Callable[[Any], torch.Tensor],
    autocast: torch.dtype | None = None,
) -> list[int]:
    """Each step's peak live tensor bytes over three steps of a plain training loop (the forward pass
    under CPU autocast to ``autocast``, if given; fp16 with a ``GradScaler``, as PyTorch's AMP recipe
    runs it). A step the scaler skips (the loss overflowed fp16) is an error: that loop is not steady by
    step 3."""
    make = {
        "adamw": torch.optim.AdamW,
        "sgd": lambda params: torch.optim.SGD(params, lr=0.01, momentum=0.9),
    }[optimizer]
    opt = make(model.parameters())
    scaler = torch.amp.GradScaler("cpu", enabled=autocast is torch.float16)
    tracker = LiveBytes([*model.parameters(), *model.buffers(), batch])
    peaks = []
    with tracker:
        for _ in range(3):
            tracker.mark()
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
                loss = loss_fn(model(batch))
            scaler.scale(loss).backward()
            scaler.step(opt)
            scale = scaler.get_scale()
            scaler.update()
            assert scaler.get_scale() >= scale, "the scaler skipped a step: the loss overflowed fp16"
            del loss
            peaks.append(tracker.high)
    return peaks


def measured_inference_peaks(
    model: nn.Module, batch: torch.Tensor, autocast: torch.dtype | None = None
) -> list[int]:
    """Each forward's peak live tensor bytes over three forward passes of a plain ``torch.no_grad()``
    loop (under CPU autocast to ``autocast``, if given), each output let go before the next batch."""
    tracker = LiveBytes([*model.parameters(), *model.buffers(), batch])
    peaks = []
    with tracker, torch.no_grad():
        for _ in range(3):
            tracker.mark()
            with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
                output = model(batch)
            del output
            peaks.append(tracker.high)
    return peaks
