"""StructuralDelta: what a pruned or quantized model's class cannot rebuild by itself, saved with its weights.

Pruning changes tensor shapes and the attributes that describe them (``out_channels``, ``in_features``,
``num_features``, depthwise ``groups`` ...). The delta records those changes as plain JSON in the slim
file's metadata, so a pruned model is saved without pickling the module: :func:`slimtorch.load_model`
builds the original class on the meta device, :func:`apply_delta` reshapes it, and the weights fill it.

Quantization swaps layers for :mod:`slimtorch.quant` ones; the delta names them and their scheme, and
:func:`apply_delta` swaps them again, from slimtorch's own layer classes only. The format does not know
those classes: :data:`SECTIONS` names, by dotted path, where each section's reader lives, and it is
imported when a file holds that section, so the format core never imports the steps above it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from slimtorch.errors import SlimtorchError
from slimtorch.format.source import MAX_DIMS, shape_problem
from slimtorch.graph.prunable import SHAPE_ATTRIBUTES, SIZE_ATTRIBUTES
from slimtorch.graph.slots import model_slots, replace

ATTRIBUTE = "_slimtorch_delta"  # where a pruned module keeps its delta until it is saved


@dataclass(frozen=True)
class Swaps:
    """How a step that swaps layers (quantization) reads its section of a delta back."""

    check: Callable[[object], dict[str, dict[str, Any]]]
    """The section as read from a file -> the section, checked (raises SlimtorchError)."""
    restore: Callable[[nn.Module, dict[str, dict[str, Any]]], None]
    """Swap the recorded layers into a freshly built model."""


SECTIONS: dict[str, str] = {"quantized": "slimtorch.quant.recorded:SWAPS"}
"""Each section a delta may hold beyond shapes and attributes -> where its :class:`Swaps` lives, as
``module:attribute``. Found from the file alone and imported on first use: a reader that existed only once
its step had been imported left a fresh process that imported ``slimtorch`` alone unable to load what
another process had saved. The format names the module by its dotted path and never imports it itself."""


def swaps_of(section: str) -> Swaps:
    """The :class:`Swaps` that read the delta's ``section``, its module imported if it was not yet (a key of
    :data:`SECTIONS`: :meth:`StructuralDelta.from_json` refuses any other)."""
    module, _, attribute = SECTIONS[section].partition(":")
    swaps = getattr(importlib.import_module(module), attribute)
    if not isinstance(swaps, Swaps):
        raise TypeError(f"{SECTIONS[section]} is not a Swaps")  # a broken table: our bug, not the file's
    return swaps


@dataclass
class StructuralDelta:
    """How a pruned model differs from what its constructor builds: new tensor shapes and attributes."""

    shapes: dict[str, list[int]] = field(default_factory=dict)
    """state_dict key -> new shape"""
    attributes: dict[str, dict[str, Any]] = field(default_factory=dict)
    """module name -> {attribute: new value} (``out_channels``, ``in_features``, ``groups`` ...)"""
    quantized: dict[str, dict[str, Any]] = field(default_factory=dict)
    """module name -> how :func:`slimtorch.quantize` replaced it (``scheme``, ``group_size``, ``dtype``)"""

    def __bool__(self) -> bool:
        return bool(self.shapes or self.attributes or self.quantized)

    def merge(self, later: StructuralDelta) -> StructuralDelta:
        """This delta followed by ``later`` (a second pruning of the same model)."""
        attributes = {name: dict(values) for name, values in self.attributes.items()}
        for name, values in later.attributes.items():
            attributes.setdefault(name, {}).update(values)
        return StructuralDelta(
            {**self.shapes, **later.shapes}, attributes, {**self.quantized, **later.quantized}
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, value: object) -> StructuralDelta:
        """A delta from a file's metadata, checked: shapes are lists of sizes, attributes are sizes."""
        if not isinstance(value, Mapping):
            raise SlimtorchError("the structural delta is not a JSON object")
        unknown = sorted(set(value) - {"shapes", "attributes"} - set(SECTIONS))
        if unknown:  # a later slimtorch's section: loading without it would build another model
            raise SlimtorchError(
                f"the structural delta has a {str(unknown[0])[:40]!r} section, which this slimtorch does not "
                "know (a newer version wrote it?)"
            )
        shapes, attributes = value.get("shapes", {}), value.get("attributes", {})
        if not isinstance(shapes, Mapping) or not all(_is_shape(s) for s in shapes.values()):
            raise SlimtorchError(
                f"the structural delta's shapes are not lists of sizes (at most {MAX_DIMS}, each below "
                "2**48, their product within int64)"
            )
        if not isinstance(attributes, Mapping) or not all(
            isinstance(a, Mapping) for a in attributes.values()
        ):
            raise SlimtorchError("the structural delta's attributes are not objects")
        for module, values in attributes.items():
            for name, setting in values.items():
                if not (name in SIZE_ATTRIBUTES and _is_size(setting)) and not (
                    name in SHAPE_ATTRIBUTES and _is_shape(setting)
                ):
                    raise SlimtorchError(
                        f"the structural delta sets {module}.{name} = {str(setting)[:60]}, not a size"
                    )
        return cls(
            {k: list(v) for k, v in shapes.items()},
            {k: dict(v) for k, v in attributes.items()},
            swaps_of("quantized").check(value["quantized"]) if "quantized" in value else {},
        )


def delta_of(model: nn.Module) -> StructuralDelta | None:
    """The delta a pruned model carries (None: never pruned)."""
    return model.__dict__.get(ATTRIBUTE)


def record(model: nn.Module, delta: StructuralDelta) -> None:
    """Remember ``delta`` on the model (merged with an earlier pruning's) for :func:`slimtorch.save_model`."""
    earlier = delta_of(model)
    model.__dict__[ATTRIBUTE] = earlier.merge(delta) if earlier else delta


def apply_delta(model: nn.Module, delta: StructuralDelta) -> None:
    """Reshape a freshly built model as the delta says: set size attributes, give tensors their new shapes.

    Reshaped tensors are left on the meta device (their values come from the checkpoint next).
    """
    modules = dict(model.named_modules())
    for name, values in delta.attributes.items():
        module = modules.get(name)
        if module is None:
            raise SlimtorchError(f"the structural delta names module {name!r}, which the model does not have")
        for attr, setting in values.items():
            setattr(module, attr, tuple(setting) if isinstance(setting, list) else setting)
    slots = model_slots(model)
    unknown = set(delta.shapes) - {name for slot in slots for name in slot.names}
    if unknown:
        raise SlimtorchError(f"the structural delta reshapes {sorted(unknown)[0]!r}, which the model lacks")
    for slot in slots:  # one slot per tensor: tied names get one new tensor, and stay tied
        shape = next((delta.shapes[name] for name in slot.names if name in delta.shapes), None)
        if shape is None:
            continue
        replace(slot, torch.empty(shape, dtype=slot.tensor.dtype, device="meta"))
    if delta.quantized:
        swaps_of("quantized").restore(model, delta.quantized)
    record(model, delta)


def _is_size(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 48


def _is_shape(value: object) -> bool:
    """A list of sizes torch can build a (meta) tensor of: a shape of 10**6 dims or 2**47 x 2**47 x 2**47
    elements ends in torch's RuntimeError, not in a message naming the file."""
    return isinstance(value, list) and all(_is_size(v) for v in value) and shape_problem(value) is None
