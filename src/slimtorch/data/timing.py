"""Timing one DataLoader candidate, and the user's training step, with no worker left behind.

A candidate is timed over one short epoch: its first batch (workers start), a warm-up that empties what
the workers prefetched while they started (else the first pass reads batches made for free), then
``passes`` timed passes of ``batches`` batches (fewer when the budget runs out, or when they take over
:data:`CANDIDATE_S`). The sampler repeats the dataset's indices, so a dataset smaller than that still
fills every pass, and it can end the epoch early. Then the next epoch starts, timed to its first batch:
that is what ``persistent_workers`` saves (workers resumed, not started again).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from slimtorch.data.options import TuneOptions
from slimtorch.data.report import Candidate, Trial

PASS_S = 0.25
"""how long a timed pass should last at ``num_workers=0``'s speed: shorter ones are mostly noise"""
PROBE_S = 0.1
BATCHES = (2, 256)
"""the fewest and the most batches in a pass, whatever the probe says"""
CANDIDATE_S = 2.0
"""about the most a candidate's timed passes take: a loader much slower than ``num_workers=0`` (workers on
cheap data) has passes sized for a faster one"""
STEP_S = 1.0
"""about how long the training step is timed for"""


class Bench:
    """Times candidates for one dataset, all against one deadline (``time.perf_counter()`` seconds)."""

    def __init__(
        self, dataset: Dataset, options: TuneOptions, collate_fn: Callable | None, deadline: float
    ) -> None:
        self.dataset, self.options, self.collate_fn, self.deadline = dataset, options, collate_fn, deadline
        self.batch_size: int = options.batch_size  # type: ignore[assignment]  # tune refuses None
        self.batches = options.batches or 0  # 0 until calibrate() has timed the baseline

    def calibrate(self) -> int:
        """Batches per timed pass: the option, or as many as last :data:`PASS_S` at ``num_workers=0``'s
        speed, probed for :data:`PROBE_S` after a first batch that pays what is paid once."""
        if not self.batches:
            iterator = iter(self._loader(Candidate(), 1 + BATCHES[1]))
            next(iterator)
            started, count = time.perf_counter(), 0
            while count < BATCHES[1] and time.perf_counter() - started < PROBE_S:
                next(iterator)
                count += 1
            per_batch = (time.perf_counter() - started) / count
            self.batches = min(max(math.ceil(PASS_S / per_batch), BATCHES[0]), BATCHES[1])
        return self.batches

    def out_of_time(self) -> bool:
        return time.perf_counter() >= self.deadline

    def time(self, candidate: Candidate) -> Trial:
        """``candidate`` measured: its median samples/s over the timed passes, and its epoch start.

        Every worker it started is shut down before this returns, however it ends."""
        warmup = max(1, candidate.num_workers * (candidate.prefetch_factor or 0))
        batches = 1 + warmup + self.options.passes * self.batches
        indices = _Indices(len(self.dataset), batches * self.batch_size)  # type: ignore[arg-type]
        loader = self._loader(candidate, indices)
        iterator = iter(loader)
        try:
            for _ in range(1 + warmup):
                next(iterator)
            rates = self._passes(iterator)
            indices.close()  # the epoch ends with what the workers were already sent
            for _ in iterator:
                pass
            if not candidate.persistent_workers:
                _shut_down(iterator)
            started = time.perf_counter()
            iterator = iter(loader)
            next(iterator)
            start_s = time.perf_counter() - started
        finally:
            _shut_down(iterator)
        median = statistics.median(rates)
        spread = (max(rates) - min(rates)) / median
        return Trial(candidate, median, spread, len(rates), start_s)

    def try_time(self, candidate: Candidate) -> Trial:
        """:meth:`time`, with a failure (a worker died, the dataset could not reach one) recorded in the
        trial, not raised: workers are an option the tuner tries, and the answer then is fewer of them."""
        try:
            return self.time(candidate)
        except Exception as exc:  # whatever a worker raised: the user's dataset code, or torch's own
            return Trial(candidate, None, None, 0, None, error=f"{type(exc).__name__}: {exc}")

    def time_step(self, step: Callable[[Any], Any]) -> float:
        """The training step's own samples/s: each batch is loaded first, then only ``step(batch)`` is
        timed (and CUDA synchronised); the first call is a warm-up (kernels chosen, memory allocated), then
        at least two are timed, and more while they take under :data:`STEP_S` (a pass's batches at most)."""
        times: list[float] = []
        for n, batch in enumerate(self._loader(Candidate(), 1 + self.batches)):
            if n > 2 and (self.out_of_time() or sum(times) > STEP_S):
                break
            started = time.perf_counter()
            step(batch)
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.synchronize()
            if n:
                times.append(time.perf_counter() - started)
        return self.batch_size / statistics.median(times)

    def _loader(self, candidate: Candidate, indices: Sampler | int) -> DataLoader:
        """A DataLoader with ``candidate``'s settings over ``indices`` (a number: that many full batches)."""
        if isinstance(indices, int):
            indices = _Indices(len(self.dataset), indices * self.batch_size)  # type: ignore[arg-type]
        settings = candidate.settings(self.batch_size, self.options.start_method)
        return DataLoader(self.dataset, sampler=indices, collate_fn=self.collate_fn, **settings)

    def _passes(self, iterator: Iterator) -> list[float]:
        """samples/s of each timed pass; the first always runs, the others while the budget lasts, and a
        third and later only while the passes so far have taken under :data:`CANDIDATE_S`."""
        rates: list[float] = []
        spent = 0.0
        for n in range(self.options.passes):
            if (n and self.out_of_time()) or (n > 1 and spent > CANDIDATE_S):
                break
            started = time.perf_counter()
            for _ in range(self.batches):
                next(iterator)
            elapsed = time.perf_counter() - started
            spent += elapsed
            rates.append(self.batches * self.batch_size / elapsed)
        return rates


def _shut_down(iterator: Iterator) -> None:
    """Stop ``iterator``'s workers now, not when the garbage collector finds it: the next candidate's
    timing must not share the cores with them, and none may outlive the search. Torch's multi-process
    iterator has done this with ``_shutdown_workers`` since 1.0; the single-process one has no workers."""
    shutdown = getattr(iterator, "_shutdown_workers", None)
    if shutdown is not None:
        shutdown()


class _Indices(Sampler[int]):
    """The dataset's indices, repeated as often as ``count`` needs (a small dataset still fills every pass).

    :meth:`close` ends the epoch being read at the next batch: the DataLoader asks the sampler for a batch
    at a time, as it sends one to a worker, so what the workers already have is all that still arrives."""

    def __init__(self, size: int, count: int) -> None:
        self.size, self.count, self.closed = size, count, False

    def __iter__(self) -> Iterator[int]:
        self.closed = False
        for index in range(self.count):
            if self.closed:
                return
            yield index % self.size

    def __len__(self) -> int:
        return self.count

    def close(self) -> None:
        self.closed = True
