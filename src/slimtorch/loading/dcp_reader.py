"""``dcp.load`` from slim checkpoints: a ``torch.distributed.checkpoint`` storage reader.

torch's planner matches each rank's shards (FSDP2 rows, tensor-parallel rows or columns, whole replicated
tensors) against the chunks a checkpoint lists, and asks the reader for those regions. A slim file lists
one chunk per logical tensor; :class:`SlimStorageReader` answers each request with the rows it covers
(``get_rows``: a raw, int8 or row-grouped int4 tensor keeps each row's bytes together, so only those rows
are read and decoded), then its columns. Each rank verifies the checksum chunks its rows fall in, once, and
counts what it read in :attr:`SlimStorageReader.stats`. Anything :func:`slimtorch.open` reads works the same
(safetensors files and Hugging Face folders, DCP folders read without running their pickle).

Only tensors are listed: torch's default planner unpickles non-tensor values with ``weights_only=False``,
so a reader of files from elsewhere must never hand it one.

This module imports ``torch.distributed.checkpoint`` (about a second): nothing imports it eagerly.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import (
    ChunkStorageMetadata,
    LoadPlan,
    LoadPlanner,
    Metadata,
    ReadItem,
    StorageReader,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.metadata import STORAGE_TYPES, MetadataIndex, StorageMeta, TensorProperties
from torch.distributed.checkpoint.planner import LoadItemType
from torch.futures import Future

from slimtorch.errors import SlimtorchError
from slimtorch.format.source import TensorSource
from slimtorch.sources import open_checkpoint
from slimtorch.sources.slim import keeps_rows_apart


@dataclass
class ReadStats:
    """What one rank's reader did: requests served, file bytes read for them (the rows decoded; a column
    shard reads every row), checksum bytes verified (each stored chunk its rows touch, whole, once), and
    bytes written into the rank's tensors."""

    items: int = 0
    bytes_read: int = 0
    bytes_verified: int = 0
    bytes_decoded: int = 0

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


class SlimStorageReader(StorageReader):
    """Lets ``torch.distributed.checkpoint.load`` fill a model (FSDP2, tensor parallel, or plain) from a slim
    checkpoint, decoding int8 / int4 codes for each rank's shard only.

    ``verify``: check the CRC-32 of every stored chunk a rank reads (the chunks its rows fall in).

    Example:
        >>> import torch.distributed.checkpoint as dcp
        >>> from slimtorch import SlimStorageReader
        >>> state = model.state_dict()  # doctest: +SKIP
        >>> dcp.load(state, storage_reader=SlimStorageReader("model.safetensors"))  # doctest: +SKIP
    """

    def __init__(self, path: str | os.PathLike[str], *, verify: bool = True) -> None:
        super().__init__()
        self.path = Path(path)
        self.verify = verify
        self.stats = ReadStats()
        self._source: TensorSource | None = None
        self._names: Mapping[MetadataIndex, Any] = {}
        self._verified: set[tuple[str, str, int]] = set()

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            self.path = Path(checkpoint_id)
        self.close()
        self.stats = ReadStats()

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """One chunk per logical tensor, at offset 0, of the tensor's full shape."""
        entries: dict[str, STORAGE_TYPES] = {}
        storage: dict[MetadataIndex, str] = {}
        for info in self._open().infos():
            zeros = torch.Size([0] * len(info.shape))
            shape = torch.Size(info.shape)
            chunk = ChunkStorageMetadata(offsets=zeros, sizes=shape)
            entries[info.name] = TensorStorageMetadata(TensorProperties(dtype=info.dtype), shape, [chunk])
            storage[MetadataIndex(info.name, zeros)] = info.name
        meta = StorageMeta(checkpoint_id=str(self.path))
        return Metadata(state_dict_metadata=entries, storage_data=storage, storage_meta=meta)

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        self._names = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Copy each requested region into the rank's tensor; done when it returns (the future is set)."""
        for item in plan.items:
            if item.type != LoadItemType.TENSOR:  # read_metadata lists none: a planner that asks is wrong
                raise SlimtorchError(
                    f"{self.path}: asked for a non-tensor value, which slimtorch never gives"
                )
            target = planner.resolve_tensor(item).detach()
            target.copy_(self._region(item))
            planner.commit_tensor(item, target)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return Path(checkpoint_id).exists()

    def close(self) -> None:
        """Drop the file mappings (``dcp.load`` never closes its reader; the mappings go with it too)."""
        if self._source is not None:
            self._source.close()
        self._source = None
        self._verified.clear()

    def _open(self) -> TensorSource:
        if self._source is None:
            self._source = open_checkpoint(self.path)
            self._source.verify = False  # verified here, a chunk once, only those a rank reads
        return self._source

    def _region(self, item: ReadItem) -> torch.Tensor:
        """The saved tensor's region ``item`` asks for: its rows read (and verified), then its columns."""
        source, name = self._open(), self._names[item.storage_index]
        offsets, lengths = tuple(item.storage_offsets), tuple(item.lengths)
        if not offsets:  # a 0-d tensor
            self._account(source, name, None)
            block = source.get(name)
        else:
            rows = (offsets[0], offsets[0] + lengths[0])
            self._account(source, name, rows)
            block = source.get_rows(name, *rows)
            where = (slice(None), *(slice(o, o + n) for o, n in zip(offsets[1:], lengths[1:], strict=True)))
            block = block[where]
        self.stats.items += 1
        self.stats.bytes_decoded += block.numel() * block.element_size()
        return block

    def _account(self, source: TensorSource, name: str, rows: tuple[int, int] | None) -> None:
        """Count the stored bytes rows ``rows`` (None: all) of ``name`` take, and verify their chunks."""
        info = source.info(name)
        if not source.coded:  # stored as is: the rows' own bytes, and no checksums
            share = 1.0 if rows is None or not info.shape[0] else (rows[1] - rows[0]) / info.shape[0]
            self.stats.bytes_read += round(info.nbytes * share)
            return
        by_rows = rows is not None and keeps_rows_apart(source.codec(name), source.stages(name), info.shape)
        parts = source.parts(name)  # mapped, not read: verify is off
        for role, part in parts.items():
            row_bytes = part.nbytes // part.shape[0] if part.dim() and part.shape[0] else 0
            span = (rows[0] * row_bytes, rows[1] * row_bytes) if by_rows and rows else (0, part.nbytes)
            self.stats.bytes_read += span[1] - span[0]
            if self.verify:
                self._verify(source, name, role, part, span)

    def _verify(
        self, source: TensorSource, name: str, role: str, part: torch.Tensor, span: tuple[int, int]
    ) -> None:
        """Run the checks of the stored chunks overlapping ``span`` of the part, each once per reader."""
        for check in source.checks(name, {role: part}):
            start, data = getattr(check, "start", 0), getattr(check, "data", None)
            overlaps = data is None or (start < span[1] and span[0] < start + len(data))
            if overlaps and (name, role, start) not in self._verified:
                self.stats.bytes_verified += check()
                self._verified.add((name, role, start))
