"""One record per layer type that pruning resizes: which size attributes it has and how to bring them in
line with its (cut) tensors, with the operators that carry its channels.

Channel surgery (:func:`slimtorch.prune.surgery.cut`) resizes a module through its record, and the
structural delta's allow-list (:data:`SIZE_ATTRIBUTES` and :data:`SHAPE_ATTRIBUTES`: what a file may set
on a module) is every record's attributes, so no layer can be pruned into a file the loader refuses. They
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

from slimtorch.errors import SlimtorchError
from slimtorch.graph.layers import head_size, is_hf_conv1d, query_width


@dataclass(frozen=True)
class LayerRecord:
    """What pruning means for one layer type's attributes."""

    name: str
    matches: Callable[[nn.Module], bool]
    """whether a module is of this type (the first record that matches a module is its record)"""
    sizes: tuple[str, ...]
    """the attributes that hold a size (an int): with :attr:`shapes`, all a saved delta may set on the type"""
    resize: Callable[[Any], None]
    """set :attr:`sizes` and :attr:`shapes` from the module's tensors, after channels were cut from them"""
    ops: tuple[str, ...] = ()
    """the operators (``aten`` names) through which the type's channels pass, each with a handler in
    :mod:`slimtorch.graph.channels`"""
    shapes: tuple[str, ...] = ()
    """the attributes that hold a shape (a tuple of sizes, a list in JSON: ``normalized_shape``)"""

    @property
    def attributes(self) -> tuple[str, ...]:
        """Every attribute :attr:`resize` may set."""
        return (*self.sizes, *self.shapes)


def _conv(module: nn.modules.conv._ConvNd) -> None:
    weight = module.weight
    transposed = module.transposed
    if module.groups > 1 and module.groups == module.in_channels == module.out_channels:  # depthwise
        module.groups = module.in_channels = module.out_channels = weight.shape[0]
        return
    out_dim, in_dim = (1, 0) if transposed else (0, 1)
    module.out_channels = weight.shape[out_dim] * (module.groups if transposed else 1)
    module.in_channels = weight.shape[in_dim] * (1 if transposed else module.groups)


def _linear(module: nn.Linear) -> None:
    module.out_features, module.in_features = module.weight.shape


def _batch_norm(module: nn.modules.batchnorm._NormBase) -> None:
    reference = module.weight if module.weight is not None else module.running_mean
    if reference is not None:
        module.num_features = reference.shape[0]


def _layer_norm(module: nn.LayerNorm | nn.RMSNorm) -> None:
    """``nn.LayerNorm`` and ``nn.RMSNorm``: the normalised shape is the weight's."""
    if module.weight is not None:
        module.normalized_shape = tuple(module.weight.shape)


def _group_norm(module: nn.GroupNorm) -> None:
    """The channel walk lets a channel go alone only with one group, or one channel per group: the group
    count stays 1, or keeps its channels per group (one)."""
    channels = module.weight.shape[0]
    if module.num_groups > 1:
        module.num_groups = channels // (module.num_channels // module.num_groups)
    module.num_channels = channels


def _embedding(module: nn.Embedding) -> None:
    module.num_embeddings, module.embedding_dim = module.weight.shape


def _prelu(module: nn.PReLU) -> None:
    """One slope per channel follows the channels; one shared slope (``nn.PReLU()``) is never cut."""
    module.num_parameters = module.weight.numel()


def _hf_conv1d(module: Any) -> None:  # transformers' Conv1D, never imported
    module.nf = module.weight.shape[1]  # Hugging Face's Conv1D (GPT-2): weight [in, out], nf = out
    if hasattr(module, "nx"):
        module.nx = module.weight.shape[0]


HEAD_COUNTS = ("num_attention_heads", "num_heads", "n_head", "n_heads")


def _is_attention(module: nn.Module) -> bool:
    return bool(head_size(module)) and query_width(module) is not None


def _attention(module: Any) -> None:
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
        ("batch_norm", "_native_batch_norm_legit_no_training", "_native_batch_norm_legit", "instance_norm"),
    ),
    LayerRecord(
        "layer norm", _has_weight(nn.LayerNorm), (), _layer_norm, ("layer_norm",), ("normalized_shape",)
    ),
    LayerRecord("RMS norm", _has_weight(nn.RMSNorm), (), _layer_norm, ("rms_norm",), ("normalized_shape",)),
    LayerRecord(
        "group norm", _has_weight(nn.GroupNorm), ("num_groups", "num_channels"), _group_norm, ("group_norm",)
    ),
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
"""Every size attribute a record may set: what a saved delta may set to an int, never code or other state."""
SHAPE_ATTRIBUTES = frozenset(name for record in (*RECORDS, ATTENTION) for name in record.shapes)
"""Every shape attribute a record may set: what a saved delta may set to a list of sizes."""


def record_of(module: nn.Module) -> LayerRecord | None:
    """The record of ``module``'s type (None: pruning resizes nothing on it)."""
    return next((record for record in RECORDS if record.matches(module)), None)


def resizable(module: nn.Module) -> bool:
    """Whether pruning knows ``module``'s size attributes (its tensors may then be cut)."""
    return record_of(module) is not None


def resize(module: nn.Module) -> dict[str, Any]:
    """Bring ``module``'s size attributes in line with its (cut) tensors, by its record and, for an
    attention module, :data:`ATTENTION`'s; returns what changed (tuples as lists, as JSON holds them)."""
    records = [r for r in (record_of(module), ATTENTION) if r is not None and r.matches(module)]
    before = _sizes(module)
    for record in records:
        record.resize(module)
    after = _sizes(module)
    changed = {k: list(v) if isinstance(v, tuple) else v for k, v in after.items() if before.get(k) != v}
    undeclared = set(changed) - {name for record in records for name in record.attributes}
    if undeclared:  # a record that sets more than it names would save a file the loader refuses
        raise SlimtorchError(
            f"resizing {type(module).__name__} changed {sorted(undeclared)}, which no record of it names"
        )
    return changed


def _sizes(module: nn.Module) -> dict[str, Any]:
    """A module's public attributes that can hold a size; a tensor kept as a plain attribute (torchfcpe
    does) is none, and comparing two of them has no single truth value."""
    return {
        k: v for k, v in vars(module).items() if not k.startswith("_") and not isinstance(v, torch.Tensor)
    }
