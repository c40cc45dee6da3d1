"""Reading one rank's rows or columns of a stored tensor with ``pread``, straight into its memory.

A sharded load (FSDP2, tensor parallel) wants a few rows or columns of each tensor on each rank. Mapping
the file would leave every touched page in the process's RSS besides the shard (measured: 2.2x the share);
``os.preadv`` into the shard's own memory reads each byte once and keeps nothing else. The bytes read are
hashed as they are in hand, cut at the stored checksum chunks (:class:`Piece`), so that the ranks can check
a chunk's CRC-32 together (:func:`slimtorch.format.layout.crc32_combine`) without any rank reading bytes it
does not keep.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from slimtorch.errors import FormatError

Span = tuple[int, int]
"""``[start, stop)`` along one dimension."""


class Piece(NamedTuple):
    """Bytes one reader hashed from one stored checksum chunk, and what the file says of that chunk."""

    tensor: str
    part: str
    chunk: int
    """Where the stored chunk starts in the part, in bytes."""
    chunk_bytes: int
    expected: int
    """The chunk's CRC-32 as the file records it."""
    start: int
    """Where the piece starts in the part, in bytes."""
    length: int
    crc: int


@dataclass
class ShardRead:
    """What reading one tensor's region did: file bytes read, the pieces hashed (formats with checksums),
    and why the region could not be read by itself (None: it was)."""

    bytes_read: int = 0
    pieces: list[Piece] = field(default_factory=list)
    note: str | None = None


def region(
    shape: Sequence[int], rows: Span | None, cols: Span | None
) -> tuple[Span, Span | None, tuple[int, ...]]:
    """Rows and columns checked against ``shape`` (None rows: all; a 0-d tensor is one row), and the
    region's own shape.

    Example:
        >>> region((8, 6), (2, 4), (0, 3))
        ((2, 4), (0, 3), (2, 3))
    """
    count = shape[0] if shape else 1
    rows = rows or (0, count)
    if not 0 <= rows[0] <= rows[1] <= count:
        raise ValueError(f"rows {rows} outside a tensor of {count} rows")
    if cols is None:
        return rows, None, (rows[1] - rows[0], *shape[1:]) if shape else ()
    if len(shape) < 2 or not 0 <= cols[0] <= cols[1] <= shape[1]:
        raise ValueError(f"columns {cols} outside a tensor of shape {list(shape)}")
    return rows, cols, (rows[1] - rows[0], cols[1] - cols[0], *shape[2:])


def read_region(
    file: Path, base: int, shape: Sequence[int], itemsize: int, rows: Span, cols: Span | None, out: memoryview
) -> list[tuple[int, memoryview]]:
    """Read rows ``rows`` (columns ``cols`` of each, None: whole rows) of a contiguous tensor stored at byte
    ``base`` of ``file`` into ``out``, back to back. Returns each range read: (its start relative to
    ``base``, the part of ``out`` it filled). One ``preadv`` for whole rows, one per row for columns."""
    row_bytes = math.prod(shape[1:]) * itemsize
    if cols is None:
        spans = [(rows[0] * row_bytes, out[: (rows[1] - rows[0]) * row_bytes])]
    else:
        inner = math.prod(shape[2:]) * itemsize
        width = (cols[1] - cols[0]) * inner
        spans = [
            (row * row_bytes + cols[0] * inner, out[i * width : (i + 1) * width])
            for i, row in enumerate(range(*rows))
        ]
    fd = os.open(file, os.O_RDONLY)
    try:
        for start, view in spans:
            _pread_exact(fd, view, base + start, file)
    finally:
        os.close(fd)
    return spans


def _pread_exact(fd: int, view: memoryview, offset: int, file: Path) -> None:
    """Fill ``view`` from ``offset``: ``preadv`` may return less than asked (2 GiB a call on Linux)."""
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got <= 0:
            raise FormatError(file, f"ends at byte {offset + done}, inside a tensor's data (truncated?)")
        done += got
