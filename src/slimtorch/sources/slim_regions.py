"""Regions of a slim tensor read with ``pread`` (:meth:`SlimSource.read_into
<slimtorch.sources.slim.SlimSource.read_into>`): each stored part's rows and columns only, decoded in
bounded blocks, the bytes read hashed for the caller to check. Chains that keep no row apart (zstd,
sparse, flat int4) are decoded whole."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Protocol

import torch

from slimtorch.errors import FormatError
from slimtorch.format.codecs import CodecError, decode
from slimtorch.format.layout import CHECKSUM_CHUNK, Entry, crc32, recorded_crcs, tensor_bytes
from slimtorch.format.shard_read import Piece, ShardRead, Span, read_region, region
from slimtorch.format.source import StorageLocation, TensorInfo

READ_BLOCK = 16 << 20  # bytes of decoded rows per block when a sharded read decodes codes


class RegionSource(Protocol):
    """What a region read asks of :class:`slimtorch.sources.slim.SlimSource` (which imports this module)."""

    path: Path
    physical: dict[str, TensorInfo]
    locations: dict[str, StorageLocation]
    hash_reads: bool

    def entry(self, name: str) -> Entry: ...

    def _map(self, info: TensorInfo) -> torch.Tensor: ...

    def checks(self, name: str, parts: Mapping[str, torch.Tensor]) -> list[Callable[[], int]]: ...

    def decode_parts(self, name: str, parts: dict[str, torch.Tensor]) -> torch.Tensor: ...


def read_into(
    source: RegionSource, name: str, out: torch.Tensor, *, rows: Span | None = None, cols: Span | None = None
) -> ShardRead:
    """Rows and columns of tensor ``name`` into ``out`` with ``pread`` (see
    :meth:`TensorSource.read_into`), each stored part's region only: raw and cast tensors by rows or
    columns, int8 codes on any column (its scales are per row), row-grouped int4 on whole groups (the
    covering groups read, then trimmed). The bytes read are hashed into :class:`Piece` s for the caller
    to check (``verify``); other chains are decoded whole and checked here, with a ``note``."""
    entry = source.entry(name)
    rows, cols, shape = region(entry.shape, rows, cols)
    if tuple(out.shape) != shape:
        raise ValueError(f"{name}: the region is {list(shape)}, the tensor given {list(out.shape)}")
    plan = _column_plan(entry, cols)
    if plan is None:
        return _read_whole(source, entry, out, rows, cols)
    done = ShardRead()
    if not entry.stages and out.dtype == entry.dtype and out.is_contiguous() and out.device.type == "cpu":
        _read_part(source, entry, "", rows, cols, out, done)  # straight into the shard: no copy
        return done
    width = max(1, math.prod(shape[1:]) * entry.dtype.itemsize)
    step = max(1, READ_BLOCK // width)  # decode in bounded blocks: scratch stays small
    for start in range(rows[0], rows[1], step):
        block = (start, min(rows[1], start + step))
        parts = {
            role: _read_part(source, entry, role, block, span, None, done) for role, span in plan.items()
        }
        decoded = _decode_block(source, entry, parts, block, plan)
        if cols:  # int4 read whole groups: cut to the columns asked
            trim = cols[0] - plan[_primary(entry)][0] * _per_code(entry)  # type: ignore[index]
            decoded = decoded[:, trim : trim + cols[1] - cols[0]]
        out[block[0] - rows[0] : block[1] - rows[0]].copy_(decoded)
    return done


def _read_part(
    source: RegionSource,
    entry: Entry,
    role: str,
    rows: Span,
    cols: Span | None,
    out: torch.Tensor | None,
    done: ShardRead,
) -> torch.Tensor:
    """One part's rows (its columns ``cols``) pread into ``out`` (None: a new tensor), hashed."""
    key = entry.parts[role]
    info = source.physical[key]
    shape = region(info.shape, rows, cols)[2]
    out = torch.empty(shape, dtype=info.dtype) if out is None else out
    data = tensor_bytes(out) if out.numel() else memoryview(b"")
    location = source.locations[info.storage]
    spans = read_region(
        location.file, location.offset + info.storage_offset, info.shape, info.itemsize, rows, cols, data
    )
    done.bytes_read += len(data)
    if source.hash_reads:
        done.pieces += _pieces(source.path, entry, role, spans, info.nbytes)
    return out


def _decode_block(
    source: RegionSource,
    entry: Entry,
    parts: dict[str, torch.Tensor],
    rows: Span,
    plan: dict[str, Span | None],
) -> torch.Tensor:
    """Decode a block of parts read by rows (and columns ``plan``)."""
    span = plan[_primary(entry)]
    width = entry.shape[1:] if span is None else (_decoded_width(entry, span), *entry.shape[2:])
    return decode_block(source.path, entry, parts, [rows[1] - rows[0], *width])


def decode_block(path: Path, entry: Entry, parts: dict[str, torch.Tensor], shape: list[int]) -> torch.Tensor:
    """Tensor ``entry``'s ``parts`` as read for a block of its rows, decoded to ``shape`` (the stages are
    told the block's own shape); a failure names the file and the tensor."""
    stages = [{**stage, "shape": shape} for stage in entry.stages]
    try:
        return decode(parts, stages, entry.dtype, shape) if stages else parts[""]
    except CodecError as exc:
        raise FormatError(path, f"tensor {entry.name!r} does not decode: {exc}") from None


def _read_whole(
    source: RegionSource, entry: Entry, out: torch.Tensor, rows: Span, cols: Span | None
) -> ShardRead:
    """A chain without row access (zstd, sparse, flat int4): decoded whole, its chunks checked here."""
    parts = {role: source._map(source.physical[key]) for role, key in entry.parts.items()}
    if source.hash_reads:
        for check in source.checks(entry.name, parts):
            check()
    tensor = source.decode_parts(entry.name, parts)
    where = (slice(*rows), *([slice(*cols)] if cols else []))
    out.copy_(tensor[where])
    stored = sum(p.nbytes for p in parts.values())
    return ShardRead(stored, note=f"{entry.name}: {entry.chain} has no row access: decoded whole")


def _primary(entry: Entry) -> str:
    """The role of the part holding the codes (or the values): the one read by columns."""
    return next(role for role in ("q", "q4", "") if role in entry.parts)


def _per_code(entry: Entry) -> int:
    """Columns one unit of the primary part's column span stands for (int4: a byte holds two)."""
    return 2 if _primary(entry) == "q4" else 1


def _decoded_width(entry: Entry, span: Span) -> int:
    """Columns a block read on ``span`` of the primary part decodes to (int4: its groups, the last cut)."""
    start, stop = span[0] * _per_code(entry), span[1] * _per_code(entry)
    return min(stop, entry.shape[1]) - start


def _column_plan(entry: Entry, cols: Span | None) -> dict[str, Span | None] | None:
    """Which columns of each stored part a region's columns need (None: whole rows); None when the chain
    keeps no row apart (zstd, sparse, flat or packed int4, a 1-d coded tensor)."""
    chain, stages = entry.chain, entry.stages
    if chain in ("raw", "cast") and set(entry.parts) == {""}:
        return {"": cols}
    if len(entry.shape) < 2 or stages[-1].get("flat") or stages[0].get("packing") is not None:
        return None
    if chain == "int8" and set(entry.parts) == {"q", "scale"}:
        return {"q": cols, "scale": None}
    if chain != "int4" or set(entry.parts) != {"q4", "scale", "zero"}:
        return None
    if cols is None:
        return dict.fromkeys(entry.parts)
    if len(entry.shape) != 2:
        return None  # int4 groups run over the flattened columns: dim 1 alone is not a group boundary
    size = stages[0]["group_size"]
    first, last = cols[0] // size, -(-cols[1] // size)
    return {"q4": (first * size // 2, last * size // 2), "scale": (first, last), "zero": (first, last)}


def _pieces(
    path: Path, entry: Entry, role: str, spans: list[tuple[int, memoryview]], part_bytes: int
) -> list[Piece]:
    """The bytes ``spans`` read from part ``role``, hashed one :class:`Piece` per stored chunk they touch."""
    crcs = recorded_crcs(path, entry, role, part_bytes, CHECKSUM_CHUNK)
    pieces, key = [], entry.parts[role]
    for start, view in spans:
        at, stop = start, start + len(view)
        while at < stop:
            index = at // CHECKSUM_CHUNK
            end = min(stop, (index + 1) * CHECKSUM_CHUNK)
            size = min(CHECKSUM_CHUNK, part_bytes - index * CHECKSUM_CHUNK)
            crc = crc32(view[at - start : end - start])
            pieces.append(
                Piece(entry.name, key, index * CHECKSUM_CHUNK, size, crcs[index], at, end - at, crc)
            )
            at = end
    return pieces
