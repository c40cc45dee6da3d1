"""Channel surgery: cut chosen channels out of every tensor of a model, and bring its modules' size
attributes (``out_channels``, ``in_features``, ``num_features``, head counts ...) in line with them.

:func:`cut` is the one place a model changes shape; it returns the :class:`StructuralDelta` that records
the change, so a saved model can be rebuilt from its class and the delta.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from slimtorch.format.delta import StructuralDelta
from slimtorch.graph.layers import head_size, is_hf_conv1d, query_width
from slimtorch.graph.slots import model_slots, replace
from slimtorch.graph.spaces import ChannelGroup

RESIZABLE = (  # the modules whose size attributes cut() brings in line
    nn.modules.conv._ConvNd,
    nn.Linear,
    nn.modules.batchnorm._NormBase,
    nn.LayerNorm,
    nn.Embedding,
    nn.PReLU,
)


def model_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer by state_dict key, shared ones under each of their names."""
    return {
        **dict(model.named_parameters(remove_duplicate=False)),
        **dict(model.named_buffers(remove_duplicate=False)),
    }


def cut(model: nn.Module, groups: list[ChannelGroup], removed: dict[int, torch.Tensor]) -> StructuralDelta:
    """Cut the ``removed`` channels of each group (by ``id(group)``) out of every tensor, then fix the
    modules' size attributes; returns what changed."""
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
        changed = _resize_attributes(module)
        if changed:
            delta.attributes[name] = changed
    return delta


def _resize_attributes(module: nn.Module) -> dict[str, Any]:
    """Bring a module's size attributes in line with its (pruned) tensors; returns what changed."""
    before = _size_attributes(module)
    weight = getattr(module, "weight", None)
    if isinstance(module, nn.modules.conv._ConvNd) and weight is not None:
        transposed = module.transposed
        depthwise = module.groups > 1 and module.groups == module.in_channels == module.out_channels
        out_dim, in_dim = (1, 0) if transposed else (0, 1)
        if depthwise:
            module.groups = module.in_channels = module.out_channels = weight.shape[0]
        else:
            per_group_out = weight.shape[out_dim] * (module.groups if transposed else 1)
            module.out_channels = per_group_out
            module.in_channels = weight.shape[in_dim] * (1 if transposed else module.groups)
    elif isinstance(module, nn.Linear):
        module.out_features, module.in_features = weight.shape
    elif isinstance(module, nn.modules.batchnorm._NormBase):
        reference = weight if weight is not None else module.running_mean
        if reference is not None:
            module.num_features = reference.shape[0]
    elif isinstance(module, nn.LayerNorm) and weight is not None:
        module.normalized_shape = tuple(weight.shape)
    elif isinstance(module, nn.Embedding):
        module.num_embeddings, module.embedding_dim = weight.shape
    elif isinstance(module, nn.PReLU):
        module.num_parameters = weight.numel()
    elif is_hf_conv1d(module) and weight is not None:
        module.nf = weight.shape[1]  # Hugging Face's Conv1D (GPT-2): weight [in, out], nf = out
        if hasattr(module, "nx"):
            module.nx = weight.shape[0]
    _resize_heads(module)
    after = _size_attributes(module)
    return {k: list(v) if isinstance(v, tuple) else v for k, v in after.items() if before.get(k) != v}


def _size_attributes(module: nn.Module) -> dict[str, Any]:
    """A module's public attributes that can hold a size; a tensor kept as a plain attribute (torchfcpe
    does) is none, and comparing two of them has no single truth value."""
    return {
        k: v for k, v in vars(module).items() if not k.startswith("_") and not isinstance(v, torch.Tensor)
    }


HEAD_COUNTS = ("num_attention_heads", "num_heads", "n_head", "n_heads")


def _resize_heads(module: nn.Module) -> None:
    """An attention module's head count (and total head width) from its query projection's rows."""
    size, width = head_size(module), query_width(module)
    if not size or width is None:
        return
    if hasattr(module, "c_attn") and hasattr(module, "split_size"):
        module.split_size = width  # GPT-2 splits its fused q/k/v output by this
    heads = width // size
    for name in HEAD_COUNTS:
        if isinstance(getattr(module, name, None), int):
            setattr(module, name, heads)
    if isinstance(getattr(module, "all_head_size", None), int):
        module.all_head_size = heads * size
