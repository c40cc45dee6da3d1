"""Atomic, sharded, checksummed writes of slim checkpoints.

A checkpoint is written where nothing reads it (a temporary file beside the target, or a temporary folder
beside the target folder), flushed to disk with fsync, and only then moved into place with one rename, or,
for a folder that already exists, one atomic exchange (Linux ``renameat2``). An interrupted run leaves the
previous checkpoint untouched and, at worst, a ``.slimtorch-tmp-*`` leftover, which the next write to the
same place removes (concurrent writes to one output are not supported: the last rename would win anyway).
OUT is never a symbolic link (replacing it would replace the link, not write where it points), and a
folder is replaced only when it holds nothing but what slimtorch writes.

Each tensor's parts go to disk as soon as it is added (:class:`_ShardFile`), so memory holds one tensor's
encoded parts, never a shard's or the model's; parts stored as is are written straight from the source's
memory map. The header, known only at the end, is written into room left before the data; a small file is
moved down over room it did not use (it comes out as if written in one go). How many shards a save makes is
known only at its end, so each shard's header leaves room for the count, filled in (and the header
resealed) before the commit.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import json
import os
import re
import shutil
import struct
import tempfile
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path, PurePosixPath
from typing import Any

import torch

from slimtorch.errors import SlimtorchError
from slimtorch.format.codecs.chain import Encoded
from slimtorch.format.container import DTYPES, read_metadata
from slimtorch.format.layout import (
    INDEX_NAME,
    METADATA_KEY,
    RESERVED_NAMES,
    SINGLE_NAME,
    Entry,
    Layout,
    crc32_chunks,
    is_slim,
    part_key,
    seal,
    tensor_bytes,
)
from slimtorch.format.untrusted import load_json

SAFETENSORS_NAMES = {dtype: name for name, dtype in DTYPES.items()}
TEMP_PREFIX = ".slimtorch-tmp-"
STARTED = time.time()
"""When this process started writing: temporary files of OUT older than this are an earlier run's."""
HEADER_ROOM = 16
"""Spaces left at the end of every header, for the shard count filled in at the end of a save."""
CARD_NAME = "README.md"
"""A folder's model card, which ``card`` rewrites once the weights are written."""
Card = Callable[[Path | bytes | None, int], bytes]
"""(the card the folder had, bytes written) -> the card to write"""


class SlimWriter:
    """Collect encoded tensors and write them as one slim file or a sharded folder, atomically.

    ``out`` ending in ``.safetensors`` is one file; anything else is a folder holding ``model.safetensors``
    or ``model-0000i-of-0000N.safetensors`` shards plus ``model.safetensors.index.json``.

    Example:
        >>> from slimtorch.format.codecs import encode
        >>> with SlimWriter(Path("w.safetensors")) as writer:  # doctest: +SKIP
        ...     writer.add("fc.weight", encode(torch.randn(4, 4), ["int8"]), torch.float32, (4, 4))
    """

    def __init__(
        self,
        out: str | os.PathLike[str],
        *,
        shard_bytes: int | None = None,
        ties: Mapping[str, str] | None = None,
        copies: Mapping[str, str] | None = None,
        provenance: Mapping[str, Any] | None = None,
        delta: Any = None,
        extra_files: Mapping[str, Path | bytes] | None = None,
        objects: Mapping[str, Any] | None = None,
        card: Card | None = None,
        expected_tensors: int | None = None,
    ) -> None:
        """``expected_tensors`` (how many :meth:`add` calls will come, if known) sizes the room left for
        each shard's header: a guess too small costs one move of the shard's data, never a wrong file."""
        self.out = Path(out)
        self.card = card
        self.single = self.out.suffix == ".safetensors"
        if self.single and shard_bytes:
            raise SlimtorchError(
                f"{self.out}: sharding writes a folder; give a folder name, not a .safetensors"
            )
        if self.single and extra_files:
            raise SlimtorchError(f"{self.out}: config and tokenizer files need a folder output")
        self.shard_bytes = shard_bytes
        self.checkpoint = uuid.uuid4().hex
        self.ties, self.copies = dict(ties or {}), dict(copies or {})
        self.provenance, self.delta = dict(provenance or {}), delta
        self.objects = dict(objects or {})  # plain JSON data (slimtorch.sources.objects checked it)
        self.extra_files = dict(extra_files or {})
        if self.out.is_symlink():
            raise SlimtorchError(f"{self.out}: is a symbolic link; give the path it points to")
        self.out.parent.mkdir(parents=True, exist_ok=True)
        clear_stale_temps(self.out)
        self._staging = self.out.parent / f"{TEMP_PREFIX}{self.out.name}-{self.checkpoint[:8]}"
        if not self.single:
            check_replaceable(self.out, self.extra_files)  # before any work, not only at the end
            self._staging.mkdir()
        self._room = _header_room(expected_tensors)
        self._shard: _ShardFile | None = None  # the shard being written
        self._shards: list[tuple[Path, list[str]]] = []  # staged file, physical keys
        self._owners: dict[str, str] = {}  # physical key -> the tensor it belongs to
        self.bytes_written = 0

    # -- collecting ------------------------------------------------------------------------------------
    def add(
        self,
        name: str,
        encoded: Encoded,
        dtype: torch.dtype,
        shape: tuple[int, ...],
        keys: Mapping[str, str] | None = None,
    ) -> Entry:
        """Queue one logical tensor; flushes a shard first when it would overflow ``shard_bytes``.

        ``keys`` names the physical parts (role -> key) where another reader needs its own names (the
        compressed-tensors ``<layer>.weight_scale`` ...); by default ``name::role`` (:func:`part_key`)."""
        keys = {role: (keys or {}).get(role) or part_key(name, role) for role in encoded.parts}
        for key in keys.values():
            if key in RESERVED_NAMES:
                raise SlimtorchError(
                    f"{self.out}: a tensor named {key!r} cannot be saved: safetensors keeps the file's "
                    "metadata under that name; rename the tensor"
                )
            # A tensor named like another one's part ("fc.weight::scale" beside a quantized "fc.weight")
            # would overwrite that part in the file, which would then not load.
            if key in self._owners:
                raise SlimtorchError(
                    f"{self.out}: tensor {name!r} would be stored as {key!r}, which already holds "
                    f"tensor {self._owners[key]!r}; rename one of them"
                )
        self._owners.update(dict.fromkeys(keys.values(), name))
        parts = {role: _storable(tensor) for role, tensor in encoded.parts.items()}
        entry = Entry(
            name, dtype, tuple(shape), encoded.stages, keys, {r: crc32_chunks(t) for r, t in parts.items()}
        )
        self._shard_for(encoded.nbytes).add(entry, {keys[role]: t for role, t in parts.items()})
        return entry

    def _shard_for(self, nbytes: int) -> _ShardFile:
        """The shard the next ``nbytes`` go to: a new one when they would overflow ``shard_bytes``."""
        shard, limit = self._shard, self.shard_bytes
        if limit and shard is not None and shard.entries and shard.nbytes + nbytes > limit:
            self._flush()
        if self._shard is None:
            number = len(self._shards) + 1
            self._shard = _ShardFile(
                self._staging if self.single else self._staging / f"shard-{number}.tmp", self._room
            )
        return self._shard

    def _flush(self, last: bool = False) -> None:
        """Finish the shard being written (an empty one if nothing was added); before the ``last`` one the
        shard count is not known yet (0), and :meth:`_count_shards` fills it in."""
        number = len(self._shards) + 1
        shard, self._shard = self._shard or self._shard_for(0), None
        here = {entry.name for entry in shard.entries}
        layout = Layout(
            tensors={entry.name: entry for entry in shard.entries},
            # Each shard lists the ties to its own tensors, so that it stays readable on its own.
            ties={name: target for name, target in self.ties.items() if target in here},
            copies={name: target for name, target in self.copies.items() if target in here},
            provenance=self.provenance,
            delta=self.delta,
            checkpoint=self.checkpoint,
            shard=number,
            objects=self.objects,
            shards=number if last else 0,
        )
        self.bytes_written += shard.finish(layout.to_metadata())
        self._shards.append((shard.path, shard.keys))

    # -- finishing -------------------------------------------------------------------------------------
    def commit(self) -> list[Path]:
        """Write what is queued and move the checkpoint into place; returns the files written."""
        if self._shard is not None or not self._shards:
            self._flush(last=True)
        self._count_shards()
        if self.single:
            os.replace(self._staging, self.out)
            _fsync_dir(self.out.parent)
            return [self.out]
        files = self._name_shards()
        extra: dict[str, Path | bytes] = dict(self.extra_files)
        if self.card is not None and CARD_NAME in extra:  # what was done to the weights, and to which
            extra[CARD_NAME] = self.card(extra.get(CARD_NAME), self.bytes_written)
        for name, source in extra.items():
            _copy_synced(source, _companion_target(self._staging, name))
            files.append(self.out / name)
        _fsync_dir(self._staging)
        staged = [p.relative_to(self._staging).as_posix() for p in self._staging.rglob("*") if p.is_file()]
        check_replaceable(self.out, staged)
        replace_folder(self._staging, self.out)
        return files

    def _count_shards(self) -> None:
        """Record the shard count in the shards written before the last one (their headers left room)."""
        count = len(self._shards)
        for staged, _ in self._shards:
            header, length = _read_own_header(staged)
            body = load_json(staged, header["__metadata__"][METADATA_KEY], "slimtorch metadata")
            if body["shards"] == count:
                continue
            body["shards"] = count
            header["__metadata__"][METADATA_KEY] = json.dumps(body, separators=(",", ":"))
            text = _header_bytes(header).rstrip(b" ")
            if len(text) > length:
                raise SlimtorchError(f"{staged}: no room left in the header for the shard count")
            with open(staged, "r+b") as stream:
                stream.seek(8)
                stream.write(text.ljust(length))
                stream.flush()
                os.fsync(stream.fileno())

    def _name_shards(self) -> list[Path]:
        count = len(self._shards)
        names = (
            [SINGLE_NAME]
            if count == 1
            else [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]
        )
        weight_map = {}
        for (staged, keys), name in zip(self._shards, names, strict=True):
            staged.rename(self._staging / name)
            weight_map.update(dict.fromkeys(keys, name))
        if count > 1:
            index = {
                "metadata": {
                    "total_size": self.bytes_written,
                    "format": "slimtorch",
                    "checkpoint": self.checkpoint,
                    "shards": count,
                },
                "weight_map": weight_map,
            }
            write_atomic_text(self._staging / INDEX_NAME, json.dumps(index, indent=2))
            names.append(INDEX_NAME)
        return [self.out / name for name in names]

    def abort(self) -> None:
        """Remove everything staged; the previous checkpoint, if any, is untouched."""
        if self._shard is not None:
            self._shard.close()
            self._shard = None
        if self._staging.is_dir():
            shutil.rmtree(self._staging, ignore_errors=True)
        else:
            self._staging.unlink(missing_ok=True)

    def __enter__(self) -> SlimWriter:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()


def _storable(tensor: torch.Tensor) -> torch.Tensor:
    """A part as safetensors can hold it: contiguous, on the CPU, in a dtype safetensors names."""
    tensor = tensor.detach().to("cpu").contiguous()
    if tensor.dtype not in SAFETENSORS_NAMES:
        raise SlimtorchError(f"a part has dtype {tensor.dtype}, which safetensors cannot store")
    return tensor


STREAM_COMPACT = 64 << 20
"""A shard with less data than this is moved down over header room it did not use, so a small file is as
small as if written in one go; a larger one keeps the spaces unless they pass :data:`UNUSED_ROOM_SHARE` of
its data (many tiny tensors), where one move of the data costs less than the spaces would."""
UNUSED_ROOM_SHARE = 0.001
_COPY_STEP = 16 << 20


def _header_room(expected_tensors: int | None) -> int:
    """Bytes left for a shard's header before its data: a generous guess from the tensor count (a slim
    entry and its parts' safetensors entries take a few hundred bytes), 8-byte aligned."""
    room = (64 << 10) + 2048 * (expected_tensors if expected_tensors is not None else 512)
    return room + (-(8 + room) % 8)


class _ShardFile:
    """One safetensors file written as its tensors arrive, then sealed with its header.

    After the room left for the header, a part whose length is a multiple of 8 bytes goes straight to disk,
    which keeps the data 8-byte aligned; any other part waits in a side file and follows at the end, parts
    of wider items first. Every part then starts aligned to its dtype with no gap between parts (safetensors
    allows none), and memory holds only the part being written.
    """

    def __init__(self, path: Path, room: int) -> None:
        self.path, self.room = path, room
        self.entries: list[Entry] = []
        self.keys: list[str] = []
        self.nbytes = 0  # encoded bytes added
        self._headers: dict[str, dict[str, Any]] = {}
        self._offset = 0  # data bytes on disk
        self._waiting: list[tuple[str, torch.dtype, list[int], int, int]] = []  # and where in the side file
        self._side: Any = None
        self._stream = open(path, "w+b")  # noqa: SIM115 (closed by finish or close)
        self._stream.seek(8 + room)

    def add(self, entry: Entry, parts: Mapping[str, torch.Tensor]) -> None:
        self.entries.append(entry)
        for key, tensor in parts.items():
            data = tensor_bytes(tensor)
            if len(data) % 8:
                if self._side is None:
                    self._side = tempfile.TemporaryFile(dir=self.path.parent)  # noqa: SIM115
                self._waiting.append((key, tensor.dtype, list(tensor.shape), self._side.tell(), len(data)))
                self._side.write(data)
            else:
                self._record(key, tensor.dtype, list(tensor.shape), len(data))
                self._stream.write(data)
            self.keys.append(key)
        self.nbytes += sum(t.numel() * t.element_size() for t in parts.values())

    def _record(self, key: str, dtype: torch.dtype, shape: list[int], nbytes: int) -> None:
        self._headers[key] = {
            "dtype": SAFETENSORS_NAMES[dtype],
            "shape": shape,
            "data_offsets": [self._offset, self._offset + nbytes],
        }
        self._offset += nbytes

    def finish(self, metadata: Mapping[str, str]) -> int:
        """Append the waiting parts, write the header (moving the data if its room did not fit it), fsync and
        close; returns the file's byte count."""
        stream = self._stream
        if self._side is not None:
            self._side.flush()
            side = self._side.fileno()
            for key, dtype, shape, start, nbytes in sorted(self._waiting, key=lambda w: -w[1].itemsize):
                self._record(key, dtype, shape, nbytes)
                _copy_range(side, start, stream, nbytes)
        stream.flush()
        raw = _header_bytes({"__metadata__": dict(metadata), **self._headers})
        unused = self.room - len(raw)
        if unused < 0 or (
            unused and (self._offset < STREAM_COMPACT or unused > UNUSED_ROOM_SHARE * self._offset)
        ):
            _move(stream.fileno(), 8 + self.room, 8 + len(raw), self._offset)
            os.ftruncate(stream.fileno(), 8 + len(raw) + self._offset)
            self.room = len(raw)
        stream.seek(0)
        stream.write(struct.pack("<Q", self.room))
        stream.write(raw.ljust(self.room))
        stream.flush()
        os.fsync(stream.fileno())
        self.close()
        return 8 + self.room + self._offset

    def close(self) -> None:
        self._stream.close()
        if self._side is not None:
            self._side.close()  # a temporary file: gone once closed
            self._side = None


def _copy_range(source: int, start: int, stream: Any, nbytes: int) -> None:
    """Append ``nbytes`` of file descriptor ``source`` from ``start`` to ``stream``."""
    done = 0
    while done < nbytes:
        chunk = os.pread(source, min(_COPY_STEP, nbytes - done), start + done)
        if not chunk:
            raise SlimtorchError(f"{stream.name}: the side file ended early")
        stream.write(chunk)
        done += len(chunk)


def _move(fd: int, source: int, target: int, nbytes: int) -> None:
    """Move ``nbytes`` inside a file from offset ``source`` to ``target`` (the ranges may overlap): front to
    back when moving down, back to front when moving up."""
    steps = range(0, nbytes, _COPY_STEP)
    for at in steps if target < source else reversed(steps):
        size = min(_COPY_STEP, nbytes - at)
        os.pwrite(fd, os.pread(fd, size, source + at), target + at)


def seal_header(header: Mapping[str, Any]) -> dict[str, Any]:
    """A safetensors header (``__metadata__`` and entries) with its slim seal (re)computed.

    Example:
        >>> w = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
        >>> seal_header({"__metadata__": {}, "w": w})["__metadata__"]
        {'slimtorch.crc': '2b120d78'}
    """
    entries = {key: value for key, value in header.items() if key != "__metadata__"}
    parts = {
        key: (DTYPES[e["dtype"]], e["shape"], e["data_offsets"][0], e["data_offsets"][1])
        for key, e in entries.items()
    }
    return {"__metadata__": seal(header["__metadata__"], parts), **entries}


def _header_bytes(header: Mapping[str, Any]) -> bytes:
    """The sealed header as written: JSON, :data:`HEADER_ROOM` spaces, padding to start the data 8-byte
    aligned."""
    raw = json.dumps(seal_header(header), separators=(",", ":")).encode() + b" " * HEADER_ROOM
    return raw + b" " * (-(8 + len(raw)) % 8)


def _read_own_header(path: Path) -> tuple[dict[str, Any], int]:
    """(header, its length) of a file this writer has just staged."""
    with open(path, "rb") as stream:
        (length,) = struct.unpack("<Q", stream.read(8))
        return load_json(path, stream.read(length), "header"), length


def write_atomic_text(path: Path, text: str) -> None:
    """Write a small text file through a temporary file, fsync and rename."""
    staged = path.with_name(f"{TEMP_PREFIX}{path.name}")
    with open(staged, "w", encoding="utf-8") as stream:
        stream.write(text)
        stream.flush()
        os.fsync(stream.fileno())
    os.replace(staged, path)


def _copy_synced(source: Path | bytes, target: Path) -> None:
    """Copy a companion file (config, tokenizer), or write its new bytes (a model card), and flush it to
    disk: the folder's rename must not make visible a file whose bytes are still only in the page cache."""
    target.parent.mkdir(parents=True, exist_ok=True)  # 1_Pooling/config.json
    if isinstance(source, bytes):
        target.write_bytes(source)
    else:
        shutil.copyfile(source, target)
    with open(target, "rb+") as stream:
        os.fsync(stream.fileno())


def _companion_target(staging: Path, name: str) -> Path:
    """Where companion ``name`` (``tokenizer.json``, ``1_Pooling/config.json``) goes in the staging folder:
    a relative name inside it, never over a file the writer staged (a shard, the index)."""
    parts = PurePosixPath(name).parts
    if (
        not parts
        or name.startswith("/")
        or any(p in ("", ".", "..") or "\\" in p or "\0" in p for p in parts)
    ):
        raise SlimtorchError(f"companion file {name!r}: not a relative name inside the output folder")
    target = staging.joinpath(*parts)
    if target.exists():
        raise SlimtorchError(f"companion file {name!r} would replace the weights written under that name")
    return target


def clear_stale_temps(out: Path) -> list[Path]:
    """Remove what an earlier, interrupted write of ``out`` left beside it (``.slimtorch-tmp-<name>-<id>``
    and ``-old-<id>``, modified before this process started); returns what was removed.

    Example:
        >>> clear_stale_temps(Path("out/model.safetensors"))  # doctest: +SKIP
        [PosixPath('out/.slimtorch-tmp-model.safetensors-1a2b3c4d')]
    """
    pattern = re.compile(re.escape(f"{TEMP_PREFIX}{out.name}") + r"(-old)?-[0-9a-f]{8}")
    removed = []
    for path in out.parent.glob(f"{TEMP_PREFIX}*"):
        if not pattern.fullmatch(path.name) or path.lstat().st_mtime >= STARTED:
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        removed.append(path)
    return removed


def _fsync_dir(folder: Path) -> None:
    with contextlib.suppress(OSError):  # not every platform lets a folder be opened
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def replace_folder(staged: Path, target: Path) -> None:
    """Make the folder ``staged`` become ``target``: a rename, or an atomic exchange when ``target`` exists
    (the caller has checked that ``target`` may be replaced)."""
    if target.is_symlink():  # an exchange would swap the link itself, and leave it behind as `staged`
        raise SlimtorchError(f"{target}: is a symbolic link; give the path it points to")
    if not target.exists():
        os.rename(staged, target)
    else:
        if not _exchange(staged, target):
            # No atomic exchange here: move the old folder aside first, so it survives an interruption.
            aside = target.with_name(f"{TEMP_PREFIX}{target.name}-old-{uuid.uuid4().hex[:8]}")
            os.rename(target, aside)
            os.rename(staged, target)
            staged = aside
        shutil.rmtree(staged, ignore_errors=True)
    _fsync_dir(target.parent)


def check_replaceable(target: Path, companions: Iterable[str] = ()) -> None:
    """Refuse to replace a folder unless it holds only a slim checkpoint: slim shards, their index and the
    companion files a new checkpoint brings again (``1_Pooling/config.json`` in its sub-folder, the model
    card), all plain files. Anything else (a folder or file of another name, even one ending in
    ``.index.json``) may be the user's work."""
    if target.is_symlink():
        raise SlimtorchError(f"{target}: is a symbolic link; give the path it points to")
    if not target.exists():
        return
    if not target.is_dir():
        raise SlimtorchError(f"{target}: exists and is not a folder")
    entries = list(target.iterdir())
    weights = [p for p in entries if p.suffix == ".safetensors"]
    if entries and not (weights and all(p.is_file() and is_slim(read_metadata(p)) for p in weights)):
        raise SlimtorchError(
            f"{target}: exists and is not a slimtorch checkpoint; refusing to replace it (pick another -o)"
        )
    known = {*companions, INDEX_NAME}
    stray = _stray(target, [p for p in entries if p.suffix != ".safetensors"], known)
    if stray:
        raise SlimtorchError(
            f"{target}: holds {stray[0]!r}, which a new checkpoint would not keep; refusing to replace the "
            "folder (move the file or pick another -o)"
        )


def _plain_file(path: Path) -> bool:
    return path.is_file() and not path.is_symlink()


def _stray(root: Path, entries: list[Path], known: set[str]) -> list[str]:
    """Names under ``root`` (from ``entries`` down) that are not ``known`` plain files: sub-folders are
    looked into only where a known name lies."""
    folders = {str(parent) for name in known for parent in PurePosixPath(name).parents} - {"."}
    stray, pending = [], list(entries)
    while pending:
        path = pending.pop()
        name = path.relative_to(root).as_posix()
        if name in folders and path.is_dir() and not path.is_symlink():
            pending.extend(path.iterdir())
        elif not (name in known and _plain_file(path)):
            stray.append(name)
    return sorted(stray)


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths with renameat2(RENAME_EXCHANGE); False where that is not available."""
    libc_name = ctypes.util.find_library("c")
    if not libc_name:
        return False
    libc = ctypes.CDLL(libc_name, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    return renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0
