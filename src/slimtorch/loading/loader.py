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

This module decides (options, the model, its slots matched to the file's names, the checks); how one
tensor comes out of the file is :mod:`slimtorch.loading.fetching`, how the slots are filled with them
:mod:`slimtorch.loading.filling`.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch import nn

from slimtorch.errors import FormatError, OptionError, SlimtorchError
from slimtorch.format.delta import StructuralDelta, apply_delta
from slimtorch.format.pages import release_unwritten
from slimtorch.format.progress import Progress
from slimtorch.format.source import TensorSource
from slimtorch.format.verbs import resolve
from slimtorch.graph.slots import Slot, model_slots
from slimtorch.loading.construct import build_model, intended_device
from slimtorch.loading.fetching import prefetch
from slimtorch.loading.filling import fill
from slimtorch.loading.model_slots import file_slots, match, place_the_rest
from slimtorch.loading.offload import plan_offload
from slimtorch.loading.options import LoadOptions, LoadReport
from slimtorch.loading.sharded import fill_sharded, is_sharded, shard_model
from slimtorch.loading.staging import Stager
from slimtorch.loading.verification import Verification
from slimtorch.sources import open_checkpoint

__all__ = [
    "LoadOptions",
    "LoadReport",
    "load",
    "load_model",
]

DECODE_THREADS = min(4, os.cpu_count() or 1)
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
        fill(source, slots, target, options.dtype, stager, pool, {}, progress, report, checks)
    _verify(checks, "eager" if options.verify else False, report)  # no forward to wait in: wait now
    report.wall_s = time.perf_counter() - started
    by_name = {name: slot.tensor for slot in slots for name in slot.names}
    report.tensors = {name: by_name[name] for name in source.names()}
    return report


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
            folder, sharded or not). The file comes first, as in ``torch.load(f)``, and the object
            first when saving, as in ``torch.save(obj, f)`` (:func:`slimtorch.save_model`); the other
            order (safetensors' ``load_model(model, filename)``) is an :class:`OptionError`.
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
    if isinstance(path, nn.Module):  # safetensors' load_model(model, filename) is the other way round
        raise OptionError("load_model takes the file first, then the model: load_model(path, model)")
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
        early = {} if stager or budget else prefetch(source, pool, options.dtype, checks)
        try:
            model, slots = _matched_model(source, model_or_factory, options, report)
            plan = plan_offload(model, slots, source, options, target) if budget else None
            filled, fill_checks = (plan.to_fill(slots), plan.checks(checks)) if plan else (slots, checks)
            fill(source, filled, target, options.dtype, stager, pool, early, progress, report, fill_checks)
        except BaseException:
            pool.shutdown(wait=False, cancel_futures=True)  # fail now, not after decoding the whole file
            raise
        place_the_rest(model, target, options.dtype)
        if plan is not None:
            plan.attach(report)
    lookups = lookup_tables(model) if stager is None and plan is None else []
    _verify(checks, options.verify, report, after=functools.partial(release_unwritten, lookups))
    report.wall_s = time.perf_counter() - started
    report.model = model
    return report


def lookup_tables(model: nn.Module) -> list[torch.Tensor]:
    """The tensors of the model's embeddings (``nn.Embedding``, and layers marked ``ROWS_LOOKED_UP``) that
    no other layer holds (a head tied to them reads every row). A forward reads only the rows of the
    tokens it is given, so once the load has checked them their mapped pages are given back
    (:func:`~slimtorch.format.pages.release_unwritten`): a Llama-3-8B's bfloat16 embedding is 1 GiB,
    of which a prompt reads a few rows."""
    tables: list[torch.Tensor] = []
    held: set[int] = set()
    for module in model.modules():
        own = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
        if isinstance(module, nn.Embedding) or getattr(module, "ROWS_LOOKED_UP", False):
            tables += own
        else:
            held.update(t.data_ptr() for t in own)
    return [t for t in tables if t.data_ptr() not in held]


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


def _verify(
    checks: Verification | None,
    mode: str | bool,
    report: LoadReport,
    after: Callable[[], Any] = lambda: None,
) -> None:
    """Run the load's checks as ``mode`` says: all before returning (``"eager"``), or beside the caller
    with each module's forward waiting for its own (``"before-use"``); ``after`` once they are done."""
    report.verify = mode if isinstance(mode, str) else "off"
    if checks is None:
        after()
        return

    def finished() -> None:
        _record_checks(checks, report)
        after()

    checks.start(hooks=mode == "before-use", on_finish=finished)
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
        apply_delta(model, _rebased(StructuralDelta.from_json(recorded), model))
    except SlimtorchError as exc:
        raise FormatError(source.path, str(exc)) from None


def _rebased(delta: StructuralDelta, model: nn.Module) -> StructuralDelta:
    """``delta`` with its module names under the model's own prefix, as the tensors' names are matched:
    a folder written under its file's names (``bert.encoder...``, custom heads beside) loads into the
    transformers body (``encoder...``), and one written from that body into the class around it. The
    delta as it is where every name is the model's, or where no one prefix makes them so (the error then
    names the first)."""
    modules = {name for name, _ in model.named_modules()}
    named = [*delta.attributes, *delta.quantized, *(key.rpartition(".")[0] for key in delta.shapes)]
    missing = next((name for name in named if name not in modules), None)
    if missing is None:
        return delta
    candidates = [("", module[: -len(missing)]) for module in modules if module.endswith(f".{missing}")]
    parts = missing.split(".")
    candidates += [(".".join(parts[:i]) + ".", "") for i in range(1, len(parts))]
    for strip, add in candidates:
        moved = [add + name.removeprefix(strip) for name in named if name.startswith(strip)]
        if len(moved) == len(named) and all(name in modules for name in moved):
            return StructuralDelta(
                {add + key.removeprefix(strip): shape for key, shape in delta.shapes.items()},
                {add + key.removeprefix(strip): value for key, value in delta.attributes.items()},
                {add + key.removeprefix(strip): value for key, value in delta.quantized.items()},
            )
    return delta


def stager_for(device: torch.device | None) -> Stager | None:
    """Pinned staging for CUDA; CPU tensors need none (they are mapped or decoded in place)."""
    return Stager(device) if device is not None and device.type == "cuda" else None
