"""Arrays from ``.npy`` and ``.npz`` files we did not write, read within a budget.

numpy reads an array's header and then allocates what the header says: a 100-byte ``.npy`` claiming a
shape of ``(10**12,)``, or an ``.npz`` member deflated 1000:1, asks for far more memory than the file
holds. Here every header is read first and checked before numpy allocates anything:

- ``.npy``: the header's bytes (shape x itemsize) must be in the file;
- ``.npz``: at most :data:`MAX_MEMBERS` members, each an ``.npy``; each member's array within its declared
  (decompressed) zip size, that size within the expansion budget of
  :func:`~slimtorch.format.untrusted.check_expansion` over its compressed size (the rule every slim file
  is decoded by: 64x plus 64 MiB unless ``SLIMTORCH_MAX_EXPANSION`` says more), and the members read
  together within that budget over the whole file and within the memory this machine has available;
- no pickle: arrays of Python objects are refused.

A refusal is one :class:`~slimtorch.errors.FormatError` naming the file and the member.

Example:
    >>> arrays = read_npz("batch.npz")  # doctest: +SKIP
    >>> sorted(arrays), arrays["x"].shape  # doctest: +SKIP
    (['x', 'y'], (64, 6))
"""

from __future__ import annotations

import math
import os
import struct
import zipfile
from collections.abc import Collection
from pathlib import Path
from typing import Any

import numpy as np

from slimtorch.errors import FormatError
from slimtorch.format.untrusted import check_expansion, untrusted

MAX_MEMBERS = 1024
"""the most arrays one ``.npz`` may hold: inputs of a model or a task's ``x`` and ``y`` are a handful, and
each member costs a zip entry parsed and a header read before its bytes are even checked"""
MAX_DIRECTORY_BYTES = MAX_MEMBERS * 1024
"""the most bytes of zip directory parsed (zipfile makes a Python object of every entry): 1 KiB a member,
room for the fixed fields, a long name and a ZIP64 extra"""
NPY = ".npy"
_END_RECORD = b"PK\x05\x06"
_END_RECORD_BYTES = 22


def read_npy(path: str | os.PathLike[str]) -> np.ndarray:
    """The array of an ``.npy`` file, its header checked against the file's size before numpy allocates.

    Example:
        >>> read_npy("x.npy").shape  # doctest: +SKIP
        (64, 6)
    """
    path = Path(path)
    with untrusted(path, ".npy"), path.open("rb") as stream:
        nbytes = npy_bytes(path, stream, "")
        if stream.tell() + nbytes > path.stat().st_size:
            raise FormatError(path, f"the header claims {nbytes:,} bytes, more than the file can hold")
        _within_memory(path, "the array", nbytes)
        stream.seek(0)
        return np.load(stream, allow_pickle=False)


def read_npz(path: str | os.PathLike[str], names: Collection[str] | None = None) -> dict[str, np.ndarray]:
    """The arrays of an ``.npz`` file by name (only ``names`` where given, those present), each header and
    size checked within the budget (see the module) before any member is decompressed.

    Example:
        >>> read_npz("train.npz", names=("x", "y"))["y"].dtype  # doctest: +SKIP
        dtype('int64')
    """
    path = Path(path)
    size = path.stat().st_size
    _check_directory(path, size)
    try:
        with untrusted(path, ".npz"), zipfile.ZipFile(path) as archive:
            members = archive.infolist()
            if len(members) > MAX_MEMBERS:
                raise FormatError(path, f"holds {len(members):,} members, more than the {MAX_MEMBERS:,} read")
            chosen = [m for m in members if names is None or m.filename.removesuffix(NPY) in names]
            total = 0
            for member in chosen:
                total += _member_bytes(path, archive, member)
            check_expansion(path, "its arrays together", size, total)
            _within_memory(path, "its arrays", total)
            return {m.filename.removesuffix(NPY): _read_member(path, archive, m) for m in chosen}
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, NotImplementedError, RuntimeError) as exc:
        raise FormatError(path, f"not a readable .npz file ({exc})") from None


def npy_bytes(path: Path, stream: Any, member: str) -> int:
    """The bytes an ``.npy`` stream's header says its array holds (the stream left after the header);
    arrays of Python objects (a pickle) refused."""
    where = f"{member}: " if member else ""
    version = np.lib.format.read_magic(stream)
    if version not in ((1, 0), (2, 0)):
        raise FormatError(path, f"{where}unsupported .npy version {version}")
    reader = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
    shape, _, dtype = reader(stream)
    if dtype.hasobject:
        raise FormatError(path, f"{where}holds Python objects (a pickle), which are never loaded")
    if any(size < 0 for size in shape):
        raise FormatError(path, f"{where}the header's shape {shape} has a negative size")
    return math.prod(shape) * dtype.itemsize


def available_memory() -> int:
    """Bytes this machine could give the process now: ``MemAvailable`` on Linux, else physical memory."""
    try:
        with open("/proc/meminfo") as info:
            for line in info:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 1 << 62  # nothing to ask: the other checks still hold


def _check_directory(path: Path, size: int) -> None:
    """The zip's end record read before zipfile parses its directory: the count of members and the
    directory's size within :data:`MAX_MEMBERS` and :data:`MAX_DIRECTORY_BYTES` (a ZIP64 archive, beyond
    65,535 members or 4 GiB of directory, is past both). No end record: zipfile says what is wrong."""
    with path.open("rb") as stream:  # the record is last, but for a comment of 64 KiB at most
        stream.seek(size - min(size, _END_RECORD_BYTES + 0xFFFF))
        tail = stream.read()
    at = tail.rfind(_END_RECORD)
    if at < 0 or len(tail) - at < _END_RECORD_BYTES:
        return
    members, directory = struct.unpack_from("<HI", tail, at + 10)
    if members > MAX_MEMBERS or directory > MAX_DIRECTORY_BYTES:
        raise FormatError(
            path,
            f"its zip directory lists {members:,} members in {directory:,} bytes, more than the "
            f"{MAX_MEMBERS:,} members ({MAX_DIRECTORY_BYTES:,} bytes) read",
        )


def _member_bytes(path: Path, archive: zipfile.ZipFile, member: zipfile.ZipInfo) -> int:
    """The bytes ``member``'s array would take, checked against what the member and the file can hold."""
    name = member.filename
    if not name.endswith(NPY):
        raise FormatError(path, f"member {name!r} is not an .npy array")
    if member.compress_size > path.stat().st_size:
        raise FormatError(
            path, f"member {name!r} claims {member.compress_size:,} stored bytes, more than the file"
        )
    stored = member.compress_type == zipfile.ZIP_STORED
    if stored and member.file_size != member.compress_size:
        raise FormatError(path, f"member {name!r} is stored, yet its sizes differ")
    check_expansion(path, f"member {name!r}", member.compress_size, member.file_size)
    with archive.open(member) as stream:
        nbytes = npy_bytes(path, stream, f"member {name!r}")
    if nbytes > member.file_size:
        raise FormatError(
            path,
            f"member {name!r} claims {nbytes:,} bytes, more than the file can hold ({member.file_size:,} "
            "bytes in the member)",
        )
    return nbytes


def _read_member(path: Path, archive: zipfile.ZipFile, member: zipfile.ZipInfo) -> np.ndarray:
    with archive.open(member) as stream:
        return np.lib.format.read_array(stream, allow_pickle=False)


def _within_memory(path: Path, what: str, nbytes: int) -> None:
    available = available_memory()
    if nbytes > available:
        raise FormatError(
            path, f"{what} would take {nbytes:,} bytes, more than the {available:,} this machine has free"
        )
