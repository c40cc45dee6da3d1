"""A model's tensors as slots: one :class:`Slot` per tensor under every name it has (tied parameters share
one), and :func:`replace` to put a new tensor under all of them at once, so a tie stays a tie.

Loading fills slots from a file, pruning gives them new shapes, and a structural delta reshapes them on a
freshly built model: all three see a model's tensors this one way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


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
        if not module._parameters and not module._buffers:
            continue  # a container (BERT-base: 126 of its 228 modules)
        # per instance (an LSTM has one per matrix), else its class's; not getattr: a miss through
        # nn.Module.__getattr__ raises inside it, 1.4 us a module
        coded = module.__dict__.get("SLIM_PARTS", getattr(type(module), "SLIM_PARTS", {}))
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


def replace(slot: Slot, tensor: torch.Tensor) -> None:
    """Put ``tensor`` under every name of the slot (a parameter keeps its ``requires_grad``), so that
    tied names stay one tensor."""
    old = slot.tensor
    parameter = nn.Parameter(tensor, requires_grad=old.requires_grad) if slot.parameter else None
    for module, attr in slot.places:
        if parameter is not None:
            module._parameters[attr] = parameter
        else:
            module._buffers[attr] = tensor
        if isinstance(module, nn.RNNBase):
            # An RNN runs on a cached list of its weights (torch's own Module._apply refreshes it too):
            # without this it would keep computing with the meta tensors it was built with.
            module._init_flat_weights()
    slot.tensor = tensor if parameter is None else parameter
