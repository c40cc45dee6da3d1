"""Reading a captured graph's nodes: the op a node calls, the shape it computes, its arguments as the
op's schema types them, and the module it comes from (for messages).

The channel walk (:mod:`slimtorch.graph.channels`) and the layer types' own channel rules
(:mod:`slimtorch.graph.prunable`) read nodes through these, so that an argument of an unexpected kind is a
``TypeError`` naming it, never a silently wrong walk.
"""

from __future__ import annotations

import torch
from torch.fx import Node


def op_name(node: Node) -> str:
    """The ATen op without its overload: ``conv2d`` for ``aten.conv2d.default``."""
    target = node.target
    name = getattr(target, "__name__", str(target))
    return name.split(".")[0]


def shape_of(value: object) -> tuple[int, ...]:
    """The shape of the tensor a node computes (export records one on every tensor node). Called where the
    op's schema takes a tensor: anything else is a graph the walk does not understand, a TypeError."""
    found = shape_or_none(value)
    if found is None:
        raise TypeError(f"expected a node that computes a tensor, not {value!r}")
    return found


def shape_or_none(value: object) -> tuple[int, ...] | None:
    """The shape of the tensor a node computes, or None for anything else (a number, a non-tensor node)."""
    meta = getattr(value, "meta", {}).get("val") if isinstance(value, Node) else None
    return tuple(meta.shape) if isinstance(meta, torch.Tensor) else None


def output_shape(node: Node, index: int) -> tuple[int, ...]:
    """The shape of output ``index`` of an op that returns several tensors (``embedding_bag``'s four)."""
    meta = node.meta.get("val")
    value = meta[index] if isinstance(meta, (list, tuple)) and 0 <= index < len(meta) else None
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{node.name} has no tensor output {index}")
    return tuple(value.shape)


def as_int(value: object) -> int:
    """An int argument of an op (a dimension); a TypeError for anything else."""
    if not isinstance(value, int):
        raise TypeError(f"expected an int argument, not {value!r}")
    return value


def as_list(value: object) -> list[object]:
    """A list argument of an op (cat's tensors, a norm's normalized shape); a TypeError for anything else."""
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"expected a list argument, not {value!r}")
    return list(value)


def as_ints(value: object) -> list[int]:
    """A list-of-ints argument of an op (permute's order, mean's dims)."""
    return [as_int(v) for v in as_list(value)]


def dim_arg(node: Node, index: int, rank: int, default: int = 0) -> int:
    """Argument ``index`` of ``node``, a dimension of a rank-``rank`` tensor, as a non-negative axis (a
    negative one counts from the end); ``default``, as it is, when the call leaves it out."""
    return as_int(node.args[index]) % rank if len(node.args) > index else default


def where(node: Node) -> str:
    """The module a node comes from, for messages: ``layer1.0.conv1`` (or the node's name)."""
    stack = node.meta.get("nn_module_stack") or {}
    if stack:
        path = list(stack.values())[-1][0]
        return path or "the top module"
    return node.name
