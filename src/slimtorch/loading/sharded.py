"""Sharded loads: each rank of an FSDP2 or tensor-parallel model reads only its own rows or columns.

torch shards the model (``fully_shard``, ``parallelize_module``: we never schedule anything ourselves); a
parameter becomes a ``DTensor`` whose ``to_local()`` is this rank's rows (``Shard(0)``: FSDP2, column-wise
TP) or columns (``Shard(1)``: row-wise TP). Each rank ``pread`` s exactly those bytes into that memory
(:meth:`~slimtorch.format.source.TensorSource.read_into`), decoding int8 / int4 codes on code and group
boundaries; replicated tensors and buffers are read whole by every rank.

Checksums: a slim file stores a CRC-32 per 64 MiB chunk, so a rank checking alone would read every chunk
its rows touch (3.6-4x its share on a 2 GiB model, 4 ranks). Instead every rank hashes what it read, one
``all_gather_object`` shares the hashes, and each rank combines the pieces of every chunk in byte order
(:func:`~slimtorch.format.layout.crc32_combine`) and compares with the stored CRC: every byte is read once,
by one rank, and a mismatch raises on every rank. A chunk the ranks did not cover between them (int4
columns that split a group) is read whole by the lowest rank that touched it, and counted.
"""

from __future__ import annotations

import sys
import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from slimtorch.errors import FormatError, OptionError, SlimtorchError
from slimtorch.format.layout import ChunkCheck, crc32_combine
from slimtorch.format.progress import Progress
from slimtorch.format.progress import task as progress_task
from slimtorch.format.shard_read import Piece, ShardRead, Span
from slimtorch.format.source import TensorSource
from slimtorch.graph.slots import Slot
from slimtorch.loading.options import LoadOptions, LoadReport


def is_sharded(model_or_factory: object) -> bool:
    """Whether ``model_or_factory`` is a model whose parameters are already ``DTensor`` s (sharded by the
    caller). Nothing is imported to find out: DTensors exist only once torch.distributed.tensor is."""
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    if dtensor is None or not isinstance(model_or_factory, nn.Module):
        return False
    return any(isinstance(p, dtensor) for p in model_or_factory.parameters())


def shard_model(model: nn.Module, options: LoadOptions, device: torch.device | None) -> None:
    """Shard a model built on the meta device as ``options.placements`` says over ``options.mesh``
    (``"fsdp"``: ``fully_shard`` on each repeated block, then the root; else a tensor-parallel plan), then
    give its tensors memory, empty, on ``device`` (default: the mesh's). A model already sharded is only
    given memory where it has none. Buffers the constructor computed survive (``to_empty`` would drop them).

    Example:
        >>> mesh = init_device_mesh("cpu", (4,))  # doctest: +SKIP
        >>> slimtorch.load_model("model.safetensors", Net, mesh=mesh)  # doctest: +SKIP
    """
    if options.dtype is not None:
        model.to(options.dtype)  # floating tensors only, still on meta: nothing is allocated
    mesh = options.mesh
    if mesh is not None:
        _apply_placements(model, mesh, options.placements)
    if not any(t.is_meta for t in (*model.parameters(), *model.buffers())):
        return
    kept = [
        (m, n, b) for m in model.modules() for n, b in m._buffers.items() if b is not None and not b.is_meta
    ]
    where = device or torch.device(mesh.device_type if mesh is not None else _mesh_of(model).device_type)
    model.to_empty(device=where)
    for module, name, buffer in kept:
        module._buffers[name] = buffer.to(where)


def _apply_placements(model: nn.Module, mesh: Any, placements: str | tuple[tuple[str, str], ...]) -> None:
    if is_sharded(model):
        raise OptionError("the model is sharded already: give it without mesh= (its DTensors say how)")
    if isinstance(placements, str):  # "fsdp", the one placement named by a string (LoadOptions checks)
        from torch.distributed.fsdp import fully_shard

        for block in _blocks(model):
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    styles: dict[str, Callable[[], Any]] = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    plan = {pattern: styles[style]() for pattern, style in placements if style != "replicate"}
    parallelize_module(model, mesh, plan)  # "replicate": left out of the plan, whole on every rank


def _blocks(model: nn.Module) -> list[nn.Module]:
    """The units FSDP2 shards one by one: a Hugging Face model's ``_no_split_modules``, else the members
    of the longest list of same-class children (a transformer's layers, a CNN's stages), else none (the
    root alone)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    if names:
        return [m for m in model.modules() if type(m).__name__ in names]
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList | nn.Sequential) and len(m) > 1]
    lists = [m for m in lists if len({type(c) for c in m}) == 1 and any(True for _ in m.parameters())]
    return list(max(lists, key=len)) if lists else []


def _mesh_of(model: nn.Module) -> Any:
    dtensor = sys.modules["torch.distributed.tensor"].DTensor
    return next(p.device_mesh for p in model.parameters() if isinstance(p, dtensor))


def fill_sharded(
    source: TensorSource,
    slots: list[Slot],
    options: LoadOptions,
    report: LoadReport,
    progress: Progress | None,
) -> None:
    """Read each slot's own region from ``source`` into the model's memory, then check the checksums of
    what every rank read, together; fills the report's per-rank counts."""
    import torch.distributed as dist

    todo = [slot for slot in slots if slot.file_name is not None]
    group = _group(slots)
    verify = bool(options.verify) and source.coded
    if source.coded:
        source.hash_reads = verify  # type: ignore[attr-defined]
    pieces: list[Piece] = []
    total = sum(_local(slot.tensor).numel() * _local(slot.tensor).element_size() for slot in todo)
    with progress_task(progress, "loading", total) as advance:
        for slot in todo:
            clock = time.perf_counter()
            done = _fill_slot(source, slot)
            local = _local(slot.tensor)
            report.read_s += time.perf_counter() - clock
            report.tensor_count += 1
            report.bytes_read += done.bytes_read
            report.share_bytes += local.numel() * local.element_size()
            report.notes += [done.note] if done.note else []
            pieces += done.pieces
            advance(local.numel() * local.element_size())
    report.bytes = report.share_bytes
    report.rank, report.world_size = dist.get_rank(group), dist.get_world_size(group)
    if verify:
        clock = time.perf_counter()
        report.bytes_read += check_pieces(source, _merged(pieces), group)
        report.verify_s = time.perf_counter() - clock
        report.verify, report.verified_with = "eager", "ranks"
    else:
        report.verified_with = "none" if options.verify else "off"


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _group(slots: list[Slot]) -> Any:
    """The process group of the model's mesh (the default group for a model without DTensors)."""
    import torch.distributed as dist

    for slot in slots:
        mesh = getattr(slot.tensor, "device_mesh", None)
        if mesh is not None:
            return mesh.get_group()
    return dist.group.WORLD


def _fill_slot(source: TensorSource, slot: Slot) -> ShardRead:
    """One tensor's region, read into its local memory in place (FSDP2's local shard is a view of its
    padded storage: filled, never replaced)."""
    name = slot.names[0]
    if slot.part is not None:
        raise SlimtorchError(f"{name}: quantized layers' codes are not loaded sharded yet; load unsharded")
    rows, cols = _span(slot.tensor, name)
    local = _local(slot.tensor)
    stored = source.info(slot.file_name).dtype  # type: ignore[arg-type]
    if stored != local.dtype and not (stored.is_floating_point and local.is_floating_point()):
        raise SlimtorchError(f"{name}: the file's {stored} does not convert to the model's {local.dtype}")
    with torch.no_grad():
        return source.read_into(slot.file_name, local, rows=rows, cols=cols)  # type: ignore[arg-type]


def _span(tensor: torch.Tensor, name: str) -> tuple[Span | None, Span | None]:
    """The rows and columns of the global tensor this rank holds: (None, None) for a whole tensor."""
    if not hasattr(tensor, "__create_chunk_list__"):
        return None, None
    if len(tensor.placements) != 1:  # type: ignore[attr-defined]
        raise SlimtorchError(f"{name}: a {len(tensor.placements)}-D mesh is not supported yet (1-D only)")  # type: ignore[attr-defined]
    (chunk,) = tensor.__create_chunk_list__()
    spans = [(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes, strict=True)]
    split = [d for d, (span, size) in enumerate(zip(spans, tensor.shape, strict=True)) if span != (0, size)]
    if split in ([], [0]):
        return (spans[0] if spans else None), None
    if split == [1]:
        return None, spans[1]
    raise SlimtorchError(f"{name}: a shard over dims {split} is not supported yet (rows or columns only)")


def _merged(pieces: list[Piece]) -> list[Piece]:
    """Adjacent pieces of one chunk as one (fewer to send): their CRCs combined."""
    out: list[Piece] = []
    for piece in sorted(pieces, key=lambda p: (p.tensor, p.part, p.chunk, p.start)):
        last = out[-1] if out else None
        if last and last[:3] == piece[:3] and last.start + last.length == piece.start:
            crc = crc32_combine(last.crc, piece.crc, piece.length)
            out[-1] = last._replace(length=last.length + piece.length, crc=crc)
        else:
            out.append(piece)
    return out


def check_pieces(source: TensorSource, pieces: list[Piece], group: Any) -> int:
    """Check every stored chunk any rank read, from the pieces all ranks hashed; raise
    :class:`~slimtorch.FormatError` on every rank at a mismatch. Returns the bytes this rank read again
    for chunks the ranks did not cover between them."""
    import torch.distributed as dist

    everyone: list[list[Piece]] = [[] for _ in range(dist.get_world_size(group))]
    dist.all_gather_object(everyone, pieces, group=group)
    chunks: dict[tuple[str, str, int], dict[tuple[int, int], tuple[int, int]]] = defaultdict(dict)
    about: dict[tuple[str, str, int], Piece] = {}
    for rank, mine in enumerate(everyone):
        for piece in mine:
            key = (piece.tensor, piece.part, piece.chunk)
            about.setdefault(key, piece)
            chunks[key].setdefault((piece.start, piece.length), (piece.crc, rank))
    uncovered = {}
    for key, found in chunks.items():
        crc = _combined(about[key], found)
        if crc is None:
            uncovered[key] = min(rank for _, rank in found.values())
        elif crc != about[key].expected:
            raise _mismatch(source, about[key])
    return _check_uncovered(source, uncovered, about, group) if uncovered else 0


def _combined(chunk: Piece, found: Mapping[tuple[int, int], tuple[int, int]]) -> int | None:
    """The CRC of the whole chunk from pieces that tile it (None: they leave a gap or overlap)."""
    by_start: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for (start, length), (piece_crc, _) in found.items():
        by_start[start].append((length, piece_crc))
    at, end = chunk.chunk, chunk.chunk + chunk.chunk_bytes
    crc: int | None = None
    while at < end:
        if at not in by_start:
            return None
        length, piece_crc = max(by_start[at])  # the longest piece starting here
        crc = piece_crc if crc is None else crc32_combine(crc, piece_crc, length)
        at += length
    return crc if at == end else None


def _check_uncovered(
    source: TensorSource,
    owners: dict[tuple[str, str, int], int],
    about: dict[tuple[str, str, int], Piece],
    group: Any,
) -> int:
    """Chunks no tiling covers: each read whole by its owner rank; the failures shared with all ranks."""
    import torch.distributed as dist

    rank, extra, failed = dist.get_rank(group), 0, []
    for key, owner in owners.items():
        if owner != rank:
            continue
        tensor, part, start = key
        checks = [
            c
            for c in source.checks(tensor, source.parts(tensor))
            if isinstance(c, ChunkCheck) and (c.part, c.start) == (part, start)
        ]
        try:
            extra += sum(check() for check in checks)
        except FormatError:
            failed.append(key)
    everyone: list[list[tuple[str, str, int]]] = [[] for _ in range(dist.get_world_size(group))]
    dist.all_gather_object(everyone, failed, group=group)
    bad = [key for keys in everyone for key in keys]
    if bad:
        raise _mismatch(source, about[bad[0]])
    return extra


def _mismatch(source: TensorSource, chunk: Piece) -> FormatError:
    end = chunk.chunk + chunk.chunk_bytes
    return FormatError(
        source.path,
        f"tensor {chunk.tensor!r}: checksum mismatch in part {chunk.part!r} (bytes {chunk.chunk}..{end}), "
        "checked by all ranks together: the file is corrupt",
    )
