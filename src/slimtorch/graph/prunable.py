"""The layer types pruning knows, one record each: how its channels pass through its operators, which
size attributes it has, and how to bring them in line with its (cut) tensors.

Everything pruning does to a layer type is built from its record: the channel walk
(:mod:`slimtorch.graph.channels`) follows the type's operators by the record's rules, channel surgery
(:func:`slimtorch.prune.surgery.cut`) resizes a module through its record, and the structural delta's
allow-list (:data:`SIZE_ATTRIBUTES` and :data:`SHAPE_ATTRIBUTES`: what a file may set on a module) is
every record's attributes, so no layer can be pruned into a file the loader refuses. They once lived in
four places: surgery set ``nn.PReLU(16).num_parameters`` to 8 and the loader refused the file it had just
saved ("sets a1.num_parameters = 8, not a size"). A new layer type is one record in :data:`RECORDS`.

A channel rule is ``(walk, node) -> None`` on a :class:`~slimtorch.graph.channels.Walk`: it opens spaces
for the channels its layer makes (``walk.fresh``), ties its weights' dimensions to them
(``walk.attach``: ``"out"`` the rows that make a channel, ``"in"`` the columns that read one, ``"norm"``
a per-channel vector), passes channels on (``walk.layouts[node] = ...``) or stops them with a reason
(``walk.freeze``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Protocol

import torch
from torch import nn
from torch.fx import Node

from slimtorch.errors import SlimtorchError
from slimtorch.graph.layers import head_size, is_hf_conv1d, query_width
from slimtorch.graph.nodes import as_list, op_name, shape_of, shape_or_none, where
from slimtorch.graph.spaces import Layout, Segment, Spaces


class Walk(Protocol):
    """What a channel rule may do on the walk (:class:`slimtorch.graph.channels.Walk`, which imports the
    records: they name its interface here, not its module)."""

    spaces: Spaces
    layouts: dict[Node, Layout]

    def layout(self, value: object) -> Layout | None: ...

    def fresh(
        self, node: Node, axis: int, reason: str | None = None, output: int | None = None
    ) -> Layout: ...

    def attach(self, layout: Layout, value: object, dim: int, role: str) -> None: ...

    def freeze(self, layout: Layout | None, reason: str) -> None: ...

    def unite(self, a: Layout, b: Layout) -> bool: ...


ChannelRule = Callable[[Walk, Node], None]


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
    channels: Mapping[str, ChannelRule] = field(default_factory=dict)
    """operator (the ``aten`` name, no overload) -> how the type's channels pass through it (no two records
    name the same operator)"""
    shapes: tuple[str, ...] = ()
    """the attributes that hold a shape (a tuple of sizes, a list in JSON: ``normalized_shape``)"""

    def __post_init__(self) -> None:
        object.__setattr__(self, "channels", MappingProxyType(dict(self.channels)))

    @property
    def ops(self) -> tuple[str, ...]:
        """The operators the type's channels pass through."""
        return tuple(self.channels)

    @property
    def attributes(self) -> tuple[str, ...]:
        """Every attribute :attr:`resize` may set."""
        return (*self.sizes, *self.shapes)


# -- convolutions ------------------------------------------------------------------------------------------
def _conv(module: nn.modules.conv._ConvNd) -> None:
    weight = module.weight
    transposed = module.transposed
    if module.groups > 1 and module.groups == module.in_channels == module.out_channels:  # depthwise
        module.groups = module.in_channels = module.out_channels = weight.shape[0]
        return
    out_dim, in_dim = (1, 0) if transposed else (0, 1)
    module.out_channels = weight.shape[out_dim] * (module.groups if transposed else 1)
    module.in_channels = weight.shape[in_dim] * (1 if transposed else module.groups)


def _conv_channels(walk: Walk, node: Node) -> None:
    """A convolution makes new channels from all of its input's; a depthwise one (one filter per channel)
    keeps them; other grouped ones are frozen (a channel would have to go from every group at once)."""
    op = op_name(node)
    args = list(node.args) + [None] * 9
    if op == "convolution" and args[6]:  # transposed
        return _conv_transpose_channels(walk, node)
    source, weight, bias = walk.layout(args[0]), args[1], args[2]
    groups = (args[8] if op == "convolution" else args[6]) or 1
    source = _channels_first(walk, node, source)
    if groups == 1:
        out = walk.fresh(node, 1)
        walk.attach(out, weight, 0, "out")
        walk.attach(out, bias, 0, "out")
        if source is not None:
            walk.attach(source, weight, 1, "in")
    elif source is not None and groups == source.size and shape_of(weight)[:2] == (groups, 1):
        walk.layouts[node] = source  # depthwise: one filter per channel
        walk.attach(source, weight, 0, "norm")
        walk.attach(source, bias, 0, "norm")
    else:
        walk.freeze(source, f"grouped convolution (from {where(node)})")
        walk.fresh(node, 1, f"grouped convolution (from {where(node)})")


def _channels_first(walk: Walk, node: Node, source: Layout | None) -> Layout | None:
    """A convolution reads channels on axis 1; channels anywhere else cannot be followed through it."""
    if source is not None and source.axis != 1:
        walk.freeze(source, f"convolution over a non-channel axis (from {where(node)})")
        return None
    return source


def _conv_transpose_channels(walk: Walk, node: Node) -> None:
    """A transposed convolution's weight is [in, out / groups, ...]: rows read, columns make."""
    args = list(node.args) + [None] * 9
    source, weight, bias = walk.layout(args[0]), args[1], args[2]
    groups = (args[8] if op_name(node) == "convolution" else args[6]) or 1
    source = _channels_first(walk, node, source)
    if groups != 1:
        walk.freeze(source, f"grouped transposed convolution (from {where(node)})")
        walk.fresh(node, 1, f"grouped transposed convolution (from {where(node)})")
        return
    out = walk.fresh(node, 1)
    walk.attach(out, weight, 1, "out")
    walk.attach(out, bias, 0, "out")
    if source is not None:
        walk.attach(source, weight, 0, "in")


# -- linear layers -----------------------------------------------------------------------------------------
def _linear(module: nn.Linear) -> None:
    module.out_features, module.in_features = module.weight.shape


def _linear_channels(walk: Walk, node: Node) -> None:
    """``x @ weight.T + bias`` over the last axis: rows make the output's channels, columns read the
    input's."""
    source, weight = walk.layout(node.args[0]), node.args[1]
    bias = node.args[2] if len(node.args) > 2 else None
    if source is not None and source.axis != len(shape_of(node.args[0])) - 1:
        walk.freeze(source, f"linear over a non-channel axis (from {where(node)})")
        source = None
    out = walk.fresh(node, len(shape_of(node)) - 1)
    walk.attach(out, weight, 0, "out")
    walk.attach(out, bias, 0, "out")
    if source is not None:
        walk.attach(source, weight, 1, "in")


def _hf_conv1d(module: Any) -> None:  # transformers' Conv1D, never imported
    module.nf = module.weight.shape[1]  # Hugging Face's Conv1D (GPT-2): weight [in, out], nf = out
    if hasattr(module, "nx"):
        module.nx = module.weight.shape[0]


def _addmm_channels(walk: Walk, node: Node) -> None:
    """``bias + x @ weight`` with weight stored [in, out] (Hugging Face's GPT-2 ``Conv1D``)."""
    bias, source, weight = node.args[0], walk.layout(node.args[1]), node.args[2]
    out = walk.fresh(node, 1)
    walk.attach(out, weight, 1, "out")
    walk.attach(out, bias, 0, "out")
    if source is not None and source.axis == 1:
        walk.attach(source, weight, 0, "in")
    elif source is not None:
        walk.freeze(source, f"addmm over a non-channel axis (from {where(node)})")


# -- norms -------------------------------------------------------------------------------------------------
def _batch_norm(module: nn.modules.batchnorm._NormBase) -> None:
    reference = module.weight if module.weight is not None else module.running_mean
    if reference is not None:
        module.num_features = reference.shape[0]


def _norm_channels(walk: Walk, node: Node) -> None:
    """Batch and instance norms keep channels on axis 1; their weight, bias and statistics follow them."""
    source = walk.layout(node.args[0])
    if source is None:
        return
    problem = None
    if source.axis != 1:
        problem = f"{op_name(node)} over a non-channel axis"
    elif op_name(node) == "instance_norm" and not any(isinstance(v, Node) for v in node.args[1:5]):
        # nothing to cut that would tell nn.InstanceNorm's num_features how many channels are left
        problem = "instance norm without weights or statistics"
    _through_norm(walk, node, source, problem, slice(1, 5))


def _through_norm(walk: Walk, node: Node, source: Layout, problem: str | None, vectors: slice) -> None:
    """A norm passes its input's channels on, its per-channel vectors (``node.args[vectors]``: weight,
    bias, statistics) going with them; unless ``problem`` says why a channel cannot go alone there."""
    if problem:
        walk.freeze(source, f"{problem} (from {where(node)})")
        return
    walk.layouts[node] = source
    for value in node.args[vectors]:
        walk.attach(source, value, 0, "norm")


def _layer_norm(module: nn.LayerNorm | nn.RMSNorm) -> None:
    """``nn.LayerNorm`` and ``nn.RMSNorm``: the normalised shape is the weight's."""
    if module.weight is not None:
        module.normalized_shape = tuple(module.weight.shape)


def _layer_norm_channels(walk: Walk, node: Node) -> None:
    """A norm over the last axis alone (``layer_norm`` and ``rms_norm`` take ``(x, normalized_shape,
    weight, ...)``): a channel goes with its weight and bias; over several axes, channels stay."""
    source = walk.layout(node.args[0])
    if source is None:
        return
    several = len(as_list(node.args[1])) != 1 or source.axis != len(shape_of(node.args[0])) - 1
    _through_norm(walk, node, source, "layer norm over several axes" if several else None, slice(2, 4))


def _group_norm(module: nn.GroupNorm) -> None:
    """The channel walk lets a channel go alone only with one group, or one channel per group: the group
    count stays 1, or keeps its channels per group (one)."""
    channels = module.weight.shape[0]
    if module.num_groups > 1:
        module.num_groups = channels // (module.num_channels // module.num_groups)
    module.num_channels = channels


def _group_norm_channels(walk: Walk, node: Node) -> None:
    """``nn.GroupNorm(G, C)`` normalises each group of ``C/G`` channels together. With one group (a norm
    over C, H, W, as a layer norm) or one channel per group, a channel can go alone, its weight and bias
    with it; groups of several channels would have to go whole, so their channels stay."""
    source, groups, weight = walk.layout(node.args[0]), node.args[1], node.args[2]
    if source is None:
        return
    problem = None
    if source.axis != 1 or weight is None or groups not in (1, source.size):
        problem = f"group norm {'without weights' if weight is None else 'over groups of several channels'}"
    _through_norm(walk, node, source, problem, slice(2, 4))


# -- embeddings and activations with weights --------------------------------------------------------------
def _embedding(module: nn.Embedding | nn.EmbeddingBag) -> None:
    module.num_embeddings, module.embedding_dim = module.weight.shape


def _embedding_channels(walk: Walk, node: Node) -> None:
    """A lookup of rows of ``weight`` (its first argument): the vectors' entries are new channels."""
    out = walk.fresh(node, len(shape_of(node)) - 1)
    walk.attach(out, node.args[0], 1, "out")


def _embedding_bag_channels(walk: Walk, node: Node) -> None:
    """``embedding_bag(weight, indices, offsets, ...)`` pools each bag's rows entry by entry (sum, mean or
    max), so the entries of its first output, ``(bags, dim)``, are new channels made by the weight's
    columns; its other outputs (which row went to which bag) carry none."""
    out = walk.fresh(node, 1, output=0)
    walk.attach(out, node.args[0], 1, "out")


def _prelu(module: nn.PReLU) -> None:
    """One slope per channel follows the channels; one shared slope (``nn.PReLU()``) is never cut."""
    module.num_parameters = module.weight.numel()


def _prelu_channels(walk: Walk, node: Node) -> None:
    """``nn.PReLU(C)`` scales each channel's negative side by its own slope, so its weight is one more
    per-channel vector of the group; ``nn.PReLU()`` (one shared slope) just passes the channels on."""
    source, weight = walk.layout(node.args[0]), node.args[1]
    if source is None:
        return
    if math.prod(shape_or_none(weight) or (1,)) == 1:
        walk.layouts[node] = source
        return
    if source.axis != min(1, len(shape_of(node.args[0])) - 1):  # PReLU's slopes run along axis 1
        walk.freeze(source, f"prelu over a non-channel axis (from {where(node)})")
        return
    walk.layouts[node] = source
    walk.attach(source, weight, 0, "norm")


# -- attention ---------------------------------------------------------------------------------------------
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


def _attention_channels(walk: Walk, node: Node) -> None:
    """``scaled_dot_product_attention(q, k, v)``: head h of q meets head h of k, and gives head h of the
    output from head h of v, so the three head spaces become one."""
    q, k, v = (walk.layout(a) for a in node.args[:3])
    if q is None or k is None or v is None:
        for layout in (q, k, v):
            walk.freeze(layout, f"attention with unknown heads (from {where(node)})")
        return
    q = _group_queries(walk, q, k)
    if not (walk.unite(q, k) and walk.unite(q, v)):
        for layout in (q, k, v):
            walk.freeze(layout, f"grouped-query attention (from {where(node)})")
        walk.fresh(node, q.axis, f"grouped-query attention (from {where(node)})")
        return
    walk.layouts[node] = q


def _group_queries(walk: Walk, q: Layout, k: Layout) -> Layout:
    """Grouped-query attention: each key/value head serves ``n`` consecutive query heads (``repeat_kv``
    made k look like ``Hkv`` channels of ``n`` entries), so the query heads are regrouped by ``n``."""
    if len(q.segments) != 1 or len(k.segments) != 1:
        return q
    (query,), (key,) = q.segments, k.segments
    if key.factor == 1 or query.factor != 1 or query.count != key.count * key.factor:
        return q
    groups = walk.spaces.regroup(query.space, key.factor)
    return Layout(q.axis, (Segment(groups, key.count, key.factor),))


def _has_weight(kind: type | tuple[type, ...]) -> Callable[[nn.Module], bool]:
    return lambda module: isinstance(module, kind) and getattr(module, "weight", None) is not None


CONVOLUTIONS = ("convolution", "conv1d", "conv2d", "conv3d")
TRANSPOSED = ("conv_transpose1d", "conv_transpose2d", "conv_transpose3d")
NORMS = ("batch_norm", "_native_batch_norm_legit_no_training", "_native_batch_norm_legit", "instance_norm")

RECORDS: tuple[LayerRecord, ...] = (
    LayerRecord(
        "convolution",
        _has_weight(nn.modules.conv._ConvNd),
        ("in_channels", "out_channels", "groups"),
        _conv,
        {
            **dict.fromkeys(CONVOLUTIONS, _conv_channels),
            **dict.fromkeys(TRANSPOSED, _conv_transpose_channels),
        },
    ),
    LayerRecord(
        "linear",
        _has_weight(nn.Linear),
        ("in_features", "out_features"),
        _linear,
        {"linear": _linear_channels},
    ),
    LayerRecord(
        "batch or instance norm",
        lambda module: isinstance(module, nn.modules.batchnorm._NormBase),
        ("num_features",),
        _batch_norm,
        dict.fromkeys(NORMS, _norm_channels),
    ),
    LayerRecord(
        "layer norm",
        _has_weight(nn.LayerNorm),
        (),
        _layer_norm,
        {"layer_norm": _layer_norm_channels},
        ("normalized_shape",),
    ),
    LayerRecord(
        "RMS norm",
        _has_weight(nn.RMSNorm),
        (),
        _layer_norm,
        {"rms_norm": _layer_norm_channels},  # (x, normalized_shape, weight, eps): a layer norm's arguments
        ("normalized_shape",),
    ),
    LayerRecord(
        "group norm",
        _has_weight(nn.GroupNorm),
        ("num_groups", "num_channels"),
        _group_norm,
        {"group_norm": _group_norm_channels},
    ),
    LayerRecord(
        "embedding",
        _has_weight(nn.Embedding),
        ("num_embeddings", "embedding_dim"),
        _embedding,
        {"embedding": _embedding_channels},
    ),
    LayerRecord(
        "embedding bag",
        _has_weight(nn.EmbeddingBag),
        ("num_embeddings", "embedding_dim"),
        _embedding,
        dict.fromkeys(
            ("embedding_bag", "_embedding_bag", "_embedding_bag_forward_only"), _embedding_bag_channels
        ),
    ),
    LayerRecord(
        "PReLU",
        _has_weight(nn.PReLU),
        ("num_parameters",),
        _prelu,
        dict.fromkeys(("prelu", "_prelu_kernel"), _prelu_channels),
    ),
    LayerRecord(
        "Hugging Face Conv1D",
        lambda module: is_hf_conv1d(module) and getattr(module, "weight", None) is not None,
        ("nf", "nx"),
        _hf_conv1d,
        {"addmm": _addmm_channels},
    ),
)
"""Every layer type pruning resizes, the first that matches a module being its record."""
ATTENTION = LayerRecord(
    "attention heads",
    _is_attention,
    (*HEAD_COUNTS, "all_head_size", "split_size"),
    _attention,
    {"scaled_dot_product_attention": _attention_channels},
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
