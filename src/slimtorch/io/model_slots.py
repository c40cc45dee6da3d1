"""The model side of loading: which tensors a model has, which file tensor fills each, and putting it in.

A :class:`Slot` is one tensor of the model under every name it has (tied parameters share one slot), so a
tie is filled once and stays a tie. Matching finds each slot's tensor in the file, under a training
wrapper prefix if the file has one, and checks shapes before anything is read.

A quantized layer's buffers are the *parts* of one coded tensor of the file (``fc.qweight`` is the part
``q`` of ``fc.weight``): its class says so in ``SLIM_PARTS``, and such a slot is filled with that part as
stored, never decoded.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from slimtorch.errors import FormatError
from slimtorch.io.readers.slim import SlimSource
from slimtorch.io.source import TensorSource

# Prefixes a training script puts in front of a model's names: {"model": state_dict}, DataParallel.
WRAPPER_PREFIXES = ("", "model.", "module.", "state_dict.", "model_state_dict.", "net.", "model.module.")


@dataclass
class Slot:
    """One tensor of the model, under every name it has (tied parameters share a slot)."""

    names: list[str]
    places: list[tuple[nn.Module, str]]
    tensor: torch.Tensor
    parameter: bool
    file_name: str | None = None
    part: tuple[str, str] | None = None
    """(coded tensor's name in the model, part role) for a quantized layer's buffer; the tensor is that
    part as stored"""


def model_slots(model: nn.Module) -> list[Slot]:
    """Every parameter and persistent buffer, one slot per tensor (a tied tensor has several names)."""
    slots: dict[int, Slot] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        coded = getattr(type(module), "SLIM_PARTS", {})
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
                slots[id(tensor)] = slot = Slot([name], [(module, attr)], tensor, parameter)
                if attr in coded:
                    whole, role = coded[attr]
                    slot.part = (f"{prefix}.{whole}" if prefix else whole, role)
            elif name not in slot.names:
                slot.names.append(name)
                slot.places.append((module, attr))
    return list(slots.values())


def file_slots(source: TensorSource) -> list[Slot]:
    """One slot per stored tensor of the file, without a model: tied names share a slot.

    A slim file lists its ties; in other formats a tie is two names on the same view of one storage.
    """
    slim = isinstance(source, SlimSource)
    slots: dict[object, Slot] = {}
    for info in source.infos():
        if slim:
            key: object = source.layout.ties.get(info.name, info.name)  # type: ignore[union-attr]
        else:
            key = (info.storage, info.storage_offset, info.shape, info.stride, info.dtype)
        if key in slots:
            slots[key].names.append(info.name)
            continue
        template = torch.empty(info.shape, dtype=info.dtype, device="meta")
        slots[key] = Slot([info.name], [], template, parameter=False, file_name=info.name)
    return list(slots.values())


def match(source: TensorSource, slots: list[Slot], strict: bool, built: bool) -> None:
    """Find each slot's tensor in the file (under a wrapper prefix if the file has one); check shapes."""
    available = set(source.names())
    prefix = max(WRAPPER_PREFIXES, key=lambda p: sum(p + n in available for s in slots for n in s.names))
    used: set[str] = set()
    missing: list[str] = []
    for slot in slots:
        names = [slot.part[0]] if slot.part else slot.names
        found = [prefix + n for n in names if prefix + n in available]
        used.update(found)
        if not found:
            if slot.tensor.is_meta or strict:
                missing.append(names[0])
            continue
        slot.file_name = found[0]
        if slot.part:
            _check_part(source, slot)
            continue
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


def _check_part(source: TensorSource, slot: Slot) -> None:
    """A quantized layer's buffer takes a part of a coded tensor: the file must have coded it the same way."""
    name = slot.file_name
    (module, _), model_name = slot.places[0], slot.names[0]
    if not isinstance(source, SlimSource):
        raise FormatError(
            source.path,
            f"the model's {model_name!r} is part of a quantized layer, but {source.format} files store "
            "float weights: load them into the float model, then quantize it",
        )
    entry = source.entry(name)  # type: ignore[arg-type]
    expected = module.stage
    if not entry.stages:
        raise FormatError(
            source.path,
            f"tensor {name!r} is stored unquantized, but the model's layer holds {expected['codec']} codes: "
            "load it into the float model, then quantize it",
        )
    stored = entry.stages[0]
    differs = [
        key for key in ("codec", "shape", "group_size", "flat") if stored.get(key) != expected.get(key)
    ]
    if differs:
        raise FormatError(
            source.path,
            f"tensor {name!r} is stored as {stored.get('codec')} {stored.get('shape')}, but the model's "
            f"quantized layer holds {expected['codec']} {expected['shape']} ({', '.join(differs)} differ)",
        )


def _some(names: list[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:3])
    more = f" and {len(names) - 3} more" if len(names) > 3 else ""
    return f"{len(names)} tensor{'s' if len(names) > 1 else ''} ({shown}{more})"


def target_dtype(slot: Slot, dtype: torch.dtype | None) -> torch.dtype | None:
    """The dtype a slot's tensor gets (None: as stored, for a quantized layer's parts)."""
    if slot.part is not None:
        return None
    if dtype is not None and slot.tensor.is_floating_point():
        return dtype
    return slot.tensor.dtype


def fills_in_place(slot: Slot, tensor: torch.Tensor) -> bool:
    """A built model's tensor already on the right device in the right dtype is filled in place (it keeps
    its identity); any other is replaced."""
    old = slot.tensor
    return not old.is_meta and old.device == tensor.device and old.dtype == tensor.dtype


def assign(slot: Slot, tensor: torch.Tensor) -> None:
    """Fill the slot's tensor in place where it can (:func:`fills_in_place`), else replace it."""
    if fills_in_place(slot, tensor):
        with torch.no_grad():
            slot.tensor.copy_(tensor)
        return
    replace(slot, tensor)


def replace(slot: Slot, tensor: torch.Tensor) -> None:
    """Put ``tensor`` under every name of the slot (a parameter keeps its ``requires_grad``), so that
    tied names stay one tensor."""
    old = slot.tensor
    value = nn.Parameter(tensor, requires_grad=old.requires_grad) if slot.parameter else tensor
    for module, attr in slot.places:
        (module._parameters if slot.parameter else module._buffers)[attr] = value
    slot.tensor = value


def place_the_rest(model: nn.Module, device: torch.device | None, dtype: torch.dtype | None) -> None:
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
