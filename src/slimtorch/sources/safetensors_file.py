"""safetensors files: an 8-byte header length, a JSON header, then the tensors' bytes back to back.

We parse and check the header ourselves (it is small and it is where a hostile file lies), then map each
tensor's byte range from the file like every other format.
"""

from __future__ import annotations

import math
import struct
from pathlib import Path
from typing import TypeGuard

from slimtorch.errors import FormatError
from slimtorch.format.container import DTYPES, read_header
from slimtorch.format.layout import Layout, is_slim
from slimtorch.format.source import (
    ObjectInfo,
    StorageLocation,
    TensorInfo,
    TensorSource,
    contiguous_strides,
    shape_problem,
)
from slimtorch.sources.slim import slim_source


def looks_like_safetensors(head: bytes) -> bool:
    """True when the first bytes look like a header length followed by a JSON object.

    The length itself is checked by :func:`open_safetensors`, so a truncated file gets a precise error.
    """
    return len(head) >= 9 and head[8:9] == b"{" and struct.unpack("<Q", head[:8])[0] >= 2


def open_safetensors(path: Path) -> TensorSource:
    """Read a .safetensors file lazily, checking every offset against the file.

    A slim checkpoint (``__metadata__`` holds slimtorch's layout) opens as a :class:`SlimSource` of its
    logical tensors; any other file as its tensors.
    """
    header, data_start, size = read_header(path)
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise FormatError(path, "__metadata__ is not a JSON object")
    infos, locations = [], {}
    for name, entry in header.items():
        info, location = _describe(path, name, entry, data_start, size)
        infos.append(info)
        locations[info.storage] = location
    infos.sort(key=lambda info: (locations[info.storage].offset, info.nbytes))
    _check_back_to_back(path, infos, locations, data_start, size)
    if is_slim(metadata, header):
        return slim_source(
            path,
            Layout.from_metadata(path, metadata),
            {info.name: info for info in infos},
            locations,
            objects=[],
            files=[path],
            structure_bytes=data_start,
        )
    objects = [ObjectInfo(f"__metadata__.{k}", type(v).__name__, str(v)[:80]) for k, v in metadata.items()]
    return TensorSource(path, "safetensors", infos, locations, objects, [path], structure_bytes=data_start)


def _describe(
    path: Path, name: str, entry: object, data_start: int, size: int
) -> tuple[TensorInfo, StorageLocation]:
    if not isinstance(entry, dict):
        raise FormatError(path, f"tensor {name!r}: header entry is not an object")
    kind = entry.get("dtype")
    dtype = DTYPES.get(kind) if isinstance(kind, str) else None
    if dtype is None:
        raise FormatError(path, f"tensor {name!r}: unknown dtype {str(kind)[:40]!r}")
    shape, offsets = entry.get("shape"), entry.get("data_offsets")
    if not _ints(shape) or not _ints(offsets) or len(offsets) != 2:
        raise FormatError(
            path, f"tensor {name!r}: shape and data_offsets must be lists of non-negative integers"
        )
    problem = shape_problem(shape)
    if problem:
        raise FormatError(path, f"tensor {name!r}: shape refused ({problem})")
    begin, end = offsets
    nbytes = math.prod(shape) * dtype.itemsize  # bounded by shape_problem: no huge products
    if end < begin or end - begin != nbytes:
        raise FormatError(
            path, f"tensor {name!r}: {list(shape)} {dtype} needs {nbytes} bytes, offsets give {end - begin}"
        )
    if data_start + end > size:
        raise FormatError(
            path, f"tensor {name!r} ends at byte {data_start + end} but the file has {size} (truncated file)"
        )
    info = TensorInfo(
        name,
        dtype,
        tuple(shape),
        contiguous_strides(shape),
        storage=name,
        storage_offset=0,
        storage_nbytes=nbytes,
    )
    return info, StorageLocation(path, data_start + begin, nbytes)


def _check_back_to_back(
    path: Path, infos: list[TensorInfo], locations: dict[str, StorageLocation], data_start: int, size: int
) -> None:
    """Refuse byte ranges that overlap or leave gaps, as the safetensors library does (``infos`` sorted by
    offset): aliased ranges would load as that many copies of one range (3000 of them took 12 GB), and
    bytes no tensor owns are where a hostile file hides what other readers see."""
    reach = data_start
    for info in infos:
        location = locations[info.storage]
        if location.offset != reach:
            problem = "overlaps the tensor before it" if location.offset < reach else "leaves a gap before it"
            raise FormatError(
                path, f"tensor {info.name!r} starts at byte {location.offset}, which {problem} (corrupt file)"
            )
        reach += location.nbytes
    if reach != size:
        raise FormatError(path, f"{size - reach} bytes after the last tensor belong to none (corrupt file)")


def _ints(value: object) -> TypeGuard[list[int]]:
    return isinstance(value, list) and all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value
    )
