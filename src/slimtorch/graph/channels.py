"""Channel groups: which slices of which weights must be removed together to drop one channel.

Walking the captured ATen graph, every activation gets a *layout*: the axis that carries its channels and
what those channels are made of. A layer that makes new channels (``conv2d``, ``linear``, ``embedding``)
opens a *space*; ops that keep channels (activations, PReLU, norms, pooling, depthwise convolution) pass the
layout on; ``add`` and ``mul`` of two activations unite their spaces (a residual connection ties the
channels of both branches); ``cat`` lays spaces side by side; ``flatten`` turns each channel into a run of
``H*W`` features. Every weight dimension that a layout reaches is recorded as a :class:`Slice` of the space
(offset and run length included), so a channel of a space maps to exact indices of every weight it touches.

The ops of layers with weights (convolutions, linear, norms, embeddings, attention) are handled by their
layer type's record (:mod:`slimtorch.graph.prunable`), beside its size attributes: this module holds the
:class:`Walk` they work on and the ops that only move channels (shape ops, element-wise ops, ``cat``).

United spaces form a :class:`ChannelGroup`. A group is *frozen* when its channels reach the model's input
or output, or an op whose channel semantics we do not know: ``reason`` then names the op, so pruning can
say what stopped it, and ``ignore`` lets the user fence such a part off.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
from torch.fx import Node

from slimtorch.graph.capture import Graph
from slimtorch.graph.nodes import (
    as_int,
    as_ints,
    as_list,
    dim_arg,
    op_name,
    output_shape,
    shape_of,
    shape_or_none,
    where,
)
from slimtorch.graph.prunable import ATTENTION, RECORDS
from slimtorch.graph.spaces import ChannelGroup, Layout, Segment, Spaces

# ops that keep the channel axis where it is and each channel's identity
_SAME_CHANNEL_OPS = """
relu relu_ gelu gelu_ silu silu_ sigmoid sigmoid_ tanh tanh_ hardtanh hardtanh_ hardswish hardswish_
hardsigmoid hardsigmoid_ leaky_relu leaky_relu_ elu elu_ mish dropout dropout_ alpha_dropout
feature_dropout clone contiguous detach alias _to_copy to max_pool1d max_pool2d max_pool3d
avg_pool1d avg_pool2d avg_pool3d adaptive_avg_pool1d adaptive_avg_pool2d adaptive_avg_pool3d
adaptive_max_pool2d upsample_nearest2d upsample_bilinear2d _upsample_nearest_exact2d pad
constant_pad_nd reflection_pad2d replication_pad2d abs neg exp log sqrt rsqrt square pow
"""
SAME_CHANNELS = frozenset(_SAME_CHANNEL_OPS.split())
_ELEMENTWISE_OPS = "add add_ sub sub_ mul mul_ div div_ maximum minimum where"
ELEMENTWISE = frozenset(_ELEMENTWISE_OPS.split())


def channel_groups(graph: Graph, ignore: Iterable[str] = ()) -> list[ChannelGroup]:
    """Every channel group of a captured model. ``ignore``: module names whose output channels stay."""
    walk = Walk(graph)
    for node in graph.graph.nodes:
        walk.visit(node)
    groups = walk.spaces.groups()
    groups += walk.stop_unruled(groups)
    fenced = tuple(ignore)
    for group in groups:
        for key in group.keys("out"):
            module = key.rsplit(".", 1)[0]
            if any(module == name or module.startswith(name + ".") for name in fenced):
                group.reason = group.reason or f"ignored: {module}"
    return groups


class Walk:
    """One walk over a captured graph: the layout of every node that carries channels, and the spaces.

    A handler (``(walk, node) -> None``) reads its inputs' layouts with :meth:`layout`, opens the spaces of
    the channels its layer makes with :meth:`fresh`, ties weights to layouts with :meth:`attach`, passes a
    layout on by setting ``layouts[node]``, and stops what it cannot follow with :meth:`freeze`."""

    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self.spaces = Spaces()
        self.layouts: dict[Node, Layout] = {}
        self.pieces: dict[Node, list[Layout | None]] = {}  # the layouts of an op's outputs
        self.unruled: dict[str, tuple[str, int]] = {}  # weight key -> (the op without a rule, its rows)

    # -- helpers ---------------------------------------------------------------------------------------
    def layout(self, value: object) -> Layout | None:
        return self.layouts.get(value) if isinstance(value, Node) else None

    def key(self, value: object) -> str | None:
        return self.graph.key(value) if isinstance(value, Node) else None

    def fresh(self, node: Node, axis: int, reason: str | None = None, output: int | None = None) -> Layout:
        """New channels along ``axis`` of what ``node`` computes (of its tensor ``output`` when the op
        returns several: ``getitem`` then hands that one on); ``reason``: they cannot be pruned, and why."""
        size = (shape_of(node) if output is None else output_shape(node, output))[axis]
        layout = Layout(axis, (Segment(self.spaces.new(size, reason), size),))
        if output is None:
            self.layouts[node] = layout
        else:
            pieces = self.pieces.setdefault(node, [])
            pieces.extend([None] * (output + 1 - len(pieces)))
            pieces[output] = layout
        return layout

    def attach(self, layout: Layout, value: object, dim: int, role: str) -> None:
        """Record that weight ``value``'s ``dim`` runs along ``layout``'s channels. A weight that the
        forward computes (``weight_norm``'s ``g * v / |v|``) is traced back to the stored tensors it is made
        of; one computed some other way freezes the channels, since cutting it would cut nothing stored."""
        if not isinstance(value, Node):
            return
        key = self.key(value)
        if key is not None:
            self.spaces.attach(layout, key, dim, role)
        elif _weight_normed(value):
            size = shape_of(value)[dim]
            for part in value.args[:2]:  # v (the direction) and g (the magnitude, size 1 off its dim)
                part_key = self.key(part)
                if part_key is not None and shape_of(part)[dim] == size:
                    self.spaces.attach(layout, part_key, dim, role)
        elif self.layout(value) is None:
            made_by = op_name(value) if value.op == "call_function" else "a constant"
            self.freeze(layout, f"a weight computed by {made_by} (from {where(value)})")

    def freeze(self, layout: Layout | None, reason: str) -> None:
        for segment in layout.segments if layout else ():
            for root in self.spaces.roots(segment.space):
                self.spaces.freeze(root, reason)

    def freeze_inputs(self, node: Node, reason: str) -> None:
        for value in node.all_input_nodes:
            self.freeze(self.layout(value), reason)

    # -- the walk --------------------------------------------------------------------------------------
    def visit(self, node: Node) -> None:
        if node.op == "placeholder":
            shape = shape_or_none(node)
            if self.graph.key(node) is None and shape is not None and len(shape) >= 1:
                self.fresh(node, 1 if len(shape) >= 3 else len(shape) - 1, "the model's input")
        elif node.op == "output":
            self.freeze_inputs(node, "the model's output")
        elif node.op == "call_function":
            op = op_name(node)
            handler = HANDLERS.get(op)
            if handler is None:
                reason = f"op {op} (from {where(node)})"
                self.freeze_inputs(node, reason)
                self.read_without_rule(node, reason)
            else:
                handler(self, node)

    def read_without_rule(self, node: Node, reason: str) -> None:
        """Note the weights (float matrices and up) an op without a rule reads: what it computes from them
        is not known, so no channel of theirs may be cut (:meth:`stop_unruled`)."""
        for value in node.all_input_nodes:
            for stored in value.all_input_nodes if _weight_normed(value) else [value]:  # its v and g
                key, meta = self.key(stored), stored.meta.get("val")
                if key and isinstance(meta, torch.Tensor) and meta.dim() >= 2 and meta.is_floating_point():
                    self.unruled.setdefault(key, (reason, meta.shape[0]))

    def stop_unruled(self, groups: list[ChannelGroup]) -> list[ChannelGroup]:
        """After the walk: each of ``groups`` holding a weight an op without a rule reads is frozen with
        that op as the reason; returned, a frozen group of rows for each such weight in none (its layer's op
        has no rule, as ``nn.EmbeddingBag``'s once), so the report names the op instead of leaving the layer
        out in silence."""
        grouped: set[str] = set()
        for group in groups:
            for piece in group.slices:
                grouped.add(piece.key)
                if piece.key in self.unruled:
                    group.reason = group.reason or self.unruled[piece.key][0]
        return [
            ChannelGroup(rows, [], reason)
            for key, (reason, rows) in self.unruled.items()
            if key not in grouped
        ]

    def same(self, node: Node) -> None:
        source = self.layout(node.args[0])
        if source is not None and shape_or_none(node) is not None:
            self.layouts[node] = source

    def nothing(self, node: Node) -> None:
        """Ops that only check (``_assert_tensor_metadata``): no data flows through them."""

    def elementwise(self, node: Node) -> None:
        out_shape = shape_or_none(node)
        operands = [(a, s) for a in node.args if isinstance(a, Node) and (s := shape_or_none(a)) is not None]
        laid = [(shape, layout) for a, shape in operands if (layout := self.layout(a)) is not None]
        if not laid or out_shape is None:
            return
        first_shape, first = laid[0]
        axis = first.axis + len(out_shape) - len(first_shape)  # broadcasting aligns from the right
        for shape, layout in laid[1:]:
            if layout.axis + len(out_shape) - len(shape) != axis or not self.unite(first, layout):
                self.freeze(first, f"{op_name(node)} of differently arranged channels (from {where(node)})")
                self.freeze(layout, f"{op_name(node)} of differently arranged channels")
        # a weight broadcast over the channels (a learned scale) is part of them
        for value, shape in operands:
            key = self.key(value)
            if key is not None and len(shape) >= len(out_shape) - axis and shape[axis - len(out_shape)] > 1:
                self.spaces.attach(first, key, len(shape) - (len(out_shape) - axis), "norm")
        self.layouts[node] = Layout(axis, first.segments)

    def unite(self, a: Layout, b: Layout) -> bool:
        if [(s.count, s.factor) for s in a.segments] != [(s.count, s.factor) for s in b.segments]:
            return False
        for x, y in zip(a.segments, b.segments, strict=True):
            self.spaces.union(x.space, y.space)
        return True

    def cat(self, node: Node) -> None:
        tensors = as_list(node.args[0])
        dim = dim_arg(node, 1, len(shape_of(node)))
        maybe_layouts = [self.layout(t) for t in tensors]
        layouts = [layout for layout in maybe_layouts if layout is not None]
        if len(layouts) < len(maybe_layouts):
            for maybe_layout in maybe_layouts:
                self.freeze(maybe_layout, f"cat with an input of unknown channels (from {where(node)})")
            return
        if all(layout.axis == dim for layout in layouts):
            segments = tuple(s for layout in layouts for s in layout.segments)
            self.layouts[node] = Layout(dim, segments)
        elif all(layout.axis == layouts[0].axis for layout in layouts) and all(
            self.unite(layouts[0], layout) for layout in layouts[1:]
        ):
            self.layouts[node] = layouts[0]
        else:
            for layout in layouts:
                self.freeze(layout, f"cat of differently arranged channels (from {where(node)})")

    def flatten(self, node: Node) -> None:
        source = self.layout(node.args[0])
        in_shape = shape_of(node.args[0])
        rank = len(in_shape)
        start, end = dim_arg(node, 1, rank), dim_arg(node, 2, rank, default=rank - 1)
        self.merge_axes(node, source, in_shape, start, end)

    def merge_axes(
        self, node: Node, source: Layout | None, in_shape: tuple[int, ...], start: int, end: int
    ) -> None:
        if source is None:
            return
        if source.axis < start:
            self.layouts[node] = source
        elif source.axis == start:
            run = math.prod(in_shape[start + 1 : end + 1])
            segments = tuple(Segment(s.space, s.count, s.factor * run) for s in source.segments)
            self.layouts[node] = Layout(start, segments)
        elif source.axis > end:
            self.layouts[node] = Layout(source.axis - (end - start), source.segments)
        else:
            self.freeze(source, f"flatten that splits a channel's entries (from {where(node)})")

    def view(self, node: Node) -> None:
        source = self.layout(node.args[0])
        if source is None:
            return
        in_shape, out_shape = shape_of(node.args[0]), shape_of(node)
        if tuple(in_shape[: source.axis + 1]) == tuple(out_shape[: source.axis + 1]):
            self.layouts[node] = source  # everything up to the channels unchanged
            return
        if source.axis == len(in_shape) - 1 and in_shape[-1] == out_shape[-1]:
            self.layouts[node] = Layout(len(out_shape) - 1, source.segments)  # [B, T, C] <-> [B*T, C]
            return
        heads = self.split_heads(node, source, in_shape, out_shape)
        if heads is not None:
            self.layouts[node] = heads
            return
        # [N, C, H, W] -> [N, C*H*W] (a flatten written as a view), [B, Hkv, n, T, D] -> [B, Hkv*n, T, D]
        axis, merged = source.axis, len(in_shape) - len(out_shape)
        if (
            merged > 0
            and tuple(out_shape[:axis]) == tuple(in_shape[:axis])
            and tuple(out_shape[axis + 1 :]) == tuple(in_shape[axis + merged + 1 :])
        ):
            self.merge_axes(node, source, in_shape, axis, axis + merged)
            return
        self.freeze(source, f"view {list(in_shape)} -> {list(out_shape)} (from {where(node)})")

    def split_heads(
        self, node: Node, source: Layout, in_shape: tuple[int, ...], out_shape: tuple[int, ...]
    ) -> Layout | None:
        """``[B, T, H*D] -> [B, T, H, D]``: the channels become H heads of D features each.

        Only for a projection's own output (one space, seen by nothing but this view), so that no other
        user still counts its channels one by one."""
        axis, viewed = source.axis, node.args[0]
        if (
            len(out_shape) != len(in_shape) + 1
            or tuple(out_shape[:axis]) != tuple(in_shape[:axis])
            or tuple(out_shape[axis + 2 :]) != tuple(in_shape[axis + 1 :])
            or out_shape[axis] * out_shape[axis + 1] != in_shape[axis]
            or len(source.segments) != 1
            or source.segments[0].factor != 1
            or not isinstance(viewed, Node)
            or len(viewed.users) != 1
        ):
            return None
        heads = self.spaces.regroup(source.segments[0].space, out_shape[axis + 1])
        return Layout(axis, (Segment(heads, out_shape[axis]),))

    def split(self, node: Node) -> None:
        """``split`` along the channels (GPT-2's fused q/k/v) makes a space per piece; along another axis
        every piece keeps the channels."""
        source = self.layout(node.args[0])
        if source is None:
            return
        dim = dim_arg(node, 2, len(shape_of(node.args[0])))
        sizes = [tuple(value.shape)[dim] for value in node.meta.get("val", ())]
        if dim != source.axis:
            self.pieces[node] = [source] * len(sizes)
        elif len(source.segments) == 1 and source.segments[0].factor == 1 and len(node.users) == len(sizes):
            spaces = self.spaces.partition(source.segments[0].space, sizes)
            self.pieces[node] = [
                Layout(dim, (Segment(space, size),)) for space, size in zip(spaces, sizes, strict=True)
            ]
        else:
            self.freeze(source, f"split of mixed channels (from {where(node)})")

    def getitem(self, node: Node) -> None:
        pieces = self.pieces.get(node.args[0]) if isinstance(node.args[0], Node) else None
        index = node.args[1]
        if pieces is not None and isinstance(index, int) and 0 <= index < len(pieces):
            piece = pieces[index]
            if piece is not None:
                self.layouts[node] = piece

    def unsqueeze(self, node: Node) -> None:
        source, rank = self.layout(node.args[0]), len(shape_of(node.args[0]))
        if source is not None:
            dim = as_int(node.args[1]) % (rank + 1)
            self.layouts[node] = Layout(source.axis + (dim <= source.axis), source.segments)

    def expand(self, node: Node) -> None:
        source = self.layout(node.args[0])
        if source is None:
            return
        in_shape, out_shape = shape_of(node.args[0]), shape_of(node)
        axis = source.axis + len(out_shape) - len(in_shape)
        if out_shape[axis] != in_shape[source.axis]:
            self.freeze(source, f"expand of the channels (from {where(node)})")
            return
        self.layouts[node] = Layout(axis, source.segments)

    def select(self, node: Node) -> None:
        """``x[:, 0]`` (select) or ``x[:, 1:]`` (slice) along an axis other than the channels'."""
        source = self.layout(node.args[0])
        if source is None:
            return
        dim = dim_arg(node, 1, len(shape_of(node.args[0])))
        if dim == source.axis:
            self.freeze(source, f"{op_name(node)} of some channels (from {where(node)})")
            return
        dropped = op_name(node) == "select" and dim < source.axis
        self.layouts[node] = Layout(source.axis - dropped, source.segments)

    def transpose(self, node: Node) -> None:
        source, rank = self.layout(node.args[0]), len(shape_of(node.args[0]))
        if source is None:
            return
        if op_name(node) == "permute":
            order = [d % rank for d in as_ints(node.args[1])]
        else:
            a, b = as_int(node.args[1]) % rank, as_int(node.args[2]) % rank
            order = list(range(rank))
            order[a], order[b] = b, a
        self.layouts[node] = Layout(order.index(source.axis), source.segments)

    def mean(self, node: Node) -> None:
        source = self.layout(node.args[0])
        if source is None:
            return
        rank = len(shape_of(node.args[0]))
        given = node.args[1] if len(node.args) > 1 else list(range(rank))
        dims = {d % rank for d in (as_ints(given) if isinstance(given, (list, tuple)) else [as_int(given)])}
        keepdim = bool(node.args[2]) if len(node.args) > 2 else bool(node.kwargs.get("keepdim", False))
        if source.axis in dims:
            return  # a statistic over the channels (RMSNorm's mean of squares): it has no channels itself
        shift = 0 if keepdim else sum(d < source.axis for d in dims)
        self.layouts[node] = Layout(source.axis - shift, source.segments)


def _weight_normed(value: Node) -> bool:
    """A weight the forward computes as ``weight_norm``'s ``g * v / |v|``, from the stored v and g."""
    return value.op == "call_function" and op_name(value) == "_weight_norm"


Handler = Callable[[Walk, Node], None]

_MOVES: dict[str, Handler] = {name: Walk.same for name in SAME_CHANNELS}
_MOVES.update({name: Walk.elementwise for name in ELEMENTWISE})
_MOVES.update(
    {
        "cat": Walk.cat,
        "flatten": Walk.flatten,
        "view": Walk.view,
        "reshape": Walk.view,
        "_unsafe_view": Walk.view,
        "mean": Walk.mean,
        "sum": Walk.mean,
        "amax": Walk.mean,
        "select": Walk.select,
        "unsqueeze": Walk.unsqueeze,
        "split": Walk.split,
        "split_with_sizes": Walk.split,
        "getitem": Walk.getitem,
        "expand": Walk.expand,
        "_assert_tensor_metadata": Walk.nothing,
        "_assert_scalar": Walk.nothing,
        "_weight_norm": Walk.nothing,  # makes a weight: its user traces it to v and g (attach)
        "slice": Walk.select,
        "transpose": Walk.transpose,
        "permute": Walk.transpose,
    }
)
LAYER_OPS: dict[str, Handler] = {op: rule for r in (*RECORDS, ATTENTION) for op, rule in r.channels.items()}
"""The ops of layers with weights, each handled by its layer type's record."""
_clash = set(_MOVES) & set(LAYER_OPS)
if _clash or len(LAYER_OPS) < sum(len(r.channels) for r in (*RECORDS, ATTENTION)):
    raise ImportError(f"two channel rules for ops {sorted(_clash) or 'of two records'}")  # a broken table
HANDLERS: dict[str, Handler] = {**_MOVES, **LAYER_OPS}
"""Every op the walk follows channels through; any other freezes the channels that reach it."""
