"""Channel surgery: cut chosen channels out of every tensor of a model, and bring its modules' size
attributes (``out_channels``, ``in_features``, ``num_features``, head counts ...) in line with them.

:func:`cut` is the one place a model changes shape; it returns the :class:`StructuralDelta` that records
the change, so a saved model can be rebuilt from its class and the delta.
"""

from __future__ import annotations

import torch
from torch import nn

from slimtorch.format.delta import StructuralDelta
from slimtorch.graph.prunable import resize
from slimtorch.graph.slots import model_slots, replace
from slimtorch.graph.spaces import ChannelGroup


def model_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer by state_dict key, shared ones under each of their names."""
    return {
        **dict(model.named_parameters(remove_duplicate=False)),
        **dict(model.named_buffers(remove_duplicate=False)),
    }


def cut(model: nn.Module, groups: list[ChannelGroup], removed: dict[int, torch.Tensor]) -> StructuralDelta:
    """Cut the ``removed`` channels of each group (by ``id(group)``) out of every tensor, then fix the
    modules' size attributes, each by its layer type's record (:mod:`slimtorch.graph.prunable`, where the
    saved delta's allow-list comes from too); returns what changed."""
    tensors = model_tensors(model)
    keep: dict[tuple[str, int], torch.Tensor] = {}
    for group in groups:
        channels = removed[id(group)]
        if not len(channels):
            continue
        for piece in group.slices:
            mask = keep.setdefault(
                (piece.key, piece.dim), torch.ones(tensors[piece.key].shape[piece.dim], dtype=torch.bool)
            )
            mask[piece.indices(channels)] = False
    slots = {name: slot for slot in model_slots(model) for name in slot.names}
    delta = StructuralDelta()
    for (key, dim), mask in keep.items():  # a weight pruned on two dims is cut twice, one dim at a time
        slot = slots[key]
        new = slot.tensor.detach().index_select(dim, mask.nonzero().squeeze(1))
        replace(slot, new)
        delta.shapes.update({name: list(new.shape) for name in slot.names})
    for name, module in model.named_modules():
        changed = resize(module)
        if changed:
            delta.attributes[name] = changed
    return delta
