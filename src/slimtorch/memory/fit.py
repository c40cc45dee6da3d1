"""``fit``: make a training step fit a memory budget, with the least recomputation, and apply it.

The levers, in the order they are pulled:

1. activation checkpointing of the model's repeated blocks (non-reentrant), one more block at a time:
   exact (the same ops run again in backward, same results), it costs one more forward of each block;
2. mixed precision (``torch.autocast`` to bfloat16): activations take half the bytes, results change in
   the last bits, so only when checkpointing alone does not fit;
3. on CUDA, activations offloaded to pinned host memory (``torch.autograd.graph.save_on_cpu``): the
   device keeps almost none, each crosses the bus twice.

Every candidate is estimated on fake tensors (:func:`slimtorch.memory.estimate`), so choosing costs a few
simulated steps and no memory; the first that fits (with a margin) is applied to the model.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from slimtorch.errors import SlimtorchError
from slimtorch.memory.estimating import estimate
from slimtorch.memory.step import checkpoint_blocks

MARGIN = 0.05


@dataclass
class FitPlan:
    """What :func:`fit` chose and applied; ``remove()`` puts the model back as it was."""

    checkpointed: list[str]
    precision: str
    offload: bool
    predicted_peak_bytes: int
    unmodified_peak_bytes: int
    budget_bytes: int
    recompute_share: float
    """share of the model's parameters whose forward runs twice (a proxy for the extra compute)"""
    _undo: list[Callable[[], None]] = field(default_factory=list, repr=False)

    @property
    def fits(self) -> bool:
        return self.predicted_peak_bytes <= self.budget_bytes

    def remove(self) -> None:
        """Undo what was applied: blocks run plainly again, the model's forward is its own."""
        while self._undo:
            self._undo.pop()()

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": "slimtorch.fit/1",
            **{k: v for k, v in vars(self).items() if not k.startswith("_")},
            "fits": self.fits,
        }


def fit(
    model: nn.Module,
    budget: int,
    example_inputs: Any,
    *,
    optimizer: str = "adamw",
    device: str = "cuda",
    allow_precision: bool = True,
    allow_offload: bool = True,
    margin: float = MARGIN,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
) -> FitPlan:
    """Choose checkpointing, precision and offload so one training step fits ``budget`` bytes, with the
    least recomputation, and apply them to ``model`` (``plan.remove()`` undoes it).

    Example:
        >>> plan = slimtorch.memory.fit(model, 16 * 2**30, batch)  # doctest: +SKIP
        >>> plan.checkpointed, plan.predicted_peak_bytes  # doctest: +SKIP
        (['layers.0', 'layers.1', 'layers.2'], 15_812_000_000)
    """
    blocks = checkpoint_blocks(model)
    usable = budget * (1 - margin)

    def peak(names: list[str], precision: str) -> int:
        report = estimate(
            model,
            example_inputs,
            optimizer=optimizer,
            precision=precision,
            checkpointing=tuple(names) or None,
            device=device,
            loss_fn=loss_fn,
        )
        return report.steps[0].peak_bytes

    unmodified = peak([], "fp32")
    precisions = ["fp32", "bf16-mixed"] if allow_precision else ["fp32"]
    chosen: tuple[list[str], str, int] | None = None
    for precision in precisions:
        for count in range(len(blocks) + 1):
            names = blocks[:count]
            predicted = unmodified if (count, precision) == (0, "fp32") else peak(names, precision)
            if predicted <= usable:
                chosen = (names, precision, predicted)
                break
        if chosen:
            break
    offload = False
    if chosen is None:
        names, precision = blocks, precisions[-1]
        offload = allow_offload and torch.device(device).type == "cuda"
        predicted = peak(names, precision)  # offloading moves saved activations off the device
        chosen = (names, precision, predicted)
    names, precision, predicted = chosen
    plan = FitPlan(names, precision, offload, predicted, unmodified, budget, _share(model, names))
    if not plan.fits and not offload:
        raise SlimtorchError(
            f"no plan fits {budget:,} bytes: the best ({len(names)} of {len(blocks)} blocks checkpointed, "
            f"{precision}) is predicted at {predicted:,}; the weights, gradients and optimizer state alone "
            "may be too large (try a smaller optimizer, bf16 weights or sharding)"
        )
    _apply(model, plan, device)
    return plan


def _share(model: nn.Module, names: list[str]) -> float:
    total = sum(p.numel() for p in model.parameters())
    modules = dict(model.named_modules())
    inside = sum(p.numel() for name in names for p in modules[name].parameters())
    return inside / total if total else 0.0


def _apply(model: nn.Module, plan: FitPlan, device: str) -> None:
    modules = dict(model.named_modules())
    for name in plan.checkpointed:
        module = modules[name]
        own = module.__dict__.get("forward")
        module.forward = functools.partial(checkpoint, module.forward, use_reentrant=False)
        plan._undo.append(functools.partial(_restore, module, own))
    if plan.precision != "fp32" or plan.offload:
        forward = model.forward
        own = model.__dict__.get("forward")
        autocast = plan.precision == "bf16-mixed"
        device_type = torch.device(device).type

        @functools.wraps(forward)
        def planned(*args: Any, **kwargs: Any) -> Any:
            with _contexts(device_type, autocast, plan.offload):
                return forward(*args, **kwargs)

        model.forward = planned
        plan._undo.append(functools.partial(_restore, model, own))


@contextlib.contextmanager
def _contexts(device_type: str, autocast: bool, offload: bool) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        if autocast:
            stack.enter_context(torch.autocast(device_type, dtype=torch.bfloat16))
        if offload:
            stack.enter_context(torch.autograd.graph.save_on_cpu(pin_memory=True))
        yield


def _restore(module: nn.Module, own: Any) -> None:
    if own is None:
        module.__dict__.pop("forward", None)
    else:
        module.forward = own
