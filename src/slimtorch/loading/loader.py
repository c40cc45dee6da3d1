"""load and load_model: tensors out of any checkpoint, and models built around them without waste.

:func:`load` gives every tensor as a dict. :func:`load_model` puts them straight into a model:

- a factory is called with its parameters on the meta device (:mod:`slimtorch.loading.construct`): no RAM and
  no random initialisation for weights that the file is about to provide;
- on the CPU, a tensor stored as is and already in the target dtype becomes the parameter itself, mapped
  from the file (copy-on-write: training can write into it, the file never changes), so the model costs
  its own bytes once, never twice;
- coded tensors (int8, int4, sparse, cast, zstd) are decoded in a thread pool; torch's kernels, NumPy and
  zlib release the GIL, so checksums and decodes run on every core;
- for CUDA, tensors go through pinned staging buffers with non-blocking copies
  (:mod:`slimtorch.loading.staging`), so reading the file overlaps the transfer.

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

from slimtorch.errors import FormatError, OptionError, SlimtorchError
from slimtorch.format.delta import StructuralDelta, apply_delta
from slimtorch.format.names import Rename, Skipped
from slimtorch.format.progress import Progress
from slimtorch.format.progress import task as progress_task
from slimtorch.format.source import TensorSource
from slimtorch.graph.slots import Slot, model_slots
from slimtorch.loading.construct import build_model, intended_device
from slimtorch.loading.model_slots import (
    Matching,
    assign,
    file_slots,
    fills_in_place,
    match,
    place_the_rest,
    target_dtype,
)
from slimtorch.loading.staging import Stager
from slimtorch.sources import open_checkpoint

DECODE_THREADS = min(4, os.cpu_count() or 1)
ModelOrFactory = nn.Module | Callable[[], nn.Module]


def load(
    path: str | os.PathLike[str],
    *,
    verify: bool = True,
    threads: int | None = None,
    progress: Progress | None = None,
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
    progress: Progress | None = None,
    allow_globals: tuple[str, ...] = (),
) -> tuple[dict[str, torch.Tensor], LoadProfile]:
    """:func:`load`, plus a :class:`LoadProfile` of where the time went."""
    started = time.perf_counter()
    source, profile = _open(path, None, verify, threads, allow_globals)
    with source, ThreadPoolExecutor(profile.threads) as pool:
        slots = file_slots(source)
        _fill(source, slots, None, None, None, pool, {}, progress, profile)
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
    model: str | None = None
    """The model's class (None: tensors loaded without a model)."""
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
    prefix: str = ""
    """The wrapper prefix the model's names were read under in the file (``model_state.``)."""
    model_prefix: str = ""
    """A prefix of the model's names that the file lacks (``bert.``: a base model saved alone)."""
    ignored: list[Skipped] = field(default_factory=list)
    """Names left out because the model declares it does without them, each with the reason."""
    unmatched: list[str] = field(default_factory=list)
    """File names under the prefix that the model lacks, left out (strict=False)."""
    missing: list[str] = field(default_factory=list)
    """Model names the file lacks, left at the model's own values (strict=False)."""
    outside_prefix: list[str] = field(default_factory=list)
    """File names outside the wrapper prefix (optimizer state, ...), not the model's."""
    notes: list[str] = field(default_factory=list)
    """What the load did differently from the fast path, and why."""

    def record(self, matching: Matching) -> None:
        """Keep what name matching decided."""
        self.prefix, self.model_prefix = matching.prefix.file, matching.prefix.model
        self.ignored, self.unmatched = matching.ignored, matching.unmatched
        self.missing, self.outside_prefix = matching.missing, matching.outside
        self.notes += matching.notes

    def to_dict(self) -> dict:
        return {"schema": "slimtorch.load-profile/1", **asdict(self)}


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
    progress: Progress | None = None,
    allow_globals: tuple[str, ...] = (),
    prefix: str | None = None,
    rename: Rename = (),
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
            Parameters of a factory-built model must come from the file whatever ``strict`` says, and
            a file that matches no name at all is refused either way. Names the model declares it
            does without (its non-persistent buffers, Hugging Face's ``_keys_to_ignore_on_load_*``)
            are left out and listed in the profile, never refused.
        verify: check the CRC-32 of every part of a slim file (a mismatch names the tensor).
        threads: decode threads (default: up to 4, one per core).
        progress: told how many bytes got loaded (:mod:`slimtorch.format.progress`); None: silent.
        prefix: the wrapper the model's names sit under in the file (``"model_state."``); None: found
            by matching (:func:`~slimtorch.format.names.find_prefix`), at any depth.
        rename: (old, new) name prefixes, or a mapping, replaced in the file's names once the wrapper
            prefix is off (``{"lstm.": "rnn."}``; ``{"": "bert."}`` puts a prefix in front of all).

    Example:
        >>> import slimtorch, torch
        >>> build = lambda: torch.nn.Linear(1024, 1024)
        >>> model = slimtorch.load_model("linear.safetensors", build)  # doctest: +SKIP
        >>> model = slimtorch.load_model("ckpt.pt", Net, rename={"lstm.": "rnn."})  # doctest: +SKIP
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
        prefix=prefix,
        rename=rename,
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
    progress: Progress | None = None,
    allow_globals: tuple[str, ...] = (),
    prefix: str | None = None,
    rename: Rename = (),
) -> tuple[nn.Module, LoadProfile]:
    """:func:`load_model`, plus a :class:`LoadProfile` of where the time went (``slimtorch load
    --profile`` prints it)."""
    started = time.perf_counter()
    target = _device(device)
    source, profile = _open(path, target, verify, threads, allow_globals)
    built = not isinstance(model_or_factory, nn.Module)
    with source, ThreadPoolExecutor(profile.threads) as pool:
        # The factory runs Python (holding the GIL) while the pool verifies and decodes (releasing it).
        stager = stager_for(target)
        early = {} if stager else _prefetch(source, pool, dtype)
        try:
            clock = time.perf_counter()
            model, note = _model(model_or_factory)
            profile.construct_s = time.perf_counter() - clock
            profile.model = type(model).__name__
            profile.notes += [note] if note else []
            _reshape(source, model)
            slots = model_slots(model)
            matching = match(source, model, slots, strict=strict, built=built, prefix=prefix, rename=rename)
            profile.record(matching)
            if target is None:
                _check_intended_devices(slots)
            _fill(source, slots, target, dtype, stager, pool, early, progress, profile)
        except BaseException:
            pool.shutdown(wait=False, cancel_futures=True)  # fail now, not after decoding the whole file
            raise
        place_the_rest(model, target, dtype)
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
        raise OptionError(f"unknown device {device!r} ({exc})") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise OptionError(f"device {str(device)!r} asked for, but this torch sees no CUDA device")
    return device


def _model(model_or_factory: ModelOrFactory) -> tuple[nn.Module, str | None]:
    if isinstance(model_or_factory, nn.Module):
        return model_or_factory, None
    if not callable(model_or_factory):
        raise SlimtorchError(
            f"load_model takes a model or a function that builds one, not a {type(model_or_factory).__name__}"
        )
    return build_model(model_or_factory)


def _check_intended_devices(slots: list[Slot]) -> None:
    """A constructor that sends the model to CUDA (``.cuda()``, ``.to(device)``) gets it there, if it can."""
    for slot in slots:
        wanted = intended_device(slot.tensor) if slot.tensor.is_meta else None
        if wanted is not None and wanted.type == "cuda" and not torch.cuda.is_available():
            raise SlimtorchError(
                f"the model's constructor puts {slot.names[0]!r} on {wanted}, but this torch sees no CUDA "
                "device: load it with device='cpu' (--device cpu)"
            )


def _reshape(source: TensorSource, model: nn.Module) -> None:
    """Give a pruned model's class the shapes it was saved with (the file's structural delta)."""
    recorded = source.delta()
    if not recorded:
        return
    try:
        apply_delta(model, StructuralDelta.from_json(recorded))
    except SlimtorchError as exc:
        raise FormatError(source.path, str(exc)) from None


def _fetch(source: TensorSource, name: str, dtype: torch.dtype | None, convert: bool) -> _Fetched:
    """Read (and decode) one tensor on a worker thread; converted to ``dtype`` when ``convert``."""
    clock = time.perf_counter()
    parts = source.parts(name)
    read = time.perf_counter()
    tensor = source.decode_parts(name, parts)
    fetched = _Fetched(tensor, read - clock, time.perf_counter() - read, codec=source.codec(name))
    fetched.zero_copy = fetched.codec == "raw"
    if convert and dtype is not None and fetched.tensor.dtype != dtype:
        clock = time.perf_counter()
        fetched.tensor = fetched.tensor.to(dtype)
        fetched.copy_s = time.perf_counter() - clock
        fetched.zero_copy = False
    return fetched


def _prefetch(source: TensorSource, pool: ThreadPoolExecutor, dtype: torch.dtype | None) -> dict[str, Future]:
    """Start verifying and decoding every stored tensor of a slim file before the model exists.

    Only without staging (the CPU), where what is decoded becomes the model's memory anyway (before a
    transfer it would pile up in RAM); and only slim files have work to start (checksums, codecs). Tensors
    the model turns out not to want were decoded for nothing: a slim file holds a model's tensors only.
    The weights of quantized layers are left alone: the layers take their parts, not the float tensor.
    """
    if not source.coded:
        return {}
    shared = {**source.ties(), **source.copies()}
    stored = [info for info in source.infos() if info.name not in shared]
    quantized = _quantized_weights(source)
    return {
        info.name: pool.submit(
            _fetch, source, info.name, dtype if info.dtype.is_floating_point else None, dtype is not None
        )
        for info in stored
        if info.name not in quantized
    }


def _quantized_weights(source: TensorSource) -> set[str]:
    delta = source.delta()
    layers = delta.get("quantized") if isinstance(delta, dict) else None
    if not isinstance(layers, dict):
        return set()
    # an LSTM / GRU codes each of its "matrices" under its own name; other layers code their weight
    matrices = {name: how.get("matrices") if isinstance(how, dict) else None for name, how in layers.items()}
    tensors = [(name, tensor) for name, coded in matrices.items() for tensor in coded or ["weight"]]
    return {f"{name}.{tensor}" if name else tensor for name, tensor in tensors}


def _fetch_part(source: TensorSource, slot: Slot) -> _Fetched:
    """A quantized layer's buffer: one part of a coded tensor, as stored (mapped, verified)."""
    clock = time.perf_counter()
    name, role = slot.file_name, slot.part[1]  # type: ignore[index]
    tensor = source.part(name, role)  # type: ignore[union-attr]
    if tensor.numel() == slot.tensor.numel() and _squeezed(tensor.shape) == _squeezed(slot.tensor.shape):
        tensor = tensor.reshape(slot.tensor.shape)  # a scale per row stored as a column (compressed-tensors)
    if tuple(tensor.shape) != tuple(slot.tensor.shape):
        raise FormatError(
            source.path,
            f"part {role!r} of tensor {name!r} is {list(tensor.shape)} in the file but the model's "
            f"{slot.names[0]!r} is {list(slot.tensor.shape)}",
        )
    codec = source.codec(name)  # type: ignore[arg-type]
    return _Fetched(tensor, time.perf_counter() - clock, zero_copy=len(codec.split("+")) == 1, codec=codec)


def _squeezed(shape: torch.Size) -> tuple[int, ...]:
    return tuple(size for size in shape if size != 1)


def _fill(
    source: TensorSource,
    slots: list[Slot],
    device: torch.device | None,
    dtype: torch.dtype | None,
    stager: Stager | None,
    pool: ThreadPoolExecutor,
    early: dict[str, Future],
    progress: Progress | None,
    profile: LoadProfile,
) -> None:
    """Fetch every slot's tensor on the pool and put it into the model as it arrives.

    ``early`` holds fetches started before the model existed, by stored name (each serves one slot)."""
    todo = [s for s in slots if s.file_name is not None]
    total = sum(_stored_bytes(source, s) for s in todo)
    handed_out: set[int] = set()  # storages already given to a slot: a second slot gets a copy
    stored = source.ties()
    # CUDA: convert on the device after the transfer (cheaper there, and the transfer is smaller).
    convert = stager is None

    def task(slot: Slot) -> Future | Callable[[], _Fetched]:
        if slot.part is not None:
            return lambda: _fetch_part(source, slot)
        started = early.pop(stored.get(slot.file_name, slot.file_name), None)  # type: ignore[arg-type]
        return started or (lambda: _fetch(source, slot.file_name, target_dtype(slot, dtype), convert))

    with progress_task(progress, "loading", total) as advance:
        for slot, fetched in _bounded(pool, ((s, task(s)) for s in todo), window=2 * profile.threads):
            clock = time.perf_counter()
            tensor = _to_target(fetched.tensor, slot, device, dtype, stager)
            replaced = not fills_in_place(slot, tensor)
            if replaced:
                tensor = in_model_layout(tensor, slot.tensor)
            zero_copy = fetched.zero_copy and replaced and tensor is fetched.tensor
            if zero_copy and tensor.numel():
                key = tensor.untyped_storage().data_ptr()
                if key in handed_out:  # the file stores it once, the model has two separate tensors
                    tensor, zero_copy = tensor.clone(), False
                handed_out.add(key)
            copy = time.perf_counter() - clock
            assign(slot, tensor)
            profile.tensors += 1
            profile.bytes += tensor.numel() * tensor.element_size()
            profile.zero_copy += zero_copy
            profile.decoded += fetched.codec != "raw"
            profile.by_codec[fetched.codec] = profile.by_codec.get(fetched.codec, 0) + 1
            profile.read_s += fetched.read_s
            profile.decode_s += fetched.decode_s
            profile.copy_s += fetched.copy_s + copy
            profile.assign_s += time.perf_counter() - clock - copy
            advance(_stored_bytes(source, slot))
        if stager is not None:
            clock = time.perf_counter()
            stager.finish()
            profile.copy_s += time.perf_counter() - clock
    for unused in early.values():
        unused.cancel()


def in_model_layout(tensor: torch.Tensor, model_tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` laid out in memory as the model's own tensor is (returned as is when it already is).

    A file may store a weight transposed (legacy ``torch.save`` of a ``.t()`` view): kernels pick other
    algorithms for other strides, so the model would compute with other rounding than
    ``load_state_dict`` (which copies into the model's tensor) gives. Contiguous tensors, the usual
    case, stay the file's mapped bytes.

    Example:
        >>> in_model_layout(torch.ones(2, 3).t(), torch.empty(3, 2, device="meta")).is_contiguous()
        True
    """
    if tensor.is_contiguous() and model_tensor.is_contiguous():
        return tensor
    if tensor.stride() == model_tensor.stride() or model_tensor.shape != tensor.shape:
        return tensor
    if model_tensor.is_contiguous() or not _dense(model_tensor):
        return tensor.contiguous()
    laid_out = torch.empty_strided(
        tensor.shape, model_tensor.stride(), dtype=tensor.dtype, device=tensor.device
    )
    return laid_out.copy_(tensor)


def _dense(tensor: torch.Tensor) -> bool:
    """Its elements fill a block of memory with neither gaps nor overlaps (a permutation of contiguous)."""
    step = 1
    for size, stride in sorted(zip(tensor.shape, tensor.stride(), strict=True), key=lambda p: p[1]):
        if size != 1:
            if stride != step:
                return False
            step *= size
    return True


def _stored_bytes(source: TensorSource, slot: Slot) -> int:
    """Bytes a slot's tensor takes in memory: the part's for a quantized layer's buffer (from its shape in
    the model, which the fetch checks), the tensor's otherwise."""
    if slot.part is not None:
        return slot.tensor.numel() * slot.tensor.element_size()
    return source.info(slot.file_name).nbytes  # type: ignore[arg-type]


def stager_for(device: torch.device | None) -> Stager | None:
    """Pinned staging for CUDA; CPU tensors need none (they are mapped or decoded in place)."""
    return Stager(device) if device is not None and device.type == "cuda" else None


def _bounded(
    pool: ThreadPoolExecutor,
    work: Iterator[tuple[Slot, Future | Callable[[], _Fetched]]],
    window: int,
) -> Iterator[tuple[Slot, _Fetched]]:
    """Run ``work`` on ``pool`` with at most ``window`` tasks in flight; yields results as they finish.

    The window bounds what waits in memory between decoding and its consumer (the CUDA transfer); a task
    may be a future already started."""
    pending: dict[Future, Slot] = {}
    try:
        for slot, task in work:
            pending[task if isinstance(task, Future) else pool.submit(task)] = slot
            while len(pending) >= window:
                yield from _collect(pending)
        while pending:
            yield from _collect(pending)
    finally:
        for future in pending:
            future.cancel()


def _collect(pending: dict[Future, Slot]) -> Iterator[tuple[Slot, _Fetched]]:
    done, _ = wait(pending, return_when=FIRST_COMPLETED)
    for future in done:
        slot = pending.pop(future)
        yield slot, future.result()


def _to_target(
    tensor: torch.Tensor,
    slot: Slot,
    device: torch.device | None,
    dtype: torch.dtype | None,
    stager: Stager | None,
) -> torch.Tensor:
    want_dtype = target_dtype(slot, dtype) or tensor.dtype
    if device is not None:
        want_device = device
    elif slot.tensor.is_meta:  # where its constructor sent it, else the CPU
        want_device = intended_device(slot.tensor) or torch.device("cpu")
    else:
        want_device = slot.tensor.device
    if stager is not None:
        tensor = stager.copy(tensor)
    elif tensor.device != want_device:
        tensor = tensor.to(want_device)
    return tensor if tensor.dtype == want_dtype else tensor.to(want_dtype)
