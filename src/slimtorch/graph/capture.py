"""Graph capture: one ATen-level graph of a model's forward, shared by pruning and memory estimation.

``torch.export`` traces the forward with the example inputs into a graph of ATen operators (``conv2d``,
``linear``, ``batch_norm``, ``add``, ``cat``, ``view`` ...) whose parameter and buffer inputs are named
by their ``state_dict`` keys. It needs no autograd (it works under ``torch.no_grad``), it handles Python
control flow that depends only on shapes, and every node carries the shape of what it computes.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from slimtorch.errors import SlimtorchError


@dataclass(frozen=True)
class Graph:
    """A captured forward: the FX graph and, for each placeholder that is a weight, its state_dict key."""

    graph: torch.fx.Graph
    weights: dict[str, str]
    """placeholder node name -> state_dict key (parameters and buffers)"""

    def key(self, node: torch.fx.Node) -> str | None:
        """The state_dict key a node stands for, or None when it is not a weight."""
        return self.weights.get(node.name) if node.op == "placeholder" else None


def capture(
    model: nn.Module, example_inputs: Sequence[Any] | Any, example_kwargs: Mapping[str, Any] | None = None
) -> Graph:
    """Trace ``model(*example_inputs, **example_kwargs)`` into an ATen graph (nothing is trained or changed).

    Example:
        >>> graph = capture(nn.Sequential(nn.Linear(4, 8), nn.ReLU()), (torch.randn(2, 4),))
        >>> [n.target.__name__ for n in graph.graph.nodes if n.op == "call_function"]
        ['linear.default', 'relu.default']
    """
    args = as_args(example_inputs)
    kwargs = without_cache(model, dict(example_kwargs or {}))
    try:
        with torch.no_grad():
            program = torch.export.export(model, args, kwargs, strict=False)
    except Exception as exc:  # export raises many types; the user needs the op and the reason
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise SlimtorchError(f"cannot capture the model's graph with torch.export: {first}") from exc
    signature = program.graph_signature
    weights = {**signature.inputs_to_parameters, **signature.inputs_to_buffers}
    return Graph(program.graph, weights)


def as_args(example_inputs: Sequence[Any] | Any) -> tuple[Any, ...]:
    """Example inputs as positional arguments: a tuple or list is several, anything else is one."""
    return tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)


def random_like(value: Any, generator: torch.Generator | None = None) -> Any:
    """Another input like ``value``: fresh normal noise for a float tensor, ids below the largest seen for
    an integer one (token ids stay in the vocabulary); anything else as it is. Drawn on the CPU from
    ``generator`` (a CPU one; None: torch's global one), then moved to ``value``'s device."""
    if not isinstance(value, torch.Tensor):
        return value
    if value.is_floating_point():
        drawn = torch.randn(value.shape, generator=generator, dtype=value.dtype)
    else:
        high = int(value.max()) + 1 if value.numel() else 1
        drawn = torch.randint(0, high, value.shape, generator=generator, dtype=value.dtype)
    return drawn.to(value.device)


def without_cache(model: nn.Module, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Hugging Face decoders return a key/value cache object that export cannot flatten; the graph is the
    same without it, so ask for none unless the caller said otherwise."""
    config = getattr(model, "config", None)
    if "use_cache" not in kwargs and getattr(config, "use_cache", False):
        with contextlib.suppress(TypeError, ValueError):
            if "use_cache" in inspect.signature(model.forward).parameters:
                kwargs["use_cache"] = False
    return kwargs
