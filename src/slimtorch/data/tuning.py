"""``tune``: the fastest DataLoader settings for a dataset, measured in a bounded time.

The search is greedy, not a grid: ``num_workers=0`` first (the baseline, and the answer when loading is
cheap), then more workers while each count is faster than the best so far (1, 2, 3, 4, 6, 8, 12 ...: one
worker only moves the work to another process, so the search always goes on to two), then, on the best
count, ``prefetch_factor=4``, ``persistent_workers`` and, with CUDA, ``pin_memory``, each kept only where it
measurably helps. With a training ``step``, it stops adding workers once the loader outruns the step.
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Callable, Iterator
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
from torch.utils.data import Dataset, IterableDataset

from slimtorch.data.options import TuneOptions
from slimtorch.data.report import Candidate, Trial, TuneReport
from slimtorch.data.timing import Bench
from slimtorch.errors import OptionError
from slimtorch.format.progress import Progress, announcer
from slimtorch.format.verbs import resolve

GAIN = 0.05
"""a candidate must be this much faster than the best so far to count: passes on a busy machine vary by
a few percent, and a worker costs memory and start-up time"""
SERIAL_SHARE = 0.1
"""with no workers, loading and the step take turns: loading under this share of the step's time is not
worth a worker"""


def tune(
    dataset: Dataset,
    /,
    options: TuneOptions | None = None,
    *,
    step: Callable[[Any], Any] | None = None,
    collate_fn: Callable[[list], Any] | None = None,
    progress: Progress | None = None,
    **overrides: Any,
) -> TuneReport:
    """Time ``DataLoader(dataset, ...)`` over candidate settings and return the fastest, with the table.

    ``step`` (optional) is the training step, called with a batch: the search stops adding workers once
    loading is faster than it. ``collate_fn`` is passed to every DataLoader. Workers are processes: a
    dataset the start method cannot send to one (not picklable, under spawn or forkserver) stays at
    ``num_workers=0``, with a note.

    Example:
        >>> import torch
        >>> from torch.utils.data import TensorDataset
        >>> report = tune(TensorDataset(torch.zeros(256, 4)), batch_size=32, budget_s=5)
        >>> report.settings["num_workers"]  # doctest: +SKIP
        0
    """
    options = resolve(TuneOptions, options, overrides, "tune")
    _check(dataset, options)
    started = time.perf_counter()
    bench = Bench(dataset, options, collate_fn, deadline=started + options.budget_s)
    announce = announcer(progress)
    announce("timing a batch")
    bench.calibrate()
    search = _Search(bench, announce)
    search.run(step, _unsendable(dataset, collate_fn, options))
    best = search.trials[search.best]
    return TuneReport(
        settings=best.candidate.settings(options.batch_size, options.start_method),  # type: ignore[arg-type]
        trials=search.trials,
        chosen=search.best,
        batch_size=options.batch_size,  # type: ignore[arg-type]
        batches=bench.batches,
        seconds=time.perf_counter() - started,
        budget_s=options.budget_s,
        step_samples_per_s=search.step_rate,
        stopped=search.stopped,
        skipped=search.skipped,
        notes=search.notes,
    )


class _Search:
    """The trials so far, the best of them, and what was said and skipped on the way."""

    def __init__(self, bench: Bench, announce: Callable[[str], None]) -> None:
        self.bench, self.announce = bench, announce
        self.trials: list[Trial] = []
        self.best = 0
        self.step_rate: float | None = None
        self.stopped = ""
        self.skipped: list[str] = []
        self.notes: list[str] = []

    def run(self, step: Callable[[Any], Any] | None, unsendable: str | None) -> None:
        """Baseline, the training step, workers, then the variants of the best worker count."""
        self._try(Candidate())
        if step is not None:
            self.announce("timing the training step")
            self.step_rate = self.bench.time_step(step)
        if self._serial_is_enough():
            return
        if unsendable is not None or self.bench.options.worker_limit == 0:
            self.stopped = unsendable or "max_workers is 0"
            self.skipped += [f"num_workers={n}" for n in _worker_counts(self.bench.options.worker_limit)]
        else:
            self._add_workers()
        self._try_variants()
        self._say_if_still_input_bound()

    def _serial_is_enough(self) -> bool:
        """With a step, no workers is the answer when loading costs under a tenth of the step."""
        loader_rate = self.trials[0].samples_per_s
        if self.step_rate is None or loader_rate is None or loader_rate < self.step_rate / SERIAL_SHARE:
            return False
        self.stopped = (
            f"the input pipeline is not the bottleneck: with num_workers=0 loading runs at "
            f"{loader_rate:,.0f} samples/s, over 10x the step's {self.step_rate:,.0f}"
        )
        return True

    def _add_workers(self) -> None:
        """One more worker count at a time while it pays; the first that does not ends the climb."""
        counts = list(_worker_counts(self.bench.options.worker_limit))
        for position, workers in enumerate(counts):
            if self.bench.out_of_time():
                self.stopped = f"the budget of {self.bench.options.budget_s:g} s ran out"
                self.skipped += [f"num_workers={n}" for n in counts[position:]]
                return
            trial = self._try(Candidate(workers, prefetch_factor=2))
            if trial.error is not None:
                self.stopped = f"num_workers={workers} failed ({trial.error}); fewer workers kept"
                return
            if workers > 1 and self.trials[self.best] is not trial:
                self.stopped = f"num_workers={workers} was not {GAIN:.0%} faster than the best before it"
                return
            if self.step_rate is not None and trial.samples_per_s >= self.step_rate:  # type: ignore[operator]
                self.stopped = (
                    f"the loader ({trial.samples_per_s:,.0f} samples/s with num_workers={workers}) is faster "
                    f"than the step ({self.step_rate:,.0f}): the input pipeline is no longer the bottleneck"
                )
                return
        self.stopped = f"every worker count up to max_workers={self.bench.options.worker_limit} was tried"

    def _try_variants(self) -> None:
        """prefetch_factor=4, persistent_workers and pin_memory, each on the best settings so far."""
        for name, value, wanted in _variants(self.trials[self.best].candidate):
            if not wanted:
                continue
            variant = self.trials[self.best].candidate.but(**{name: value})
            if self.bench.out_of_time():
                self.skipped.append(variant.label)
                continue
            trial = self._try(variant)
            if trial.error is not None:
                self.notes.append(f"{variant.label} failed: {trial.error}")

    def _try(self, candidate: Candidate) -> Trial:
        """Time ``candidate`` (the baseline's errors are the dataset's own, and raised), keep the trial,
        and make it the best where it beats the best by :data:`GAIN`."""
        self.announce(f"timing {candidate.label}")
        trial = self.bench.try_time(candidate) if candidate.num_workers else self.bench.time(candidate)
        self.trials.append(trial)
        if trial.error is None and _better(trial, self.trials[self.best], self.trials[0], self.step_rate):
            self.best = len(self.trials) - 1
        return trial

    def _say_if_still_input_bound(self) -> None:
        best = self.trials[self.best].samples_per_s
        if self.step_rate is not None and best is not None and best < self.step_rate:
            self.notes.append(
                f"the input pipeline is still the bottleneck: the loader gives {best:,.0f} samples/s, the "
                f"step takes {self.step_rate:,.0f}; a cheaper transform or more cores would help"
            )


def _better(trial: Trial, best: Trial, baseline: Trial, step_rate: float | None) -> bool:
    """Faster by :data:`GAIN` as the training loop would see it (:func:`_loop_rate`); for persistent
    workers, which cannot be faster within an epoch, an epoch that starts sooner at a speed within
    :data:`GAIN` of the best, and still faster than ``baseline`` (no workers): never a slower pick."""
    rate, best_rate = _loop_rate(trial, step_rate), _loop_rate(best, step_rate)
    if trial.candidate.persistent_workers and not best.candidate.persistent_workers:
        sooner = trial.start_s is not None and best.start_s is not None and trial.start_s < best.start_s
        faster = rate > _loop_rate(baseline, step_rate)
        return sooner and faster and rate >= best_rate * (1 - GAIN)
    return rate > best_rate * (1 + GAIN)


def _loop_rate(trial: Trial, step_rate: float | None) -> float:
    """The samples/s a training loop would get: the loader's, with no step given; with one, no workers
    take turns with the step (their times add up), workers run beside it (the slower of the two wins)."""
    rate = trial.samples_per_s or 0.0
    if step_rate is None or not rate:
        return rate
    return 1 / (1 / rate + 1 / step_rate) if trial.candidate.num_workers == 0 else min(rate, step_rate)


def _variants(best: Candidate) -> Iterator[tuple[str, Any, bool]]:
    """(setting, value, whether it applies here): worker-only settings need workers, pinning needs CUDA."""
    yield "prefetch_factor", 4, best.num_workers > 0
    yield "persistent_workers", True, best.num_workers > 0
    yield "pin_memory", True, torch.cuda.is_available()


def _worker_counts(limit: int) -> Iterator[int]:
    """1, 2, 3, 4, 6, 8, 12, 16 ... up to ``limit``, and ``limit`` itself: fine steps where one worker
    more is a large share, coarser ones where it is not."""
    counts = sorted({2**k for k in range(12)} | {3 * 2**k for k in range(11)})
    yield from (n for n in counts if n < limit)
    if limit > 0:
        yield limit


def _check(dataset: Dataset, options: TuneOptions) -> None:
    if options.batch_size is None:
        raise OptionError("tune: batch_size is required (the batch the training loop loads)")
    if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__"):
        raise OptionError(
            "tune: the dataset must be map-style (__getitem__ and __len__); an IterableDataset's workers "
            "each yield the whole stream unless it shards itself, so its timing would mislead"
        )
    if len(dataset) == 0:
        raise OptionError("tune: the dataset is empty")


def _unsendable(dataset: Dataset, collate_fn: Callable | None, options: TuneOptions) -> str | None:
    """Why workers cannot get the dataset (or collate_fn), or None: fork copies the process, so nothing
    is pickled there; spawn and forkserver pickle both to each worker, with the pickler multiprocessing
    uses (torch's tensors go to shared memory, as they would for the workers) into a sink that keeps
    nothing, so a large dataset is not copied to be checked."""
    if options.method == "fork":
        return None
    for name, value in (("dataset", dataset), ("collate_fn", collate_fn)):
        try:
            ForkingPickler(_Discard(), pickle.HIGHEST_PROTOCOL).dump(value)
        except Exception as exc:  # pickling runs the object's own __reduce__: any error can come out
            return (
                f"the {name} cannot be pickled ({type(exc).__name__}: {exc}), and workers started by "
                f"{options.method} need it pickled: num_workers=0 kept"
            )
    return None


class _Discard:
    """A file that forgets what is written to it: pickling only to learn whether it works."""

    def write(self, data: bytes) -> int:
        return len(data)
