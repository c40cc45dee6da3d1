"""``fit``: make a training step fit a memory budget, with the least recomputation, and apply it.

The levers, in the order they are pulled:

1. activation checkpointing of the model's repeated blocks (non-reentrant), one more block at a time:
   exact (the same ops run again in backward, same results), it costs one more forward of each block;
2. mixed precision (``torch.autocast`` to bfloat16): activations take half the bytes, results change in
   the last bits, so only when checkpointing alone does not fit;
3. on CUDA, activations offloaded to pinned host memory (``torch.autograd.graph.save_on_cpu``): the
   device keeps almost none, each crosses the bus twice. On the CPU they already live in host memory,
   so this lever does not exist there, and the plan's ``notes`` say so when it would have been pulled.

The device is this machine's unless named (CUDA if torch sees one); bf16 autocast works on both (on the
CPU, torch's CPU autocast: linear, matmul and convolution in bfloat16), and the plan notes it on the CPU.

Every candidate is estimated on fake tensors (:func:`slimtorch.memory.estimate`), so choosing costs a few
simulated steps (a bisection over the number of blocks) and no memory; the first that fits (with a
margin) is applied to the model. A candidate fits when the loop's steady state does (from step 2 on,
the optimizer's state is alive through forward and backward), not only its first step.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from slimtorch.errors import OptionError, SlimtorchError
from slimtorch.format.progress import Progress, task
from slimtorch.format.verbs import NOT_JSON, Report, resolve
from slimtorch.memory.device import runnable_device
from slimtorch.memory.estimating import estimate
from slimtorch.memory.options import FitOptions, StepOptions
from slimtorch.memory.step import checkpoint_blocks, checkpoint_forward, replace_forward


@dataclass
class FitPlan(Report):
    """What :func:`fit` chose and applied to ``model``; ``remove()`` puts the model back as it was."""

    SCHEMA: ClassVar[str] = "slimtorch.fit/1"
    DERIVED: ClassVar[dict[str, dict[str, Any]]] = {"fits": {"type": "boolean"}}

    checkpointed: list[str]
    precision: str
    offload: bool
    predicted_peak_bytes: int
    unmodified_peak_bytes: int
    budget_bytes: int
    recompute_share: float
    """share of the model's parameters whose forward runs twice (a proxy for the extra compute)"""
    device: str = "cpu"
    notes: list[str] = field(default_factory=list)
    """what the device changed about the plan (bf16 on the CPU, no offloading there)"""
    model: nn.Module | None = field(default=None, repr=False, compare=False, metadata=NOT_JSON)
    """the model the plan is applied to (changed in place)"""
    _undo: list[Callable[[], None]] = field(default_factory=list, repr=False, metadata=NOT_JSON)

    @property
    def fits(self) -> bool:
        return self.predicted_peak_bytes <= self.budget_bytes

    def remove(self) -> None:
        """Undo what was applied: blocks run plainly again, the model's forward is its own."""
        while self._undo:
            self._undo.pop()()


def fit(
    model: nn.Module,
    example_inputs: Any,
    /,
    options: FitOptions | None = None,
    *,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    progress: Progress | None = None,
    **overrides: Any,
) -> FitPlan:
    """Choose checkpointing, precision and offload so one training step fits the budget, with the least
    recomputation, and apply them to ``model`` in place (``plan.remove()`` undoes it).

    ``options``: :class:`FitOptions` (budget, required; optimizer, device, allow_precision, allow_offload,
    margin); ``**overrides`` replace its fields. The device is where the model trains (None: this
    machine's, CUDA if torch sees one); a plan is applied here, so CUDA on a machine without it is refused
    (:func:`slimtorch.memory.estimate` plans for a GPU anywhere). ``progress`` is told of each simulated
    step.

    Example:
        >>> plan = slimtorch.memory.fit(model, batch, budget=16 * 2**30)  # doctest: +SKIP
        >>> plan.checkpointed, plan.predicted_peak_bytes  # doctest: +SKIP
        (['layers.0', 'layers.1', 'layers.2'], 15_812_000_000)
    """
    if isinstance(example_inputs, int | float) and not isinstance(example_inputs, bool):
        raise OptionError("fit takes the budget as an option: fit(model, example_inputs, budget=...)")
    how = resolve(FitOptions, options, overrides, "fit")
    if how.budget is None:
        raise OptionError("fit needs a budget in bytes: fit(model, example_inputs, budget=16 * 2**30)")
    device = runnable_device(how.device, "fit")
    with task(progress, "fitting the step: simulated steps", None, "steps") as advance:

        def peak(names: list[str], precision: str) -> int:
            """The estimated steady-state peak with ``names`` checkpointed, in ``precision``."""
            step = StepOptions(
                optimizer=how.optimizer, precision=precision, checkpointing=tuple(names), device=device
            )
            advance(1)
            return estimate(model, example_inputs, step, loss_fn=loss_fn).steps[0].peak_bytes

        plan = _plan(model, how, how.budget, device, peak)
    if not plan.fits and not plan.offload:
        raise SlimtorchError(
            f"no plan fits {how.budget:,} bytes: the best ({len(plan.checkpointed)} of "
            f"{len(checkpoint_blocks(model))} blocks checkpointed, {plan.precision}) is predicted at "
            f"{plan.predicted_peak_bytes:,}; the weights, gradients and optimizer state alone may be too "
            "large (try a smaller optimizer, bf16 weights or sharding)"
        )
    _apply(model, plan, device)
    return plan


def _plan(
    model: nn.Module, how: FitOptions, budget: int, device: str, peak: Callable[[list[str], str], int]
) -> FitPlan:
    """The first plan that fits, levers pulled in order; else every lever pulled (it may still not fit)."""
    blocks = checkpoint_blocks(model)
    usable = budget * (1 - how.margin)
    unmodified = peak([], "fp32")
    precisions = ["fp32", "bf16-mixed"] if how.allow_precision else ["fp32"]
    chosen = _fewest_blocks(blocks, precisions, usable, unmodified, peak)
    offload, cuda, notes = False, torch.device(device).type == "cuda", []
    if chosen is None:
        names, precision = blocks, precisions[-1]
        offload = how.allow_offload and cuda
        if how.allow_offload and not cuda:
            notes.append("offloading activations is for CUDA: on the CPU they already live in host memory")
        chosen = (names, precision, peak(names, precision))  # offloading moves saved activations off
    names, precision, predicted = chosen
    if precision != "fp32" and not cuda:
        notes.append(
            "bf16 autocast on the CPU: linear, matmul and convolution run in bfloat16 (fast only on CPUs "
            "with bf16 instructions)"
        )
    share = _share(model, names)
    return FitPlan(
        names, precision, offload, predicted, unmodified, budget, share, device, notes, model=model
    )


def _fewest_blocks(
    blocks: list[str],
    precisions: list[str],
    usable: float,
    unmodified: int,
    peak: Callable[[list[str], str], int],
) -> tuple[list[str], str, int] | None:
    """(blocks, precision, peak) with the fewest blocks checkpointed that fit, in the first precision
    where all of them fit; None when none does."""
    for precision in precisions:
        # more blocks checkpointed never raises the peak: bisect for the fewest that fit
        known = {0: unmodified} if precision == "fp32" else {}

        def at(count: int, precision: str = precision, known: dict[int, int] = known) -> int:
            if count not in known:
                known[count] = peak(blocks[:count], precision)
            return known[count]

        if at(len(blocks)) > usable:
            continue
        low, high = -1, len(blocks)  # at(high) fits; at(low) does not (or low is below zero)
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (low, middle) if at(middle) <= usable else (middle, high)
        return blocks[:high], precision, at(high)
    return None


def _share(model: nn.Module, names: list[str]) -> float:
    total = sum(p.numel() for p in model.parameters())
    modules = dict(model.named_modules())
    inside = sum(p.numel() for name in names for p in modules[name].parameters())
    return inside / total if total else 0.0


def _apply(model: nn.Module, plan: FitPlan, device: str) -> None:
    modules = dict(model.named_modules())
    plan._undo.extend(checkpoint_forward(modules[name]) for name in plan.checkpointed)
    if plan.precision != "fp32" or plan.offload:
        forward = model.forward
        autocast = plan.precision == "bf16-mixed"
        device_type = torch.device(device).type

        @functools.wraps(forward)
        def planned(*args: Any, **kwargs: Any) -> Any:
            with _contexts(device_type, autocast, plan.offload):
                return forward(*args, **kwargs)

        plan._undo.append(replace_forward(model, planned))


@contextlib.contextmanager
def _contexts(device_type: str, autocast: bool, offload: bool) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        if autocast:
            stack.enter_context(torch.autocast(device_type, dtype=torch.bfloat16))
        if offload:
            stack.enter_context(torch.autograd.graph.save_on_cpu(pin_memory=True))
        yield
