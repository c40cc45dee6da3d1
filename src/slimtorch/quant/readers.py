"""Layers whose weight is read outside their own forward, found while the float model runs.

A quantized layer keeps its weight as codes: code that reads ``layer.weight`` itself (a self-attention
doing ``x @ self.key.weight.T``, an output head tied by hand to an embedding's table, ``F.linear(x,
self.proj.weight)``) fails on the swapped layer (``'Int8DynamicLinear' object has no attribute
'weight'``), in the user's first forward. :func:`watching_weight_reads` records, during the calibration
pass :func:`slimtorch.quantize` already makes over the float model, every read of a candidate's weight that
happens outside the candidate's own ``forward``; such a layer is kept float, with the place that read it.

A module's parameters are not in its ``__dict__``: every read goes through ``nn.Module.__getattr__``. For
the pass each candidate's class is swapped for a subclass whose ``__getattr__`` notes such reads, and its
forward hooks say when the module's own forward runs; classes and hooks are restored after.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from typing import Any

from torch import nn


def removed_by_swap(module: nn.Module) -> frozenset[str]:
    """The attributes a quantized layer no longer has: its weight matrices (biases stay parameters)."""
    return frozenset(name for name in module._parameters if "weight" in name)


@contextlib.contextmanager
def watching_weight_reads(candidates: dict[str, nn.Module]) -> Iterator[dict[str, str]]:
    """While the block runs, each read of a candidate's weight outside the candidate's own forward is
    noted: the dict yielded fills with ``name -> where`` (``"attention.py:42 in forward"``, the first
    such read), for the layers that must stay float."""
    found: dict[str, str] = {}
    depth: dict[int, int] = {}
    names = {id(module): name for name, module in candidates.items()}
    watched: list[tuple[nn.Module, type, list[Any]]] = []

    def enter(module: nn.Module, args: Any) -> None:
        depth[id(module)] = depth.get(id(module), 0) + 1

    def leave(module: nn.Module, args: Any, output: Any) -> None:
        depth[id(module)] -= 1

    try:
        for module in candidates.values():
            removed = removed_by_swap(module)
            if not removed or id(module) in depth:
                continue
            depth[id(module)] = 0
            original = type(module)
            handles = [
                module.register_forward_pre_hook(enter),
                module.register_forward_hook(leave, always_call=True),
            ]
            module.__class__ = _watching(original, removed, depth, names, found)
            watched.append((module, original, handles))
        yield found
    finally:
        for module, original, handles in watched:
            module.__class__ = original
            for handle in handles:
                handle.remove()


def _watching(
    original: type,
    removed: frozenset[str],
    depth: dict[int, int],
    names: dict[int, str],
    found: dict[str, str],
) -> type:
    """A subclass of ``original`` whose parameter reads are noted when they come from outside its forward."""

    def __getattr__(self: nn.Module, attr: str) -> Any:
        value = original.__getattr__(self, attr)
        if attr in removed and not depth.get(id(self)) and names[id(self)] not in found:
            found[names[id(self)]] = _caller(sys._getframe(1))
        return value

    return type(
        original.__name__, (original,), {"__getattr__": __getattr__, "__module__": original.__module__}
    )


def _caller(frame: Any) -> str:
    """``file.py:42 in forward`` for the frame that read the weight (the file's name only)."""
    code = frame.f_code
    return f"{os.path.basename(code.co_filename)}:{frame.f_lineno} in {code.co_name}"
