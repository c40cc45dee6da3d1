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

When one device is not enough, ranks are the next lever (``world_size="auto"``, or a fixed count): each
rank trains on the example's batch under DDP, ZeRO-1 or FSDP2 (:mod:`slimtorch.memory.parallel` gives the
busiest rank's peak). Which costs less, recomputation or ranks, is the caller's trade: checkpointing a
block costs one more forward of it (at most about a third more compute, on every device), bf16 the last
bits of the results; a rank costs a whole device, and sharding costs communication every step (FSDP2
all-gathers the weights twice and reduce-scatters the gradients: about 1.5 times DDP's traffic). The
order chosen here: one device with the fewest levers if any plan fits there; else the fewest ranks, at
that count the strategy with the least communication (DDP, ZeRO-1, FSDP2, FSDP2 with CPU offload), and
at that strategy the fewest levers. ``allow_checkpointing=False`` (and ``allow_precision=False``) puts
ranks before recomputation. ``fit`` applies checkpointing and autocast; it cannot start ranks, so the
plan's ``launch`` says the ``torchrun`` command and the wrapper in one line.

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
from slimtorch.memory.device import default_device, runnable_device
from slimtorch.memory.estimating import MemoryReport, estimate
from slimtorch.memory.options import FitOptions, StepOptions
from slimtorch.memory.parallel import (
    RankMemory,
    fewest_ranks,
    parallel_step,
    rank_memory,
    unshardable_bytes,
)
from slimtorch.memory.step import checkpoint_blocks, checkpoint_forward, replace_forward

Estimated = Callable[[list[str], str], MemoryReport]


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
    """what the device changed about the plan (bf16 on the CPU, no offloading there); the batch per rank"""
    strategy: str | None = None
    """the wrapper the ranks use (``"ddp"``, ``"zero1"``, ``"fsdp"``, ``"fsdp-offload"``); None: one device"""
    world_size: int = 1
    """ranks, each training on the example's batch; ``predicted_peak_bytes`` is then the busiest rank's"""
    per_rank: RankMemory | None = None
    """the busiest rank's peak, where it happens and what it holds, when the plan takes ranks"""
    launch: str = ""
    """how to start the ranks, in one line (the torchrun command and the wrapper); empty for one device"""
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
    allow_checkpointing, margin, world_size, strategies, max_world_size, apply); ``**overrides`` replace
    its fields. The device is where the model trains (None: this machine's, CUDA if torch sees one); a
    plan is applied here, so CUDA on a machine without it is refused unless ``apply=False``.
    ``world_size="auto"`` proposes ranks when one device cannot fit (the module's docstring says in which
    order, and why); ``progress`` is told of each simulated step.

    Example:
        >>> plan = slimtorch.memory.fit(model, batch, budget=16 * 2**30)  # doctest: +SKIP
        >>> plan.checkpointed, plan.predicted_peak_bytes  # doctest: +SKIP
        (['layers.0', 'layers.1', 'layers.2'], 15_812_000_000)
        >>> plan = slimtorch.memory.fit(model, batch, budget=40 * 2**30, world_size="auto")  # doctest: +SKIP
        >>> plan.world_size, plan.strategy, plan.launch  # doctest: +SKIP
        (2, 'fsdp', 'torchrun --nproc-per-node 2 train.py: fully_shard(block) on each of layers.0 .. ...')
    """
    if isinstance(example_inputs, int | float) and not isinstance(example_inputs, bool):
        raise OptionError("fit takes the budget as an option: fit(model, example_inputs, budget=...)")
    how = resolve(FitOptions, options, overrides, "fit")
    _budget(how)  # refused before anything runs
    device = runnable_device(how.device, "fit") if how.apply else how.device or default_device()
    reports: dict[tuple[tuple[str, ...], str], MemoryReport] = {}
    with task(progress, "fitting the step: simulated steps", None, "steps") as advance:

        def estimated(names: list[str], precision: str) -> MemoryReport:
            """The estimated step with ``names`` checkpointed, in ``precision`` (each estimated once)."""
            key = (tuple(names), precision)
            if key not in reports:
                step = StepOptions(
                    optimizer=how.optimizer, precision=precision, checkpointing=key[0] or None, device=device
                )
                advance(1)
                reports[key] = estimate(model, example_inputs, step, loss_fn=loss_fn)
            return reports[key]

        plan = _chosen(model, how, device, estimated)
    if how.apply:
        _apply(model, plan, device)
    return plan


def _chosen(model: nn.Module, how: FitOptions, device: str, estimated: Estimated) -> FitPlan:
    """One device's plan, or the ranks' when asked for (or when ``"auto"`` finds one device too small);
    a clear error when neither fits."""
    budget = _budget(how)
    alone = _plan(model, how, budget, device, lambda names, p: estimated(names, p).steps[0].peak_bytes)
    # offloading moves the saved activations off the device, not the optimizer step's weights and state
    step = estimated(alone.checkpointed, alone.precision).steps[0]
    offloading = alone.offload and step.phases.get("optimizer", 0) <= budget * (1 - how.margin)
    # a count of ranks asked for; None: one device, or "auto"
    fixed = how.world_size if isinstance(how.world_size, int) and how.world_size > 1 else None
    if fixed is None and (alone.fits or how.world_size != "auto"):
        if not alone.fits and not offloading:
            raise _refusal(model, how, alone, device, estimated)
        return alone
    sizes = range(fixed, fixed + 1) if fixed is not None else range(2, how.max_world_size + 1)
    ranked = _ranked(model, how, device, estimated, sizes, alone.unmodified_peak_bytes)
    if ranked is not None:
        return ranked
    if offloading and fixed is None:
        return alone  # activations too large for any count of ranks: offloading is what is left
    raise _ranks_refusal(model, how, device, estimated, sizes)


def _budget(how: FitOptions) -> int:
    """The budget in bytes, which ``fit`` requires (:class:`FitOptions` holds None until one is given)."""
    if how.budget is None:
        raise OptionError("fit needs a budget in bytes: fit(model, example_inputs, budget=16 * 2**30)")
    return how.budget


def _plan(
    model: nn.Module, how: FitOptions, budget: int, device: str, peak: Callable[[list[str], str], int]
) -> FitPlan:
    """The first plan that fits, levers pulled in order; else every lever pulled (it may still not fit)."""
    blocks, precisions = _levers(model, how)
    usable = budget * (1 - how.margin)
    unmodified = peak([], "fp32")
    chosen = _fewest_blocks(blocks, precisions, usable, unmodified, peak)
    offload, cuda, notes = False, torch.device(device).type == "cuda", []
    if chosen is None:
        names, precision = blocks, precisions[-1]
        offload = how.allow_offload and cuda
        if how.allow_offload and not cuda:
            notes.append("offloading activations is for CUDA: on the CPU they already live in host memory")
        chosen = (names, precision, peak(names, precision))  # offloading moves saved activations off
    names, precision, predicted = chosen
    notes += _precision_notes(precision, device)
    share = _share(model, names)
    return FitPlan(
        names, precision, offload, predicted, unmodified, budget, share, device, notes, model=model
    )


def _levers(model: nn.Module, how: FitOptions) -> tuple[list[str], list[str]]:
    """The blocks that may be checkpointed and the precisions that may be tried, in the order pulled."""
    blocks = checkpoint_blocks(model) if how.allow_checkpointing else []
    return blocks, ["fp32", "bf16-mixed"] if how.allow_precision else ["fp32"]


def _precision_notes(precision: str, device: str) -> list[str]:
    if precision == "fp32" or torch.device(device).type == "cuda":
        return []
    return [
        "bf16 autocast on the CPU: linear, matmul and convolution run in bfloat16 (fast only on CPUs "
        "with bf16 instructions)"
    ]


def _ranked(
    model: nn.Module, how: FitOptions, device: str, estimated: Estimated, sizes: range, unmodified: int
) -> FitPlan | None:
    """The fewest ranks in ``sizes`` whose busiest rank fits with every block checkpointed (in either
    precision), at that count the first strategy that does, and there the fewest levers; None when no
    count fits. Under sharding bf16 autocast can cost more than it saves (autocast keeps a bf16 copy of
    each weight it casts through the forward, and those copies are not sharded), so both are tried."""
    blocks, precisions = _levers(model, how)
    usable = int(_budget(how) * (1 - how.margin))
    strategies, notes = _strategies(how, device)
    leanest = [parallel_step(model, estimated(blocks, precision)) for precision in precisions]
    fitting = [fewest_ranks(step, usable, strategies=strategies, sizes=sizes) for step in leanest]
    found = min(
        (memory for memory in fitting if memory is not None),
        key=lambda memory: (memory.world_size, strategies.index(memory.strategy)),
        default=None,
    )
    if found is None:
        return None

    def memory(names: list[str], precision: str) -> RankMemory:
        return rank_memory(
            parallel_step(model, estimated(names, precision)), found.strategy, found.world_size
        )

    def peak(names: list[str], precision: str) -> int:
        return memory(names, precision).peak_bytes

    chosen = _fewest_blocks(blocks, precisions, usable, peak([], "fp32"), peak)
    assert chosen is not None, "every lever pulled fits at this count: fewest_ranks said so"
    names, precision, predicted = chosen
    notes += _precision_notes(precision, device)
    notes.append(
        f"each of the {found.world_size} ranks trains on the example's batch: the global batch is "
        f"{found.world_size} times it"
    )
    return FitPlan(
        names,
        precision,
        False,
        predicted,
        unmodified,
        _budget(how),
        _share(model, names),
        device,
        notes,
        strategy=found.strategy,
        world_size=found.world_size,
        per_rank=memory(names, precision),
        launch=_launch(found.strategy, found.world_size, checkpoint_blocks(model), how.optimizer),
        model=model,
    )


def _strategies(how: FitOptions, device: str) -> tuple[tuple[str, ...], list[str]]:
    """The strategies asked for that exist on ``device``, and a note for one that does not."""
    if torch.device(device).type == "cuda" or "fsdp-offload" not in how.strategies:
        return how.strategies, []
    kept = tuple(s for s in how.strategies if s != "fsdp-offload")
    return kept, [
        "fsdp-offload is for CUDA: FSDP2's CPU offload needs an accelerator, and on the CPU the "
        "device's memory is host memory already"
    ]


OPTIMIZER_CLASSES = {
    "adamw": "AdamW",
    "adam": "Adam",
    "sgd": "SGD",
    "sgd-no-momentum": "SGD",
    "adagrad": "Adagrad",
    "rmsprop": "RMSprop",
}
"""the torch.optim class of each of :data:`~slimtorch.memory.options.OPTIMIZERS`, for the launch line"""


def _launch(strategy: str, world_size: int, blocks: list[str], optimizer: str) -> str:
    """The one line that starts the plan's ranks: torchrun, and the wrapper the model goes into."""
    start = f"torchrun --nproc-per-node {world_size} train.py"
    if world_size > 8:  # more ranks than one machine usually holds: several nodes
        start = f"torchrun --nnodes M --nproc-per-node {world_size}/M train.py ({world_size} ranks)"
    if strategy in ("ddp", "zero1"):
        wrapper = "the model in torch.nn.parallel.DistributedDataParallel"
        if strategy == "zero1":
            name = OPTIMIZER_CLASSES[optimizer]
            wrapper += (
                ", the optimizer as torch.distributed.optim.ZeroRedundancyOptimizer("
                f"params, optimizer_class=torch.optim.{name})"
            )
        return f"{start}: {wrapper}"
    offload = ", offload_policy=CPUOffloadPolicy()" if strategy == "fsdp-offload" else ""
    each = f"fully_shard(block{offload}) on each of {blocks[0]} .. {blocks[-1]}, then " if blocks else ""
    return f"{start}: {each}fully_shard(model{offload}) (torch.distributed.fsdp)"


def _refusal(
    model: nn.Module, how: FitOptions, plan: FitPlan, device: str, estimated: Estimated
) -> SlimtorchError:
    """No one-device plan fits: how close the best came, and whether ranks would fit."""
    ranked = _ranked(
        model, how, device, estimated, range(2, how.max_world_size + 1), plan.unmodified_peak_bytes
    )
    ranks = (
        f"; on {ranked.world_size} ranks with {ranked.strategy} it fits: world_size='auto' "
        "(--world-size auto) proposes it"
        if ranked is not None
        else f"; no count of ranks up to {how.max_world_size} fits either"
    )
    return SlimtorchError(
        f"no plan fits {how.budget:,} bytes: the best ({len(plan.checkpointed)} of "
        f"{len(checkpoint_blocks(model))} blocks checkpointed, {plan.precision}) is predicted at "
        f"{plan.predicted_peak_bytes:,}; the weights, gradients and optimizer state alone may be too "
        f"large (try a smaller optimizer, bf16 weights or sharding){ranks}"
    )


def _ranks_refusal(
    model: nn.Module, how: FitOptions, device: str, estimated: Estimated, sizes: range
) -> SlimtorchError:
    """No count of ranks fits: the least per-rank peak, and what no count shrinks."""
    blocks = checkpoint_blocks(model) if how.allow_checkpointing else []
    precisions = ["fp32", "bf16-mixed"] if how.allow_precision else ["fp32"]
    steps = {precision: parallel_step(model, estimated(blocks, precision)) for precision in precisions}
    strategies, _ = _strategies(how, device)
    counts = sorted({sizes.start, sizes[-1]})
    least, precision = min(
        (
            (rank_memory(step, s, n), precision)
            for precision, step in steps.items()
            for s in strategies
            for n in counts
        ),
        key=lambda pair: pair[0].peak_bytes,
    )
    step = steps[precision]
    span = f"{sizes.start}" if len(sizes) == 1 else f"{sizes.start} to {sizes[-1]}"
    return SlimtorchError(
        f"no plan fits {how.budget:,} bytes per rank on {span} ranks ({', '.join(strategies)}): the "
        f"least per-rank peak is {least.peak_bytes:,} bytes ({least.strategy} on {least.world_size} ranks, "
        f"at {least.where}, {len(blocks)} blocks checkpointed, {precision}); every rank keeps "
        f"{unshardable_bytes(step):,} bytes of inputs, buffers and activations whatever the count: "
        "shrink the per-rank batch"
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
