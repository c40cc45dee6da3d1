"""load and load_model: tensors out of any checkpoint, and models built around them without waste.

:func:`load` gives every tensor as a dict. :func:`load_model` puts them straight into a model:

- a factory is called with its parameters on the meta device (:mod:`slimtorch.io.construct`): no RAM and
  no random initialisation for weights that the file is about to provide;
- on the CPU, a tensor stored as is and already in the target dtype becomes the parameter itself, mapped
  from the file (copy-on-write: training can write into it, the file never changes), so the model costs
  its own bytes once, never twice;
- coded tensors (int8, int4, sparse, cast, zstd) are decoded in a thread pool; torch's kernels, NumPy and
  zlib release the GIL, so checksums and decodes run on every core;
- for CUDA, tensors go through pinned staging buffers with non-blocking copies
  (:mod:`slimtorch.io.staging`), so reading the file overlaps the transfer.

Tied parameters (one tensor under several names) stay tied; a tensor the file stores once for two
separate parameters is copied so that they do not share memory.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from slimtorch.errors import FormatError, SlimtorchError
from slimtorch.io.construct import build_on_meta
from slimtorch.io.readers import open_checkpoint
from slimtorch.io.readers.slim import SlimSource
from slimtorch.io.source import TensorSource
from slimtorch.io.staging import Stager
from slimtorch.report.progress import ByteProgress

DECODE_THREADS = min(4, os.cpu_count() or 1)
PROGRESS_DELAY_S = 1.0
# Prefixes a training script puts in front of a model's names: {"model": state_dict}, DataParallel.
WRAPPER_PREFIXES = ("", "model.", "module.", "state_dict.", "model_state_dict.", "net.", "model.module.")
ModelOrFactory = nn.Module | Callable[[], nn.Module]


def load(
    path: str | os.PathLike[str],
    *,
    verify: bool = True,
    threads: int | None = None,
    progress: bool | None = None,
    allow_globals: tuple[str, ...] = (),
) -> dict[str, torch.Tensor]:
    """Load every tensor of a checkpoint (slim or any format :func:`slimtorch.open` reads) as a dict.

    Tensors stored as is come memory-mapped from the file (copy-on-write); coded ones are decoded on a
    thread pool. A slim file's parts are checked against their CRC-32 first (``verify=False`` skips
    that); a mismatch raises :class:`slimtorch.FormatError` naming the tensor. Tied tensors come back as
    one tensor under several names, equal copies as separate tensors.

    Example:
        >>> import slimtorch
        >>> state = slimtorch.load("model.safetensors")  # doctest: +SKIP
        >>> model.load_state_dict(state)  # doctest: +SKIP
    """
    state, _ = load_profiled(
        path, verify=verify, threads=threads, progress=progress, allow_globals=allow_globals
    )
    return state


def load_profiled(
    path: str | os.PathLike[str],
    *,
    verify: bool = True,
    threads: int | None = None,
    progress: bool | None = None,
    allow_globals: tuple[str, ...] = (),
) -> tuple[dict[str, torch.Tensor], LoadProfile]:
    """:func:`load`, plus a :class:`LoadProfile` of where the time went."""
    started = time.perf_counter()
    source, profile = _open(path, None, verify, threads, allow_globals)
    with source:
        slots = _file_slots(source)
        _fill(source, slots, None, None, profile.threads, progress, profile)
    profile.wall_s = time.perf_counter() - started
    by_name = {name: slot.tensor for slot in slots for name in slot.names}
    return {name: by_name[name] for name in source.names()}, profile


@dataclass
class LoadProfile:
    """Where the time of one :func:`load_model` went. Phase times are summed over the worker threads, so
    they can add up to more than ``wall_s``; ``to_dict()`` is the ``--json`` output."""

    path: str
    format: str
    device: str
    threads: int
    tensors: int = 0
    bytes: int = 0
    """Bytes of the loaded tensors, as the model holds them."""
    file_bytes: int = 0
    zero_copy: int = 0
    """Tensors that are the file's bytes themselves (memory-mapped, no copy)."""
    decoded: int = 0
    open_s: float = 0.0
    """Parsing the file's structure (headers, index, pickle)."""
    construct_s: float = 0.0
    """Calling the model factory with parameters on the meta device."""
    read_s: float = 0.0
    """Mapping parts and verifying their checksums (which reads every stored byte)."""
    decode_s: float = 0.0
    copy_s: float = 0.0
    """dtype conversion, copies into existing tensors, host-to-device transfer."""
    assign_s: float = 0.0
    """Putting the tensors into the model."""
    wall_s: float = 0.0
    by_codec: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"schema": "slimtorch.load-profile/1", **asdict(self)}


@dataclass
class _Slot:
    """One tensor of the model, under every name it has (tied parameters share a slot)."""

    names: list[str]
    places: list[tuple[nn.Module, str]]
    tensor: torch.Tensor
    parameter: bool
    file_name: str | None = None


@dataclass
class _Fetched:
    tensor: torch.Tensor
    read_s: float = 0.0
    decode_s: float = 0.0
    copy_s: float = 0.0
    zero_copy: bool = False
    codec: str = "raw"


def load_model(
    path: str | os.PathLike[str],
    model_or_factory: ModelOrFactory,
    *,
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
    strict: bool = True,
    verify: bool = True,
    threads: int | None = None,
    progress: bool | None = None,
    allow_globals: tuple[str, ...] = (),
) -> nn.Module:
    """Build a model and fill it from a checkpoint, fast and without holding the weights twice.

    Args:
        path: any checkpoint :func:`slimtorch.open` reads (slim, safetensors, torch.save, Hugging Face
            folder, sharded or not).
        model_or_factory: a callable returning the model (built with parameters on the meta device: no
            RAM, no random init), or a model. A model's real tensors are filled in place; its meta
            tensors are replaced.
        device: where the tensors go ("cpu", "cuda", "cuda:1"); None: the CPU for meta tensors, and
            where they already are for a built model.
        dtype: floating-point tensors are converted to it; None: the dtype the model declares.
        strict: refuse a file that lacks a tensor of the model or holds one the model does not have.
            Parameters of a factory-built model must come from the file whatever ``strict`` says.
        verify: check the CRC-32 of every part of a slim file (a mismatch names the tensor).
        threads: decode threads (default: up to 4, one per core).
        progress: a progress bar on stderr for loads over a second; None: only on a terminal.

    Example:
        >>> import slimtorch, torch
        >>> build = lambda: torch.nn.Linear(1024, 1024)
        >>> model = slimtorch.load_model("linear.safetensors", build)  # doctest: +SKIP
    """
    model, _ = load_model_profiled(
        path,
        model_or_factory,
        device=device,
        dtype=dtype,
        strict=strict,
        verify=verify,
        threads=threads,
        progress=progress,
        allow_globals=allow_globals,
    )
    return model


def load_model_profiled(
    path: str | os.PathLike[str],
    model_or_factory: ModelOrFactory,
    *,
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
    strict: bool = True,
    verify: bool = True,
    threads: int | None = None,
    progress: bool | None = None,
    allow_globals: tuple[str, ...] = (),
) -> tuple[nn.Module, LoadProfile]:
    """:func:`load_model`, plus a :class:`LoadProfile` of where the time went (``slimtorch load
    --profile`` prints it)."""
    started = time.perf_counter()
    target = _device(device)
    source, profile = _open(path, target, verify, threads, allow_globals)
    with source:
        clock = time.perf_counter()
        model = _model(model_or_factory)
        profile.construct_s = time.perf_counter() - clock
        slots = _slots(model)
        _match(source, slots, strict, built=not isinstance(model_or_factory, nn.Module))
        _fill(source, slots, target, dtype, profile.threads, progress, profile)
        _place_the_rest(model, target, dtype)
    profile.wall_s = time.perf_counter() - started
    return model, profile


def _open(
    path: str | os.PathLike[str],
    device: torch.device | None,
    verify: bool,
    threads: int | None,
    allow_globals: tuple[str, ...],
) -> tuple[TensorSource, LoadProfile]:
    clock = time.perf_counter()
    source = open_checkpoint(path, allow_globals=allow_globals)
    if isinstance(source, SlimSource):
        source.verify = verify
    profile = LoadProfile(str(path), source.format, str(device or "cpu"), threads or DECODE_THREADS)
    profile.open_s = time.perf_counter() - clock
    profile.file_bytes = source.file_bytes
    return source, profile


def _device(device: str | torch.device | None) -> torch.device | None:
    if device is None:
        return None
    try:
        device = torch.device(device)
    except RuntimeError as exc:
        raise SlimtorchError(f"unknown device {device!r} ({exc})") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SlimtorchError(f"device {str(device)!r} asked for, but this torch sees no CUDA device")
    return device


def _model(model_or_factory: ModelOrFactory) -> nn.Module:
    if isinstance(model_or_factory, nn.Module):
        return model_or_factory
    if not callable(model_or_factory):
        raise SlimtorchError(
            f"load_model takes a model or a function that builds one, not a {type(model_or_factory).__name__}"
        )
    return build_on_meta(model_or_factory)


def _slots(model: nn.Module) -> list[_Slot]:
    """Every parameter and persistent buffer, one slot per tensor (a tied tensor has several names)."""
    slots: dict[int, _Slot] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        owned = [(n, t, True) for n, t in module._parameters.items()]
        owned += [
            (n, t, False) for n, t in module._buffers.items() if n not in module._non_persistent_buffers_set
        ]
        for attr, tensor, parameter in owned:
            if tensor is None:
                continue
            name = f"{prefix}.{attr}" if prefix else attr
            slot = slots.get(id(tensor))
            if slot is None:
                slots[id(tensor)] = _Slot([name], [(module, attr)], tensor, parameter)
            elif name not in slot.names:
                slot.names.append(name)
                slot.places.append((module, attr))
    return list(slots.values())


def _file_slots(source: TensorSource) -> list[_Slot]:
    """One slot per stored tensor of the file, without a model: tied names share a slot.

    A slim file lists its ties; in other formats a tie is two names on the same view of one storage.
    """
    slim = isinstance(source, SlimSource)
    slots: dict[object, _Slot] = {}
    for info in source.infos():
        if slim:
            key: object = source.layout.ties.get(info.name, info.name)  # type: ignore[union-attr]
        else:
            key = (info.storage, info.storage_offset, info.shape, info.stride, info.dtype)
        if key in slots:
            slots[key].names.append(info.name)
            continue
        template = torch.empty(info.shape, dtype=info.dtype, device="meta")
        slots[key] = _Slot([info.name], [], template, parameter=False, file_name=info.name)
    return list(slots.values())


def _match(source: TensorSource, slots: list[_Slot], strict: bool, built: bool) -> None:
    """Find each slot's tensor in the file (under a wrapper prefix if the file has one); check shapes."""
    available = set(source.names())
    prefix = max(WRAPPER_PREFIXES, key=lambda p: sum(p + n in available for s in slots for n in s.names))
    used: set[str] = set()
    missing: list[str] = []
    for slot in slots:
        found = [prefix + n for n in slot.names if prefix + n in available]
        used.update(found)
        if not found:
            if slot.tensor.is_meta or strict:
                missing.append(slot.names[0])
            continue
        slot.file_name = found[0]
        info = source.info(slot.file_name)
        if tuple(info.shape) != tuple(slot.tensor.shape):
            raise FormatError(
                source.path,
                f"tensor {slot.file_name!r} is {list(info.shape)} in the file but the model's "
                f"{slot.names[0]!r} is {list(slot.tensor.shape)}",
            )
    unexpected = sorted(n for n in available - used if n.startswith(prefix)) if strict else []
    if missing:
        why = (
            "; the model was built on the meta device, so they have no values"
            if built and any(s.tensor.is_meta for s in slots if s.names[0] in missing)
            else " (load with strict=False, --non-strict, to keep the model's own values)"
        )
        raise FormatError(source.path, f"the file lacks {_some(missing)} of the model{why}")
    if unexpected:
        raise FormatError(
            source.path,
            f"the file holds {_some(unexpected)} that the model does not have "
            "(load with strict=False, --non-strict, to ignore them)",
        )


def _some(names: list[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:3])
    more = f" and {len(names) - 3} more" if len(names) > 3 else ""
    return f"{len(names)} tensor{'s' if len(names) > 1 else ''} ({shown}{more})"


def _target_dtype(slot: _Slot, dtype: torch.dtype | None) -> torch.dtype:
    if dtype is not None and slot.tensor.is_floating_point():
        return dtype
    return slot.tensor.dtype


def _fetch(source: TensorSource, name: str, dtype: torch.dtype, convert: bool) -> _Fetched:
    """Read (and decode) one tensor on a worker thread; converted to ``dtype`` when ``convert``."""
    clock = time.perf_counter()
    if isinstance(source, SlimSource):
        parts = source.parts(name)
        read = time.perf_counter()
        tensor = source.decode_parts(name, parts)
        fetched = _Fetched(tensor, read - clock, time.perf_counter() - read, codec=source.entry(name).chain)
        fetched.zero_copy = fetched.codec == "raw"
    else:
        fetched = _Fetched(source.get(name), time.perf_counter() - clock, zero_copy=True)
    if convert and fetched.tensor.dtype != dtype:
        clock = time.perf_counter()
        fetched.tensor = fetched.tensor.to(dtype)
        fetched.copy_s = time.perf_counter() - clock
        fetched.zero_copy = False
    return fetched


def _fill(
    source: TensorSource,
    slots: list[_Slot],
    device: torch.device | None,
    dtype: torch.dtype | None,
    threads: int,
    progress: bool | None,
    profile: LoadProfile,
) -> None:
    """Fetch every slot's tensor on a thread pool and put it into the model as it arrives."""
    todo = [s for s in slots if s.file_name is not None]
    total = sum(source.info(s.file_name).nbytes for s in todo)  # type: ignore[arg-type]
    stager = stager_for(device)
    handed_out: set[int] = set()  # storages already given to a slot: a second slot gets a copy
    with (
        ByteProgress("loading", total, delay=PROGRESS_DELAY_S, enabled=progress) as bar,
        ThreadPoolExecutor(threads) as pool,
    ):
        # CUDA: convert on the device after the transfer (cheaper there, and the transfer is smaller).
        convert = stager is None
        work = ((s, lambda s=s: _fetch(source, s.file_name, _target_dtype(s, dtype), convert)) for s in todo)
        for slot, fetched in _bounded(pool, work, window=2 * threads):
            clock = time.perf_counter()
            tensor = _to_target(fetched.tensor, slot, device, dtype, stager)
            replaced = not _fills_in_place(slot, tensor)
            zero_copy = fetched.zero_copy and replaced and tensor is fetched.tensor
            if zero_copy and tensor.numel():
                key = tensor.untyped_storage().data_ptr()
                if key in handed_out:  # the file stores it once, the model has two separate tensors
                    tensor, zero_copy = tensor.clone(), False
                handed_out.add(key)
            copy = time.perf_counter() - clock
            _assign(slot, tensor)
            profile.tensors += 1
            profile.bytes += tensor.numel() * tensor.element_size()
            profile.zero_copy += zero_copy
            profile.decoded += fetched.codec != "raw"
            profile.by_codec[fetched.codec] = profile.by_codec.get(fetched.codec, 0) + 1
            profile.read_s += fetched.read_s
            profile.decode_s += fetched.decode_s
            profile.copy_s += fetched.copy_s + copy
            profile.assign_s += time.perf_counter() - clock - copy
            bar.advance(source.info(slot.file_name).nbytes)  # type: ignore[arg-type]
        if stager is not None:
            clock = time.perf_counter()
            stager.finish()
            profile.copy_s += time.perf_counter() - clock


def stager_for(device: torch.device | None) -> Stager | None:
    """Pinned staging for CUDA; CPU tensors need none (they are mapped or decoded in place)."""
    return Stager(device) if device is not None and device.type == "cuda" else None


def _bounded(
    pool: ThreadPoolExecutor, work: Iterator[tuple[_Slot, Callable[[], _Fetched]]], window: int
) -> Iterator[tuple[_Slot, _Fetched]]:
    """Run ``work`` on ``pool`` with at most ``window`` tasks in flight; yields results as they finish.

    The window bounds what waits in memory between decoding and its consumer (the CUDA transfer)."""
    pending: dict[Future, _Slot] = {}
    try:
        for slot, task in work:
            pending[pool.submit(task)] = slot
            while len(pending) >= window:
                yield from _collect(pending)
        while pending:
            yield from _collect(pending)
    finally:
        for future in pending:
            future.cancel()


def _collect(pending: dict[Future, _Slot]) -> Iterator[tuple[_Slot, _Fetched]]:
    done, _ = wait(pending, return_when=FIRST_COMPLETED)
    for future in done:
        slot = pending.pop(future)
        yield slot, future.result()


def _fills_in_place(slot: _Slot, tensor: torch.Tensor) -> bool:
    """A built model's tensor already on the right device in the right dtype is filled in place (it keeps
    its identity); any other is replaced."""
    old = slot.tensor
    return not old.is_meta and old.device == tensor.device and old.dtype == tensor.dtype


def _to_target(
    tensor: torch.Tensor,
    slot: _Slot,
    device: torch.device | None,
    dtype: torch.dtype | None,
    stager: Stager | None,
) -> torch.Tensor:
    want_dtype = _target_dtype(slot, dtype)
    want_device = device or (torch.device("cpu") if slot.tensor.is_meta else slot.tensor.device)
    if stager is not None:
        tensor = stager.copy(tensor)
    elif tensor.device != want_device:
        tensor = tensor.to(want_device)
    return tensor if tensor.dtype == want_dtype else tensor.to(want_dtype)


def _assign(slot: _Slot, tensor: torch.Tensor) -> None:
    old = slot.tensor
    if _fills_in_place(slot, tensor):
        with torch.no_grad():
            old.copy_(tensor)
        return
    value = nn.Parameter(tensor, requires_grad=old.requires_grad) if slot.parameter else tensor
    for module, attr in slot.places:
        (module._parameters if slot.parameter else module._buffers)[attr] = value
    slot.tensor = value


def _place_the_rest(model: nn.Module, device: torch.device | None, dtype: torch.dtype | None) -> None:
    """Move what the file did not provide (non-persistent buffers) where the loaded tensors went."""
    if device is None and dtype is None:
        return
    for module in model.modules():
        for attr, buffer in module._buffers.items():
            if buffer is None or buffer.is_meta:
                continue
            want = dtype if dtype is not None and buffer.is_floating_point() else buffer.dtype
            if buffer.device != (device or buffer.device) or buffer.dtype != want:
                module._buffers[attr] = buffer.to(device=device or buffer.device, dtype=want)
