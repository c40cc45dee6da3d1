"""What :func:`~slimtorch.data.tune` found: each candidate's measured samples/s, and the settings chosen."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

from slimtorch.format.verbs import Report


@dataclass(frozen=True)
class Candidate:
    """One set of DataLoader settings the tuner times.

    Example:
        >>> Candidate(num_workers=2, prefetch_factor=4).label
        'num_workers=2 prefetch_factor=4'
    """

    num_workers: int = 0
    prefetch_factor: int | None = None
    """batches each worker loads ahead (None with no workers: torch refuses it there)"""
    persistent_workers: bool = False
    pin_memory: bool = False

    @property
    def label(self) -> str:
        """The settings that differ from torch's defaults, as a user would write them."""
        parts = [f"num_workers={self.num_workers}"]
        if self.prefetch_factor not in (None, 2):
            parts.append(f"prefetch_factor={self.prefetch_factor}")
        parts += [name for name in ("persistent_workers", "pin_memory") if getattr(self, name)]
        return " ".join(part if "=" in part else f"{part}=True" for part in parts)

    def settings(self, batch_size: int, start_method: str | None = None) -> dict[str, Any]:
        """Keyword arguments for ``DataLoader(dataset, **settings)``: the ones only workers take are left
        out at ``num_workers=0``, where torch refuses them."""
        settings: dict[str, Any] = {
            "batch_size": batch_size,
            "num_workers": self.num_workers,
            "pin_memory": self.pin_memory,
        }
        if self.num_workers:
            settings["prefetch_factor"] = self.prefetch_factor or 2
            settings["persistent_workers"] = self.persistent_workers
            if start_method is not None:
                settings["multiprocessing_context"] = start_method
        return settings

    def but(self, **changes: Any) -> Candidate:
        """These settings with ``changes``: the variants tried on the best worker count."""
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class Trial:
    """One candidate, measured: the median samples/s of its timed passes, and what it costs to start."""

    candidate: Candidate
    samples_per_s: float | None
    """median over the timed passes, after a warm-up that empties the workers' first prefetch; None: failed"""
    spread: float | None
    """(fastest pass - slowest pass) / median: how far the passes disagree"""
    passes: int
    """timed passes run (fewer than asked when the budget ran out)"""
    start_s: float | None
    """seconds from the start of an epoch to its first batch (workers started, or resumed when persistent)"""
    error: str | None = None
    """why the candidate failed (a worker died, the dataset could not be sent to one)"""


@dataclass(frozen=True)
class TuneReport(Report):
    """The fastest DataLoader settings found, with every candidate timed.

    Example:
        >>> trial = Trial(Candidate(), samples_per_s=900.0, spread=0.02, passes=3, start_s=0.01)
        >>> report = TuneReport(
        ...     Candidate().settings(8), [trial], 0, batch_size=8, batches=16, seconds=1.2, budget_s=20
        ... )
        >>> report.settings, report.speedup
        ({'batch_size': 8, 'num_workers': 0, 'pin_memory': False}, 1.0)
    """

    SCHEMA: ClassVar[str] = "slimtorch.dataloader/1"
    DERIVED: ClassVar[dict[str, dict[str, Any]]] = {
        "samples_per_s": {"anyOf": [{"type": "number"}, {"type": "null"}]},
        "speedup": {"anyOf": [{"type": "number"}, {"type": "null"}]},
    }

    settings: dict[str, Any]
    """the fastest settings, ready for ``DataLoader(dataset, **report.settings)``"""
    trials: list[Trial]
    """every candidate timed, in the order tried; the first is ``num_workers=0``"""
    chosen: int
    """the index in ``trials`` of the settings chosen"""
    batch_size: int
    batches: int
    """batches in each timed pass"""
    seconds: float
    """time the search took"""
    budget_s: float
    step_samples_per_s: float | None = None
    """the training step's own speed (median time per batch), when a step was given"""
    stopped: str = ""
    """why the search stopped adding workers"""
    skipped: list[str] = field(default_factory=list)
    """candidates not tried, because the budget ran out or workers could not be used"""
    notes: list[str] = field(default_factory=list)

    @property
    def best(self) -> Trial:
        """The trial the settings come from."""
        return self.trials[self.chosen]

    @property
    def samples_per_s(self) -> float | None:
        """The chosen settings' median samples/s."""
        return self.best.samples_per_s

    @property
    def speedup(self) -> float | None:
        """The chosen settings' samples/s over ``num_workers=0``'s (the first trial)."""
        best, baseline = self.best.samples_per_s, self.trials[0].samples_per_s
        return None if best is None or not baseline else best / baseline
