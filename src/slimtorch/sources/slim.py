"""Slim checkpoints: safetensors files whose ``__metadata__["slimtorch"]`` describes coded tensors.

:class:`SlimSource` shows the *logical* tensors (what ``slimtorch.save`` was given) with their codec chain,
and decodes a tensor when asked, after checking the CRC-32 of every part it reads. Tensors stored as is
are mapped from the file without a copy, like any safetensors tensor. The physical parts stay visible in
:attr:`SlimSource.physical`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from slimtorch.errors import FormatError
from slimtorch.format.codecs import CodecError, decode
from slimtorch.format.codecs.chain import undo
from slimtorch.format.codecs.lossy import int4_layer_parts
from slimtorch.format.layout import (
    CHECKSUM_CHUNK,
    Entry,
    Layout,
    check_seal,
    chunk_checks,
    recorded_crcs,
)
from slimtorch.format.shard_read import ShardRead, Span
from slimtorch.format.source import (
    ObjectInfo,
    StorageLocation,
    StoredChunk,
    TensorInfo,
    TensorSource,
    contiguous_strides,
)
from slimtorch.sources import slim_regions
from slimtorch.sources.pickled import flatten

ROW_CODECS = ("raw", "int8", "int4")  # chains whose parts are stored row by row, first dim = the tensor's


@dataclass
class SlimSource(TensorSource):
    """A slim checkpoint (one file or a sharded folder); ``get`` decodes and verifies checksums."""

    layout: Layout = field(default_factory=Layout)
    physical: dict[str, TensorInfo] = field(default_factory=dict)
    """Physical parts by key, as a plain safetensors reader sees them (storage keys as in ``locations``)."""
    verify: bool = True
    hash_reads: bool = True
    """:meth:`read_into` hashes what it reads for the caller to check (False: no checksums, no cost)."""

    @property
    def coded(self) -> bool:
        return True

    def ties(self) -> Mapping[str, str]:
        return self.layout.ties

    def copies(self) -> Mapping[str, str]:
        return self.layout.copies

    def delta(self) -> Mapping[str, Any] | None:
        return self.layout.delta

    def codec(self, name: str) -> str:
        return self.entry(name).chain

    def stages(self, name: str) -> list[dict[str, Any]]:
        return list(self.entry(name).stages)

    def entry(self, name: str) -> Entry:
        """How tensor ``name`` is stored (for a tie or copy, the entry of the tensor it shares)."""
        name = self.layout.ties.get(name, self.layout.copies.get(name, name))
        try:
            return self.layout.tensors[name]
        except KeyError:
            raise KeyError(f"{self.path}: no tensor named {name!r}") from None

    def parts(self, name: str) -> dict[str, torch.Tensor]:
        """The stored parts of tensor ``name`` by role, mapped from the file and checksum-verified."""
        entry = self.entry(name)
        parts = {}
        for role, key in entry.parts.items():
            tensor = self._map(self.physical[key])
            if self.verify:
                _check_crc(self.path, entry, role, tensor)
            parts[role] = tensor
        return parts

    def checks(self, name: str, parts: Mapping[str, torch.Tensor]) -> list[Callable[[], int]]:
        """The CRC-32 checks of tensor ``name``'s ``parts`` as :meth:`parts` or :meth:`part` mapped them
        (with ``verify`` off), one :class:`~slimtorch.format.layout.ChunkCheck` per stored chunk."""
        entry = self.entry(name)
        return [
            check
            for role, tensor in parts.items()
            for check in chunk_checks(self.path, entry, role, tensor, chunk=CHECKSUM_CHUNK)
        ]

    def stored_chunks(self) -> list[StoredChunk]:
        """Every checksummed chunk of every stored part, in file order: what a file-wide check reads."""
        chunk = CHECKSUM_CHUNK
        found = []
        for entry in self.layout.tensors.values():
            for role, key in entry.parts.items():
                location = self.locations[self.physical[key].storage]
                expected = recorded_crcs(self.path, entry, role, location.nbytes, chunk)
                for i, crc in enumerate(expected):
                    at, length = i * chunk, min(chunk, location.nbytes - i * chunk)
                    where = (location.file, location.offset + at, length)
                    found.append(StoredChunk(*where, crc, entry.name, key, at))
        found.sort(key=lambda c: (str(c.file), c.offset))
        return found

    def part(self, name: str, role: str) -> torch.Tensor:
        """Part ``role`` of tensor ``name`` as the first codec stage made it (a quantized layer's codes or
        scales): mapped from the file and checksum-verified when stored as is, with any later lossless
        stage (``sparse``, ``zstd``) undone otherwise. Never dequantized."""
        entry = self.entry(name)
        packed = bool(entry.stages) and entry.stages[0].get("packing") is not None
        if len(entry.stages) <= 1 and role in entry.parts and not packed:
            tensor = self._map(self.physical[entry.parts[role]])
            if self.verify:
                _check_crc(self.path, entry, role, tensor)
            return tensor
        try:
            if packed:  # compressed-tensors' int4 words: the layer's nibbles, viewed; its zero point, made
                return int4_layer_parts(self.parts(name), entry.stages[0])[role]
            return undo(self.parts(name), entry.stages, keep=1)[role]
        except (CodecError, KeyError) as exc:
            raise FormatError(self.path, f"tensor {entry.name!r} has no part {role!r}: {exc}") from None

    def get_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``start:stop`` (of the first dimension) of tensor ``name``, reading only their bytes.

        Tensors stored as is, int8 and row-grouped int4 keep each row's bytes together, so only those
        parts' rows are mapped, checksum-verified (the 64 MiB chunks they fall in) and decoded. Other
        codecs decode the whole tensor first.
        """
        entry = self.entry(name)
        if not entry.shape:
            raise ValueError(f"tensor {name!r} is 0-d: it has no rows")
        start, stop, _ = slice(start, stop).indices(entry.shape[0])
        stop = max(start, stop)
        if not keeps_rows_apart(entry.chain, entry.stages, entry.shape):
            return self.get(name)[start:stop]
        parts = {}
        for role, key in entry.parts.items():
            whole = self._map(self.physical[key])
            row_bytes = whole[0].numel() * whole.element_size() if whole.dim() > 1 else whole.element_size()
            if self.verify:
                _check_crc(self.path, entry, role, whole, (start * row_bytes, stop * row_bytes))
            parts[role] = whole[start:stop]
        return slim_regions.decode_block(self.path, entry, parts, [stop - start, *entry.shape[1:]])

    def read_into(
        self, name: str, out: torch.Tensor, *, rows: Span | None = None, cols: Span | None = None
    ) -> ShardRead:
        """Rows and columns of tensor ``name`` into ``out`` with ``pread``, each stored part's region only
        (:func:`slimtorch.sources.slim_regions.read_into`), the bytes read hashed for the caller to check."""
        return slim_regions.read_into(self, name, out, rows=rows, cols=cols)

    def as_stored(self, name: str) -> torch.Tensor | None:
        """Tensor ``name`` mapped from the file when it is stored as is (one raw part in its own dtype and
        shape), its checksums left to the caller; None when it must be decoded (:meth:`get`)."""
        info = _stored_as_is(self.entry(name), self.physical)
        return None if info is None else self._map(info)

    def get(self, name: str) -> torch.Tensor:
        """Tensor ``name``, decoded (zero-copy for a tensor stored as is)."""
        self.info(name)  # a clear KeyError for unknown names
        return self.decode_parts(name, self.parts(name))

    def decode_parts(self, name: str, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        """Tensor ``name`` from its :meth:`parts`: the part itself when stored as is, else decoded."""
        entry = self.entry(name)
        if not entry.stages and set(parts) == {""}:
            tensor = parts[""]
            if tensor.dtype == entry.dtype and tuple(tensor.shape) == entry.shape:
                return tensor
        try:
            return decode(parts, entry.stages, entry.dtype, entry.shape)
        except CodecError as exc:
            raise FormatError(self.path, f"tensor {entry.name!r} does not decode: {exc}") from None


def keeps_rows_apart(chain: str, stages: Sequence[Mapping[str, Any]], shape: Sequence[int]) -> bool:
    """Whether a tensor's stored parts keep each row's bytes together, so its rows are read alone (stored
    as is, int8, row-grouped int4); other chains (sparse, zstd, int4 grouped over the flattened tensor)
    decode whole."""
    if stages and stages[-1].get("flat"):
        return False
    return chain == "raw" or (chain in ROW_CODECS and len(shape) >= 2)


def _check_crc(
    path: Path, entry: Entry, role: str, tensor: torch.Tensor, within: tuple[int, int] | None = None
) -> None:
    """Check the part's CRC-32 chunks, or only those overlapping the byte range ``within``."""
    for check in chunk_checks(path, entry, role, tensor, within, CHECKSUM_CHUNK):
        check()


def slim_source(
    path: Path,
    layout: Layout,
    physical: dict[str, TensorInfo],
    locations: dict[str, StorageLocation],
    *,
    objects: list[ObjectInfo],
    files: list[Path],
    structure_bytes: int,
    format: str = "slim",
) -> SlimSource:
    """Check the header's seal, that the layout and the physical parts agree, and build the source of
    logical tensors. ``structure_bytes`` is where the data starts (the offsets in the seal count from it)."""
    if layout.metadata is not None:  # one file; a merged layout's shards were each checked on opening
        check_seal(path, layout, _header_parts(physical, locations, structure_bytes))
    owner: dict[str, str] = {}
    infos: dict[str, TensorInfo] = {}
    for name, entry in layout.tensors.items():
        for key in entry.parts.values():
            if key not in physical:
                raise FormatError(path, f"tensor {name!r}: part {key!r} is missing from the file")
            if key in owner:
                raise FormatError(path, f"tensor {name!r}: part {key!r} also belongs to {owner[key]!r}")
            owner[key] = name
        infos[name] = _logical_info(entry, physical)
    stray = [key for key in physical if key not in owner]
    if stray:
        raise FormatError(path, f"tensor {stray[0]!r} is in the file but not in the slimtorch metadata")
    for kind, links in (("tie", layout.ties), ("copy", layout.copies)):
        for name, target in links.items():
            if target not in infos:
                raise FormatError(path, f"tensor {name!r} is a {kind} of {target!r}, which the file lacks")
            if name in infos:
                raise FormatError(path, f"tensor {name!r} is stored and also listed as a {kind}")
    order = sorted(infos.values(), key=lambda i: (locations[i.storage].file, locations[i.storage].offset))
    tensors = [*order, *(replace(infos[t], name=n) for n, t in {**layout.ties, **layout.copies}.items())]
    return SlimSource(
        path,
        format,
        tensors,
        locations,
        [*objects, *flatten(layout.objects).objects],
        files,
        structure_bytes=structure_bytes,
        tree=layout.objects,
        layout=layout,
        physical=physical,
    )


def _header_parts(
    physical: dict[str, TensorInfo], locations: dict[str, StorageLocation], data_start: int
) -> dict[str, tuple[torch.dtype, tuple[int, ...], int, int]]:
    """Each part's dtype, shape and ``[begin, end)`` offsets as its safetensors header entry gives them."""
    parts = {}
    for key, info in physical.items():
        location = locations[info.storage]
        begin = location.offset - data_start
        parts[key] = (info.dtype, info.shape, begin, begin + location.nbytes)
    return parts


def _stored_as_is(entry: Entry, physical: Mapping[str, TensorInfo]) -> TensorInfo | None:
    """The header's entry of the one part that holds ``entry`` as is (no stages, its dtype and shape);
    None where the parts must be decoded."""
    key = entry.parts.get("")
    if entry.stages or key is None or len(entry.parts) > 1:
        return None
    info = physical[key]
    return info if info.dtype == entry.dtype and info.shape == entry.shape else None


def _logical_info(entry: Entry, physical: dict[str, TensorInfo]) -> TensorInfo:
    as_is = _stored_as_is(entry, physical)
    if as_is is not None and as_is.name == entry.name:
        return as_is  # stored as is under its own name: the header's entry says it all
    parts = [physical[key] for key in entry.parts.values()]
    shape = entry.shape
    if not entry.stages:
        first = parts[0]
        return TensorInfo(
            entry.name, entry.dtype, shape, contiguous_strides(shape), first.storage, 0, first.storage_nbytes
        )
    stored = sum(p.nbytes for p in parts)
    stride = contiguous_strides(shape)
    primary = physical[entry.parts.get("", next(iter(entry.parts.values())))]
    return TensorInfo(
        entry.name,
        entry.dtype,
        shape,
        stride,
        storage=primary.storage,
        storage_offset=0,
        storage_nbytes=stored,
        codec=entry.chain,
        stored_nbytes=stored,
    )
