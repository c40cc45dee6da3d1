"""Regions of a slim tensor read with ``pread`` (:meth:`SlimSource.read_into
<slimtorch.sources.slim.SlimSource.read_into>`): each stored part's rows and columns only, decoded in
bounded blocks, the bytes read hashed for the caller to check. Chains that keep no row apart (zstd,
sparse, flat int4) are decoded whole."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Protocol, TypeGuard

import torch

from slimtorch.errors import FormatError
from slimtorch.format.codecs import CodecError, decode
from slimtorch.format.codecs.lossy import is_int4_group_size, is_int8_group_size
from slimtorch.format.layout import CHECKSUM_CHUNK, Entry, crc32, recorded_crcs, tensor_bytes
from slimtorch.format.shard_read import Piece, ShardRead, Span, read_region, region
from slimtorch.format.source import StorageLocation, TensorInfo

READ_BLOCK = 16 << 20  # bytes of decoded rows per block when a sharded read decodes codes
GROUPED_PARTS = {"int8": {"q", "scale"}, "int4": {"q4", "scale", "zero"}}
"""The parts of the codecs whose scales go per group along a row (int8 with a ``group_size``)."""


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
    columns, int8 codes on any column (with scales per row), int8 with scales per group and row-grouped
    int4 on whole groups (the covering groups read, then trimmed). The bytes read are hashed into
    :class:`Piece` s for the caller to check (``verify``); other chains are decoded whole and checked here,
    with a ``note``."""
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
    keeps no row apart (zstd, sparse, flat or packed int4, a 1-d coded tensor). int8 with a scale per row
    reads the columns asked; int8 with a scale per group and row-grouped int4 read the whole groups that
    cover them, codes and sides alike (trimmed once decoded): a grouped int8's scales have columns too."""
    chain, stages = entry.chain, entry.stages
    if chain in ("raw", "cast") and set(entry.parts) == {""}:
        return {"": cols}
    if len(entry.shape) < 2 or stages[-1].get("flat") or stages[0].get("packing") is not None:
        return None
    grouped = "group_size" in stages[0]
    if chain == "int8" and set(entry.parts) == {"q", "scale"} and not grouped:
        return {"q": cols, "scale": None}
    if set(entry.parts) != GROUPED_PARTS.get(chain):
        return None
    if cols is None:
        return dict.fromkeys(entry.parts)
    size = stages[0].get("group_size")
    if len(entry.shape) == 2 and _group_size_of(size, chain):
        return _covering_groups(entry, cols, size)
    return None  # groups run over the flattened columns; a bad size is decode's to refuse


def _covering_groups(entry: Entry, cols: Span, size: int) -> dict[str, Span | None]:
    """Each part's columns for the whole groups of ``size`` covering ``cols``."""
    first, last = cols[0] // size, -(-cols[1] // size)
    codes = _primary(entry)
    stop = last * size if codes == "q4" else min(last * size, entry.shape[1])  # int8 rows are not padded
    spans: dict[str, Span | None] = dict.fromkeys(entry.parts, (first, last))
    spans[codes] = (first * size // _per_code(entry), stop // _per_code(entry))
    return spans


def _group_size_of(size: object, chain: str) -> TypeGuard[int]:
    """Whether a file's group size is one the chain's codec takes (checked before it divides anything)."""
    return is_int4_group_size(size) if chain == "int4" else is_int8_group_size(size)


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
