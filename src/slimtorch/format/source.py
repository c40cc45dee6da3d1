"""TensorSource: a lazy, read-only view of the tensors in a checkpoint, whatever its format.

Readers parse only the small structural part of a file (a pickle, a JSON header) and describe every tensor by
a :class:`TensorInfo` and every physical storage by a :class:`StorageLocation` (which file, which byte range).
Tensor data is read only when :meth:`TensorSource.get` asks for it, and then by memory-mapping the file: the
pages come from the page cache, not from anonymous memory, and nothing is copied unless the bytes are
misaligned for their dtype.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch

from slimtorch.errors import FormatError
from slimtorch.format.shard_read import ShardRead, Span, read_region, region


@dataclass(frozen=True)
class StorageLocation:
    """Where the bytes of one physical storage lie: ``nbytes`` bytes at ``offset`` in ``file``."""

    file: Path
    offset: int
    nbytes: int


@dataclass(slots=True)
class StoredChunk:
    """One checksummed chunk of a stored part, as a file-wide check sees it: where it lies, and the CRC-32
    the file records for it."""

    file: Path
    offset: int
    """Where the chunk starts in ``file``."""
    length: int
    expected: int
    tensor: str
    """The logical tensor whose part it is (named in a mismatch)."""
    part: str
    start: int
    """Where the chunk starts in its part."""


@dataclass(frozen=True)
class TensorInfo:
    """What a checkpoint says about one tensor, without its data.

    ``storage`` names the physical storage the tensor lives in: tensors with the same ``storage`` share
    memory (tied weights, views). ``storage_offset`` is the byte offset of the tensor's first element in
    that storage. ``role`` is "parameter" or "buffer" where the file records it (TorchScript, a pickled
    nn.Parameter), None where it does not say.
    """

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage: str
    storage_offset: int
    storage_nbytes: int
    role: str | None = None
    codec: str = "raw"
    stored_nbytes: int | None = None
    """Bytes the tensor takes in the file when a codec stores it in another form (None: ``nbytes``)."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor's own elements (what a dense copy of it would take)."""
        return self.numel * self.itemsize

    @property
    def span(self) -> tuple[int, int]:
        """Byte range ``[start, end)`` of the storage that the tensor's elements touch."""
        if self.stored_nbytes is not None:
            return (self.storage_offset, self.storage_offset + self.stored_nbytes)
        if self.numel == 0:
            return (self.storage_offset, self.storage_offset)
        last = sum((size - 1) * step for size, step in zip(self.shape, self.stride, strict=True))
        return (self.storage_offset, self.storage_offset + (last + 1) * self.itemsize)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "dtype": dtype_name(self.dtype),
            "shape": list(self.shape),
            "nbytes": self.nbytes,
            "storage": self.storage,
            "role": self.role,
            "codec": self.codec,
        }


@dataclass(frozen=True)
class ObjectInfo:
    """A non-tensor value found in a checkpoint (an epoch counter, a learning rate, a config entry)."""

    name: str
    type: str
    summary: str

    def to_dict(self) -> dict[str, str]:
        return {"name": self.name, "type": self.type, "summary": self.summary}


@dataclass(frozen=True)
class FileRest:
    """What of a loaded file the model does not hold: the wrapper prefix its names were read under
    (``bert.``) and the file names it did not load (a custom head beside a transformers body, a pooler
    its class lacks). A command writing the folder back writes these too, so that the output still fits
    the class the file was made for, not only the one slimtorch built."""

    path: Path | None = None
    prefix: str = ""
    names: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.prefix or self.names)


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``."""
    return str(dtype).removeprefix("torch.")


MAX_DIMS = 64
"""The most dimensions a tensor from a file may have (torch's own kernels stop at 25): a shape of 150,000
ones is a CPU bomb for every walk over it, not a tensor."""
INT64_MAX = 2**63 - 1


def shape_problem(shape: Sequence[object]) -> str | None:
    """Why ``shape`` cannot be a tensor's (None when it can), checked before any product over it.

    torch counts elements in int64: every size, and the product of the non-zero ones, must fit (``[10**30,
    0]`` holds no element, but torch cannot build it).

    Example:
        >>> shape_problem([10**30, 0])
        'size 1000000000000000000000000000000 is beyond int64'
    """
    if len(shape) > MAX_DIMS:
        return f"{len(shape)} dimensions, more than the {MAX_DIMS} allowed"
    count = 1
    for size in shape:
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            return f"size {size!r} is not a non-negative integer"
        if size > INT64_MAX:
            return f"size {size} is beyond int64"
        count *= size or 1
        if count > INT64_MAX:
            return f"{list(shape)} holds more elements than int64 can count"
    return None


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """Row-major strides of ``shape`` (``math.prod(shape[i + 1:])`` each) in one pass, not D products."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def check_tensor_fits(path: str | Path, info: TensorInfo) -> None:
    """Refuse a tensor whose shape or strides reach outside its storage (a corrupt or hostile file)."""
    problem = shape_problem(info.shape)
    if problem:
        raise FormatError(path, f"tensor {info.name!r}: shape refused ({problem})")
    if any(step < 0 for step in info.stride):
        raise FormatError(path, f"tensor {info.name!r} has a negative size or stride {info.shape}")
    if len(info.shape) != len(info.stride):
        raise FormatError(
            path, f"tensor {info.name!r} has {len(info.shape)} sizes but {len(info.stride)} strides"
        )
    start, end = info.span
    if start < 0 or end > info.storage_nbytes:
        raise FormatError(
            path,
            f"tensor {info.name!r} {list(info.shape)} needs bytes {start}..{end} of a storage "
            f"of {info.storage_nbytes} bytes",
        )


def check_storage_fits(path: str | Path, where: str, location: StorageLocation) -> None:
    """Refuse a storage that claims bytes beyond the end of its file (truncated or absurd sizes)."""
    size = os.path.getsize(location.file)
    if location.offset < 0 or location.nbytes < 0 or location.offset + location.nbytes > size:
        raise FormatError(
            path,
            f"{where} claims {location.nbytes} bytes at offset {location.offset}, but the file has only "
            f"{size} bytes (truncated or corrupt)",
        )


@dataclass
class TensorSource:
    """A lazy, read-only view of one checkpoint: its tensors' names, dtypes, shapes and storages.

    Build one with :func:`slimtorch.open`. Nothing but the file's structure is read up front; each
    :meth:`get` maps the tensor's bytes from the file on demand.

    Example:
        >>> import slimtorch
        >>> with slimtorch.open("model.safetensors") as source:  # doctest: +SKIP
        ...     for info in source.infos():
        ...         print(info.name, info.dtype, info.shape)
        ...     weight = source.get("fc.weight")
    """

    path: Path
    format: str
    tensors: list[TensorInfo]
    locations: dict[str, StorageLocation]
    objects: list[ObjectInfo] = field(default_factory=list)
    files: list[Path] = field(default_factory=list)
    structure_bytes: int = 0
    """Bytes of the serialized structure around the tensors (pickle stream, JSON header, index)."""
    tree: Any = field(default=None, repr=False)
    """The checkpoint's object as unpickled, tensors as meta tensors (a slim file: its stored objects);
    None for formats without one. :func:`slimtorch.load_objects` reads its plain data."""
    verify: bool = True
    """Check stored checksums on every read (formats without checksums have nothing to check)."""
    _by_name: dict[str, TensorInfo] = field(init=False, repr=False)
    _maps: dict[Path, torch.UntypedStorage] = field(init=False, repr=False, default_factory=dict)

    def __post_init__(self) -> None:
        self._by_name = {}
        for info in self.tensors:
            if info.name in self._by_name:
                raise FormatError(self.path, f"tensor {info.name!r} appears twice")
            if info.storage not in self.locations:
                raise FormatError(
                    self.path, f"tensor {info.name!r} refers to a storage the file does not hold"
                )
            self._by_name[info.name] = info
        if not self.files:
            self.files = sorted({loc.file for loc in self.locations.values()}) or [self.path]

    # -- what is in the file ---------------------------------------------------------------------------
    @property
    def file_bytes(self) -> int:
        """Bytes on disk of every file this source reads."""
        return sum(os.path.getsize(f) for f in self.files)

    # -- what the format stores besides tensors: plain formats have none of it; slim files override ------
    @property
    def coded(self) -> bool:
        """Whether tensors are stored through slimtorch's codecs (parts, checksums, ties, a delta): a slim
        file. Other formats store every tensor as one raw part, under its own name."""
        return False

    def ties(self) -> Mapping[str, str]:
        """Name -> the name whose tensor it shares, as the file records it. Plain formats record none: their
        ties are names on the same view of one storage (see :class:`TensorInfo`)."""
        return {}

    def copies(self) -> Mapping[str, str]:
        """Name -> the name holding equal values, stored once but loaded as a separate tensor."""
        return {}

    def delta(self) -> Mapping[str, Any] | None:
        """The structural delta the file records (JSON, unchecked), or None."""
        return None

    def as_stored(self, name: str) -> torch.Tensor | None:
        """Tensor ``name`` mapped from the file, checksums left to the caller, where the reader knows it is
        stored as is (a slim file's raw tensors); None: read it with :meth:`get`."""
        return None

    def codec(self, name: str) -> str:
        """The codec chain tensor ``name`` is stored with (``"raw"``, ``"int8"``, ``"sparse+zstd"`` ...)."""
        self.info(name)
        return "raw"

    def stages(self, name: str) -> list[dict[str, Any]]:
        """The codec stages tensor ``name`` went through, first first, as the file records them (``[]``:
        stored as is, as plain formats store every tensor)."""
        self.info(name)
        return []

    def part(self, name: str, role: str) -> torch.Tensor:
        """Part ``role`` of tensor ``name`` as the first codec stage made it (a quantized layer's codes or
        scales), never decoded further; a plain format's tensor is its one part, role ``""``."""
        parts = self.parts(name)
        if role not in parts:
            raise KeyError(f"{self.path}: tensor {name!r} has no part {role!r}")
        return parts[role]

    def parts(self, name: str) -> dict[str, torch.Tensor]:
        """The stored parts of tensor ``name`` by role, mapped from the file (and verified where the format
        has checksums); a plain format's tensor is its one part, role ``""``."""
        return {"": self.get(name)}

    def checks(self, name: str, parts: Mapping[str, torch.Tensor]) -> list[Callable[[], int]]:
        """The checksum checks of tensor ``name``'s ``parts``, mapped with ``verify`` off, for a caller that
        runs them later or on other threads: each returns the bytes it read, or raises
        :class:`~slimtorch.errors.FormatError` naming the tensor. Formats without checksums have none."""
        return []

    def stored_chunks(self) -> list[StoredChunk]:
        """Every checksummed chunk of every stored part, in file order, for a check of the whole file
        (:meth:`slimtorch.loading.verification.Verification.watch`). Formats without checksums have none."""
        return []

    def decode_parts(self, name: str, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        """Tensor ``name`` from its :meth:`parts`."""
        return parts[""]

    def names(self) -> list[str]:
        """Tensor names in file order."""
        return [info.name for info in self.tensors]

    def infos(self) -> list[TensorInfo]:
        return list(self.tensors)

    def info(self, name: str) -> TensorInfo:
        try:
            return self._by_name[name]
        except KeyError:
            raise KeyError(f"{self.path}: no tensor named {name!r}") from None

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self.tensors)

    # -- data, on demand ---------------------------------------------------------------------------------
    def storage_bytes(self, storage: str) -> torch.Tensor:
        """The raw bytes of one physical storage as a uint8 tensor mapped from the file."""
        view = self._storage(storage)
        return torch.empty(0, dtype=torch.uint8).set_(view, 0, (view.nbytes(),), (1,))

    def _storage(self, storage: str) -> torch.UntypedStorage:
        """One physical storage's bytes, mapped from the file (a storage of their own: tensors of two
        storages never look like views of each other, as they would as views of one file-wide storage)."""
        location = self.locations[storage]
        mapped = self._mapped(location.file)
        if location.offset + location.nbytes > mapped.nbytes():
            raise FormatError(
                location.file, f"storage {storage!r} ends past the end of the file (truncated?)"
            )
        return mapped[location.offset : location.offset + location.nbytes]

    def mapped_range(self, file: Path, start: int, stop: int) -> torch.Tensor:
        """Bytes ``[start, stop)`` of ``file`` (one of :attr:`files`) as a uint8 tensor, in the same mapping
        that :meth:`get` takes tensors from: checking these bytes checks theirs."""
        mapped = self._mapped(file)
        if not 0 <= start <= stop <= mapped.nbytes():
            raise FormatError(file, f"bytes {start}..{stop} are past the end of the file (truncated?)")
        return torch.empty(0, dtype=torch.uint8).set_(mapped[start:stop], 0, (stop - start,), (1,))

    def _mapped(self, file: Path) -> torch.UntypedStorage:
        mapped = self._maps.get(file)
        if mapped is None:
            size = os.path.getsize(file)
            # shared=False maps the file copy-on-write: reads come from the page cache and a caller that
            # writes into a returned tensor never changes the file.
            opened = torch.UntypedStorage.from_file(str(file), shared=False, nbytes=size)
            mapped = cast(torch.UntypedStorage, opened)  # torch annotates it on the base class of storages
            self._maps[file] = mapped
        return mapped

    def get(self, name: str) -> torch.Tensor:
        """Tensor ``name``, mapped from the file (zero-copy where its bytes are aligned).

        Writing into the result never changes the file.
        """
        return self._map(self.info(name))

    def _map(self, info: TensorInfo) -> torch.Tensor:
        raw = self._storage(info.storage)
        if raw.data_ptr() % max(info.itemsize, 1):
            raw = raw.clone()  # a legacy file can place a storage at an odd offset; kernels want alignment
        out = torch.empty(0, dtype=info.dtype)
        return out.set_(raw, info.storage_offset // info.itemsize, info.shape, info.stride)

    def read_into(
        self, name: str, out: torch.Tensor, *, rows: Span | None = None, cols: Span | None = None
    ) -> ShardRead:
        """Read rows ``rows`` (None: all) and columns ``cols`` (dim 1; None: all) of tensor ``name`` into
        ``out`` with ``pread``, never mapping the file: a sharded load keeps only its own bytes in memory.
        ``out`` takes the region's shape; its dtype may differ (converted, as ``copy_`` does).

        Example:
            >>> shard = torch.empty(500, 1024)
            >>> source.read_into("fc.weight", shard, rows=(500, 1000)).bytes_read  # doctest: +SKIP
            2048000
        """
        info = self.info(name)
        rows, cols, shape = region(info.shape, rows, cols)
        if tuple(out.shape) != shape:
            raise ValueError(f"{name}: the region is {list(shape)}, the tensor given {list(out.shape)}")
        if info.stride != contiguous_strides(info.shape):  # a legacy view: its rows are not together
            where = (slice(*rows), *([slice(*cols)] if cols else []))
            out.copy_(self.get(name)[where])
            return ShardRead(info.nbytes, note=f"{name}: stored with strides {info.stride}, mapped")
        direct = out.dtype == info.dtype and out.is_contiguous() and out.device.type == "cpu"
        target = out if direct else torch.empty(shape, dtype=info.dtype)
        location = self.locations[info.storage]
        data = target.reshape(-1).view(torch.uint8).numpy().data if target.numel() else memoryview(b"")
        read_region(
            location.file, location.offset + info.storage_offset, info.shape, info.itemsize, rows, cols, data
        )
        if not direct:
            out.copy_(target)
        return ShardRead(len(data))

    def get_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``start:stop`` of tensor ``name`` (its first dimension), reading only their bytes.

        The result is a view of the file mapping: pages outside those rows are never touched.

        Example:
            >>> with slimtorch.open("model.safetensors") as source:  # doctest: +SKIP
            ...     shard = source.get_rows("embed.weight", 0, 1000)  # the first 1000 embeddings
        """
        info = self.info(name)
        if not info.shape:
            raise ValueError(f"tensor {name!r} is 0-d: it has no rows")
        return self.get(name)[start:stop]

    def close(self) -> None:
        """Drop the file mappings (tensors already returned keep theirs alive)."""
        self._maps.clear()

    def __enter__(self) -> TensorSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
