"""Offload: run a model larger than the memory it may hold (``load_model(..., max_memory={"cpu": "4GB"},
offload="disk")``).

The model is cut into units: the blocks Hugging Face says not to split (``_no_split_modules``), else the
entries of its longest ``nn.ModuleList``, and every other module that holds tensors of its own. In
registration order (about the order a forward runs them) units stay resident while they fit the budget;
the rest are offloaded, with no second copy written anywhere:

- a tensor stored as is, in the dtype the model wants (and a quantized layer's codes and scales, which
  are stored as is) stays the checkpoint's memory mapping: its pages come in when the forward reads them
  and a forward hook gives them back after the unit (``madvise(MADV_DONTNEED)`` on the whole pages inside
  each tensor, Linux). The mapping is private and never written, so the next forward re-reads the same
  bytes from the page cache;
- a tensor that must be decoded (int8 / int4 codes into a float model, a dtype conversion) waits on the
  meta device; a forward pre-hook decodes it from the mapped codes into the unit, the forward hook drops
  it and releases the codes' pages. Decoded memory is bounded by one unit.

Tensors tied across names stay resident. Offloaded units are for inference: their forward refuses to run
while autograd would record it (wrap calls in ``torch.inference_mode()`` or ``torch.no_grad()``), and a
write into an offloaded tensor is refused rather than silently undone by the page release.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import nn

from slimtorch.errors import OptionError, SlimtorchError
from slimtorch.format.pages import RELEASE, check_platform, release_pages, trim_heap
from slimtorch.format.source import TensorSource
from slimtorch.format.units import format_bytes
from slimtorch.graph.slots import Slot, replace
from slimtorch.loading.model_slots import assign, target_dtype
from slimtorch.loading.options import LoadOptions, LoadReport

Check = Callable[[], int]


@dataclass(eq=False)
class Unit:
    """One module the budget keeps or offloads whole, with the model's tensors it owns."""

    name: str
    module: nn.Module
    slots: list[Slot] = field(default_factory=list)
    bytes: int = 0
    """Bytes its tensors take as the model holds them (decoded, in the target dtype)."""
    mapped: list[tuple[Slot, int]] = field(default_factory=list)
    """Offloaded tensors that are the file's mapped bytes, with their version counter when loaded."""
    decoded: list[Slot] = field(default_factory=list)
    """Offloaded tensors decoded in each forward (on meta between forwards)."""


@dataclass
class OffloadPlan:
    """Which units stay resident and which are offloaded (:func:`plan_offload`)."""

    budget: int
    units: list[Unit]
    offloaded: list[Unit]
    resident_bytes: int
    source: TensorSource
    dtype: torch.dtype | None
    verify: bool
    mode: str
    """``options.offload``"""
    notes: list[str] = field(default_factory=list)
    to_decode: list[Slot] = field(default_factory=list)
    """Slots decoded by this module rather than the loader (:meth:`to_fill`)."""

    def to_fill(self, slots: list[Slot]) -> list[Slot]:
        """The slots the loader fills: those that get the file's bytes as they are. Tensors to decode are
        left to :meth:`attach`, one at a time (the loader's pool would decode several at once and leave
        their codes' pages in memory: over budget by a quarter for int8)."""
        self.to_decode = [s for s in slots if s.file_name and not _as_stored(self.source, s, self.dtype)]
        later = {id(slot) for slot in self.to_decode}
        return [slot for slot in slots if id(slot) not in later]

    def checks(self, inner: Any) -> Any:
        """What the loader hands mapped tensors' checks to: resident ones go to ``inner`` (the load's
        :class:`~slimtorch.loading.verification.Verification`), offloaded ones run now, one chunk at a
        time with the pages released after each, so checking never holds more than one chunk."""
        if inner is None:
            return None
        owned = {id(m) for unit in self.offloaded for slot in unit.slots for m, _ in slot.places}
        return _OffloadChecks(inner, owned)

    def attach(self, report: LoadReport) -> None:
        """Check that each offloaded tensor the loader mapped is the file's bytes, put the decoded ones on
        meta, release every offloaded page and hook the units; fill in the report."""
        offloaded = {id(slot) for unit in self.offloaded for slot in unit.slots}
        for slot in self.to_decode:
            if id(slot) not in offloaded:
                self._decode_resident(slot, report)
        for unit in self.offloaded:
            self._settle(unit)
            unit.module.register_forward_pre_hook(partial(_before_forward, self, unit))
            unit.module.register_forward_hook(partial(_after_forward, self, unit), always_call=True)
        report.offload = self.mode
        report.max_memory = {"cpu": self.budget}
        report.offloaded = [unit.name or "(root)" for unit in self.offloaded]
        report.resident_bytes = self.resident_bytes
        report.page_release = RELEASE
        report.notes += self.notes

    def _decode_resident(self, slot: Slot, report: LoadReport) -> None:
        """Check, decode and put in one resident tensor, its codes' pages released after each step."""
        clock = time.perf_counter()
        if self.verify:
            _check_and_release(self.source, slot)
        decoded = time.perf_counter()
        tensor = _decode(self.source, slot, self.dtype)
        assign(slot, tensor)
        report.read_s += decoded - clock
        report.decode_s += time.perf_counter() - decoded
        codec = self.source.codec(slot.file_name)  # type: ignore[arg-type]
        report.tensor_count += 1
        report.decoded += 1
        report.bytes += _nbytes(tensor)
        report.by_codec[codec] = report.by_codec.get(codec, 0) + 1

    def _settle(self, unit: Unit) -> None:
        mapped = []
        decoded = {id(slot) for slot in unit.decoded}
        for slot in unit.slots:
            if id(slot) in decoded:
                replace(slot, _placeholder(slot, self.dtype))
                if self.verify:  # their parts are checked once, here, not in every forward
                    _check_and_release(self.source, slot)
            elif _is_mapped(self.source, slot):
                mapped.append((slot, slot.tensor._version))
            else:  # a copy the loader had to make (odd alignment, stored once for two tensors): it stays
                self.resident_bytes += _nbytes(slot.tensor)
                self.notes.append(
                    f"offload: {slot.names[0]!r} is a copy, not the file's bytes: kept resident"
                )
        unit.mapped = mapped
        release_pages(slot.tensor for slot, _ in mapped)


def plan_offload(
    model: nn.Module,
    slots: list[Slot],
    source: TensorSource,
    options: LoadOptions,
    device: torch.device | None,
) -> OffloadPlan:
    """Cut ``model`` into units and fill ``options.max_memory["cpu"]`` with the first ones (tied tensors
    count first, they stay resident); with ``offload="disk"`` the rest are offloaded, without it a model
    over the budget is refused.

    Example:
        >>> plan = plan_offload(model, model_slots(model), source, LoadOptions(max_memory={"cpu": "1GB"},
        ...                     offload="disk"), None)  # doctest: +SKIP
        >>> [unit.name for unit in plan.offloaded]  # doctest: +SKIP
        ['layers.6', 'layers.7', 'norm', 'head']
    """
    if device is not None and device.type != "cpu":
        raise OptionError(
            f"offload to {device.type} is not built yet: load with device='cpu' (GPU placement with CPU "
            "offload needs a GPU to test it on)"
        )
    if options.offload == "disk":
        check_platform()
    budget = dict(options.max_memory)["cpu"]
    units = find_units(model, slots, source, options.dtype)
    resident = sum(_nbytes_as_loaded(s, options.dtype) for s in slots if _tied(s) or s.file_name is None)
    offloaded: list[Unit] = []
    room = budget
    if resident + sum(unit.bytes for unit in units) > budget:  # something is offloaded: leave room for
        room -= _decode_scratch(units, source, options.dtype)  # the codes of the tensor being decoded
    for unit in units:
        if offloaded or resident + unit.bytes > room:
            offloaded.append(unit)
        else:
            resident += unit.bytes
    if offloaded and options.offload != "disk":
        total = resident + sum(unit.bytes for unit in offloaded)
        raise OptionError(
            f"the model needs {format_bytes(total)}, more than max_memory's {format_bytes(budget)} for the "
            "CPU: pass offload='disk' (--offload disk) to keep the rest mapped from the file"
        )
    for unit in offloaded:
        _split(unit, source, options.dtype)
    return OffloadPlan(
        budget, units, offloaded, resident, source, options.dtype, bool(options.verify), options.offload
    )


def find_units(
    model: nn.Module, slots: Sequence[Slot], source: TensorSource, dtype: torch.dtype | None
) -> list[Unit]:
    """The model's units in registration order, each with the slots it owns (tied tensors and tensors the
    file lacks belong to none: they stay resident)."""
    blocks = _blocks(model)
    units: list[Unit] = []
    owner: dict[int, Unit] = {}
    for name, module in model.named_modules():
        inside = next((b for b in blocks if name.startswith(f"{b}.")), None)
        if inside is not None:
            owner[id(module)] = owner[id(model.get_submodule(inside))]
            continue
        if name in blocks or any(True for _ in _own_tensors(module)):
            units.append(Unit(name, module))
            owner[id(module)] = units[-1]
    for slot in slots:
        if _tied(slot) or slot.file_name is None:
            continue
        unit = owner[id(slot.places[0][0])]
        unit.slots.append(slot)
        unit.bytes += _nbytes_as_loaded(slot, dtype)
    return [unit for unit in units if unit.slots]


def _blocks(model: nn.Module) -> set[str]:
    """Names of the blocks kept whole: Hugging Face's ``_no_split_modules`` classes (outermost), else the
    entries of the longest ``nn.ModuleList``, else none (every module holding tensors is a unit)."""
    from slimtorch.memory.step import checkpoint_blocks

    classes = set(getattr(model, "_no_split_modules", None) or ())
    found: list[str] = []
    for name, module in model.named_modules():
        if type(module).__name__ in classes and not any(name.startswith(f"{b}.") for b in found):
            found.append(name)
    return set(found or checkpoint_blocks(model))


def _own_tensors(module: nn.Module) -> Any:
    yield from (t for t in module._parameters.values() if t is not None)
    yield from (t for t in module._buffers.values() if t is not None)


def _tied(slot: Slot) -> bool:
    return len(slot.places) > 1


def _split(unit: Unit, source: TensorSource, dtype: torch.dtype | None) -> None:
    """Which of an offloaded unit's tensors stay mapped and which are decoded per forward; a model built
    with real tensors cannot offload them (their memory is already taken)."""
    for slot in unit.slots:
        if not slot.tensor.is_meta:
            raise OptionError(
                f"offload needs the model built on the meta device: {slot.names[0]!r} already has memory "
                "(pass a function that builds the model, not the model)"
            )
        if not _as_stored(source, slot, dtype):
            unit.decoded.append(slot)


def _as_stored(source: TensorSource, slot: Slot, dtype: torch.dtype | None) -> bool:
    """The loader gives this slot the file's bytes themselves (no decode, no conversion)."""
    name: str = slot.file_name  # type: ignore[assignment]
    if slot.part is not None:
        return len(source.codec(name).split("+")) == 1
    return source.codec(name) == "raw" and source.info(name).dtype == target_dtype(slot, dtype)


def _decode_scratch(units: list[Unit], source: TensorSource, dtype: torch.dtype | None) -> int:
    """The most stored bytes one decode holds beside its result: the largest coded tensor's parts."""
    coded = [s for unit in units for s in unit.slots if not _as_stored(source, s, dtype)]
    return max((sum(map(_nbytes, _stored_parts(source, s).values())) for s in coded), default=0)


def _nbytes_as_loaded(slot: Slot, dtype: torch.dtype | None) -> int:
    want = target_dtype(slot, dtype) or slot.tensor.dtype
    return slot.tensor.numel() * torch.empty(0, dtype=want).element_size()


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _placeholder(slot: Slot, dtype: torch.dtype | None) -> torch.Tensor:
    want = target_dtype(slot, dtype) or slot.tensor.dtype
    return torch.empty(slot.tensor.shape, dtype=want, device="meta")


def _is_mapped(source: TensorSource, slot: Slot) -> bool:
    """The slot's tensor is the file's mapped bytes (so releasing its pages loses nothing)."""
    name = slot.file_name
    stored = source.part(name, slot.part[1]) if slot.part else source.get(name)  # type: ignore[arg-type]
    tensor = slot.tensor
    return tensor.numel() == 0 or (
        tensor.device.type == "cpu"
        and tensor.data_ptr() == stored.data_ptr()
        and tensor.shape == stored.shape
        and tensor.stride() == stored.stride()
    )


def _stored_parts(source: TensorSource, slot: Slot) -> dict[str, torch.Tensor]:
    return source.parts(slot.file_name)  # type: ignore[arg-type]


def _check_and_release(source: TensorSource, slot: Slot) -> None:
    """Verify the stored parts of a tensor decoded per forward once, at load, one chunk at a time."""
    parts = _stored_parts(source, slot)
    for check in source.checks(slot.file_name, parts):  # type: ignore[arg-type]
        check()
        release_pages(parts.values())


def _decode(source: TensorSource, slot: Slot, dtype: torch.dtype | None) -> torch.Tensor:
    """An offloaded tensor decoded from its mapped parts (whose pages are then released)."""
    parts = _stored_parts(source, slot)
    if slot.part is not None:
        tensor = source.part(slot.file_name, slot.part[1])  # type: ignore[arg-type]
    else:
        tensor = source.decode_parts(slot.file_name, parts)  # type: ignore[arg-type]
    want = target_dtype(slot, dtype) or tensor.dtype
    tensor = tensor.to(want) if tensor.dtype != want else tensor
    release_pages(p for p in parts.values() if p.data_ptr() != tensor.data_ptr())
    return tensor.reshape(slot.tensor.shape)


def _before_forward(plan: OffloadPlan, unit: Unit, module: nn.Module, args: Any) -> None:
    """Bring the unit's decoded tensors in; refuse a forward autograd would record (it would keep them)."""
    if torch.is_grad_enabled() and any(slot.tensor.requires_grad for slot in unit.slots):
        raise SlimtorchError(
            f"{unit.name or 'the model'!r} is offloaded (its weights leave memory after each forward): run "
            "it under torch.inference_mode() or torch.no_grad(); offload is for inference"
        )
    for slot in unit.decoded:
        replace(slot, _decode(plan.source, slot, plan.dtype))


def _after_forward(plan: OffloadPlan, unit: Unit, module: nn.Module, args: Any, output: Any) -> None:
    """Drop the decoded tensors and give the mapped pages back (refusing if someone wrote into them)."""
    for slot in unit.decoded:
        replace(slot, _placeholder(slot, plan.dtype))
    if unit.decoded:
        trim_heap()  # glibc keeps freed blocks of this size in its heap: give them back now
    for slot, version in unit.mapped:
        if slot.tensor._version != version:
            raise SlimtorchError(
                f"{slot.names[0]!r} is offloaded and was written in place: releasing its pages would undo "
                "the write; offload is for inference (load without max_memory to change weights)"
            )
    release_pages(slot.tensor for slot, _ in unit.mapped)


class _OffloadChecks:
    """The load's checks, with those of offloaded tensors run at once and their pages released."""

    def __init__(self, inner: Any, offloaded_modules: set[int]) -> None:
        self.inner = inner
        self.offloaded_modules = offloaded_modules

    def add(
        self, checks: Sequence[Check], tensor: torch.Tensor, modules: list[nn.Module], order: int
    ) -> None:
        if not any(id(m) in self.offloaded_modules for m in modules):
            self.inner.add(checks, tensor, modules, order)
            return
        for check in checks:
            check()
            release_pages([tensor])
