"""Every slot of a model filled from the file: fetched (:mod:`slimtorch.loading.fetching`) on the load's
pool, a few at a time, and put into the model as each arrives, mapped where the file's bytes can be the
model's own, checked before use where they cannot."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

import torch

from slimtorch.format.progress import Progress
from slimtorch.format.progress import task as progress_task
from slimtorch.format.source import TensorSource
from slimtorch.graph.slots import Slot, replace
from slimtorch.loading import fetching
from slimtorch.loading.construct import intended_device
from slimtorch.loading.fetching import Fetched, checked, on_the_caller, under_watch, watching
from slimtorch.loading.model_slots import assign, fills_in_place, target_dtype
from slimtorch.loading.options import LoadReport
from slimtorch.loading.staging import Stager
from slimtorch.loading.verification import Verification


def fill(
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
    watched = watching(checks)
    filled: list[tuple[Fetched, torch.Tensor, bool, float, float]] = []  # added to the report at the end

    def task(slot: Slot) -> Fetched | Future | Callable[[], Fetched]:
        verify = None if checks is None else "later" if stager is None and slot.tensor.is_meta else "now"
        if slot.part is not None:
            return lambda: fetching.fetch_part(source, slot, verify, watched)
        name = slot.file_name
        assert name is not None  # todo holds only the slots matched to a stored tensor
        started = early.pop(stored.get(name, name), None)
        dtype_of = target_dtype(slot, dtype)
        if started is None and stager is None and on_the_caller(source, source.info(name), dtype_of):
            return fetching.fetch(source, name, dtype_of, convert, verify, watched)
        return started or (lambda: fetching.fetch(source, name, dtype_of, convert, verify, watched))

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
                checked(fetched.checks, later=False)  # copied from the mapping: checked before it is used
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
    199 tensors). Everything else goes the general way (:func:`fill`)."""

    source: TensorSource
    dtype: torch.dtype | None
    watched: Verification | None
    order: dict[int, int]
    handed_out: set[int]
    filled: list[tuple[Fetched, torch.Tensor, bool, float, float]]

    def fill(
        self, slot: Slot, device: torch.device | None, advance: Callable[[int], None], sizes: list[int]
    ) -> bool:
        """Fill ``slot`` if it takes the file's bytes as they are; False: left for the general path."""
        clock, model_tensor, name = time.perf_counter(), slot.tensor, slot.file_name
        if slot.part is not None or not model_tensor.is_meta or name is None:
            return False
        if (intended_device(model_tensor) or device or _CPU) != _CPU or not model_tensor.is_contiguous():
            return False
        stored = under_watch(self.source, name, "later", self.watched)
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
        fetched = Fetched(tensor, read_s=mapped - clock, zero_copy=True)
        self.filled.append((fetched, tensor, True, 0.0, time.perf_counter() - mapped))
        if sizes:
            advance(sizes[index])
        return True


_CPU = torch.device("cpu")


def _tally(report: LoadReport, filled: list[tuple[Fetched, torch.Tensor, bool, float, float]]) -> None:
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


def _bounded(
    pool: ThreadPoolExecutor,
    work: Iterator[tuple[Slot, Fetched | Future | Callable[[], Fetched]]],
    window: int,
) -> Iterator[tuple[Slot, Fetched]]:
    """Run ``work`` on ``pool`` with at most ``window`` tasks in flight; yields results as they finish.

    The window bounds what waits in memory between decoding and its consumer (the CUDA transfer); a task
    may be a future already started, or its result already fetched."""
    pending: dict[Future, Slot] = {}
    try:
        for slot, task in work:
            if isinstance(task, Fetched):
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


def _collect(pending: dict[Future, Slot]) -> Iterator[tuple[Slot, Fetched]]:
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
