"""The model side of loading: which tensors a model has, which file tensor fills each, and putting it in.

A :class:`Slot` is one tensor of the model under every name it has (tied parameters share one slot), so a
tie is filled once and stays a tie. Matching finds each slot's tensor in the file, under a training
wrapper prefix if the file has one (:mod:`slimtorch.format.names`), checks shapes before anything is
read, and accounts for every name it leaves out (:class:`Matching`).

A quantized layer's buffers are the *parts* of one coded tensor of the file (``fc.qweight`` is the part
``q`` of ``fc.weight``): its class says so in ``SLIM_PARTS``, and such a slot is filled with that part as
stored, never decoded.
"""

from __future__ import annotations

import difflib
import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import torch
from torch import nn

from slimtorch.errors import FormatError, SlimtorchError
from slimtorch.format.names import (
    IgnoreRules,
    Prefix,
    Rename,
    RenameRules,
    Skipped,
    closest,
    explicit_prefix,
    file_groups,
    find_prefix,
    model_name_of,
    rename_rules,
    some,
    weight_norm_aliases,
)
from slimtorch.format.source import TensorSource
from slimtorch.graph.slots import Slot, replace


def file_slots(source: TensorSource) -> list[Slot]:
    """One slot per stored tensor of the file, without a model: tied names share a slot.

    A slim file lists its ties; in other formats a tie is two names on the same view of one storage.
    """
    ties = source.ties()
    slots: dict[object, Slot] = {}
    for info in source.infos():
        if source.coded:
            key: object = ties.get(info.name, info.name)
        else:
            key = (info.storage, info.storage_offset, info.shape, info.stride, info.dtype)
        if key in slots:
            slots[key].names.append(info.name)
            continue
        template = torch.empty(info.shape, dtype=info.dtype, device="meta")
        slots[key] = Slot([info.name], [], template, parameter=False, file_name=info.name)
    return list(slots.values())


@dataclass
class Matching:
    """How the file's names were matched to the model's, and every name left out (``LoadReport`` shows
    them: nothing is left out silently)."""

    prefix: Prefix
    ignored: list[Skipped] = field(default_factory=list)
    """Names the model declares it does without (file names, or model names the file lacks)."""
    unmatched: list[str] = field(default_factory=list)
    """File names under the prefix that the model does not have (only with strict=False)."""
    missing: list[str] = field(default_factory=list)
    """Model names the file lacks, left at the model's own values (only with strict=False)."""
    outside: list[str] = field(default_factory=list)
    """File names outside the wrapper prefix (optimizer state, other models), never loaded."""
    notes: list[str] = field(default_factory=list)
    """Names matched in another way than by spelling (``weight_norm``'s old and new names)."""


def match(
    source: TensorSource,
    model: nn.Module,
    slots: list[Slot],
    *,
    strict: bool,
    built: bool,
    prefix: str | None = None,
    rename: Rename = (),
) -> Matching:
    """Find each slot's tensor in the file, check shapes, and account for every name left out.

    The wrapper prefix is found by :func:`~slimtorch.format.names.find_prefix` unless ``prefix`` is
    given; ``rename`` maps the names (once the prefix is off) before they are compared.
    """
    file_names = source.names()
    wanted = [[slot.part[0]] if slot.part else slot.names for slot in slots]
    model_names = [name for names in wanted for name in names]
    rules = rename_rules(rename)
    try:
        if prefix is None:
            found = find_prefix(file_names, model_names, rules)
        else:
            found = explicit_prefix(file_names, model_names, prefix, rules)
    except SlimtorchError as exc:
        raise FormatError(source.path, str(exc)) from None
    by_model, matching = _by_model_name(source, file_names, found, rules), Matching(found)
    if not all(name in by_model for name in model_names):  # else no other spelling is wanted
        matching.notes += _read_other_spelling(by_model, weight_norm_aliases(model), set(model_names))
    matching.outside = [n for n in file_names if not n.startswith(found.file)]
    ignore = functools.cache(lambda: IgnoreRules.of(model))  # asked only of a name left out
    used: set[str] = set()
    lacking: list[str] = []
    for slot, names in zip(slots, wanted, strict=True):
        hits = [by_model[n] for n in names if n in by_model]
        if not hits:
            reason = None if slot.tensor.is_meta else ignore().missing_reason(names[0])
            if reason is not None:
                matching.ignored.append(Skipped(names[0], reason))
            elif strict or slot.tensor.is_meta:
                lacking.append(names[0])
            else:
                matching.missing.append(names[0])
            continue
        used.update(hits)
        slot.file_name = hits[0]
        if slot.part:
            _check_part(source, slot, hits[0])
            continue
        _check_shape(source, slot, hits[0], by_model)
    if slots and not used:
        raise FormatError(source.path, _nothing_matched(model, file_names, model_names, found))
    if lacking:
        meta = built and any(s.tensor.is_meta for s in slots if s.names[0] in lacking)
        raise FormatError(source.path, _lacking(lacking, file_names, found, meta))
    unexpected = []
    for model_name, file_name in by_model.items():
        if file_name in used:
            continue
        reason = ignore().unexpected_reason(model_name)
        if reason is not None:
            matching.ignored.append(Skipped(file_name, reason))
        else:
            unexpected.append((file_name, model_name))
    if unexpected and strict:
        near = closest([m for _, m in unexpected], model_names)
        raise FormatError(
            source.path,
            f"the file holds {some([f for f, _ in unexpected])} that the model does not have"
            + (f"; closest in the model: {near}" if near else "")
            + " (load with strict=False, --non-strict, to leave them out, or map the names with "
            "prefix=/--prefix, rename=/--rename)",
        )
    matching.unmatched = [f for f, _ in unexpected]
    return matching


def _by_model_name(
    source: TensorSource, file_names: list[str], prefix: Prefix, rules: RenameRules
) -> dict[str, str]:
    """The file's names under the prefix, by the model name each becomes (file order kept)."""
    by_model: dict[str, str] = {}
    for file_name in file_names:
        model_name = model_name_of(file_name, prefix, rules)
        if model_name is None:
            continue
        if model_name in by_model:
            raise FormatError(
                source.path,
                f"the file's {by_model[model_name]!r} and {file_name!r} both become the model's "
                f"{model_name!r}: check rename=/--rename",
            )
        by_model[model_name] = file_name
    return by_model


def _read_other_spelling(by_model: dict[str, str], aliases: dict[str, str], wanted: set[str]) -> list[str]:
    """Let a model name the file lacks take the file's tensor under its other spelling (in place)."""
    moved = []
    for model_name, other in aliases.items():
        if model_name in wanted and model_name not in by_model and other in by_model:
            by_model[model_name] = by_model.pop(other)
            moved.append(f"{by_model[model_name]!r} -> {model_name!r}")
    if not moved:
        return []
    return [
        f"{len(moved)} weight_norm tensors read under the model's spelling (weight_g/weight_v are "
        f"parametrizations.weight.original0/1), as torch's own load hook does: {', '.join(moved[:2])}"
        + (" ..." if len(moved) > 2 else "")
    ]


def _check_shape(source: TensorSource, slot: Slot, name: str, by_model: dict[str, str]) -> None:
    """The file's tensor ``name``, matched to ``slot``, must have the slot's shape."""
    info = source.info(name)
    want = tuple(slot.tensor.shape)
    if tuple(info.shape) == want:
        return
    # Names shuffled by a refactor show up as a tensor of the right shape under a near name.
    fitting = [n for n in by_model.values() if tuple(source.info(n).shape) == want]
    near = difflib.get_close_matches(name, fitting, n=2, cutoff=0)
    raise FormatError(
        source.path,
        f"tensor {name!r} is {list(info.shape)} in the file but the model's "
        f"{slot.names[0]!r} is {list(want)}"
        + (f"; the file's nearest names shaped {list(want)}: {', '.join(map(repr, near))}" if near else ""),
    )


def _nothing_matched(model: nn.Module, file_names: list[str], model_names: list[str], found: Prefix) -> str:
    near = closest(model_names, file_names)
    where = f" under the prefix {found.file!r}" if found.file else ""
    return (
        f"no tensor of the file{where} has a name of the model {type(model).__name__}: the file holds "
        f"{file_groups(file_names)}; the model has {some(model_names)}"
        + (f"; closest: {near}" if near else "")
        + "; map the names with prefix=/--prefix or rename=/--rename OLD=NEW "
        "(strict=False, --non-strict, never loads a file that matches nothing)"
    )


def _lacking(lacking: list[str], file_names: list[str], found: Prefix, meta: bool) -> str:
    near = closest(lacking, file_names)
    where = f" (read under the prefix {found.file!r})" if found.file else ""
    why = (
        "; the model was built on the meta device, so they have no values"
        if meta
        else " (load with strict=False, --non-strict, to keep the model's own values)"
    )
    return (
        f"the file lacks {some(lacking)} of the model{why}"
        + (f"; closest in the file: {near}" if near else "")
        + f"; the file holds {file_groups(file_names)}{where}; map the names with prefix=/--prefix "
        "or rename=/--rename"
    )


class _CodedLayer(Protocol):
    """What a quantized layer tells of the parts it holds (``slimtorch.quant.modules.QuantizedWeight``)."""

    SLIM_PARTS: Mapping[str, tuple[str, str]]

    def stage_of(self, tensor: str) -> dict[str, Any]: ...


def _check_part(source: TensorSource, slot: Slot, name: str) -> None:
    """A quantized layer's buffer takes a part of a coded tensor (the file's ``name``): the file must have
    coded it the same way."""
    (module, attr), model_name = slot.places[0], slot.names[0]
    # a slot has a part only where its module declares SLIM_PARTS (graph.slots.model_slots); torch types
    # a module's other attributes as tensors or modules
    layer = cast(_CodedLayer, module)
    if not source.coded:
        raise FormatError(
            source.path,
            f"the model's {model_name!r} is part of a quantized layer, but {source.format} files store "
            "float weights: load them into the float model, then quantize it",
        )
    stages = source.stages(name)
    expected = layer.stage_of(layer.SLIM_PARTS[attr][0])  # an LSTM has a stage per matrix
    if not stages:
        raise FormatError(
            source.path,
            f"tensor {name!r} is stored unquantized, but the model's layer holds {expected['codec']} codes: "
            "load it into the float model, then quantize it",
        )
    stored = stages[0]
    differs = [
        key for key in ("codec", "shape", "group_size", "flat") if stored.get(key) != expected.get(key)
    ]
    if differs:
        raise FormatError(
            source.path,
            f"tensor {name!r} is stored as {stored.get('codec')} {stored.get('shape')}, but the model's "
            f"quantized layer holds {expected['codec']} {expected['shape']} ({', '.join(differs)} differ)",
        )
    for grid in ("symmetric", "integer_zero"):  # codes on compressed-tensors' grid stay on it, saved again
        if stored.get(grid):
            expected[grid] = True


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
