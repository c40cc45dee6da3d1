"""What a checkpoint would weigh after each shrinking action, in the slim format's own byte counts.

The actions build on each other in the order a user would apply them: drop what only training needs, finalize
pruning masks, store each tensor once, store zeros sparsely; then one lossy precision on top (fp16/bf16, int8
or int4). Tensor bytes come from the size functions of :mod:`slimtorch.format.policy`, the same ones
``slimtorch shrink`` uses to choose its codecs, so they are what shrink writes: a sparse tensor is a bitmask
plus its non-zero values, int8 one byte per weight plus an fp32 scale per output channel, int4 half a byte per
weight plus an fp16 scale and zero point per group (rows padded to whole groups, as shrink writes them). Two
things are not exact: values that round to zero in fp16 or int8 count as non-zero here (the file comes out
slightly smaller), and the file's header (pickle or JSON) is kept at its current size.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from slimtorch.format.policy import (
    SHRINK_INT4_GROUP_SIZE,
    int4_stored_bytes,
    int8_bytes,
    lossless_bytes,
    weight_like,
)

TRAINING_ONLY = ("optimizer_state", "training_state")
INT4_GROUP = SHRINK_INT4_GROUP_SIZE


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
        return weight_like(self.category, self.dtype, self.shape)


@dataclass(frozen=True)
class Saving:
    """The file size after one action (lossless ones cumulative, lossy ones each on top of them)."""

    action: str
    bytes_after: int
    saved: int
    lossless: bool

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def _lossless(cost: TensorCost) -> int:
    if cost.zeros is None or not cost.whole:
        return cost.stored_bytes
    return lossless_bytes(cost.numel, cost.zeros, cost.dtype.itemsize)


def _half(cost: TensorCost) -> float:
    if not cost.whole or cost.dtype not in (torch.float32, torch.float64):
        return _lossless(cost)
    if cost.zeros is None:
        return cost.numel * 2
    return lossless_bytes(cost.numel, cost.zeros, 2)


def _int8(cost: TensorCost) -> float:
    if not cost.whole or not cost.quantizable:
        return _lossless(cost)
    return int8_bytes(cost.shape, cost.zeros or 0, sparse=cost.zeros is not None)


def _int4(cost: TensorCost) -> float:
    if not cost.whole or not cost.quantizable:
        return _lossless(cost)
    return int4_stored_bytes(cost.shape, cost.zeros or 0, INT4_GROUP, sparse=cost.zeros is not None)


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
    after = other + sum(_lossless(c) for c in kept)
    if after < current:
        savings.append(Saving("store zeros sparsely (bitmask + non-zeros)", after, current - after, True))
        current = after
    for action, cost_of in _LOSSY_STEPS:
        after = other + math.ceil(sum(cost_of(c) for c in kept))
        if after < current:
            savings.append(Saving(action, after, current - after, lossless=False))
    return savings
