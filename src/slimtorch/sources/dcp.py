"""torch.distributed.checkpoint (DCP) folders: a ``.metadata`` pickle and ``__<rank>_<n>.distcp`` files.

``.metadata`` lists every tensor of the saved state dict with its global shape and the chunks the ranks
saved of it, and where each chunk's bytes lie (a file, an offset, a length). torch reads it with
``pickle.load``, which runs whatever a pickle says. Here it is rewritten to protocol 2
(:mod:`~slimtorch.sources.pickle_protocol`), checked against the pickle budget and unpickled by torch's
weights-only unpickler with DCP's metadata classes allowed, for this file only (:func:`dcp_globals`). Each
chunk is a complete torch.save archive inside a byte window of a ``.distcp`` file, read like any torch.save
file: its pickle weights-only, its tensor on meta, its bytes mapped from the file.

The source shows the *logical* tensors, as the saved state dict held them: :meth:`DcpSource.get` assembles a
tensor from its chunks, :meth:`DcpSource.get_rows` reads only the chunks holding those rows. Non-tensor
values (``BytesStorageMetadata``) are objects, unpickled the same weights-only way (torch's own planner
unpickles them with ``weights_only=False``).
"""

from __future__ import annotations

import itertools
import math
import pathlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from slimtorch.errors import FormatError, SlimtorchError
from slimtorch.format.source import (
    ObjectInfo,
    StorageLocation,
    TensorInfo,
    TensorSource,
    contiguous_strides,
    shape_problem,
)
from slimtorch.sources.objects import short_repr
from slimtorch.sources.pickle_budget import MAX_PICKLE_BYTES
from slimtorch.sources.pickle_protocol import downgrade_pickle
from slimtorch.sources.pickled import MetaStorages, describe_tensors, unpickle
from slimtorch.sources.zip_archive import locate_storage, open_archive, persistent_load, read_entry

METADATA = ".metadata"
DATA_FILES = "__*_*.distcp"
_METADATA_CLASSES = (
    *("Metadata", "TensorStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING"),
    *("ChunkStorageMetadata", "BytesStorageMetadata", "MetadataIndex", "StorageMeta"),
)
_PATHS = {"PosixPath": pathlib.PurePosixPath, "WindowsPath": pathlib.PureWindowsPath}
"""``StorageMeta.checkpoint_id`` is the path the folder was saved to: read as a pure path (no file access,
and a Windows path can be read on Linux), under the names Python 3.11 to 3.13 pickle it with."""


def looks_like_dcp(folder: Path) -> bool:
    """Whether ``folder`` holds a DCP checkpoint: a ``.metadata`` file and ``__<rank>_<n>.distcp`` files."""
    return (folder / METADATA).is_file() and any(folder.glob(DATA_FILES))


def dcp_globals() -> list[tuple[Any, str]]:
    """(object, dotted name) of every global a DCP ``.metadata`` pickle names beyond torch's own list: the
    metadata dataclasses, the file reader's ``_StorageInfo`` and paths. This reader's allow-list only, never
    added to ``--allow-global``'s; importing them imports ``torch.distributed.checkpoint`` (about 1 s)."""
    try:
        from torch.distributed.checkpoint import filesystem, metadata
    except (ImportError, RuntimeError) as exc:
        raise SlimtorchError(
            f"reading a torch.distributed.checkpoint folder needs torch.distributed, which this torch lacks "
            f"({exc})"
        ) from None
    found = [(getattr(metadata, name), f"{metadata.__name__}.{name}") for name in _METADATA_CLASSES]
    found.append((filesystem._StorageInfo, f"{filesystem.__name__}._StorageInfo"))
    for name, pure in _PATHS.items():
        for module in ("pathlib", "pathlib._local"):
            found += [(pure, f"{module}.{name}"), (pure, f"{module}.Pure{name}")]
    return found


@dataclass(frozen=True)
class Item:
    """Where one saved item lies: ``length`` bytes at ``offset`` of ``file`` (a torch.save archive)."""

    file: Path
    offset: int
    length: int


@dataclass(frozen=True)
class Chunk:
    """One saved chunk of a logical tensor: where it sits in the tensor, and its bytes as a tensor of its own
    (``info``, whose storage is in the source's ``locations``)."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    info: TensorInfo


@dataclass(frozen=True)
class _Saved:
    """A tensor as ``.metadata`` describes it: dtype, global shape, its chunks' offsets and sizes."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    chunks: list[tuple[tuple[int, ...], tuple[int, ...]]]


@dataclass
class DcpSource(TensorSource):
    """A DCP checkpoint folder's logical tensors, each assembled from the chunks the ranks saved.

    Example:
        >>> with slimtorch.open("checkpoints/step-1000") as source:  # doctest: +SKIP
        ...     source.get_rows("layers.0.mlp.weight", 0, 128)  # reads only the chunks holding those rows
    """

    chunks: dict[str, list[Chunk]] = field(default_factory=dict)

    def get(self, name: str) -> torch.Tensor:
        """Tensor ``name``: mapped from the file when one chunk holds all of it, else assembled."""
        info = self.info(name)
        chunks = self.chunks[name]
        if len(chunks) == 1 and chunks[0].sizes == info.shape:
            return self._map(chunks[0].info)
        return self._assemble(info, 0, info.shape[0] if info.shape else 0)

    def get_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``start:stop`` of tensor ``name``, read from the chunks that hold them only."""
        info = self.info(name)
        if not info.shape:
            raise ValueError(f"tensor {name!r} is 0-d: it has no rows")
        start, stop, _ = slice(start, stop).indices(info.shape[0])
        return self._assemble(info, start, max(start, stop))

    def storage_bytes(self, storage: str) -> torch.Tensor:
        """A chunk's bytes as mapped; a logical tensor's (its storage named ``tensor:<name>``) assembled."""
        name = storage.removeprefix("tensor:")
        if storage.startswith("tensor:") and name in self.chunks:
            return self.get(name).contiguous().reshape(-1).view(torch.uint8)
        return super().storage_bytes(storage)

    def _assemble(self, info: TensorInfo, start: int, stop: int) -> torch.Tensor:
        out = torch.empty((stop - start, *info.shape[1:]) if info.shape else (), dtype=info.dtype)
        for chunk in self.chunks[info.name]:
            if not info.shape:
                out.copy_(self._map(chunk.info))
                continue
            first, end = chunk.offsets[0], chunk.offsets[0] + chunk.sizes[0]
            low, high = max(start, first), min(stop, end)
            if low >= high:
                continue
            rest = (slice(o, o + s) for o, s in zip(chunk.offsets[1:], chunk.sizes[1:], strict=True))
            where = (slice(low - start, high - start), *rest)
            out[where] = self._map(chunk.info)[low - first : high - first]
        return out


def open_dcp(folder: Path, trusted: list[tuple[Any, str]]) -> DcpSource:
    """Read a DCP checkpoint folder lazily: its ``.metadata`` checked and unpickled without running code,
    every chunk located in its ``.distcp`` file. ``trusted``: the globals the user allows (``--allow-global``)
    for the saved values, beyond DCP's own classes."""
    metadata_path = folder / METADATA
    metadata = _read_metadata(metadata_path, trusted)
    tensors, names = _entries(metadata_path, metadata)
    items = _items(folder, metadata_path, metadata, tensors, names)
    infos, locations = [], {}
    chunks: dict[str, list[Chunk]] = {}
    structure = metadata_path.stat().st_size
    for name, saved in tensors.items():
        _check_tiling(metadata_path, name, saved)
        chunks[name] = []
        for offsets, sizes in saved.chunks:
            info, location, pickled = _read_chunk(items[name, offsets], name, saved.dtype, sizes, trusted)
            chunks[name].append(Chunk(offsets, sizes, info))
            locations[info.storage] = location
            structure += pickled
        nbytes = math.prod(saved.shape) * saved.dtype.itemsize
        strides = contiguous_strides(saved.shape)
        logical = TensorInfo(name, saved.dtype, saved.shape, strides, f"tensor:{name}", 0, nbytes)
        locations[logical.storage] = StorageLocation(folder, 0, logical.nbytes)  # assembled, never mapped
        infos.append(logical)
    objects, tree = [], {}
    for name in names:
        tree[name] = _read_object(items[name, None], trusted)
        objects.append(ObjectInfo(name, type(tree[name]).__name__, short_repr(tree[name])))
        structure += items[name, None].length
    files = sorted({item.file for item in items.values()})
    count = sum(len(c) for c in chunks.values())
    shape = (
        f"{_count(len(infos), 'tensor')} in {_count(count, 'chunk')}, {_count(len(files), '.distcp file')}"
    )
    return DcpSource(
        folder,
        f"dcp ({shape})",
        infos,
        locations,
        objects,
        [metadata_path, *files],
        structure_bytes=structure,
        tree=tree,
        chunks=chunks,
    )


def _count(number: int, what: str) -> str:
    return f"{number} {what}{'' if number == 1 else 's'}"


def _read_metadata(path: Path, trusted: list[tuple[Any, str]]) -> Any:
    if path.resolve().parent != path.parent.resolve():
        raise FormatError(path, "refused: a symbolic link out of the folder, which slimtorch does not follow")
    size = path.stat().st_size
    if size > MAX_PICKLE_BYTES:
        raise FormatError(path, f"refused pickle: {size:,} bytes, more than {MAX_PICKLE_BYTES:,}")
    data = path.read_bytes()
    return unpickle(path, downgrade_pickle(data, path), trusted=[*dcp_globals(), *trusted])


def _entries(path: Path, metadata: Any) -> tuple[dict[str, _Saved], list[str]]:
    """The tensors (checked) and the names of non-tensor values ``.metadata`` lists."""
    from torch.distributed.checkpoint import metadata as classes

    entries = getattr(metadata, "state_dict_metadata", None)
    if not isinstance(metadata, classes.Metadata) or not isinstance(entries, dict):
        raise FormatError(path, "not a torch.distributed.checkpoint Metadata")
    tensors: dict[str, _Saved] = {}
    names: list[str] = []
    for name, entry in entries.items():
        if not isinstance(name, str) or not name:
            raise FormatError(path, f"a saved value is named {short_repr(name)}, not a non-empty string")
        if isinstance(entry, classes.BytesStorageMetadata):
            names.append(name)
        elif isinstance(entry, classes.TensorStorageMetadata):
            tensors[name] = _saved(path, name, entry)
        else:
            raise FormatError(path, f"{name!r} is described by a {type(entry).__name__}, not a DCP entry")
    return tensors, names


def _saved(path: Path, name: str, entry: Any) -> _Saved:
    dtype = getattr(getattr(entry, "properties", None), "dtype", None)
    if not isinstance(dtype, torch.dtype):
        raise FormatError(path, f"tensor {name!r}: dtype {short_repr(dtype)} is not a torch dtype")
    shape = _ints(path, name, "size", getattr(entry, "size", None))
    problem = shape_problem(shape)
    if problem:
        raise FormatError(path, f"tensor {name!r}: shape refused ({problem})")
    chunks = getattr(entry, "chunks", None)
    if not isinstance(chunks, list) or not chunks:
        raise FormatError(path, f"tensor {name!r}: no list of saved chunks")
    found = []
    for chunk in chunks:
        offsets = _ints(path, name, "chunk offsets", getattr(chunk, "offsets", None))
        sizes = _ints(path, name, "chunk sizes", getattr(chunk, "sizes", None))
        if len(offsets) != len(shape) or len(sizes) != len(shape):
            raise FormatError(path, f"tensor {name!r}: a chunk of {len(sizes)} dimensions in {list(shape)}")
        found.append((offsets, sizes))
    return _Saved(dtype, shape, found)


def _ints(path: Path, name: str, what: str, value: Any) -> tuple[int, ...]:
    if not isinstance(value, tuple) or not all(type(v) is int and v >= 0 for v in value):
        raise FormatError(path, f"tensor {name!r}: {what} {short_repr(value)} are not non-negative integers")
    return tuple(value)


def _check_tiling(path: Path, name: str, saved: _Saved) -> None:
    """Refuse chunks that reach outside the tensor, overlap, or leave part of it unsaved.

    Inside and disjoint, they tile the tensor exactly when their sizes add up to its size. Disjointness is
    a sweep along the dimension the chunks are cut on most, so FSDP or TP shards cost linear time."""
    total = 0
    for offsets, sizes in saved.chunks:
        if any(o + s > g for o, s, g in zip(offsets, sizes, saved.shape, strict=True)):
            raise FormatError(
                path,
                f"tensor {name!r}: chunk {list(sizes)} at {list(offsets)} reaches outside "
                f"{list(saved.shape)}",
            )
        total += math.prod(sizes)
    dims = range(len(saved.shape))
    axis = max(dims, key=lambda d: len({o[d] for o, _ in saved.chunks}), default=None)
    boxes = sorted(
        (c for c in saved.chunks if math.prod(c[1])), key=lambda c: 0 if axis is None else c[0][axis]
    )
    for i, (offsets, sizes) in enumerate(boxes):
        for other, other_sizes in boxes[i + 1 :]:
            if axis is not None and other[axis] >= offsets[axis] + sizes[axis]:
                break
            if all(
                b < a + s and a < b + t for a, s, b, t in zip(offsets, sizes, other, other_sizes, strict=True)
            ):
                raise FormatError(
                    path,
                    f"tensor {name!r}: chunks at {list(offsets)} and {list(other)} overlap (corrupt file)",
                )
    if total != math.prod(saved.shape):
        raise FormatError(
            path,
            f"tensor {name!r}: its chunks hold {total:,} of its {math.prod(saved.shape):,} elements "
            "(a rank's file is missing from the metadata?)",
        )


def _items(
    folder: Path, path: Path, metadata: Any, tensors: dict[str, _Saved], names: list[str]
) -> dict[tuple[str, tuple[int, ...] | None], Item]:
    """Where each chunk and value lies, keyed by (name, chunk offsets; None for a value): every file inside
    the folder, every item inside its file, no two items sharing bytes, none missing and none extra."""
    from torch.distributed.checkpoint import filesystem
    from torch.distributed.checkpoint import metadata as classes

    storage = getattr(metadata, "storage_data", None)
    if not isinstance(storage, dict):
        raise FormatError(path, "storage_data is not a dict (not a torch.distributed.checkpoint Metadata)")
    files: dict[str, Path] = {}
    items: dict[tuple[str, tuple[int, ...] | None], Item] = {}
    for index, where in storage.items():
        if not isinstance(index, classes.MetadataIndex) or not isinstance(where, filesystem._StorageInfo):
            raise FormatError(path, f"storage_data holds {type(index).__name__}: {type(where).__name__}")
        name, offset = index.fqn, index.offset
        key = (name, None if offset is None else _ints(path, name, "item offset", offset))
        item = _item(folder, path, name, where, files)
        items[key] = item
    wanted: list[tuple[str, tuple[int, ...] | None]]
    wanted = [(n, offsets) for n, saved in tensors.items() for offsets, _ in saved.chunks]
    wanted += [(n, None) for n in names]
    for key in wanted:
        if key not in items:
            raise FormatError(path, f"{key[0]!r}: no file holds its chunk at {list(key[1] or ())}")
    if len(items) != len(wanted):
        stray = next(key for key in items if key not in set(wanted))
        raise FormatError(path, f"storage for {stray[0]!r}, which no saved value lists (corrupt metadata)")
    _check_disjoint(path, items)
    return items


def _item(folder: Path, path: Path, name: str, where: Any, files: dict[str, Path]) -> Item:
    relative, offset, length = (getattr(where, k, None) for k in ("relative_path", "offset", "length"))
    transforms = getattr(where, "transform_descriptors", None)
    if transforms:
        raise FormatError(
            path, f"{name!r} is stored through stream transforms {short_repr(transforms)}, not read yet"
        )
    if not isinstance(relative, str) or type(offset) is not int or type(length) is not int:
        raise FormatError(path, f"{name!r}: its storage entry is not a file, an offset and a length")
    if relative not in files:
        files[relative] = _data_file(folder, path, relative)
    file = files[relative]
    size = file.stat().st_size
    if offset < 0 or length < 0 or offset + length > size:
        raise FormatError(
            path, f"{name!r}: {length:,} bytes at offset {offset:,} of {relative}, a file of {size:,} bytes"
        )
    return Item(file, offset, length)


def _data_file(folder: Path, path: Path, relative: str) -> Path:
    """``relative`` as a file of the folder: a bare name, a regular file, not a link out of the folder."""
    file = folder / relative
    if Path(relative).name != relative or relative in ("", ".", ".."):
        raise FormatError(path, f"refused: a data file named {relative[:80]!r}, outside the folder")
    if not file.is_file() or file.resolve().parent != folder.resolve():
        raise FormatError(path, f"refused: data file {relative[:80]!r} is missing or links out of the folder")
    with open(file, "rb") as stream:
        head = stream.read(9)
    if len(head) == 9 and head[8:9] == b"{":
        raise FormatError(file, "saved with DCP's SerializationFormat.SAFETENSORS, which is not read yet")
    return file


def _check_disjoint(path: Path, items: dict[tuple[str, tuple[int, ...] | None], Item]) -> None:
    ordered = sorted(items.items(), key=lambda kv: (kv[1].file, kv[1].offset))
    for (name, item), (other, next_item) in itertools.pairwise(ordered):
        if item.file == next_item.file and next_item.offset < item.offset + item.length:
            raise FormatError(
                path,
                f"{name[0]!r} and {other[0]!r} share bytes at offset {next_item.offset:,} of "
                f"{item.file.name} (corrupt metadata)",
            )


def _read_chunk(
    item: Item, name: str, dtype: torch.dtype, sizes: tuple[int, ...], trusted: list[tuple[Any, str]]
) -> tuple[TensorInfo, StorageLocation, int]:
    """The chunk's tensor as saved (checked against what ``.metadata`` says), its storage's bytes in the
    ``.distcp`` file, and the bytes of its pickle."""
    window = (item.offset, item.length)
    with open_archive(item.file, window) as (archive, root):
        data = read_entry(archive, f"{root}/data.pkl", item.file)
        storages = MetaStorages(item.file)
        tensor = unpickle(item.file, data, persistent_load(item.file, storages), trusted=trusted)
        if not isinstance(tensor, torch.Tensor):
            raise FormatError(item.file, f"{name!r}: the item at byte {item.offset:,} is not a tensor")
        infos, locations = describe_tensors(
            item.file,
            [(name, tensor)],
            storages,
            lambda claim: locate_storage(item.file, archive, f"{root}/data", claim, window),
            storage_prefix=f"chunk:{item.file.name}@{item.offset}:",
        )
    info = infos[0]
    if info.dtype != dtype or info.shape != sizes:
        raise FormatError(
            item.file,
            f"{name!r}: the item at byte {item.offset:,} holds {info.dtype} {list(info.shape)}, the metadata "
            f"says {dtype} {list(sizes)}",
        )
    return info, locations[info.storage], len(data)


def _read_object(item: Item, trusted: list[tuple[Any, str]]) -> Any:
    """A saved non-tensor value, unpickled weights-only (tensors inside it come back on meta)."""
    with open_archive(item.file, (item.offset, item.length)) as (archive, root):
        data = read_entry(archive, f"{root}/data.pkl", item.file)
        return unpickle(item.file, data, persistent_load(item.file, MetaStorages(item.file)), trusted=trusted)
