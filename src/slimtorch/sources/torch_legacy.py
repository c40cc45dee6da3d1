"""Legacy torch.save files (PyTorch < 1.6, or ``_use_new_zipfile_serialization=False``).

The layout is five pickles in a row (magic number, protocol version, system info, the object, the list of
storage keys) followed by each storage's bytes in key order, each preceded by its element count as an 8-byte
integer. We unpickle the structure, then walk the storage headers to find each storage's byte range without
reading its data, so tensors can be mapped from the file like any other format.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Any

from slimtorch.errors import FormatError, UnsafeCheckpointError
from slimtorch.format.source import StorageLocation, TensorSource
from slimtorch.sources.objects import short_repr
from slimtorch.sources.pickled import MetaStorages, describe_tensors, flatten, unpickle

MAGIC_NUMBER = 0x1950A86A20F9469CFC6C
PROTOCOL_VERSION = 1001
# What torch.save writes first: pickle protocol 2, then the magic number as a 10-byte LONG1.
SIGNATURE = b"\x80\x02\x8a\x0a" + MAGIC_NUMBER.to_bytes(10, "little")


def open_torch_legacy(path: Path, trusted: list[tuple[Any, str]]) -> TensorSource:
    """Read a legacy (non-zip) torch.save file lazily."""
    storages = MetaStorages(path)
    size = os.path.getsize(path)
    with open(path, "rb") as stream:
        if not _is_int(unpickle(path, stream), MAGIC_NUMBER):
            raise FormatError(path, "not a torch.save file (wrong magic number)")
        if not _is_int(unpickle(path, stream), PROTOCOL_VERSION):
            raise FormatError(path, "unsupported legacy torch.save protocol version")
        sys_info = unpickle(path, stream)
        if isinstance(sys_info, dict) and not sys_info.get("little_endian", True):
            raise FormatError(path, "written on a big-endian machine; only little-endian files are supported")
        obj = unpickle(path, stream, _persistent_load(path, storages), trusted=trusted)
        keys = unpickle(path, stream)
        structure_bytes = stream.tell()
        if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
            raise FormatError(path, "corrupt storage key list")
        offsets = _storage_offsets(path, stream, keys, storages, size)
    flat = flatten(obj, path=path)
    infos, locations = describe_tensors(
        path, flat.tensors, storages, lambda claim: StorageLocation(path, offsets[claim.key], claim.nbytes)
    )
    return TensorSource(
        path, "torch-legacy", infos, locations, flat.objects, [path], structure_bytes, tree=obj
    )


def _is_int(value: Any, expected: int) -> bool:
    # Compared by type first: a tensor's == gives a tensor, whose truth value is an error.
    return type(value) is int and value == expected


def _persistent_load(path: Path, storages: MetaStorages):
    def load(saved_id: Any) -> Any:
        if not isinstance(saved_id, tuple) or not saved_id:
            raise FormatError(path, f"unexpected persistent id {short_repr(saved_id)}")
        if saved_id[0] == "module":
            # A pickled nn.Module class with its source code: loading it means trusting that code.
            name = getattr(saved_id[1], "__name__", saved_id[1])
            raise UnsafeCheckpointError(path, name[:200] if isinstance(name, str) else short_repr(name))
        if saved_id[0] != "storage" or len(saved_id) != 6:
            raise FormatError(path, f"unexpected persistent id {short_repr(saved_id)}")
        _, storage_type, root_key, _location, numel, view_metadata = saved_id
        if view_metadata is not None:
            raise FormatError(path, "storage views (PyTorch < 0.4 files) are not supported")
        return storages.storage(root_key, storage_type, numel)

    return load


def _storage_offsets(
    path: Path, stream, keys: list[str], storages: MetaStorages, size: int
) -> dict[str, int]:
    """Find where each storage's bytes start by hopping over the element-count headers."""
    offsets: dict[str, int] = {}
    position = stream.tell()
    for key in keys:
        claim = storages.claims.get(key)
        if claim is None:
            raise FormatError(path, f"storage {key!r} is listed but no tensor uses it")
        stream.seek(position)
        header = stream.read(8)
        if len(header) != 8:
            raise FormatError(path, f"storage {key!r} is cut off (truncated file)")
        (numel,) = struct.unpack("<q", header)
        if numel * claim.dtype.itemsize != claim.nbytes:
            raise FormatError(
                path, f"storage {key!r} header says {numel} elements, the pickle says otherwise"
            )
        offsets[key] = position + 8
        position += 8 + claim.nbytes
        if position > size:
            raise FormatError(
                path, f"storage {key!r} needs bytes up to {position} but the file has {size} (truncated file)"
            )
    missing = set(storages.claims) - set(offsets)
    if missing:
        raise FormatError(path, f"storages {sorted(missing)[:3]} are used but not stored (corrupt file)")
    return offsets
