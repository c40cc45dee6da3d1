"""Each rank's peak memory under data and model parallelism on ``torch.distributed``, from one process's step.

A single process's step (:func:`slimtorch.memory.estimate` at the per-rank batch) says what the weights,
gradients, optimizer state, activations and the optimizer's temporaries cost. How those spread over N
ranks is decided by the wrapper, replayed here moment by moment as torch 2.13 runs it:

- ``"ddp"`` (``DistributedDataParallel``): every rank holds everything, plus its gradient buckets: flat
  tensors as large as all the gradients together, allocated when the model is wrapped and alive for good
  (``bucket_cap_mb`` only decides how many there are). With ``gradient_as_bucket_view=True`` the
  gradients are views into the buckets and cost nothing more.
- ``"zero1"`` (DDP plus ``ZeroRedundancyOptimizer``): as DDP, but each rank keeps the optimizer state of
  the parameters it was dealt (largest first, each to the rank holding the fewest elements so far).
- ``"fsdp"`` (FSDP2 ``fully_shard`` on each block, then on the root; reshard after forward): parameters,
  gradients and optimizer state are 1/N each, dim 0 padded to a multiple of N. A block's parameters are
  all-gathered for its forward and again for its backward; the forward keeps each all-gather's buffer
  until the next block's copy-out, the backward prefetches the previous block's all-gather and keeps one
  reduce-scatter input alive until the next reduce-scatter. The root is not resharded after forward.
- ``"fsdp-offload"`` (``CPUOffloadPolicy``): the sharded parameters, gradients and optimizer state (and the
  optimizer step) move to host memory; the device keeps buffers, inputs, activations and the units being
  all-gathered. FSDP2 needs an accelerator for it (on a CPU-only torch it fails with "Cannot access
  accelerator device when none is available").

Not modelled: mixed precision policies (all-gathers in the parameters' dtype), DDP's one-off bucket
rebuild at step 2 (new buckets allocated before the old are freed), what the communication backend
allocates outside torch's tensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

from torch import nn

from slimtorch.errors import OptionError, SlimtorchError
from slimtorch.format.units import parse_size
from slimtorch.format.verbs import Report
from slimtorch.memory.options import PARALLEL
from slimtorch.memory.step import checkpoint_blocks

STRATEGIES = PARALLEL
"""the wrappers, from the least communication to the least memory (the order ``smallest_world_size`` tries)"""
STATE_RATIOS = {"adamw": 2.0, "adam": 2.0, "sgd": 1.0, "sgd-no-momentum": 0.0, "adagrad": 1.0, "rmsprop": 1.0}
"""optimizer state bytes per parameter byte, for a step whose peak did not hold the state"""
LOW_PRECISION = {"bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class Unit:
    """The parameters one ``fully_shard`` call wraps (a block, or what the root keeps for itself)."""

    name: str
    shapes: tuple[tuple[int, ...], ...] = ()
    itemsizes: tuple[int, ...] = ()
    activation_bytes: int = 0
    """what this unit's forward saves for backward (alive until its backward)"""

    @property
    def bytes(self) -> int:
        return sum(math.prod(shape) * size for shape, size in zip(self.shapes, self.itemsizes, strict=True))

    def shard_bytes(self, world_size: int) -> int:
        """One rank's shard: each parameter's dim 0 padded to a multiple of N, then cut in N (rank 0's)."""
        total = 0
        for shape, size in zip(self.shapes, self.itemsizes, strict=True):
            rows, rest = (shape[0], math.prod(shape[1:])) if shape else (1, 1)
            total += -(-rows // world_size) * rest * size
        return total

    def parameter_bytes(self) -> list[int]:
        return [math.prod(shape) * size for shape, size in zip(self.shapes, self.itemsizes, strict=True)]


@dataclass(frozen=True)
class ParallelStep:
    """What one process's step costs, in the terms the wrappers split it by (fill it with
    :func:`parallel_step` from a model and an estimate at the per-rank batch)."""

    units: tuple[Unit, ...]
    """the blocks, in the order their forwards run"""
    root: Unit = Unit("")
    """parameters in no block, and activations no block saved (the loss, the output)"""
    buffer_bytes: int = 0
    input_bytes: int = 0
    gradient_ratio: float = 1.0
    """gradient bytes per parameter byte (0: inference, or frozen weights)"""
    state_ratio: float = 2.0
    """optimizer state bytes per parameter byte (AdamW: 2)"""
    optimizer_temporary_bytes: int = 0
    """what the optimizer step allocates beyond weights, gradients and state (one process, unsharded)"""

    @property
    def parameter_bytes(self) -> int:
        return self.root.bytes + sum(unit.bytes for unit in self.units)

    @property
    def activation_bytes(self) -> int:
        return self.root.activation_bytes + sum(unit.activation_bytes for unit in self.units)


@dataclass(frozen=True)
class RankMemory(Report):
    """One rank's peak under a parallel strategy: how much, where it happens and what it is made of."""

    SCHEMA: ClassVar[str] = "slimtorch.memory.rank/1"

    strategy: str
    world_size: int
    peak_bytes: int
    """device bytes at the highest moment of the busiest rank"""
    where: str
    """the moment: "forward of layers.3", "backward of layers.1", "optimizer step" ..."""
    rank: int = 0
    breakdown: dict[str, int] = field(default_factory=dict)
    """bytes at the peak: parameters (shards and gathered units), gradients, optimizer_state, activations,
    buffers, inputs, communication (DDP's buckets, FSDP's all-gather and reduce-scatter buffers),
    temporaries (the optimizer's)"""
    ranks: tuple[int, ...] = ()
    """every rank's peak"""
    host_bytes: int = 0
    """``fsdp-offload``: the host memory each rank holds at its highest (shards, gradients, state, step)"""


def parallel_step(model: nn.Module, report: Any, /, blocks: list[str] | None = None) -> ParallelStep:
    """The :class:`ParallelStep` of ``model`` from its :class:`~slimtorch.memory.MemoryReport` (at the
    per-rank batch; its last step).

    ``blocks`` names the modules ``fully_shard`` wraps (None: the entries of the longest ``nn.ModuleList``,
    as ``checkpointing="blocks"`` finds them; none found: the root alone holds everything).

    Example:
        >>> report = slimtorch.memory.estimate(model, torch.randn(64, 512), device="cpu")  # doctest: +SKIP
        >>> step = parallel_step(model, report)  # doctest: +SKIP
        >>> rank_memory(step, "fsdp", 8).where  # doctest: +SKIP
        'backward of layers.1'
    """
    names = checkpoint_blocks(model) if blocks is None else list(blocks)
    memory = report.steps[-1]
    itemsize = LOW_PRECISION.get(report.precision)
    seen: set[int] = set()
    units = [_unit(model.get_submodule(name), name, memory.modules, itemsize, seen) for name in names]
    root = _unit(model, "", {}, itemsize, seen)
    train = report.mode == "train"
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters()) or 1
    parameters = root.bytes + sum(unit.bytes for unit in units)
    held = memory.breakdown.get("optimizer_state", 0)
    state_ratio = held / parameters if held and parameters else STATE_RATIOS.get(report.optimizer or "", 0.0)
    state_ratio = state_ratio if train else 0.0
    gradient_ratio = trainable / total if train else 0.0
    buffers, inputs = memory.breakdown.get("buffers", 0), memory.breakdown.get("inputs", 0)
    resident = parameters + buffers + inputs + state_ratio * parameters
    saved = sum(unit.activation_bytes for unit in units)
    rest = int(memory.phases.get("forward", 0) - resident - saved)
    optimizer = memory.phases.get("optimizer", 0) - resident - gradient_ratio * parameters
    return ParallelStep(
        tuple(units),
        Unit("", root.shapes, root.itemsizes, max(0, rest)),
        buffers,
        inputs,
        gradient_ratio,
        state_ratio,
        max(0, int(optimizer)) if train else 0,
    )


def _unit(module: nn.Module, name: str, saved: dict[str, int], itemsize: int | None, seen: set[int]) -> Unit:
    """A unit of ``module``'s parameters not yet claimed by another (tied weights count once)."""
    shapes, sizes = [], []
    for parameter in module.parameters():
        if id(parameter) not in seen:
            seen.add(id(parameter))
            shapes.append(tuple(parameter.shape))
            floating = parameter.dtype.is_floating_point
            sizes.append(itemsize if itemsize and floating else parameter.element_size())
    prefix = f"{name}."
    activations = sum(n for owner, n in saved.items() if owner == name or owner.startswith(prefix))
    return Unit(name, tuple(shapes), tuple(sizes), activations)


def rank_memory(
    step: ParallelStep, strategy: str, world_size: int, /, *, gradient_as_bucket_view: bool = False
) -> RankMemory:
    """Each rank's peak under ``strategy`` (one of :data:`STRATEGIES`) on ``world_size`` ranks.

    Example:
        >>> memory = rank_memory(step, "fsdp", 4)  # doctest: +SKIP
        >>> memory.peak_bytes, memory.where  # doctest: +SKIP
        (52_428_800, 'backward of layers.1')
    """
    if strategy not in STRATEGIES:
        raise OptionError(f"unknown parallel strategy {strategy!r}: use one of {', '.join(STRATEGIES)}")
    if world_size < 1:
        raise OptionError(f"world_size must be 1 or more, not {world_size}")
    if strategy == "ddp":
        per_rank = [_ddp(step, step.state_ratio * step.parameter_bytes, gradient_as_bucket_view)] * world_size
    elif strategy == "zero1":
        states = _zero_partition(step, world_size)
        alike = {state: _ddp(step, state, gradient_as_bucket_view) for state in set(states)}
        per_rank = [alike[state] for state in states]
    else:
        per_rank = [_fsdp(step, world_size, offload=strategy == "fsdp-offload")] * world_size
    peaks = [max(moments, key=lambda moment: sum(moment[1].values())) for moments, _ in per_rank]
    totals = [sum(breakdown.values()) for _, breakdown in peaks]
    busiest = totals.index(max(totals))
    where, breakdown = peaks[busiest]
    return RankMemory(
        strategy, world_size, totals[busiest], where, busiest, breakdown, tuple(totals), per_rank[busiest][1]
    )


def smallest_world_size(
    step: ParallelStep,
    budget: int | str,
    /,
    *,
    strategies: tuple[str, ...] = STRATEGIES,
    limit: int = 4096,
    start: int = 1,
) -> RankMemory:
    """The fewest ranks (``start`` to ``limit``), and at that count the first of ``strategies`` (the least
    communication first), whose busiest rank fits ``budget`` bytes of device memory (``"24GiB"`` or an int).

    One rank counts too: DDP on one rank still pays for its buckets, so check the plain estimate first.

    Example:
        >>> smallest_world_size(step, "80GiB").to_dict()  # doctest: +SKIP
        {'schema': 'slimtorch.memory.rank/1', 'strategy': 'fsdp', 'world_size': 4, ...}
    """
    room = parse_size(budget) if isinstance(budget, str) else int(budget)
    found = fewest_ranks(step, room, strategies=strategies, sizes=range(start, limit + 1))
    if found is not None:
        return found
    best = min((rank_memory(step, s, limit) for s in strategies), key=lambda m: m.peak_bytes)
    raise SlimtorchError(
        f"no strategy fits {room} bytes per rank on up to {limit} ranks: the least is {best.peak_bytes} "
        f"bytes ({best.strategy}, at {best.where}); shrink the per-rank batch or checkpoint the blocks"
    )


def fewest_ranks(
    step: ParallelStep, room: int, /, *, strategies: tuple[str, ...] = STRATEGIES, sizes: range
) -> RankMemory | None:
    """The first world size in ``sizes``, then the first of ``strategies``, whose busiest rank fits ``room``
    bytes; None when none does (at once when :func:`unshardable_bytes` alone is over ``room``).

    Counts that cannot change a strategy's answer are skipped: DDP's ranks each hold everything whatever
    their number, and ZeRO-1 deals one parameter at most to each rank once there are as many ranks.

    Example:
        >>> fewest_ranks(step, 40 * 2**20, sizes=range(2, 65)).world_size  # doctest: +SKIP
        2
    """
    if unshardable_bytes(step) > room:
        return None
    parameters = sum(len(unit.shapes) for unit in (step.root, *step.units))
    for world_size in sizes:
        for strategy in strategies:
            if world_size > sizes.start and (
                strategy == "ddp" or (strategy == "zero1" and world_size > parameters)
            ):
                continue
            memory = rank_memory(step, strategy, world_size)
            if memory.peak_bytes <= room:
                return memory
    return None


def unshardable_bytes(step: ParallelStep) -> int:
    """What every rank holds at the end of the forward pass under every strategy, however many ranks:
    buffers, inputs and the activations kept for backward (a smaller per-rank batch shrinks them).

    Example:
        >>> unshardable_bytes(ParallelStep((), buffer_bytes=8, input_bytes=16))
        24
    """
    return step.buffer_bytes + step.input_bytes + step.activation_bytes


Moments = list[tuple[str, dict[str, int]]]


def _ddp(step: ParallelStep, state: float, bucket_view: bool) -> tuple[Moments, int]:
    """Every rank whole: the forward with all activations, the backward as gradients replace activations
    block by block (last block first), the optimizer step with every gradient and its temporaries."""
    gradients = step.gradient_ratio * step.parameter_bytes
    base = {
        "parameters": step.parameter_bytes,
        "buffers": step.buffer_bytes,
        "inputs": step.input_bytes,
        "optimizer_state": state,
        "communication": 0 if bucket_view else gradients,
    }
    moments = [("forward", _add(base, activations=step.activation_bytes))]
    ratio, root = step.gradient_ratio, step.root
    for index in reversed(range(len(step.units)) if ratio else ()):
        saved = root.activation_bytes + sum(u.activation_bytes for u in step.units[: index + 1])
        grads = ratio * (root.bytes + sum(u.bytes for u in step.units[index:]))
        moments.append(
            (f"backward of {step.units[index].name}", _add(base, activations=saved, gradients=grads))
        )
    if ratio:
        temporaries = step.optimizer_temporary_bytes if state else 0
        moments.append(("optimizer step", _add(base, gradients=gradients, temporaries=temporaries)))
    return moments, 0


def _zero_partition(step: ParallelStep, world_size: int) -> list[float]:
    """Each rank's optimizer state under ``ZeroRedundancyOptimizer``: parameters dealt largest first, each
    to the rank with the fewest elements so far (its ``_partition_parameters``)."""
    sizes = sorted((n for unit in (step.root, *step.units) for n in unit.parameter_bytes()), reverse=True)
    held = [0] * world_size
    for size in sizes:
        held[held.index(min(held))] += size
    return [step.state_ratio * n for n in held]


def _fsdp(step: ParallelStep, world_size: int, *, offload: bool) -> tuple[Moments, int]:
    """FSDP2's moments on rank 0 (the one with full shards), in the order its hooks run them."""
    ratio = step.gradient_ratio
    shards = step.root.shard_bytes(world_size) + sum(u.shard_bytes(world_size) for u in step.units)
    base: dict[str, float] = {"buffers": step.buffer_bytes, "inputs": step.input_bytes}
    if not offload:
        base |= {"parameters": shards, "optimizer_state": step.state_ratio * shards}
    moments = _fsdp_forward(step, world_size, base, offload)
    if ratio:  # inference has no backward
        moments += _fsdp_backward(step, world_size, base, offload)
    if ratio and not offload:
        temporaries = step.optimizer_temporary_bytes / world_size
        moments.append(("optimizer step", _add(base, gradients=ratio * shards, temporaries=temporaries)))
    host = (1 + ratio + step.state_ratio) * shards + step.optimizer_temporary_bytes / world_size
    return moments, int(host) if offload else 0


def _fsdp_forward(step: ParallelStep, world_size: int, base: dict[str, float], offload: bool) -> Moments:
    """The root gathers first and stays gathered; each block's all-gather buffer lives until the next
    block's copy-out (offload: each rank's shard is first copied to the device)."""
    root = step.root.shard_bytes(world_size) * world_size
    copy = 1 / world_size if offload else 0
    moments = [("forward of the root", _add(base, parameters=root, communication=root * (1 + copy)))]
    previous, saved = root, step.root.activation_bytes
    for unit in step.units:
        gathered, name = unit.shard_bytes(world_size) * world_size, f"forward of {unit.name}"
        parameters = root + gathered
        copy_out = _add(
            base, parameters=parameters, communication=previous + gathered * (1 + copy), activations=saved
        )
        saved += unit.activation_bytes
        compute = _add(base, parameters=parameters, communication=gathered, activations=saved)
        moments += [(name, copy_out), (name, compute)]
        previous = gathered
    return moments


def _fsdp_backward(step: ParallelStep, world_size: int, base: dict[str, float], offload: bool) -> Moments:
    """Last block first: each block's all-gather copied out, the previous block's prefetched during its
    backward, its gradients reduce-scattered after, one reduce-scatter input kept until the next."""
    ratio, units = step.gradient_ratio, step.units
    root = step.root.shard_bytes(world_size) * world_size
    full = [unit.shard_bytes(world_size) * world_size for unit in units]
    copy = 1 / world_size if offload else 0
    moments: Moments = []
    done = in_flight = 0.0  # sharded gradients of the blocks finished; the reduce-scatter input kept
    for index in reversed(range(len(units))):
        gathered, name = full[index], f"backward of {units[index].name}"
        saved = step.root.activation_bytes + sum(u.activation_bytes for u in units[: index + 1])
        prefetch = full[index - 1] * (1 + copy) if index else 0
        held = ratio * root + (0 if offload else done)
        growing = held + ratio * gathered  # this block's unsharded gradients
        copy_out = _add(
            base,
            parameters=root + gathered,
            communication=in_flight + gathered * (1 + copy),
            activations=saved,
            gradients=held,
        )
        compute = _add(
            base,
            parameters=root + gathered,
            communication=in_flight + prefetch,
            activations=saved,
            gradients=growing,
        )
        reduce = _add(
            base,
            parameters=root,
            communication=prefetch + ratio * gathered,
            activations=saved - units[index].activation_bytes,
            gradients=growing,
        )
        moments += [(name, copy_out), (name, compute), (name, reduce)]
        done += ratio * units[index].shard_bytes(world_size)
        in_flight = ratio * gathered
    # the root's own gradients reduce-scattered last (the kept block input was let go first)
    end = _add(base, parameters=root, gradients=2 * ratio * root + (0 if offload else done))
    return [*moments, ("backward of the root", end)]


def _add(base: dict[str, float], **parts: float) -> dict[str, int]:
    """``base`` plus ``parts``, summed by category, as whole bytes (empty categories left out)."""
    total = dict(base)
    for name, value in parts.items():
        total[name] = total.get(name, 0) + value
    return {name: int(value) for name, value in total.items() if value}
