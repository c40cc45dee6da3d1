"""``estimate`` and ``profile``: a training loop's peak memory and where it goes, simulated or measured.

Both run the same steps (:mod:`slimtorch.memory.step`): ``estimate`` on fake tensors, so it needs no
memory for the model's weights or activations and works for models larger than RAM; ``profile`` on real
ones. The step runs as a loop runs it, until it repeats: the peak reported is the steady state's (from
step 2 on, the optimizer's state is alive through forward and backward), the first step's beside it.
The peak is broken down by what its bytes are (parameters, gradients, optimizer state, activations saved
for backward, inputs, temporaries), by phase (forward, backward, optimizer) and, for activations, by the
module that saved them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import torch
from torch import nn

from slimtorch.errors import OptionError, SlimtorchError
from slimtorch.format.progress import Progress, task
from slimtorch.format.verbs import Report, resolve
from slimtorch.memory.allocator import mallinfo2
from slimtorch.memory.device import default_device, runnable_device
from slimtorch.memory.heap import CODE_PAGES, repeated, resident_peak
from slimtorch.memory.options import StepOptions
from slimtorch.memory.parallel import RankMemory, parallel_step, rank_memory
from slimtorch.memory.step import DONE, StepRecord, named_device, run_steps
from slimtorch.memory.timeline import StorageTimeline

CURVE_POINTS = 1000
RESIDENT_STEPS = 3
"""steps the resident-memory prediction runs (the steady one repeated): the loop that was measured"""
CATEGORIES = ("parameters", "buffers", "gradients", "optimizer_state", "activations", "inputs", "temporaries")


@dataclass(frozen=True)
class StepMemory:
    """The peak of a training loop's step at one batch size.

    ``peak_bytes`` is the steady state's peak (``steady_peak_bytes``): every step from the second on
    reaches it, so it is what to size a device by; ``first_step_peak_bytes`` is the first step's, lower
    in training (the optimizer's state is made only in its optimizer step). The breakdown, phases,
    modules and curve are the steady step's.
    """

    batch_size: int | None
    peak_bytes: int
    peak_phase: str
    """where the peak happened: forward, backward or optimizer"""
    peak_module: str
    breakdown: dict[str, int]
    """bytes at the peak, by category (see :data:`CATEGORIES`)"""
    phases: dict[str, int]
    """the highest live bytes within each phase"""
    modules: dict[str, int]
    """activations alive at the forward pass's peak, by the module that saved them, largest first"""
    curve: list[tuple[str, int]] = field(default_factory=list)
    """live bytes through the step, (phase, bytes) at up to :data:`CURVE_POINTS` evenly spaced moments
    (each the highest of its stretch), for a chart"""
    allocator_peak_bytes: int | None = None
    """``profile`` only: the allocator's own high-water mark over the step (CUDA's max_memory_allocated,
    or the C library's heap in use on the CPU, measured after every op), in the steady step"""
    first_step_peak_bytes: int = 0
    """the loop's first step's peak (before the optimizer's state exists)"""
    steady_peak_bytes: int = 0
    """the steady state's peak: ``peak_bytes``"""
    steps_run: int = 1
    """steps run until one started with the same tensors alive as the one before (2 in training)"""
    resident_bytes: int | None = None
    """on the CPU, the RSS a fresh process running these steps is predicted to grow by, from making the
    weights and inputs through three steps: the tensors, what glibc's malloc keeps of the freed ones and
    the library code the kernels page in (:mod:`slimtorch.memory.heap`, checked against real loops by
    ``benchmarks/allocator_overhead.py``). None on CUDA"""


@dataclass(frozen=True)
class MemoryReport(Report):
    """Peaks at each batch size, and the peak as a line in the batch size (fixed + per-sample bytes)."""

    SCHEMA: ClassVar[str] = "slimtorch.memory/1"
    DERIVED: ClassVar[dict[str, dict[str, Any]]] = {"peak_bytes": {"type": "integer"}}

    mode: str
    precision: str
    optimizer: str | None
    device: str
    checkpointing: str | tuple[str, ...] | None
    steps: list[StepMemory] = field(default_factory=list)
    fixed_bytes: int | None = None
    per_sample_bytes: float | None = None
    """the peak as a line in the batch size, fitted over ``steps`` (two or more batch sizes)"""
    phase_lines: dict[str, tuple[float, float]] = field(default_factory=dict)
    """phase -> (fixed, per-sample bytes) of that phase's highest point: the overall peak moves from the
    optimizer step (weights and moments, fixed) to the backward pass (activations) as batches grow"""
    set_to_none: bool = True
    """whether gradients were freed between steps (else kept as zeros)"""
    accumulation: int = 1
    """micro-batches per optimizer step"""
    per_rank: RankMemory | None = None
    """each rank's peak under ``parallel`` (the last batch size's step, per rank), when asked for"""

    @property
    def peak_bytes(self) -> int:
        return max(step.peak_bytes for step in self.steps)

    def predict(self, batch_size: int) -> int:
        """The peak at ``batch_size``: the highest of the phases' lines through the estimated sizes."""
        if not self.phase_lines:
            raise OptionError("predicting needs estimates at two or more batch sizes (batch_sizes=[...])")
        return int(max(fixed + slope * batch_size for fixed, slope in self.phase_lines.values()))

    def largest_batch(self, budget: float, *, scale: float = 1.0, limit: int = 1 << 24) -> int:
        """The largest batch whose predicted peak, times ``scale``, fits ``budget`` (0: not even one)."""
        if scale * self.predict(1) > budget:
            return 0
        low, high = 1, 2
        while high < limit and scale * self.predict(high) <= budget:
            low, high = high, high * 2
        while high - low > 1:  # the peak never shrinks as the batch grows: bisect
            middle = (low + high) // 2
            low, high = (middle, high) if scale * self.predict(middle) <= budget else (low, middle)
        return low


def estimate(
    model: nn.Module,
    example_inputs: Any,
    /,
    options: StepOptions | None = None,
    *,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    progress: Progress | None = None,
    **overrides: Any,
) -> MemoryReport:
    """Predict a training loop's (or inference's) peak memory without running it for real.

    The forward pass, the backward pass and the optimizer step run on fake tensors (shapes, no data), so
    the model may be built on the meta device and be larger than RAM, step after step with the optimizer
    kept, until the steps repeat (step 2 in training: step 1 makes the optimizer's state). Every storage
    the steps would allocate and free is recorded; the report gives the steady state's peak (and the
    first step's), what it is made of, where it happens, and how it grows with the batch size.

    Args:
        model: the model (its weights are never touched; a meta-device model is enough).
        example_inputs: one batch: a tensor, a tuple of arguments or a dict of keyword arguments.
        options: the step (:class:`StepOptions`: mode, optimizer, precision, checkpointing, device,
            batch_sizes, set_to_none, accumulation); ``**overrides`` replace its fields. Any machine can
            plan for CUDA (``device="cuda"``): nothing runs on it.
        loss_fn: output -> scalar loss (default: the sum of the first floating-point output).
        progress: told of each batch size's step (None: silent).

    Example:
        >>> import slimtorch, torch
        >>> layers = (torch.nn.Linear(1024, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 10))
        >>> model = torch.nn.Sequential(*layers)
        >>> report = slimtorch.memory.estimate(model, torch.randn(64, 1024), batch_sizes=[64, 128])
        >>> held = report.steps[0].breakdown
        >>> held["optimizer_state"] // held["parameters"]  # AdamW: two moments per weight
        2
        >>> report.steps[0].steps_run  # step 1 makes AdamW's state; step 2, the steady one, repeats
        2
    """
    step = resolve(StepOptions, options, overrides, "estimate")
    step = replace(step, device=step.device or default_device())
    sizes = _sizes(step)
    steps = []
    with task(progress, "estimating memory", len(sizes), "steps") as advance:
        for batch_size in sizes:
            record = run_steps(model, example_inputs, batch_size, step, fake=True, loss_fn=loss_fn)
            steps.append(_measured(record, batch_size))
            advance(1)
    return _with_ranks(model, _report(step, steps), step)


def profile(
    model: nn.Module,
    example_inputs: Any,
    /,
    options: StepOptions | None = None,
    *,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    progress: Progress | None = None,
    **overrides: Any,
) -> MemoryReport:
    """The same steps as :func:`estimate`, run for real (on copies of the weights, on the options'
    ``device``; None: this machine's): the same breakdown, measured, plus the allocator's own high-water
    mark in the steady step to check both against.

    Example:
        >>> report = slimtorch.memory.profile(model, torch.randn(8, 64))  # doctest: +SKIP
        >>> report.steps[0].peak_bytes, report.steps[0].allocator_peak_bytes  # doctest: +SKIP
        (1_179_648, 1_183_744)
    """
    step = resolve(StepOptions, options, overrides, "profile")
    step = replace(step, device=runnable_device(step.device, "profile"))
    sizes = _sizes(step)
    steps = []
    with task(progress, "profiling memory", len(sizes), "steps") as advance:
        for batch_size in sizes:
            sampler = _sampler(step)
            record = run_steps(
                model, example_inputs, batch_size, step, fake=False, loss_fn=loss_fn, timeline=sampler
            )
            allocator = sampler.allocator_peak() if isinstance(sampler, _AllocatorSampler) else None
            steps.append(_measured(record, batch_size, allocator))
            advance(1)
    return _with_ranks(model, _report(step, steps), step)


def _with_ranks(model: nn.Module, report: MemoryReport, step: StepOptions) -> MemoryReport:
    """The report with each rank's peak under ``step.parallel``, when asked for."""
    if step.parallel is None:
        return report
    return replace(report, per_rank=rank_memory(parallel_step(model, report), step.parallel, step.world_size))


def _sizes(step: StepOptions) -> list[int | None]:
    """The batch sizes to step at: the options' own (checked there), or None for the inputs' as given."""
    return [None] if step.batch_sizes is None else list(step.batch_sizes)


def _measured(record: StepRecord, batch_size: int | None, allocator: int | None = None) -> StepMemory:
    """The steady (last) step's peak, breakdown, phases and curve, and the first step's peak."""
    peak = record.timeline.peak()
    breakdown = dict.fromkeys(CATEGORIES, 0)
    for key, nbytes in peak.live.items():
        breakdown[_category(record, key)] += nbytes
    modules: dict[str, int] = {}
    for key, nbytes in record.timeline.peak("forward").live.items():
        if _category(record, key) == "activations":
            owner = record.timeline.saved.get(key, "")
            modules[owner] = modules.get(owner, 0) + nbytes
    ranked = dict(sorted(modules.items(), key=lambda item: -item[1]))
    return StepMemory(
        batch_size,
        peak.bytes,
        peak.phase,
        peak.module,
        breakdown,
        {name: value for name, value in record.timeline.step_phase_peaks[-1].items() if name != DONE},
        ranked,
        _curve(record.timeline),
        allocator,
        record.timeline.peak(step=0).bytes,
        peak.bytes,
        record.steps_run,
        _resident(record),
    )


def _resident(record: StepRecord) -> int | None:
    """The CPU process's predicted RSS growth over :data:`RESIDENT_STEPS` steps, the steady one repeated
    (None on CUDA: not glibc's heap)."""
    timeline = record.timeline
    if timeline.rounding != 1:
        return None
    window = timeline.window()
    end = next((index for index in window if timeline.events[index].phase == DONE), window.stop)
    events = [(event.key, event.nbytes) for event in timeline.events[:end]]
    scratch = [op for op in timeline.scratch if op[0] < end]
    if record.steps_run > 1:  # in training: the first step made the optimizer's state; repeat the steady one
        steps = max(RESIDENT_STEPS - record.steps_run, 0)
        events, scratch = repeated(events, scratch, range(window.start, end), steps)
    return resident_peak(events, scratch) + CODE_PAGES


def _curve(timeline: StorageTimeline) -> list[tuple[str, int]]:
    """Live bytes after each event of the steady (last) step, thinned to :data:`CURVE_POINTS` (the
    highest of each stretch)."""
    points: list[tuple[str, int]] = []
    current = 0
    window = timeline.window()
    for index, event in enumerate(timeline.events):
        current += event.nbytes
        if index in window and event.phase != DONE:
            points.append((event.phase, current))
    stride = max(1, -(-len(points) // CURVE_POINTS))
    return [max(points[i : i + stride], key=lambda p: p[1]) for i in range(0, len(points), stride)]


def _category(record: StepRecord, key: int) -> str:
    for category, keys in (
        ("parameters", record.parameters),
        ("buffers", record.buffers),
        ("gradients", record.gradients),
        ("optimizer_state", record.optimizer_state),
        ("inputs", record.inputs),
    ):
        if key in keys:
            return category
    return "activations" if key in record.timeline.saved else "temporaries"


def _report(plan: StepOptions, steps: list[StepMemory]) -> MemoryReport:
    sized = [s for s in steps if s.batch_size is not None]
    overall = _line([(s.batch_size, s.peak_bytes) for s in sized])  # type: ignore[misc]
    phases = {name for s in sized for name in s.phases if name not in ("setup", DONE)}
    lines = {}
    for name in sorted(phases):
        line = _line([(s.batch_size, s.phases.get(name, 0)) for s in sized])  # type: ignore[misc]
        if line is not None:
            lines[name] = line
    optimizer = plan.optimizer if plan.mode == "train" else None
    fixed, per_sample = (int(overall[0]), overall[1]) if overall else (None, None)
    return MemoryReport(
        plan.mode,
        plan.precision,
        optimizer,
        named_device(plan),
        plan.checkpointing,
        steps,
        fixed,
        per_sample,
        lines,
        plan.set_to_none,
        plan.accumulation,
    )


def _line(points: list[tuple[int, int]]) -> tuple[float, float] | None:
    """Least-squares (intercept, slope) through (batch size, bytes); None below two batch sizes."""
    if len({b for b, _ in points}) < 2:
        return None
    n = len(points)
    mean_b = sum(b for b, _ in points) / n
    mean_p = sum(p for _, p in points) / n
    slope = sum((b - mean_b) * (p - mean_p) for b, p in points) / sum((b - mean_b) ** 2 for b, _ in points)
    return mean_p - slope * mean_b, slope


def measure_peak(step: Callable[[], Any], device: str | None = None, resident: int = 0) -> int:
    """The peak bytes of running ``step`` on ``device`` (None: this machine's): CUDA's
    ``max_memory_allocated`` (everything allocated on the device); on the CPU, the heap the step adds at
    its highest plus ``resident`` (what it found already allocated: the model's weights).

    Example:
        >>> measure_peak(lambda: torch.zeros(2**20), "cpu") >= 4 * 2**20  # doctest: +SKIP
        True
    """
    device = runnable_device(device, "measure_peak")
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        torch.cuda.synchronize(device)
        return int(torch.cuda.max_memory_allocated(device))
    heap = _heap_in_use()
    if heap is None:
        raise SlimtorchError("measuring CPU memory needs glibc's mallinfo2 (Linux)")
    sampler = _AllocatorSampler(1, heap)
    with sampler:
        step()
    return sampler.allocator_peak() + resident


# -- the allocator's view ---------------------------------------------------------------------------------
class _AllocatorSampler(StorageTimeline):
    """A timeline that also reads the allocator's bytes in use after every op."""

    def __init__(self, rounding: int, read: Callable[[], int]) -> None:
        super().__init__(rounding)
        self._read = read
        self._start = read()
        self._highs = [self._start]  # per step

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        self._highs[-1] = max(self._highs[-1], self._read())
        return out

    def begin_step(self) -> None:
        super().begin_step()
        self._highs.append(self._read())

    def allocator_peak(self) -> int:
        """Bytes in use at the highest of the last step, counted from before the first step made its
        tensors (weights, inputs)."""
        return self._highs[-1] - self._start


def _sampler(plan: StepOptions) -> StorageTimeline:
    if torch.device(named_device(plan)).type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        return _AllocatorSampler(512, torch.cuda.memory_allocated)
    heap = _heap_in_use()
    return _AllocatorSampler(1, heap) if heap is not None else StorageTimeline(1)


def _heap_in_use() -> Callable[[], int] | None:
    """glibc's bytes in use (its arenas plus mmap'd chunks): where torch's CPU tensors live."""
    heap = mallinfo2()
    return None if heap is None else (lambda: heap()[0])
