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

import contextlib
import functools
import gc
import os
import time
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from slimtorch.errors import FormatError, OptionError, SlimtorchError, deprecated
from slimtorch.format.delta import StructuralDelta, apply_delta
from slimtorch.format.progress import Progress
from slimtorch.format.progress import task as progress_task
from slimtorch.format.source import TensorInfo, TensorSource
from slimtorch.format.verbs import resolve
from slimtorch.graph.slots import Slot, model_slots, replace
from slimtorch.loading.construct import build_model, intended_device
from slimtorch.loading.model_slots import (
    assign,
    file_slots,
    fills_in_place,
    match,
    place_the_rest,
    target_dtype,
)
from slimtorch.loading.offload import plan_offload
from slimtorch.loading.options import LoadOptions, LoadProfile, LoadReport
from slimtorch.loading.sharded import fill_sharded, is_sharded, shard_model
from slimtorch.loading.staging import Stager
from slimtorch.loading.verification import Check, Verification
from slimtorch.sources import open_checkpoint

__all__ = [
    "LoadOptions",
    "LoadProfile",
    "LoadReport",
    "load",
    "load_model",
    "load_model_profiled",
    "load_profiled",
]

DECODE_THREADS = min(4, os.cpu_count() or 1)
SMALL_TENSOR = 1 << 20
"""Bytes under which a tensor is fetched on the calling thread (see :func:`_on_the_caller`)."""
ModelOrFactory = nn.Module | Callable[[], nn.Module]


def load(
    path: str | os.PathLike[str],
    /,
    options: LoadOptions | None = None,
    *,
    progress: Progress | None = None,
    **overrides: Any,
) -> LoadReport:
    """Load every tensor of a checkpoint (slim or any format :func:`slimtorch.open` reads) as a dict: the
    report's ``tensors``.

    Tensors stored as is come memory-mapped from the file (copy-on-write); coded ones are decoded on a
    thread pool. A slim file's parts are checked against their CRC-32 first (``verify=False`` skips
    that); a mismatch raises :class:`slimtorch.FormatError` naming the tensor. Tied tensors come back as
    one tensor under several names, equal copies as separate tensors. ``device`` and ``dtype`` apply as
    in :func:`load_model`; the options that match names to a model (``strict``, ``prefix``, ``rename``)
    are refused, for there is no model.

    Example:
        >>> import slimtorch
        >>> state = slimtorch.load("model.safetensors").tensors  # doctest: +SKIP
        >>> model.load_state_dict(state)  # doctest: +SKIP
    """
    options = resolve(LoadOptions, options, overrides, "load")
    given = options.model_only_given()
    if given is not None:
        raise OptionError(
            f"load: {given!r} applies to a model (matching names, a memory budget, shards), and load "
            "has no model: use load_model (slimtorch load --model)"
        )
    started = time.perf_counter()
    target = _device(options.device)
    source, report = _open(path, target, options)
    stager = stager_for(target)
    checks = _checks(source, options, report, stager, budget=False)
    with source, ThreadPoolExecutor(report.threads) as pool, _cancelled_on_error(checks):
        slots = file_slots(source)
        _fill(source, slots, target, options.dtype, stager, pool, {}, progress, report, checks)
    _verify(checks, "eager" if options.verify else False, report)  # no forward to wait in: wait now
    report.wall_s = time.perf_counter() - started
    by_name = {name: slot.tensor for slot in slots for name in slot.names}
    report.tensors = {name: by_name[name] for name in source.names()}
    return report


@dataclass(slots=True)
class _Fetched:
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


def load_model(
    path: str | os.PathLike[str],
    model_or_factory: ModelOrFactory,
    /,
    options: LoadOptions | None = None,
    *,
    progress: Progress | None = None,
    **overrides: Any,
) -> LoadReport:
    """Build a model and fill it from a checkpoint, fast and without holding the weights twice: the
    report's ``model``, with where the time went (``slimtorch load --profile`` prints it).

    Args:
        path: any checkpoint :func:`slimtorch.open` reads (slim, safetensors, torch.save, Hugging Face
            folder, sharded or not).
        model_or_factory: a callable returning the model (built with parameters on the meta device: no
            RAM, no random init), or a model. A model's real tensors are filled in place; its meta
            tensors are replaced.
        options: a :class:`LoadOptions` (device, dtype, strict, verify, threads, allow_globals, prefix,
            rename), or its fields as keywords. Names the model declares it does without (its
            non-persistent buffers, Hugging Face's ``_keys_to_ignore_on_load_*``) are left out and listed
            in the report, never refused.
        progress: told how many bytes got loaded (:mod:`slimtorch.format.progress`); None: silent.

    A slim file's checksums are checked from the moment it is opened, beside the model's construction
    (:mod:`slimtorch.loading.verification`), and waited for as ``verify`` says (:class:`LoadOptions`): by
    default every one before returning; with ``verify="before-use"`` beside your code, each module's
    forward waiting for its own tensors' (and raising a mismatch there), ``report.wait()`` for all.

    Example:
        >>> import slimtorch, torch
        >>> build = lambda: torch.nn.Linear(1024, 1024)
        >>> model = slimtorch.load_model("linear.safetensors", build).model  # doctest: +SKIP
        >>> report = slimtorch.load_model("ckpt.pt", Net, rename={"lstm.": "rnn."})  # doctest: +SKIP
    """
    options = resolve(LoadOptions, options, overrides, "load_model")
    started = time.perf_counter()
    target = _device(options.device)
    if options.mesh is not None or is_sharded(model_or_factory):
        return _load_sharded(path, model_or_factory, options, target, progress)
    with _collector_paused():
        return _load_model(path, model_or_factory, options, target, progress, started)


def _load_model(
    path: str | os.PathLike[str],
    model_or_factory: ModelOrFactory,
    options: LoadOptions,
    target: torch.device | None,
    progress: Progress | None,
    started: float,
) -> LoadReport:
    source, report = _open(path, target, options)
    stager = stager_for(target)
    budget = bool(options.max_memory)  # offload: nothing decoded before the plan says what stays
    checks = _checks(source, options, report, stager, budget)
    with source, ThreadPoolExecutor(report.threads) as pool, _cancelled_on_error(checks):
        # The factory runs Python (holding the GIL) while the pool maps and decodes (releasing it).
        early = {} if stager or budget else _prefetch(source, pool, options.dtype, checks)
        try:
            model, slots = _matched_model(source, model_or_factory, options, report)
            plan = plan_offload(model, slots, source, options, target) if budget else None
            filled, fill_checks = (plan.to_fill(slots), plan.checks(checks)) if plan else (slots, checks)
            _fill(source, filled, target, options.dtype, stager, pool, early, progress, report, fill_checks)
        except BaseException:
            pool.shutdown(wait=False, cancel_futures=True)  # fail now, not after decoding the whole file
            raise
        place_the_rest(model, target, options.dtype)
        if plan is not None:
            plan.attach(report)
    _verify(checks, options.verify, report)
    report.wall_s = time.perf_counter() - started
    report.model = model
    return report


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off while a load makes its thousands of small objects, none of
    them garbage, and back on after as it was: BERT-base's load ran 16 collections (3 ms of its 50)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _load_sharded(
    path: str | os.PathLike[str],
    model_or_factory: ModelOrFactory,
    options: LoadOptions,
    target: torch.device | None,
    progress: Progress | None,
) -> LoadReport:
    """Each rank reads only its own shards into a model torch shards (:mod:`slimtorch.loading.sharded`)."""
    started = time.perf_counter()
    source, report = _open(path, target, options)
    with source:
        shard = functools.partial(shard_model, options=options, device=target)
        model, slots = _matched_model(source, model_or_factory, options, report, shard)
        fill_sharded(source, slots, options, report, progress)
    report.wall_s = time.perf_counter() - started
    report.model = model
    return report


def _matched_model(
    source: TensorSource,
    model_or_factory: ModelOrFactory,
    options: LoadOptions,
    report: LoadReport,
    shard: Callable[[nn.Module], None] | None = None,
) -> tuple[nn.Module, list[Slot]]:
    """The model built (or given), reshaped to the file's structural delta, and its slots matched to the
    file's names, shapes checked: everything decided before a tensor is put in."""
    clock = time.perf_counter()
    model, note = _model(model_or_factory)
    report.construct_s = time.perf_counter() - clock
    report.model_class = type(model).__name__
    report.notes += [note] if note else []
    _reshape(source, model)
    if shard is not None:
        shard(model)  # sharded and given memory before its slots are taken: they are the DTensors
    slots = model_slots(model)
    built = not isinstance(model_or_factory, nn.Module)
    report.record(
        match(
            source,
            model,
            slots,
            strict=options.strict,
            built=built,
            prefix=options.prefix,
            rename=options.rename,
        )
    )
    if options.device is None:
        _check_intended_devices(slots)
    return model, slots


def _load_model_profiled(*args: Any, **kwargs: Any) -> tuple[nn.Module, LoadReport]:
    report = load_model(*args, **kwargs)
    return report.model, report  # type: ignore[return-value]


def _load_profiled(*args: Any, **kwargs: Any) -> tuple[dict[str, torch.Tensor], LoadReport]:
    report = load(*args, **kwargs)
    return report.tensors, report  # type: ignore[return-value]


load_model_profiled = deprecated(
    _load_model_profiled, "slimtorch.load_model_profiled", "report = slimtorch.load_model(...); report.model"
)
load_profiled = deprecated(
    _load_profiled, "slimtorch.load_profiled", "report = slimtorch.load(...); report.tensors"
)


def _checks(
    source: TensorSource, options: LoadOptions, report: LoadReport, stager: Stager | None, budget: bool
) -> Verification | None:
    """The load's checks (None: ``verify=False``). A slim file loaded to the CPU in full has every stored
    byte checked from now on, beside the model's construction (:meth:`Verification.watch`); staged
    (CUDA) and offloading loads check each tensor as it is read, for they release its pages after."""
    if not options.verify:
        return None
    checks = Verification(options.threads or DECODE_THREADS)
    if source.coded and stager is None and not budget:
        clock = time.perf_counter()
        checks.watch(source)
        report.open_s += time.perf_counter() - clock  # laying out the spans is part of opening the file
    return checks


@contextlib.contextmanager
def _cancelled_on_error(checks: Verification | None) -> Iterator[None]:
    """A load that fails stops its checks (they would read a file nobody uses)."""
    try:
        yield
    except BaseException:
        if checks is not None:
            checks.cancel()
        raise


def _open(
    path: str | os.PathLike[str], device: torch.device | None, options: LoadOptions
) -> tuple[TensorSource, LoadReport]:
    clock = time.perf_counter()
    source = open_checkpoint(path, allow_globals=options.allow_globals)
    source.verify = False  # the loader runs the checks itself (source.checks): some now, some later
    report = LoadReport(str(path), source.format, str(device or "cpu"), options.threads or DECODE_THREADS)
    report.open_s = time.perf_counter() - clock
    report.file_bytes = source.file_bytes
    return source, report


def _verify(checks: Verification | None, mode: str | bool, report: LoadReport) -> None:
    """Run the load's checks as ``mode`` says: all before returning (``"eager"``), or beside the caller
    with each module's forward waiting for its own (``"before-use"``)."""
    report.verify = mode or "off"
    if checks is None:
        return
    checks.start(hooks=mode == "before-use", on_finish=lambda: _record_checks(checks, report))
    if mode == "eager":
        checks.wait()
    else:
        checks.returned()
        report.checks = checks


def _record_checks(checks: Verification, report: LoadReport) -> None:
    stats = checks.stats
    report.verify_s, report.verified_bytes = stats.check_s, stats.checked_bytes
    report.verify_wall_s, report.verify_after_s = stats.wall_s, stats.after_return_s
    report.verify_waited_s = stats.waited_s


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


def _fetch(
    source: TensorSource,
    name: str,
    dtype: torch.dtype | None,
    convert: bool,
    verify: str | None,
    watched: Verification | None = None,
) -> _Fetched:
    """Read (and decode) one tensor on a worker thread; converted to ``dtype`` when ``convert``.

    ``verify``: None (no checks), ``"now"``, or ``"later"``: a tensor that stays the mapped bytes
    themselves leaves its checks to the caller; one decoded or converted is checked first, always. Under
    ``watched`` (a file-wide check, :meth:`Verification.watch`) checking first is waiting for it."""
    clock = time.perf_counter()
    parts = source.parts(name)
    codec = source.codec(name)
    converts = convert and dtype is not None and source.info(name).dtype != dtype
    later = verify == "later" and codec == "raw" and not converts
    stored = _under_watch(source, name, verify, watched)
    checks: list[Check] = []
    if stored is None:
        checks = _checked(source.checks(name, parts), later) if verify else []
    elif not later:
        watched.verify_stored(stored)  # type: ignore[union-attr]
        stored = None
    read = time.perf_counter()
    tensor = source.decode_parts(name, parts)
    if checks and tensor is not parts.get(""):
        checks = _checked(checks, later=False)  # decoding only viewed them, but the model gets a copy
    fetched = _Fetched(tensor, read - clock, time.perf_counter() - read, codec=codec, checks=checks)
    fetched.watched = stored
    fetched.zero_copy = fetched.codec == "raw"
    if convert and dtype is not None and fetched.tensor.dtype != dtype:
        clock = time.perf_counter()
        fetched.tensor = fetched.tensor.to(dtype)
        fetched.copy_s = time.perf_counter() - clock
        fetched.zero_copy = False
    return fetched


def _under_watch(
    source: TensorSource, name: str, verify: str | None, watched: Verification | None
) -> str | None:
    """The stored tensor file name ``name`` reads (a tie or copy reads the tensor it shares) where the
    load's file-wide check covers it, else None (its own checks apply, or none without ``verify``)."""
    if not verify or watched is None:
        return None
    stored = source.ties().get(name, source.copies().get(name, name))
    return stored if watched.covers(stored) else None


def _watching(checks: object) -> Verification | None:
    """``checks`` when it is a load's file-wide check (:meth:`Verification.watch`), else None."""
    return checks if isinstance(checks, Verification) and checks.watching else None


def _checked(checks: list[Check], later: bool) -> list[Check]:
    """``checks`` to run later, or none once they have run here."""
    if later:
        return checks
    for check in checks:
        check()
    return []


def _prefetch(
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
        info for info in source.infos() if info.name not in shared and not _on_the_caller(source, info, dtype)
    ]
    quantized = _quantized_weights(source)
    return {
        info.name: pool.submit(
            _fetch,
            source,
            info.name,
            dtype if info.dtype.is_floating_point else None,
            dtype is not None,
            "later" if checks is not None else None,
            _watching(checks),
        )
        for info in stored
        if info.name not in quantized
    }


def _on_the_caller(source: TensorSource, info: TensorInfo, dtype: torch.dtype | None) -> bool:
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


def _fetch_part(
    source: TensorSource, slot: Slot, verify: str | None, watched: Verification | None = None
) -> _Fetched:
    """A quantized layer's buffer: one part of a coded tensor, as stored (mapped; checked as ``verify``
    says for :func:`_fetch`, or now when the part is made from the stored ones)."""
    clock = time.perf_counter()
    name, role = slot.file_name, slot.part[1]  # type: ignore[index]
    checks: list[Check] = []
    stored_name = _under_watch(source, name, verify, watched)  # type: ignore[arg-type]
    if verify:
        stored, stages = source.parts(name), source.stages(name)  # type: ignore[arg-type]
        as_stored = role in stored and len(stages) <= 1 and not (stages and stages[0].get("packing"))
        if stored_name is not None and not (as_stored and verify == "later"):
            watched.verify_stored(stored_name)  # type: ignore[union-attr]
            verify, stored_name = None, None  # checked: nothing left to do below
        elif stored_name is None and not as_stored:
            _checked(source.checks(name, stored), later=False)  # type: ignore[arg-type]
    tensor = source.part(name, role)  # type: ignore[arg-type]
    if verify and as_stored and stored_name is None:
        checks = _checked(source.checks(name, {role: tensor}), verify == "later")  # type: ignore[arg-type]
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
    fetched = _Fetched(tensor, time.perf_counter() - clock, zero_copy=zero_copy, codec=codec, checks=checks)
    fetched.watched = stored_name
    return fetched


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
    report: LoadReport,
    checks: Verification | None,
) -> None:
    """Fetch every slot's tensor on the pool and put it into the model as it arrives.

    ``early`` holds fetches started before the model existed, by stored name (each serves one slot).
    A tensor that becomes the model's as mapped leaves its checks to ``checks``; any other is checked
    before the model gets it."""
    todo = [s for s in slots if s.file_name is not None]
    order = {id(slot): i for i, slot in enumerate(todo)}
    # only a load whose progress is shown needs the sizes up front (1 us a tensor, asked of the file)
    sizes = [_stored_bytes(source, s) for s in todo] if progress is not None else []
    handed_out: set[int] = set()  # storages already given to a slot: a second slot gets a copy
    stored = source.ties()
    # CUDA: convert on the device after the transfer (cheaper there, and the transfer is smaller).
    convert = stager is None
    watched = _watching(checks)
    filled: list[tuple[_Fetched, torch.Tensor, bool, float, float]] = []  # added to the report at the end

    def task(slot: Slot) -> _Fetched | Future | Callable[[], _Fetched]:
        verify = None if checks is None else "later" if stager is None and slot.tensor.is_meta else "now"
        if slot.part is not None:
            return lambda: _fetch_part(source, slot, verify, watched)
        started = early.pop(stored.get(slot.file_name, slot.file_name), None)  # type: ignore[arg-type]
        dtype_of = target_dtype(slot, dtype)
        if (
            started is None
            and stager is None
            and _on_the_caller(source, source.info(slot.file_name), dtype_of)
        ):
            return _fetch(source, slot.file_name, dtype_of, convert, verify, watched)  # type: ignore[arg-type]
        return started or (lambda: _fetch(source, slot.file_name, dtype_of, convert, verify, watched))

    with progress_task(progress, "loading", sum(sizes)) as advance:
        if source.coded and stager is None and (checks is None or watched is not None):
            lane = _AsStored(source, dtype, watched, order, handed_out, filled)
            todo = [slot for slot in todo if not lane.fill(slot, device, advance, sizes)]
        for slot, fetched in _bounded(pool, ((s, task(s)) for s in todo), window=2 * report.threads):
            clock, index = time.perf_counter(), order[id(slot)]
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
            if fetched.watched is not None and zero_copy:
                checks.use(fetched.watched, [m for m, _ in slot.places], index)  # type: ignore[union-attr]
            elif fetched.watched is not None:
                checks.verify_stored(fetched.watched)  # type: ignore[union-attr]  # copied: checked first
            elif fetched.checks and zero_copy:
                checks.add(fetched.checks, tensor, [m for m, _ in slot.places], index)  # type: ignore[union-attr]
            elif fetched.checks:
                _checked(fetched.checks, later=False)  # copied from the mapping: checked before it is used
            copied = time.perf_counter()
            if replaced:
                replace(slot, tensor)
            else:
                assign(slot, tensor)  # fills the built model's tensor in place
            filled.append((fetched, tensor, zero_copy, copied - clock, time.perf_counter() - copied))
            if sizes:
                advance(sizes[index])
        if stager is not None:
            clock = time.perf_counter()
            stager.finish()
            report.copy_s += time.perf_counter() - clock
    _tally(report, filled)
    for unused in early.values():
        unused.cancel()


@dataclass
class _AsStored:
    """The usual load of a slim file to the CPU, on a short path: a slot whose tensor the file stores as
    is (raw, in the slot's dtype, laid out as the model's) becomes the file's mapped bytes, tied to the
    spans of the file-wide check over them (BERT-base: 9 us a tensor against the general path's 13, on
    199 tensors). Everything else goes the general way (:func:`_fill`)."""

    source: TensorSource
    dtype: torch.dtype | None
    watched: Verification | None
    order: dict[int, int]
    handed_out: set[int]
    filled: list[tuple[_Fetched, torch.Tensor, bool, float, float]]

    def fill(
        self, slot: Slot, device: torch.device | None, advance: Callable[[int], None], sizes: list[int]
    ) -> bool:
        """Fill ``slot`` if it takes the file's bytes as they are; False: left for the general path."""
        clock, model_tensor, name = time.perf_counter(), slot.tensor, slot.file_name
        if slot.part is not None or not model_tensor.is_meta or name is None:
            return False
        if (intended_device(model_tensor) or device or _CPU) != _CPU or not model_tensor.is_contiguous():
            return False
        stored = _under_watch(self.source, name, "later", self.watched)
        if self.watched is not None and stored is None:
            return False  # not under the file-wide check: its own checks, on the general path
        tensor = self.source.as_stored(name)
        if tensor is None or tensor.dtype != target_dtype(slot, self.dtype) or not tensor.is_contiguous():
            return False
        key = tensor.untyped_storage().data_ptr() if tensor.numel() else None
        if key in self.handed_out:
            return False  # stored once for two separate tensors: the general path copies it
        if key is not None:
            self.handed_out.add(key)
        index = self.order[id(slot)]
        if stored is not None:
            self.watched.use(stored, [module for module, _ in slot.places], index)  # type: ignore[union-attr]
        mapped = time.perf_counter()
        replace(slot, tensor)
        fetched = _Fetched(tensor, read_s=mapped - clock, zero_copy=True)
        self.filled.append((fetched, tensor, True, 0.0, time.perf_counter() - mapped))
        if sizes:
            advance(sizes[index])
        return True


_CPU = torch.device("cpu")


def _tally(report: LoadReport, filled: list[tuple[_Fetched, torch.Tensor, bool, float, float]]) -> None:
    """Add the tensors put into the model to the report: counts, bytes, codecs and where the time went
    (summed here once, not field by field as each tensor goes in)."""
    report.tensor_count += len(filled)
    report.bytes += sum(tensor.numel() * tensor.element_size() for _, tensor, _, _, _ in filled)
    report.zero_copy += sum(zero_copy for _, _, zero_copy, _, _ in filled)
    report.decoded += sum(fetched.codec != "raw" for fetched, *_ in filled)
    for fetched, *_ in filled:
        report.by_codec[fetched.codec] = report.by_codec.get(fetched.codec, 0) + 1
    report.read_s += sum(fetched.read_s for fetched, *_ in filled)
    report.decode_s += sum(fetched.decode_s for fetched, *_ in filled)
    report.copy_s += sum(fetched.copy_s + copy for fetched, _, _, copy, _ in filled)
    report.assign_s += sum(assigned for *_, assigned in filled)


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
    work: Iterator[tuple[Slot, _Fetched | Future | Callable[[], _Fetched]]],
    window: int,
) -> Iterator[tuple[Slot, _Fetched]]:
    """Run ``work`` on ``pool`` with at most ``window`` tasks in flight; yields results as they finish.

    The window bounds what waits in memory between decoding and its consumer (the CUDA transfer); a task
    may be a future already started, or its result already fetched."""
    pending: dict[Future, Slot] = {}
    try:
        for slot, task in work:
            if isinstance(task, _Fetched):
                yield slot, task
                continue
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
