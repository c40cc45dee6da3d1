"""One stored tensor out of the file for a model's slot, on a worker thread or the caller's: read,
checked as the load's ``verify`` says, decoded, converted. :mod:`slimtorch.loading.filling` puts what comes
back into the model; :func:`prefetch` starts the work before the model exists."""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from slimtorch.errors import FormatError
from slimtorch.format.source import TensorInfo, TensorSource
from slimtorch.graph.slots import Slot
from slimtorch.loading.verification import Check, Verification

SMALL_TENSOR = 1 << 20
"""Bytes under which a tensor is fetched on the calling thread (see :func:`on_the_caller`)."""


@dataclass(slots=True)
class Fetched:
    tensor: torch.Tensor
    read_s: float = 0.0
    decode_s: float = 0.0
    copy_s: float = 0.0
    zero_copy: bool = False
    codec: str = "raw"
    checks: list[Check] = field(default_factory=list)
    """Checks of the bytes ``tensor`` maps, not run yet (it is those bytes, as stored)."""
    watched: str | None = None
    """The stored tensor whose bytes ``tensor`` maps, under the load's file-wide check
    (:meth:`Verification.watch`), not waited for yet."""


def fetch(
    source: TensorSource,
    name: str,
    dtype: torch.dtype | None,
    convert: bool,
    verify: str | None,
    watched: Verification | None = None,
) -> Fetched:
    """Read (and decode) one tensor on a worker thread; converted to ``dtype`` when ``convert``.

    ``verify``: None (no checks), ``"now"``, or ``"later"``: a tensor that stays the mapped bytes
    themselves leaves its checks to the caller; one decoded or converted is checked first, always. Under
    ``watched`` (a file-wide check, :meth:`Verification.watch`) checking first is waiting for it."""
    clock = time.perf_counter()
    parts = source.parts(name)
    codec = source.codec(name)
    converts = convert and dtype is not None and source.info(name).dtype != dtype
    later = verify == "later" and codec == "raw" and not converts
    stored = under_watch(source, name, verify, watched)
    checks: list[Check] = []
    if stored is None:
        checks = checked(source.checks(name, parts), later) if verify else []
    elif not later:
        watched.verify_stored(stored)  # type: ignore[union-attr]
        stored = None
    read = time.perf_counter()
    tensor = source.decode_parts(name, parts)
    if checks and tensor is not parts.get(""):
        checks = checked(checks, later=False)  # decoding only viewed them, but the model gets a copy
    fetched = Fetched(tensor, read - clock, time.perf_counter() - read, codec=codec, checks=checks)
    fetched.watched = stored
    fetched.zero_copy = fetched.codec == "raw"
    if convert and dtype is not None and fetched.tensor.dtype != dtype:
        clock = time.perf_counter()
        fetched.tensor = fetched.tensor.to(dtype)
        fetched.copy_s = time.perf_counter() - clock
        fetched.zero_copy = False
    return fetched


def under_watch(
    source: TensorSource, name: str, verify: str | None, watched: Verification | None
) -> str | None:
    """The stored tensor file name ``name`` reads (a tie or copy reads the tensor it shares) where the
    load's file-wide check covers it, else None (its own checks apply, or none without ``verify``)."""
    if not verify or watched is None:
        return None
    stored = source.ties().get(name, source.copies().get(name, name))
    return stored if watched.covers(stored) else None


def watching(checks: object) -> Verification | None:
    """``checks`` when it is a load's file-wide check (:meth:`Verification.watch`), else None."""
    return checks if isinstance(checks, Verification) and checks.watching else None


def checked(checks: list[Check], later: bool) -> list[Check]:
    """``checks`` to run later, or none once they have run here."""
    if later:
        return checks
    for check in checks:
        check()
    return []


def prefetch(
    source: TensorSource, pool: ThreadPoolExecutor, dtype: torch.dtype | None, checks: Verification | None
) -> dict[str, Future]:
    """Start verifying and decoding every stored tensor of a slim file before the model exists.

    Only without staging (the CPU), where what is decoded becomes the model's memory anyway (before a
    transfer it would pile up in RAM); and only slim files have work to start (checksums, codecs). Tensors
    the model turns out not to want were decoded for nothing: a slim file holds a model's tensors only.
    The weights of quantized layers are left alone: the layers take their parts, not the float tensor.
    """
    if not source.coded:
        return {}
    shared = {**source.ties(), **source.copies()}
    stored = [
        info for info in source.infos() if info.name not in shared and not on_the_caller(source, info, dtype)
    ]
    quantized = _quantized_weights(source)
    return {
        info.name: pool.submit(
            fetch,
            source,
            info.name,
            dtype if info.dtype.is_floating_point else None,
            dtype is not None,
            "later" if checks is not None else None,
            watching(checks),
        )
        for info in stored
        if info.name not in quantized
    }


def on_the_caller(source: TensorSource, info: TensorInfo, dtype: torch.dtype | None) -> bool:
    """Fetched on the calling thread, after the model is built, not on the pool: a tensor the model takes
    as mapped (fetching it is a view and a list of checks, about 10 us of Python) and a small coded one
    (decoding it is mostly Python too). On the pool, or started before the model exists, they only take
    the GIL from the model's constructor (BERT-base: 29-34 ms to build beside the prefetch, 21 alone)."""
    converts = dtype is not None and info.dtype.is_floating_point and info.dtype != dtype
    return info.nbytes < SMALL_TENSOR or (not converts and source.codec(info.name) == "raw")


def _quantized_weights(source: TensorSource) -> set[str]:
    delta = source.delta()
    layers = delta.get("quantized") if isinstance(delta, dict) else None
    if not isinstance(layers, dict):
        return set()
    # an LSTM / GRU codes each of its "matrices" under its own name; other layers code their weight
    matrices = {name: how.get("matrices") if isinstance(how, dict) else None for name, how in layers.items()}
    tensors = [(name, tensor) for name, coded in matrices.items() for tensor in coded or ["weight"]]
    return {f"{name}.{tensor}" if name else tensor for name, tensor in tensors}


def fetch_part(
    source: TensorSource, slot: Slot, verify: str | None, watched: Verification | None = None
) -> Fetched:
    """A quantized layer's buffer: one part of a coded tensor, as stored (mapped; checked as ``verify``
    says for :func:`fetch`, or now when the part is made from the stored ones)."""
    clock = time.perf_counter()
    name, role = slot.file_name, slot.part[1]  # type: ignore[index]
    checks: list[Check] = []
    stored_name = under_watch(source, name, verify, watched)  # type: ignore[arg-type]
    if verify:
        stored, stages = source.parts(name), source.stages(name)  # type: ignore[arg-type]
        as_stored = role in stored and len(stages) <= 1 and not (stages and stages[0].get("packing"))
        if stored_name is not None and not (as_stored and verify == "later"):
            watched.verify_stored(stored_name)  # type: ignore[union-attr]
            verify, stored_name = None, None  # checked: nothing left to do below
        elif stored_name is None and not as_stored:
            checked(source.checks(name, stored), later=False)  # type: ignore[arg-type]
    tensor = source.part(name, role)  # type: ignore[arg-type]
    if verify and as_stored and stored_name is None:
        checks = checked(source.checks(name, {role: tensor}), verify == "later")  # type: ignore[arg-type]
    if tensor.numel() == slot.tensor.numel() and _squeezed(tensor.shape) == _squeezed(slot.tensor.shape):
        tensor = tensor.reshape(slot.tensor.shape)  # a scale per row stored as a column (compressed-tensors)
    if tuple(tensor.shape) != tuple(slot.tensor.shape):
        raise FormatError(
            source.path,
            f"part {role!r} of tensor {name!r} is {list(tensor.shape)} in the file but the model's "
            f"{slot.names[0]!r} is {list(slot.tensor.shape)}",
        )
    codec = source.codec(name)  # type: ignore[arg-type]
    zero_copy = len(codec.split("+")) == 1
    fetched = Fetched(tensor, time.perf_counter() - clock, zero_copy=zero_copy, codec=codec, checks=checks)
    fetched.watched = stored_name
    return fetched


def _squeezed(shape: torch.Size) -> tuple[int, ...]:
    return tuple(size for size in shape if size != 1)
