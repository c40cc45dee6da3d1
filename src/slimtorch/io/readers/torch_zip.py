"""torch.save zip files (.pt .pth .bin .ckpt, PyTorch >= 1.6) and TorchScript archives (torch.jit.save).

Both are zip archives of one folder: ``data.pkl`` (the object, tensors as persistent ids), ``data/<key>``
(one uncompressed entry per storage) and, for TorchScript, ``code/`` and ``constants.pkl``. We unpickle only
the structure and locate each storage's bytes inside the zip, so tensors can be mapped straight from the file.
"""

from __future__ import annotations

import struct
import zipfile
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any

from slimtorch.errors import FormatError
from slimtorch.io.readers.pickled import (
    MetaStorages,
    StorageClaim,
    describe_tensors,
    flatten,
    script_stand_ins,
    unpickle,
)
from slimtorch.io.source import StorageLocation, TensorSource, check_storage_fits

_LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature, then filename and extra-field lengths
_LOCAL_HEADER_SIGNATURE = b"PK\x03\x04"


def archive_root(path: Path, names: list[str]) -> str:
    """The folder every entry of a torch archive lives in (torch names it after the file)."""
    pickles = [n for n in names if n.endswith("/data.pkl") and n.count("/") == 1]
    if not pickles:
        raise FormatError(path, "a zip archive, but not a PyTorch checkpoint (no data.pkl inside)")
    return pickles[0].split("/", 1)[0]


def is_torchscript(names: Iterable[str], root: str) -> bool:
    return any(n.startswith(f"{root}/code/") or n == f"{root}/constants.pkl" for n in names)


def open_torch_zip(path: Path, trusted: list[tuple[Any, str]]) -> TensorSource:
    """Read a torch.save zip file or a TorchScript archive lazily."""
    try:
        archive = zipfile.ZipFile(path)
    except zipfile.BadZipFile as exc:
        raise FormatError(path, f"truncated or corrupt zip archive ({exc})") from exc
    with archive:
        names = archive.namelist()
        root = archive_root(path, names)
        byteorder = _read_small(archive, f"{root}/byteorder", path) or b"little"
        if byteorder.strip() != b"little":
            raise FormatError(
                path,
                f"written on a {byteorder.decode(errors='replace')}-endian machine; "
                "only little-endian checkpoints are supported",
            )
        if is_torchscript(names, root):
            return _open_script(path, archive, root, trusted)
        data = _read(archive, f"{root}/data.pkl", path)
        storages = MetaStorages(path)
        obj = unpickle(path, data, _persistent_load(path, storages), trusted=trusted)
        flat = flatten(obj)
        infos, locations = describe_tensors(
            path, flat.tensors, storages, lambda claim: _locate(path, archive, f"{root}/data", claim)
        )
        return TensorSource(
            path, "torch-zip", infos, locations, flat.objects, [path], structure_bytes=len(data)
        )


def _open_script(
    path: Path, archive: zipfile.ZipFile, root: str, trusted: list[tuple[Any, str]]
) -> TensorSource:
    infos, locations, objects, structure = [], {}, [], 0
    # Attributes live in data.pkl (storages under data/); tensor constants in constants.pkl (constants/).
    for pickle_name, folder, prefix in (
        ("data.pkl", "data", ""),
        ("constants.pkl", "constants", "__constants__"),
    ):
        entry = f"{root}/{pickle_name}"
        if entry not in archive.namelist():
            continue
        data = _read(archive, entry, path)
        structure += len(data)
        storages = MetaStorages(path)
        obj = unpickle(
            path, data, _persistent_load(path, storages), trusted=[*trusted, *script_stand_ins(data)]
        )
        flat = flatten(obj)
        named = [(f"{prefix}.{name}" if prefix else name, tensor) for name, tensor in flat.tensors]
        more, more_locations = describe_tensors(
            path,
            named,
            storages,
            lambda claim, f=folder: _locate(path, archive, f"{root}/{f}", claim),
            storage_prefix=f"{folder}/",
        )
        # TorchScript marks parameters with requires_grad; every other tensor attribute is a buffer.
        infos += [info if info.role else replace(info, role="buffer") for info in more]
        locations.update(more_locations)
        objects += [o for o in flat.objects if not o.name.endswith(("training", "_is_full_backward_hook"))]
    return TensorSource(path, "torchscript", infos, locations, objects, [path], structure_bytes=structure)


def _persistent_load(path: Path, storages: MetaStorages):
    def load(saved_id: Any) -> Any:
        if not isinstance(saved_id, tuple) or len(saved_id) < 5 or saved_id[0] != "storage":
            raise FormatError(path, f"unexpected persistent id in data.pkl: {saved_id!r:.80}")
        _, storage_type, key, _location, numel = saved_id[:5]
        return storages.storage(str(key), storage_type, numel)

    return load


def _locate(path: Path, archive: zipfile.ZipFile, folder: str, claim: StorageClaim) -> StorageLocation:
    """Byte range of storage ``claim.key`` in the zip file, checked against the entry and the file."""
    entry = f"{folder}/{claim.key}"
    try:
        info = archive.getinfo(entry)
    except KeyError:
        raise FormatError(path, f"storage {claim.key!r} is missing from the archive ({entry})") from None
    if info.compress_type != zipfile.ZIP_STORED:
        raise FormatError(path, f"storage {entry} is compressed; torch.save never compresses storages")
    if claim.nbytes > info.file_size:
        raise FormatError(
            path,
            f"storage {claim.key!r} claims {claim.nbytes} bytes but its zip entry holds {info.file_size}",
        )
    location = StorageLocation(path, _data_offset(path, archive, info), claim.nbytes)
    check_storage_fits(path, f"storage {claim.key!r}", location)
    return location


def _data_offset(path: Path, archive: zipfile.ZipFile, info: zipfile.ZipInfo) -> int:
    # The local header's extra field (torch pads it for alignment) can differ from the central directory's,
    # so read the real lengths from the local header itself.
    archive.fp.seek(info.header_offset)
    header = archive.fp.read(_LOCAL_HEADER.size)
    if len(header) != _LOCAL_HEADER.size:
        raise FormatError(path, f"zip entry {info.filename} is cut off (truncated file)")
    signature, name_length, extra_length = _LOCAL_HEADER.unpack(header)
    if signature != _LOCAL_HEADER_SIGNATURE:
        raise FormatError(path, f"zip entry {info.filename} has a corrupt header")
    return info.header_offset + _LOCAL_HEADER.size + name_length + extra_length


def _read(archive: zipfile.ZipFile, entry: str, path: Path) -> bytes:
    try:
        return archive.read(entry)
    except KeyError:
        raise FormatError(path, f"{entry} is missing from the archive") from None
    except (zipfile.BadZipFile, EOFError, OSError) as exc:
        raise FormatError(path, f"cannot read {entry}: {exc} (truncated or corrupt)") from exc


def _read_small(archive: zipfile.ZipFile, entry: str, path: Path) -> bytes | None:
    if entry not in archive.namelist():
        return None
    if archive.getinfo(entry).file_size > 64:
        raise FormatError(path, f"{entry} is implausibly large")
    return _read(archive, entry, path)
