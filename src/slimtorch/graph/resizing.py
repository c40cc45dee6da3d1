"""One record per layer type that pruning resizes: which size attributes it has and how to bring them in
line with its (cut) tensors, with the operators that carry its channels.

Channel surgery (:func:`slimtorch.prune.surgery.cut`) resizes a module through its record, and the
structural delta's allow-list (:data:`slimtorch.format.delta.SIZE_ATTRIBUTES`: what a file may set on a
module) is every record's size attributes, so no layer can be pruned into a file the loader refuses. They
once lived apart: surgery set ``nn.PReLU(16).num_parameters`` to 8 and the loader refused the file it
had just saved ("sets a1.num_parameters = 8, not a size"). A new layer type is one record here; its
operators' channel handlers are in :mod:`slimtorch.graph.channels` (a test checks each named one exists).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from slimtorch.graph.layers import head_size, is_hf_conv1d, query_width


@dataclass(frozen=True)
class LayerRecord:
    """What pruning means for one layer type's attributes."""

    name: str
    matches: Callable[[nn.Module], bool]
    """whether a module is of this type (the first record that matches a module is its record)"""
    sizes: tuple[str, ...]
    """the attributes that hold a size or a shape, all that a saved delta may set on such a module"""
    resize: Callable[[nn.Module], None]
    """set :attr:`sizes` from the module's tensors, after channels were cut from them"""
    ops: tuple[str, ...] = ()
    """the operators (``aten`` names) through which the type's channels pass, each with a handler in
    :mod:`slimtorch.graph.channels`"""


def _conv(module: nn.Module) -> None:
    weight = module.weight
    transposed = module.transposed
    if module.groups > 1 and module.groups == module.in_channels == module.out_channels:  # depthwise
        module.groups = module.in_channels = module.out_channels = weight.shape[0]
        return
    out_dim, in_dim = (1, 0) if transposed else (0, 1)
    module.out_channels = weight.shape[out_dim] * (module.groups if transposed else 1)
    module.in_channels = weight.shape[in_dim] * (1 if transposed else module.groups)


def _linear(module: nn.Module) -> None:
    module.out_features, module.in_features = module.weight.shape


def _batch_norm(module: nn.Module) -> None:
    reference = module.weight if module.weight is not None else module.running_mean
    if reference is not None:
        module.num_features = reference.shape[0]


def _layer_norm(module: nn.Module) -> None:
    if module.weight is not None:
        module.normalized_shape = tuple(module.weight.shape)


def _embedding(module: nn.Module) -> None:
    module.num_embeddings, module.embedding_dim = module.weight.shape


def _prelu(module: nn.Module) -> None:
    module.num_parameters = module.weight.numel()


def _hf_conv1d(module: nn.Module) -> None:
    module.nf = module.weight.shape[1]  # Hugging Face's Conv1D (GPT-2): weight [in, out], nf = out
    if hasattr(module, "nx"):
        module.nx = module.weight.shape[0]


HEAD_COUNTS = ("num_attention_heads", "num_heads", "n_head", "n_heads")


def _is_attention(module: nn.Module) -> bool:
    return bool(head_size(module)) and query_width(module) is not None


def _attention(module: nn.Module) -> None:
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


def _has_weight(kind: type | tuple[type, ...]) -> Callable[[nn.Module], bool]:
    return lambda module: isinstance(module, kind) and getattr(module, "weight", None) is not None


RECORDS: tuple[LayerRecord, ...] = (
    LayerRecord(
        "convolution",
        _has_weight(nn.modules.conv._ConvNd),
        ("in_channels", "out_channels", "groups"),
        _conv,
        (
            "convolution",
            "conv1d",
            "conv2d",
            "conv3d",
            "conv_transpose1d",
            "conv_transpose2d",
            "conv_transpose3d",
        ),
    ),
    LayerRecord("linear", _has_weight(nn.Linear), ("in_features", "out_features"), _linear, ("linear",)),
    LayerRecord(
        "batch or instance norm",
        lambda module: isinstance(module, nn.modules.batchnorm._NormBase),
        ("num_features",),
        _batch_norm,
        ("batch_norm", "_native_batch_norm_legit_no_training", "_native_batch_norm_legit"),
    ),
    LayerRecord("layer norm", _has_weight(nn.LayerNorm), ("normalized_shape",), _layer_norm, ("layer_norm",)),
    LayerRecord(
        "embedding",
        _has_weight(nn.Embedding),
        ("num_embeddings", "embedding_dim"),
        _embedding,
        ("embedding",),
    ),
    LayerRecord("PReLU", _has_weight(nn.PReLU), ("num_parameters",), _prelu, ("prelu", "_prelu_kernel")),
    LayerRecord(
        "Hugging Face Conv1D",
        lambda module: is_hf_conv1d(module) and getattr(module, "weight", None) is not None,
        ("nf", "nx"),
        _hf_conv1d,
        ("addmm",),
    ),
)
ATTENTION = LayerRecord(
    "attention heads",
    _is_attention,
    (*HEAD_COUNTS, "all_head_size", "split_size"),
    _attention,
    ("scaled_dot_product_attention",),
)
"""Applied after a module's own record: an attention module is any module with a head size and a query
projection, whatever else it is."""

SIZE_ATTRIBUTES = frozenset(name for record in (*RECORDS, ATTENTION) for name in record.sizes)
"""Every attribute a record may set: what a saved delta may set, sizes only, never code or other state."""


def record_of(module: nn.Module) -> LayerRecord | None:
    """The record of ``module``'s type (None: pruning resizes nothing on it)."""
    return next((record for record in RECORDS if record.matches(module)), None)


def resizable(module: nn.Module) -> bool:
    """Whether pruning knows ``module``'s size attributes (its tensors may then be cut)."""
    return record_of(module) is not None


def resize(module: nn.Module) -> dict[str, Any]:
    """Bring ``module``'s size attributes in line with its (cut) tensors, by its record and, for an
    attention module, :data:`ATTENTION`'s; returns what changed (tuples as lists, as JSON holds them)."""
    before = _sizes(module)
    record = record_of(module)
    if record is not None:
        record.resize(module)
    if ATTENTION.matches(module):
        ATTENTION.resize(module)
    after = _sizes(module)
    return {k: list(v) if isinstance(v, tuple) else v for k, v in after.items() if before.get(k) != v}


def _sizes(module: nn.Module) -> dict[str, Any]:
    """A module's public attributes that can hold a size; a tensor kept as a plain attribute (torchfcpe
    does) is none, and comparing two of them has no single truth value."""
    return {
        k: v for k, v in vars(module).items() if not k.startswith("_") and not isinstance(v, torch.Tensor)
    }
