"""What the chain and every codec stage share: the error a stage raises, and checks of the dtypes and
shapes a file records, made before anything is allocated from them."""

from __future__ import annotations

import torch

from slimtorch.format.source import dtype_name, shape_problem

DTYPES_BY_NAME: dict[str, torch.dtype] = {
    dtype_name(d): d for d in vars(torch).values() if isinstance(d, torch.dtype)
}
"""Every dtype torch has, by the name the slim format records it under."""


class CodecError(ValueError):
    """A tensor cannot be encoded this way, or its parts do not decode to what the metadata says."""


def parse_dtype(value: object) -> torch.dtype:
    dtype = DTYPES_BY_NAME.get(value) if isinstance(value, str) else None
    if dtype is None:
        raise CodecError(f"unknown dtype {str(value)[:40]!r}")
    return dtype


def parse_shape(value: object) -> tuple[int, ...]:
    """A shape from metadata: a list of sizes below 2**48, at most ``MAX_DIMS`` of them, whose element
    count fits int64 (checked before anything multiplies or walks them)."""
    if not isinstance(value, list):
        raise CodecError(f"shape {str(value)[:40]!r} is not a list of non-negative integers")
    problem = shape_problem(value)
    if problem is None and any(v >= 1 << 48 for v in value):
        problem = "a size of 2**48 or more"
    if problem:
        raise CodecError(f"shape: {problem[:200]}")
    return tuple(value)


def require(condition: bool, problem: str) -> None:
    """Raise :class:`CodecError` with ``problem`` unless ``condition`` holds (decoders check every part)."""
    if not condition:
        raise CodecError(problem)
