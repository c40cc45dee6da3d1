"""The zip container shared by torch.save files (PyTorch >= 1.6) and TorchScript archives.

Both are zip archives of one folder: a pickle (``data.pkl``, tensors as persistent ids) and one uncompressed
entry per storage (``data/<key>``). Here: opening the archive, reading its small entries, and finding the byte
range of each storage inside the file, so tensors can be mapped from it without reading anything else. An
archive may also lie inside a byte window of a larger file (each item of a ``torch.distributed.checkpoint``
``.distcp`` file is a torch.save archive): zip offsets then count from the window's start.
"""

from __future__ import annotations

import contextlib
import io
import os
import struct
import zipfile
import zlib
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from slimtorch.errors import FormatError
from slimtorch.format.source import StorageLocation, check_storage_fits
from slimtorch.format.untrusted import check_expansion, untrusted
from slimtorch.sources.objects import short_repr
from slimtorch.sources.pickle_budget import MAX_PICKLE_BYTES
from slimtorch.sources.pickled import MetaStorages, StorageClaim

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


class Window(io.RawIOBase):
    """Bytes ``[offset, offset + length)`` of an open file, seen as a file of their own: zipfile finds its
    end record at the window's end and reads nothing outside it."""

    def __init__(self, stream: io.BufferedReader, offset: int, length: int) -> None:
        super().__init__()
        self._stream, self._offset, self._length, self._position = stream, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, position: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self._length}[whence]
        if base + position < 0:
            raise OSError("seek before the start of the window")
        self._position = base + position
        return self._position

    def read(self, size: int | None = -1) -> bytes:
        left = max(0, self._length - self._position)
        size = left if size is None or size < 0 else min(size, left)
        self._stream.seek(self._offset + self._position)
        data = self._stream.read(size)
        self._position += len(data)
        return data

    def readinto(self, buffer) -> int:  # io.RawIOBase's read() and readall() go through it
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)


@contextmanager
def open_archive(path: Path, window: tuple[int, int] | None = None) -> Iterator[tuple[zipfile.ZipFile, str]]:
    """The open archive and its root folder, after checking it is a little-endian torch archive.

    ``window``: the archive is bytes ``(offset, length)`` of ``path``; its offsets count from ``offset``.
    """
    with contextlib.ExitStack() as opened:
        source: Path | Window = path
        if window is not None:
            source = Window(opened.enter_context(open(path, "rb")), *window)
        try:
            with untrusted(path, "zip archive"):
                archive = opened.enter_context(zipfile.ZipFile(source))
        except (zipfile.BadZipFile, EOFError) as exc:
            raise FormatError(path, f"truncated or corrupt zip archive ({exc})") from exc
        root = archive_root(path, archive.namelist())
        byteorder = _read_small(archive, f"{root}/byteorder", path) or b"little"
        if byteorder.strip() != b"little":
            raise FormatError(
                path,
                f"written on a {byteorder.decode(errors='replace')}-endian machine; "
                "only little-endian checkpoints are supported",
            )
        yield archive, root


def persistent_load(path: Path, storages: MetaStorages):
    def load(saved_id: Any) -> Any:
        if not isinstance(saved_id, tuple) or len(saved_id) < 5 or saved_id[0] != "storage":
            raise FormatError(path, f"unexpected persistent id in data.pkl: {short_repr(saved_id)}")
        _, storage_type, key, _location, numel = saved_id[:5]
        return storages.storage(key, storage_type, numel)

    return load


def locate_storage(
    path: Path,
    archive: zipfile.ZipFile,
    folder: str,
    claim: StorageClaim,
    window: tuple[int, int] | None = None,
) -> StorageLocation:
    """Byte range of storage ``claim.key`` in the zip file, checked against the entry and the file (and
    the ``window`` the archive was opened in, whose offset it adds)."""
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
    start, length = window or (0, os.path.getsize(path))
    location = StorageLocation(path, start + _data_offset(path, archive, info), claim.nbytes)
    if location.offset + claim.nbytes > start + length:
        raise FormatError(path, f"storage {claim.key!r} ends past the end of its archive (corrupt file)")
    check_storage_fits(path, f"storage {claim.key!r}", location)
    return location


def _data_offset(path: Path, archive: zipfile.ZipFile, info: zipfile.ZipInfo) -> int:
    # The local header's extra field (torch pads it for alignment) can differ from the central directory's,
    # so read the real lengths from the local header itself.
    if archive.fp is None:
        raise ValueError(f"{path}: the zip archive is closed")
    archive.fp.seek(info.header_offset)
    header = archive.fp.read(_LOCAL_HEADER.size)
    if len(header) != _LOCAL_HEADER.size:
        raise FormatError(path, f"zip entry {info.filename} is cut off (truncated file)")
    signature, name_length, extra_length = _LOCAL_HEADER.unpack(header)
    if signature != _LOCAL_HEADER_SIGNATURE:
        raise FormatError(path, f"zip entry {info.filename} has a corrupt header")
    return info.header_offset + _LOCAL_HEADER.size + name_length + extra_length


def read_entry(
    archive: zipfile.ZipFile, entry: str, path: Path, *, limit: int = MAX_PICKLE_BYTES, text: bool = False
) -> bytes:
    """The bytes of ``entry``, its declared sizes checked against ``limit`` and the file before reading.

    torch writes every entry stored, so a compressed pickle or storage is refused (a 2.5 KB zip whose
    data.pkl is bzip2-compressed would decode to gigabytes). Only TorchScript's ``code/`` text may be
    deflated (``text=True``; real archives do it), and then never more than its declared size is decoded.
    """
    try:
        info = archive.getinfo(entry)
    except KeyError:
        raise FormatError(path, f"{entry} is missing from the archive") from None
    _check_entry(path, info, limit, text)
    try:
        with archive.open(info) as stream:
            data = stream.read(info.file_size)  # a read of n bytes decodes at most about n
    except (
        zipfile.BadZipFile,
        EOFError,
        OSError,
        zlib.error,
        NotImplementedError,
        RuntimeError,
        ValueError,
    ) as exc:
        raise FormatError(path, f"cannot read {entry}: {exc} (truncated or corrupt)") from exc
    if len(data) != info.file_size:
        raise FormatError(path, f"{entry} is cut off (truncated file)")
    return data


def _check_entry(path: Path, info: zipfile.ZipInfo, limit: int, text: bool) -> None:
    deflated = text and info.compress_type == zipfile.ZIP_DEFLATED
    if info.compress_type != zipfile.ZIP_STORED and not deflated:
        raise FormatError(
            path,
            f"{info.filename} is compressed (zip method {info.compress_type}), which torch.save never does; "
            "refused as a possible zip bomb",
        )
    if info.file_size > limit:
        raise FormatError(path, f"{info.filename} declares {info.file_size:,} bytes, more than {limit:,}")
    size = os.path.getsize(path)
    if info.compress_size > size or (not deflated and info.file_size != info.compress_size):
        raise FormatError(
            path,
            f"{info.filename} declares {info.compress_size:,} bytes stored ({info.file_size:,} decoded) in a "
            f"file of {size:,} (truncated or corrupt)",
        )
    if deflated:
        check_expansion(path, info.filename, info.compress_size, info.file_size)


def _read_small(archive: zipfile.ZipFile, entry: str, path: Path) -> bytes | None:
    if entry not in archive.NameToInfo:
        return None
    return read_entry(archive, entry, path, limit=64)
