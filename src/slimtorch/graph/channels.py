"""Channel groups: which slices of which weights must be removed together to drop one channel.

Walking the captured ATen graph, every activation gets a *layout*: the axis that carries its channels and
what those channels are made of. A layer that makes new channels (``conv2d``, ``linear``, ``embedding``)
opens a *space*; ops that keep channels (activations, PReLU, norms, pooling, depthwise convolution) pass the
layout on; ``add`` and ``mul`` of two activations unite their spaces (a residual connection ties the
channels of both branches); ``cat`` lays spaces side by side; ``flatten`` turns each channel into a run of
``H*W`` features. Every weight dimension that a layout reaches is recorded as a :class:`Slice` of the space
(offset and run length included), so a channel of a space maps to exact indices of every weight it touches.

United spaces form a :class:`ChannelGroup`. A group is *frozen* when its channels reach the model's input
or output, or an op whose channel semantics we do not know: ``reason`` then names the op, so pruning can
say what stopped it, and ``ignore`` lets the user fence such a part off.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch.fx import Node

from slimtorch.graph.capture import Graph
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
NORMS = frozenset(
    ["batch_norm", "_native_batch_norm_legit_no_training", "_native_batch_norm_legit", "instance_norm"]
)
CONVS = frozenset(["conv1d", "conv2d", "conv3d", "convolution"])
CONV_TRANSPOSES = frozenset(["conv_transpose1d", "conv_transpose2d", "conv_transpose3d"])


def channel_groups(graph: Graph, ignore: Iterable[str] = ()) -> list[ChannelGroup]:
    """Every channel group of a captured model. ``ignore``: module names whose output channels stay."""
    walk = _Walk(graph)
    for node in graph.graph.nodes:
        walk.visit(node)
    groups = walk.spaces.groups()
    fenced = tuple(ignore)
    for group in groups:
        for key in group.keys("out"):
            module = key.rsplit(".", 1)[0]
            if any(module == name or module.startswith(name + ".") for name in fenced):
                group.reason = group.reason or f"ignored: {module}"
    return groups


class _Walk:
    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self.spaces = Spaces()
        self.layouts: dict[Node, Layout] = {}
        self.pieces: dict[Node, list[Layout]] = {}  # the layouts of a split's outputs

    # -- helpers ---------------------------------------------------------------------------------------
    def layout(self, value: object) -> Layout | None:
        return self.layouts.get(value) if isinstance(value, Node) else None

    def key(self, value: object) -> str | None:
        return self.graph.key(value) if isinstance(value, Node) else None

    def fresh(self, node: Node, axis: int, reason: str | None = None) -> Layout:
        size = _shape(node)[axis]
        layout = Layout(axis, (Segment(self.spaces.new(size, reason), size),))
        self.layouts[node] = layout
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
        elif value.op == "call_function" and _op_name(value) == "_weight_norm":
            size = _shape(value)[dim]
            for part in value.args[:2]:  # v (the direction) and g (the magnitude, size 1 off its dim)
                part_key = self.key(part)
                if part_key is not None and _shape(part)[dim] == size:
                    self.spaces.attach(layout, part_key, dim, role)
        elif self.layout(value) is None:
            made_by = _op_name(value) if value.op == "call_function" else "a constant"
            self.freeze(layout, f"a weight computed by {made_by} (from {_where(value)})")

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
            shape = _shape_or_none(node)
            if self.graph.key(node) is None and shape is not None and len(shape) >= 1:
                self.fresh(node, 1 if len(shape) >= 3 else len(shape) - 1, "the model's input")
        elif node.op == "output":
            self.freeze_inputs(node, "the model's output")
        elif node.op == "call_function":
            op = _op_name(node)
            handler = _HANDLERS.get(op)
            if handler is None:
                self.freeze_inputs(node, f"op {op} (from {_where(node)})")
            else:
                handler(self, node)

    def same(self, node: Node) -> None:
        source = self.layout(node.args[0])
        if source is not None and _shape_or_none(node) is not None:
            self.layouts[node] = source

    def conv(self, node: Node) -> None:
        op = _op_name(node)
        args = list(node.args) + [None] * 9
        source, weight, bias = self.layout(args[0]), args[1], args[2]
        groups = args[8] if op == "convolution" else args[6]
        groups = groups or 1
        if op == "convolution" and args[6]:  # transposed
            return self.conv_transpose(node)
        source = self.channels_first(node, source)
        if groups == 1:
            out = self.fresh(node, 1)
            self.attach(out, weight, 0, "out")
            self.attach(out, bias, 0, "out")
            if source is not None:
                self.attach(source, weight, 1, "in")
        elif source is not None and groups == source.size and _shape(weight)[:2] == (groups, 1):
            self.layouts[node] = source  # depthwise: one filter per channel
            self.attach(source, weight, 0, "norm")
            self.attach(source, bias, 0, "norm")
        else:
            self.freeze(source, f"grouped convolution (from {_where(node)})")
            self.fresh(node, 1, f"grouped convolution (from {_where(node)})")

    def channels_first(self, node: Node, source: Layout | None) -> Layout | None:
        """A convolution reads channels on axis 1; channels anywhere else cannot be followed through it."""
        if source is not None and source.axis != 1:
            self.freeze(source, f"convolution over a non-channel axis (from {_where(node)})")
            return None
        return source

    def conv_transpose(self, node: Node) -> None:
        args = list(node.args) + [None] * 8
        source, weight, bias = self.layout(args[0]), args[1], args[2]
        groups = (args[8] if _op_name(node) == "convolution" else args[6]) or 1
        source = self.channels_first(node, source)
        if groups != 1:
            self.freeze(source, f"grouped transposed convolution (from {_where(node)})")
            self.fresh(node, 1, f"grouped transposed convolution (from {_where(node)})")
            return
        out = self.fresh(node, 1)
        self.attach(out, weight, 1, "out")
        self.attach(out, bias, 0, "out")
        if source is not None:
            self.attach(source, weight, 0, "in")

    def linear(self, node: Node) -> None:
        source, weight = self.layout(node.args[0]), node.args[1]
        bias = node.args[2] if len(node.args) > 2 else None
        if source is not None and source.axis != len(_shape(node.args[0])) - 1:
            self.freeze(source, f"linear over a non-channel axis (from {_where(node)})")
            source = None
        out = self.fresh(node, len(_shape(node)) - 1)
        self.attach(out, weight, 0, "out")
        self.attach(out, bias, 0, "out")
        if source is not None:
            self.attach(source, weight, 1, "in")

    def addmm(self, node: Node) -> None:
        """``bias + x @ weight`` with weight stored [in, out] (Hugging Face's GPT-2 ``Conv1D``)."""
        bias, source, weight = node.args[0], self.layout(node.args[1]), node.args[2]
        out = self.fresh(node, 1)
        self.attach(out, weight, 1, "out")
        self.attach(out, bias, 0, "out")
        if source is not None and source.axis == 1:
            self.attach(source, weight, 0, "in")
        elif source is not None:
            self.freeze(source, f"addmm over a non-channel axis (from {_where(node)})")

    def nothing(self, node: Node) -> None:
        """Ops that only check (``_assert_tensor_metadata``): no data flows through them."""

    def embedding(self, node: Node) -> None:
        out = self.fresh(node, len(_shape(node)) - 1)
        self.attach(out, node.args[0], 1, "out")

    def norm(self, node: Node) -> None:
        source = self.layout(node.args[0])
        if source is None:
            return
        if source.axis != 1:
            self.freeze(source, f"{_op_name(node)} over a non-channel axis (from {_where(node)})")
            return
        if _op_name(node) == "instance_norm" and not any(isinstance(v, Node) for v in node.args[1:5]):
            # nothing to cut that would tell nn.InstanceNorm's num_features how many channels are left
            self.freeze(source, f"instance norm without weights or statistics (from {_where(node)})")
            return
        self.layouts[node] = source
        for value in node.args[1:5]:
            self.attach(source, value, 0, "norm")

    def group_norm(self, node: Node) -> None:
        """``nn.GroupNorm(G, C)`` normalises each group of ``C/G`` channels together. With one group (a norm
        over C, H, W, as a layer norm) or one channel per group, a channel can go alone, its weight and bias
        with it; groups of several channels would have to go whole, so their channels stay."""
        source, groups, weight = self.layout(node.args[0]), node.args[1], node.args[2]
        if source is None:
            return
        if source.axis != 1 or weight is None or groups not in (1, source.size):
            kind = "without weights" if weight is None else "over groups of several channels"
            self.freeze(source, f"group norm {kind} (from {_where(node)})")
            return
        self.layouts[node] = source
        for value in node.args[2:4]:
            self.attach(source, value, 0, "norm")

    def prelu(self, node: Node) -> None:
        """``nn.PReLU(C)`` scales each channel's negative side by its own slope, so its weight is one more
        per-channel vector of the group; ``nn.PReLU()`` (one shared slope) just passes the channels on."""
        source, weight = self.layout(node.args[0]), node.args[1]
        if source is None:
            return
        if math.prod(_shape_or_none(weight) or (1,)) == 1:
            self.layouts[node] = source
            return
        if source.axis != min(1, len(_shape(node.args[0])) - 1):  # PReLU's slopes run along axis 1
            self.freeze(source, f"prelu over a non-channel axis (from {_where(node)})")
            return
        self.layouts[node] = source
        self.attach(source, weight, 0, "norm")

    def layer_norm(self, node: Node) -> None:
        source = self.layout(node.args[0])
        normalized = node.args[1]
        if source is None:
            return
        if len(_list(normalized)) != 1 or source.axis != len(_shape(node.args[0])) - 1:
            self.freeze(source, f"layer norm over several axes (from {_where(node)})")
            return
        self.layouts[node] = source
        for value in node.args[2:4]:
            self.attach(source, value, 0, "norm")

    def elementwise(self, node: Node) -> None:
        out_shape = _shape_or_none(node)
        operands = [(a, s) for a in node.args if isinstance(a, Node) and (s := _shape_or_none(a)) is not None]
        laid = [(shape, layout) for a, shape in operands if (layout := self.layout(a)) is not None]
        if not laid or out_shape is None:
            return
        first_shape, first = laid[0]
        axis = first.axis + len(out_shape) - len(first_shape)  # broadcasting aligns from the right
        for shape, layout in laid[1:]:
            if layout.axis + len(out_shape) - len(shape) != axis or not self.unite(first, layout):
                self.freeze(first, f"{_op_name(node)} of differently arranged channels (from {_where(node)})")
                self.freeze(layout, f"{_op_name(node)} of differently arranged channels")
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
        tensors = _list(node.args[0])
        dim = _dim(node, 1, len(_shape(node)))
        maybe_layouts = [self.layout(t) for t in tensors]
        layouts = [layout for layout in maybe_layouts if layout is not None]
        if len(layouts) < len(maybe_layouts):
            for maybe_layout in maybe_layouts:
                self.freeze(maybe_layout, f"cat with an input of unknown channels (from {_where(node)})")
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
                self.freeze(layout, f"cat of differently arranged channels (from {_where(node)})")

    def flatten(self, node: Node) -> None:
        source = self.layout(node.args[0])
        in_shape = _shape(node.args[0])
        start, end = _dim(node, 1, len(in_shape)), _dim(node, 2, len(in_shape), default=len(in_shape) - 1)
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
            self.freeze(source, f"flatten that splits a channel's entries (from {_where(node)})")

    def view(self, node: Node) -> None:
        source = self.layout(node.args[0])
        if source is None:
            return
        in_shape, out_shape = _shape(node.args[0]), _shape(node)
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
        self.freeze(source, f"view {list(in_shape)} -> {list(out_shape)} (from {_where(node)})")

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

    def attention(self, node: Node) -> None:
        """``scaled_dot_product_attention(q, k, v)``: head h of q meets head h of k, and gives head h of the
        output from head h of v, so the three head spaces become one."""
        q, k, v = (self.layout(a) for a in node.args[:3])
        if q is None or k is None or v is None:
            for layout in (q, k, v):
                self.freeze(layout, f"attention with unknown heads (from {_where(node)})")
            return
        q = self.group_queries(q, k)
        if not (self.unite(q, k) and self.unite(q, v)):
            for layout in (q, k, v):
                self.freeze(layout, f"grouped-query attention (from {_where(node)})")
            self.fresh(node, q.axis, f"grouped-query attention (from {_where(node)})")
            return
        self.layouts[node] = q

    def group_queries(self, q: Layout, k: Layout) -> Layout:
        """Grouped-query attention: each key/value head serves ``n`` consecutive query heads (``repeat_kv``
        made k look like ``Hkv`` channels of ``n`` entries), so the query heads are regrouped by ``n``."""
        if len(q.segments) != 1 or len(k.segments) != 1:
            return q
        (query,), (key,) = q.segments, k.segments
        if key.factor == 1 or query.factor != 1 or query.count != key.count * key.factor:
            return q
        groups = self.spaces.regroup(query.space, key.factor)
        return Layout(q.axis, (Segment(groups, key.count, key.factor),))

    def split(self, node: Node) -> None:
        """``split`` along the channels (GPT-2's fused q/k/v) makes a space per piece; along another axis
        every piece keeps the channels."""
        source = self.layout(node.args[0])
        if source is None:
            return
        dim = _dim(node, 2, len(_shape(node.args[0])))
        sizes = [tuple(value.shape)[dim] for value in node.meta.get("val", ())]
        if dim != source.axis:
            self.pieces[node] = [source] * len(sizes)
        elif len(source.segments) == 1 and source.segments[0].factor == 1 and len(node.users) == len(sizes):
            spaces = self.spaces.partition(source.segments[0].space, sizes)
            self.pieces[node] = [
                Layout(dim, (Segment(space, size),)) for space, size in zip(spaces, sizes, strict=True)
            ]
        else:
            self.freeze(source, f"split of mixed channels (from {_where(node)})")

    def getitem(self, node: Node) -> None:
        pieces = self.pieces.get(node.args[0]) if isinstance(node.args[0], Node) else None
        if pieces is not None and isinstance(node.args[1], int):
            self.layouts[node] = pieces[node.args[1]]

    def unsqueeze(self, node: Node) -> None:
        source, rank = self.layout(node.args[0]), len(_shape(node.args[0]))
        if source is not None:
            dim = _int(node.args[1]) % (rank + 1)
            self.layouts[node] = Layout(source.axis + (dim <= source.axis), source.segments)

    def expand(self, node: Node) -> None:
        source = self.layout(node.args[0])
        if source is None:
            return
        in_shape, out_shape = _shape(node.args[0]), _shape(node)
        axis = source.axis + len(out_shape) - len(in_shape)
        if out_shape[axis] != in_shape[source.axis]:
            self.freeze(source, f"expand of the channels (from {_where(node)})")
            return
        self.layouts[node] = Layout(axis, source.segments)

    def select(self, node: Node) -> None:
        """``x[:, 0]`` (select) or ``x[:, 1:]`` (slice) along an axis other than the channels'."""
        source = self.layout(node.args[0])
        if source is None:
            return
        dim = _dim(node, 1, len(_shape(node.args[0])))
        if dim == source.axis:
            self.freeze(source, f"{_op_name(node)} of some channels (from {_where(node)})")
            return
        dropped = _op_name(node) == "select" and dim < source.axis
        self.layouts[node] = Layout(source.axis - dropped, source.segments)

    def transpose(self, node: Node) -> None:
        source, rank = self.layout(node.args[0]), len(_shape(node.args[0]))
        if source is None:
            return
        if _op_name(node) == "permute":
            order = [d % rank for d in _ints(node.args[1])]
        else:
            a, b = _int(node.args[1]) % rank, _int(node.args[2]) % rank
            order = list(range(rank))
            order[a], order[b] = b, a
        self.layouts[node] = Layout(order.index(source.axis), source.segments)

    def mean(self, node: Node) -> None:
        source = self.layout(node.args[0])
        if source is None:
            return
        rank = len(_shape(node.args[0]))
        given = node.args[1] if len(node.args) > 1 else list(range(rank))
        dims = {d % rank for d in (_ints(given) if isinstance(given, (list, tuple)) else [_int(given)])}
        keepdim = bool(node.args[2]) if len(node.args) > 2 else bool(node.kwargs.get("keepdim", False))
        if source.axis in dims:
            return  # a statistic over the channels (RMSNorm's mean of squares): it has no channels itself
        shift = 0 if keepdim else sum(d < source.axis for d in dims)
        self.layouts[node] = Layout(source.axis - shift, source.segments)


_HANDLERS = {name: _Walk.same for name in SAME_CHANNELS}
_HANDLERS.update({name: _Walk.elementwise for name in ELEMENTWISE})
_HANDLERS.update({name: _Walk.norm for name in NORMS})
_HANDLERS.update({name: _Walk.conv for name in CONVS})
_HANDLERS.update({name: _Walk.conv_transpose for name in CONV_TRANSPOSES})
_HANDLERS.update(
    {
        "linear": _Walk.linear,
        "embedding": _Walk.embedding,
        "layer_norm": _Walk.layer_norm,
        "rms_norm": _Walk.layer_norm,  # (x, normalized_shape, weight, eps): a layer norm's arguments
        "group_norm": _Walk.group_norm,
        "prelu": _Walk.prelu,
        "_prelu_kernel": _Walk.prelu,
        "cat": _Walk.cat,
        "flatten": _Walk.flatten,
        "view": _Walk.view,
        "reshape": _Walk.view,
        "_unsafe_view": _Walk.view,
        "mean": _Walk.mean,
        "sum": _Walk.mean,
        "amax": _Walk.mean,
        "select": _Walk.select,
        "unsqueeze": _Walk.unsqueeze,
        "split": _Walk.split,
        "split_with_sizes": _Walk.split,
        "getitem": _Walk.getitem,
        "expand": _Walk.expand,
        "scaled_dot_product_attention": _Walk.attention,
        "addmm": _Walk.addmm,
        "_assert_tensor_metadata": _Walk.nothing,
        "_assert_scalar": _Walk.nothing,
        "slice": _Walk.select,
        "transpose": _Walk.transpose,
        "permute": _Walk.transpose,
    }
)


def _op_name(node: Node) -> str:
    target = node.target
    name = getattr(target, "__name__", str(target))
    return name.split(".")[0]


def _shape(value: object) -> tuple[int, ...]:
    """The shape of the tensor a node computes (export records one on every tensor node). Called where the
    op's schema takes a tensor: anything else is a graph this walk does not understand, a TypeError."""
    shape = _shape_or_none(value)
    if shape is None:
        raise TypeError(f"expected a node that computes a tensor, not {value!r}")
    return shape


def _shape_or_none(value: object) -> tuple[int, ...] | None:
    """The shape of the tensor a node computes, or None for anything else (a number, a non-tensor node)."""
    meta = getattr(value, "meta", {}).get("val") if isinstance(value, Node) else None
    return tuple(meta.shape) if isinstance(meta, torch.Tensor) else None


def _int(value: object) -> int:
    """An int argument of an op (a dimension); a TypeError for anything else."""
    if not isinstance(value, int):
        raise TypeError(f"expected an int argument, not {value!r}")
    return value


def _list(value: object) -> list[object]:
    """A list argument of an op (cat's tensors, a norm's normalized shape); a TypeError for anything else."""
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"expected a list argument, not {value!r}")
    return list(value)


def _ints(value: object) -> list[int]:
    """A list-of-ints argument of an op (permute's order, mean's dims)."""
    return [_int(v) for v in _list(value)]


def _dim(node: Node, index: int, rank: int, default: int = 0) -> int:
    """Argument ``index`` of ``node``, a dimension of a rank-``rank`` tensor, as a non-negative axis (a
    negative one counts from the end); ``default``, as it is, when the call leaves it out."""
    return _int(node.args[index]) % rank if len(node.args) > index else default


def _where(node: Node) -> str:
    """The module a node comes from, for messages: ``layer1.0.conv1`` (or the node's name)."""
    stack = node.meta.get("nn_module_stack") or {}
    if stack:
        path = list(stack.values())[-1][0]
        return path or "the top module"
    return node.name
