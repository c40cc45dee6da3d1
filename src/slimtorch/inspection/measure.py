"""What a model costs: parameters and MACs, and CPU latency compared before and after a change.

Latency is measured with ``torch.utils.benchmark`` in interleaved rounds (before, after, after, before,
...), so drift in the machine's speed (other processes, turbo, thermal limits) falls on both models alike
rather than on whichever ran second, and each model's first calls (warm-up) are not timed. Each model gets
the median of its rounds and the spread as the interquartile range; when the two ranges overlap, the
difference is within the noise and the comparison says so instead of giving a ratio.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.benchmark import Measurement, Timer

from slimtorch.errors import OptionError
from slimtorch.graph.macs import count_macs

ROUNDS = 10
MIN_ROUNDS = 3
BUDGET_S = 2.0
WARMUP = 2


@dataclass(frozen=True)
class ModelCost:
    params: int
    macs: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Latency:
    """One model's time per forward pass (no grad) over the rounds: the median and the quartiles."""

    median_s: float
    iqr_s: float
    p25_s: float
    p75_s: float
    rounds: int
    blocks: int
    """timed blocks, over all rounds (the quartiles are of the blocks' mean call)"""

    def describe(self) -> str:
        """``12.3 ms +- 0.4`` (the median, plus or minus half the interquartile range)."""
        units = ((1, "s"), (1e3, "ms"))
        scale, unit = next(((s, u) for s, u in units if self.median_s * s >= 1), (1e6, "us"))
        return f"{self.median_s * scale:.2f} {unit} +- {self.iqr_s / 2 * scale:.2f}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class LatencyComparison:
    """Two models timed in interleaved rounds on the same inputs and threads.

    ``ratio``: after / before, of the medians; ``changed``: the interquartile ranges do not overlap, so
    the difference is larger than the noise (when False, the ratio means nothing).
    """

    before: Latency
    after: Latency
    ratio: float
    changed: bool
    threads: int

    @property
    def how(self) -> str:
        """How it was timed, for a footnote."""
        return (
            f"median +- half the interquartile range, {self.before.rounds} interleaved rounds "
            f"({self.before.blocks} and {self.after.blocks} timed blocks), {self.threads} "
            + ("thread" if self.threads == 1 else "threads")
        )

    def verdict(self) -> str:
        """``0.52x (faster)``, ``3.10x (slower)`` or ``no measurable change``."""
        if not self.changed:
            return "no measurable change"
        return f"{self.ratio:.2f}x ({'faster' if self.ratio < 1 else 'slower'})"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def measure(model: nn.Module, inputs: Sequence[Any]) -> ModelCost:
    """Parameters (shared ones once) and MACs of ``model(*inputs)``.

    Example:
        >>> measure(nn.Linear(64, 10), (torch.randn(8, 64),))
        ModelCost(params=650, macs=5120)
    """
    return ModelCost(sum(p.numel() for p in model.parameters()), count_macs(model, tuple(inputs)))


def measure_latency(model: nn.Module, inputs: Sequence[Any], *, runs: int = 10, warmup: int = 2) -> float:
    """Median seconds of ``model(*inputs)`` under no_grad, one model alone: ``warmup`` untimed calls, then
    ``blocked_autorange`` for about ``runs`` calls' worth of time. To compare two models, :func:`compare`
    times them in turns.

    Example:
        >>> measure_latency(nn.Linear(64, 64), (torch.randn(8, 64),), runs=3) > 0
        True
    """
    call = _forward(model, inputs, {})
    took = 0.0
    for _ in range(max(1, warmup)):
        started = time.perf_counter()
        call()
        took = time.perf_counter() - started
    timer = Timer("forward()", globals={"forward": call}, num_threads=torch.get_num_threads())
    return timer.blocked_autorange(min_run_time=max(1, runs) * took).median


def compare(
    before: nn.Module,
    after: nn.Module,
    inputs: Sequence[Any],
    kwargs: Mapping[str, Any] | None = None,
    *,
    rounds: int = ROUNDS,
    budget_s: float = BUDGET_S,
) -> LatencyComparison:
    """Time ``before(*inputs, **kwargs)`` and ``after(*inputs, **kwargs)`` (no grad) in up to ``rounds``
    interleaved rounds of ``blocked_autorange``, in about ``budget_s`` seconds, with torch's current thread
    count. A model slower than the budget allows gets fewer rounds (at least :data:`MIN_ROUNDS`), so it
    takes longer.

    Example:
        >>> small, large = nn.Linear(256, 256), nn.Sequential(*[nn.Linear(256, 256) for _ in range(10)])
        >>> compare(small, large, (torch.randn(64, 256),)).verdict()  # doctest: +SKIP
        '7.91x (slower)'
    """
    if rounds < 1 or budget_s <= 0:
        raise OptionError(f"latency needs rounds >= 1 and a positive budget, not {rounds} and {budget_s}")
    threads = torch.get_num_threads()
    calls = [_forward(model, inputs, kwargs or {}) for model in (before, after)]
    slowest = max(_warm_up(call, budget_s) for call in calls)
    # blocked_autorange runs at least two calls (one sizes the block): slow models get fewer rounds
    rounds = min(rounds, max(MIN_ROUNDS, int(budget_s / (4 * slowest))))
    timers = [Timer("forward()", globals={"forward": call}, num_threads=threads) for call in calls]
    replicates: list[list[Measurement]] = [[], []]
    for index in range(rounds):
        order = (0, 1) if index % 2 == 0 else (1, 0)  # neither model always runs on the other's warm caches
        for which in order:
            replicates[which].append(timers[which].blocked_autorange(min_run_time=budget_s / (2 * rounds)))
    first, second = (_latency(replicates[i]) for i in (0, 1))
    overlap = first.p25_s <= second.p75_s and second.p25_s <= first.p75_s
    ratio = second.median_s / first.median_s if first.median_s else float("nan")
    return LatencyComparison(first, second, ratio, not overlap, threads)


def _forward(model: nn.Module, inputs: Sequence[Any], kwargs: Mapping[str, Any]) -> Callable[[], None]:
    def forward() -> None:
        with torch.no_grad():
            model(*inputs, **kwargs)

    return forward


def _warm_up(call: Callable[[], None], budget_s: float) -> float:
    """Make up to :data:`WARMUP` untimed calls (lazy initialisation, caches); returns the seconds of the
    last. One is enough for a model slower than a tenth of the budget: the first block of each round
    then sizes itself on one more untimed call."""
    took = 0.0
    for _ in range(WARMUP):
        started = time.perf_counter()
        call()
        took = time.perf_counter() - started
        if took > budget_s / 10:
            break
    return took


def _latency(replicates: list[Measurement]) -> Latency:
    merged = Measurement.merge(replicates)[0]  # every block of every round, as the time of one call
    quartiles = torch.tensor(merged.times, dtype=torch.float64).quantile(
        torch.tensor([0.25, 0.75], dtype=torch.float64)
    )
    return Latency(
        merged.median,
        merged.iqr,
        float(quartiles[0]),
        float(quartiles[1]),
        len(replicates),
        len(merged.times),
    )
