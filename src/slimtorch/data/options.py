"""What :func:`~slimtorch.data.tune` can be asked: the batch it loads, and how long and how far it searches.

A bad value is an :class:`~slimtorch.errors.OptionError` when the options are made, before any worker
starts. ``batch_size`` has no sensible default (it is the user's, and it changes the answer), so it is
None in the dataclass and :func:`~slimtorch.data.tune` refuses to run without it.
"""

from __future__ import annotations

import multiprocessing
import os
from dataclasses import dataclass

from slimtorch.errors import OptionError

START_METHODS = ("fork", "spawn", "forkserver")


@dataclass(frozen=True)
class TuneOptions:
    """How :func:`~slimtorch.data.tune` searches for a DataLoader's settings.

    Example:
        >>> TuneOptions(batch_size=32, budget_s=5).passes
        5
    """

    batch_size: int | None = None
    """samples per batch, as the training loop loads them (required)"""
    budget_s: float = 20.0
    """seconds the whole search may take; a candidate that has started finishes its first timed pass"""
    max_workers: int | None = None
    """the most ``num_workers`` tried; None: the CPU cores this process may run on"""
    batches: int | None = None
    """batches in one timed pass (each candidate is timed over ``passes`` of them, after a warm-up); None:
    as many as take a quarter of a second at ``num_workers=0``'s speed, 2 to 256"""
    passes: int = 5
    """timed passes per candidate: the table gives their median samples/s and their spread"""
    start_method: str | None = None
    """how workers start (``"fork"``, ``"spawn"``, ``"forkserver"``); None: this platform's default"""

    def __post_init__(self) -> None:
        if self.batch_size is not None:
            _positive_int("batch_size", self.batch_size)
        budget = self.budget_s
        if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not 0 < budget < float("inf"):
            raise OptionError(f"budget_s must be a positive number of seconds, not {self.budget_s!r}")
        workers = self.max_workers
        if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 0):
            raise OptionError(f"max_workers must be None or an integer >= 0, not {self.max_workers!r}")
        if self.batches is not None:
            _positive_int("batches", self.batches)
        _positive_int("passes", self.passes)
        if self.start_method is not None and self.start_method not in START_METHODS:
            raise OptionError(
                f"start_method must be None or one of {', '.join(START_METHODS)}, not {self.start_method!r}"
            )

    @property
    def worker_limit(self) -> int:
        """``max_workers``, or the cores this process may run on (its affinity, where the OS has one)."""
        if self.max_workers is not None:
            return self.max_workers
        affinity = getattr(os, "sched_getaffinity", None)
        return len(affinity(0)) if affinity else os.cpu_count() or 1

    @property
    def method(self) -> str:
        """The start method workers get: the one asked for, the one the program set, or the platform's
        default (the first :func:`multiprocessing.get_all_start_methods` lists), read without fixing it."""
        return (
            self.start_method
            or multiprocessing.get_start_method(allow_none=True)
            or multiprocessing.get_all_start_methods()[0]
        )


def _positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise OptionError(f"{name} must be a positive integer, not {value!r}")
