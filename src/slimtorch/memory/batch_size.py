"""``find_batch_size``: the largest batch that fits, predicted from the estimate, confirmed by real steps.

The usual finders learn the limit by crashing into it: accelerate retries at 90% after every
out-of-memory error, Lightning doubles until one, then bisects. Here the estimate (each phase's peak as a
line in the batch size, in the loop's steady state) predicts the answer before any real step runs; a trial
at that size runs two real steps and measures the second (a loop's first step has no optimizer state yet,
so it fits where the second may not), whose ratio to the prediction corrects it; a second trial confirms
the corrected answer.
Out-of-memory errors (told by their type first, their message second) make it back off, and a safety
margin keeps the answer clear of the edge. With ``torch.distributed`` initialised, every rank takes the
smallest answer of all.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from slimtorch.errors import OptionError, SlimtorchError
from slimtorch.format.progress import Progress, task
from slimtorch.format.verbs import Report, resolve
from slimtorch.memory.device import runnable_device
from slimtorch.memory.estimating import MemoryReport, measure_peak
from slimtorch.memory.options import BatchSizeOptions

OOM_MESSAGES = (
    "out of memory",
    "can't allocate memory",
    "cudnn_status_not_supported",  # cuDNN's way of saying it ran out of workspace
    "cuda error: out of memory",
)
BACK_OFF = 0.9


@dataclass(frozen=True)
class Trial:
    batch_size: int
    fits: bool
    peak_bytes: int | None
    """measured peak of the trial's second step (None when either step ran out of memory)"""


@dataclass(frozen=True)
class BatchSizeResult(Report):
    """The batch size found, what the estimate alone predicted, and every real step that told it."""

    SCHEMA: ClassVar[str] = "slimtorch.batch-size/1"

    batch_size: int
    predicted: int
    """what the estimate alone predicted"""
    budget_bytes: int
    trials: list[Trial] = field(default_factory=list)


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` means the step ran out of memory: ``torch.OutOfMemoryError`` (CUDA, and others
    that raise it), else a RuntimeError whose message says so (the CPU allocator, older backends)."""
    if isinstance(error, torch.OutOfMemoryError):
        return True
    if isinstance(error, (RuntimeError, MemoryError)):
        text = " ".join(str(a) for a in error.args).lower()
        return isinstance(error, MemoryError) or any(message in text for message in OOM_MESSAGES)
    return False


def find_batch_size(
    train_step: Callable[[int], Any],
    report: MemoryReport,
    /,
    options: BatchSizeOptions | None = None,
    *,
    progress: Progress | None = None,
    **overrides: Any,
) -> BatchSizeResult:
    """The largest batch size whose training loop fits the budget, in at most ``max_trials`` trials of
    two real steps each (the second measured: it is the first with the optimizer's state alive).

    Args:
        train_step: runs one step of the real loop at the batch size it is given (forward, backward,
            optimizer step, ``zero_grad``), its optimizer kept from call to call as in training, and makes
            its batch itself. On the CPU the second step's peak is measured as the heap it adds plus what
            the estimate says a step starts with (weights, buffers, optimizer state, and gradients when
            the report kept them: ``set_to_none=False``).
        report: :func:`slimtorch.memory.estimate` of the step at two or more batch sizes, with the
            optimizer ``train_step`` uses.
        options: :class:`BatchSizeOptions` (budget, margin, max_trials, device); ``**overrides`` replace
            its fields. The budget defaults to the CUDA device's free memory (required on the CPU); the
            device to the report's, itself this machine's unless the estimate named one. The answer is
            always a batch size a real step ran at within the budget.
        progress: told of each real step (None: silent).

    Example:
        >>> report = slimtorch.memory.estimate(model, batch, batch_sizes=[8, 16])  # doctest: +SKIP
        >>> found = find_batch_size(lambda n: step(model, data(n)), report, budget=2**35)  # doctest: +SKIP
        >>> found.batch_size  # doctest: +SKIP
        112
    """
    search = resolve(BatchSizeOptions, options, overrides, "find_batch_size")
    device = runnable_device(search.device or report.device, "find_batch_size")
    budget = search.budget if search.budget is not None else _free_memory(device)
    if not report.phase_lines:
        raise OptionError("find_batch_size needs an estimate at two or more batch sizes (batch_sizes=[...])")
    usable = budget * (1 - search.margin)
    predicted = report.largest_batch(usable)
    if predicted < 1:
        raise SlimtorchError(
            f"even batch 1 is predicted to need {report.predict(1):,} bytes, over the budget of {budget:,}"
        )
    with task(progress, "finding the batch size", search.max_trials, "trials") as advance:
        trials = _search(train_step, report, predicted, budget, usable, search.max_trials, device, advance)
    best = max((t.batch_size for t in trials if t.fits), default=0)
    if best < 1:
        raise SlimtorchError(f"no batch size fitted {budget:,} bytes in {len(trials)} trials of two steps")
    return BatchSizeResult(_agreed(best), predicted, budget, trials)


def _search(
    train_step: Callable[[int], Any],
    report: MemoryReport,
    candidate: int,
    budget: int,
    usable: float,
    max_trials: int,
    device: str,
    advance: Callable[[int], None],
) -> list[Trial]:
    """Trials from the predicted ``candidate``: each measured peak rescales the estimate's lines, and
    the next candidate is the largest batch they then fit, until it repeats or stops growing."""
    resident = _resident(report)
    trials: list[Trial] = []
    best, too_big, scale = 0, None, 1.0
    for _ in range(max_trials):
        trial = _try(train_step, candidate, device, budget, resident)
        trials.append(trial)
        advance(1)
        expected = report.predict(candidate)
        if trial.peak_bytes is not None:  # ran to the end: how far off the estimate was, there
            scale = trial.peak_bytes / expected
        else:  # out of memory before the end: it needed more than the budget, by an unknown share
            scale = max(scale, budget / expected) / BACK_OFF
        if trial.fits:
            best = max(best, candidate)
        else:
            too_big = min(too_big or candidate, candidate)
        following = report.largest_batch(usable, scale=scale)
        if too_big is not None:
            following = min(following, too_big - 1)
        if following <= best or any(t.batch_size == following for t in trials):
            break
        candidate = following
    return trials


def _resident(report: MemoryReport) -> int:
    """What every step of the loop starts with: weights, buffers, the optimizer's state, and the
    gradients when they are kept as zeros between steps."""
    kept = ("parameters", "buffers", "optimizer_state") + (() if report.set_to_none else ("gradients",))
    return sum(report.steps[0].breakdown[k] for k in kept)


def _try(train_step: Callable[[int], Any], batch_size: int, device: str, budget: int, resident: int) -> Trial:
    """Two real steps, the second measured: the trial fits if neither ran out of memory and the second
    (the first with the optimizer's state alive) peaked within the budget."""
    try:
        train_step(batch_size)  # the first step makes the optimizer's state, if it is not there yet
        peak = measure_peak(lambda: train_step(batch_size), device, resident)
    except Exception as error:  # the step's own errors are the user's, except running out of memory
        if not is_out_of_memory(error):
            raise
        _release(device)
        return Trial(batch_size, False, None)
    return Trial(batch_size, peak <= budget, peak)


def _release(device: str) -> None:
    if torch.device(device).type == "cuda" and torch.cuda.is_available():
        torch.cuda.empty_cache()


def _free_memory(device: str) -> int:
    if torch.device(device).type == "cuda" and torch.cuda.is_available():
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return int(free)
    raise SlimtorchError(
        "give find_batch_size a budget= in bytes on the CPU (there is no free-memory figure)"
    )


def _agreed(batch_size: int) -> int:
    """The smallest batch size of all ranks, when ``torch.distributed`` runs: every rank steps alike."""
    distributed = torch.distributed
    if not (distributed.is_available() and distributed.is_initialized()):
        return batch_size
    value = torch.tensor([batch_size], dtype=torch.int64)
    if distributed.get_backend() == "nccl":
        value = value.cuda()
    distributed.all_reduce(value, op=distributed.ReduceOp.MIN)
    return int(value.item())
