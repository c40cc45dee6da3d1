"""What a checkpoint could weigh after each shrinking action: estimates from sizes and zero counts.

The actions build on each other in the order a user would apply them: drop what only training needs,
finalize pruning masks, store each tensor once, store zeros sparsely; then one lossy precision on top
(fp16/bf16, int8 or int4). The byte costs follow the slim format's codecs: a sparse tensor is a bitmask of
one bit per element plus its non-zero values, int8 is one byte per weight plus an fp32 scale per output
channel, int4 is half a byte per weight plus an fp16 scale and zero point per group.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

TRAINING_ONLY = ("optimizer_state", "training_state")
QUANTIZE_MIN_ELEMENTS = 4096  # norms, biases and small tensors stay in their precision
INT4_GROUP = 128


@dataclass(frozen=True)
class TensorCost:
    """What the estimates need to know of one tensor."""

    category: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    stored_bytes: int
    zeros: int | None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def whole(self) -> bool:
        """The tensor owns exactly its own bytes (not tied, not a view into a shared storage)."""
        return self.stored_bytes == self.numel * self.dtype.itemsize and self.numel > 0

    @property
    def quantizable(self) -> bool:
        return (
            self.category == "parameters"
            and self.dtype.is_floating_point
            and len(self.shape) >= 2
            and self.numel >= QUANTIZE_MIN_ELEMENTS
        )


@dataclass(frozen=True)
class Saving:
    """The file size after one action (lossless ones cumulative, lossy ones each on top of them)."""

    action: str
    bytes_after: int
    saved: int
    lossless: bool

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def _sparse(cost: TensorCost, value_bytes: float) -> float:
    """Bitmask plus non-zero values; infinite when the zero count is unknown."""
    if cost.zeros is None or not cost.whole:
        return math.inf
    return math.ceil(cost.numel / 8) + (cost.numel - cost.zeros) * value_bytes


def _lossless(cost: TensorCost) -> float:
    return min(cost.stored_bytes, _sparse(cost, cost.dtype.itemsize))


def _half(cost: TensorCost) -> float:
    if not cost.whole or not cost.dtype.is_floating_point or cost.dtype.itemsize <= 2:
        return _lossless(cost)
    return min(cost.numel * 2, _sparse(cost, 2))


def _int8(cost: TensorCost) -> float:
    if not cost.whole or not cost.quantizable:
        return _lossless(cost)
    scales = cost.shape[0] * 4
    return min(cost.numel + scales, _sparse(cost, 1) + scales)


def _int4(cost: TensorCost) -> float:
    if not cost.whole or not cost.quantizable:
        return _lossless(cost)
    groups = math.ceil(cost.numel / INT4_GROUP)
    return min(math.ceil(cost.numel / 2) + groups * 4, _int8(cost))


_LOSSLESS_STEPS: tuple[tuple[str, Callable[[TensorCost], bool]], ...] = (
    ("drop optimizer and training state", lambda c: c.category in TRAINING_ONLY),
    ("finalize pruning (weight = weight_orig * weight_mask)", lambda c: c.category == "pruning_leftovers"),
    (
        "store duplicates once, drop unreferenced storage",
        lambda c: c.category in ("duplicates", "unreferenced_storage"),
    ),
)
_LOSSY_STEPS: tuple[tuple[str, Callable[[TensorCost], float]], ...] = (
    ("+ fp16 / bf16 floats", _half),
    ("+ int8 weights (per channel)", _int8),
    (f"+ int4 weights (group {INT4_GROUP})", _int4),
)


def estimate_savings(costs: list[TensorCost], file_bytes: int) -> list[Saving]:
    """Size after each action that applies; see the module docstring for the order and the codecs."""
    other = file_bytes - sum(c.stored_bytes for c in costs)  # pickle, headers, padding: kept as is
    kept = list(costs)
    savings: list[Saving] = []
    current = file_bytes
    for action, drops in _LOSSLESS_STEPS:
        remaining = [c for c in kept if not drops(c)]
        after = other + sum(c.stored_bytes for c in remaining)
        if after < current:
            savings.append(Saving(action, after, current - after, lossless=True))
            current, kept = after, remaining
    after = other + math.ceil(sum(_lossless(c) for c in kept))
    if after < current:
        savings.append(Saving("store zeros sparsely (bitmask + non-zeros)", after, current - after, True))
        current = after
    for action, cost_of in _LOSSY_STEPS:
        after = other + math.ceil(sum(cost_of(c) for c in kept))
        if after < current:
            savings.append(Saving(action, after, current - after, lossless=False))
    return savings
