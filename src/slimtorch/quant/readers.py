"""Layers whose weight is read outside their own forward, found while the float model runs.

A quantized layer keeps its weight as codes: code that reads ``layer.weight`` itself (a self-attention
doing ``x @ self.key.weight.T``, an output head tied by hand to an embedding's table, ``F.linear(x,
self.proj.weight)``, ``nn.TransformerEncoderLayer``'s fused path) fails on the swapped layer
(``'Int8DynamicLinear' object has no attribute 'weight'``), in the user's first forward.
:func:`watching_weight_reads` records, during the calibration pass :func:`slimtorch.quantize` already
makes over the float model, every read of a candidate's weight that happens outside the candidate's own
``forward``; such a layer is kept float, with the place that read it.

A module's parameters are not in its ``__dict__``: every read goes through ``nn.Module.__getattr__``. For
the pass each candidate's class is swapped for a subclass whose ``__getattr__`` notes such reads, and its
``forward`` is wrapped (an instance attribute, :func:`wrapping_forward`) to say when its own forward
runs. Not hooks: a hook changes what some models run (``nn.TransformerEncoderLayer`` leaves its fused
path, the one that reads its layers' weights, as soon as any of its modules has a hook), so a pass with
hooks would not see the reads the user's own calls make. Classes and forwards are restored after.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

from torch import nn

from slimtorch.calibration.moments import wrapping_forward


def removed_by_swap(module: nn.Module) -> frozenset[str]:
    """The attributes a quantized layer no longer has: its weight matrices (biases stay parameters)."""
    return frozenset(name for name in module._parameters if "weight" in name)


@contextlib.contextmanager
def watching_weight_reads(candidates: dict[str, nn.Module]) -> Iterator[dict[str, str]]:
    """While the block runs, each read of a candidate's weight outside the candidate's own forward is
    noted: the dict yielded fills with ``name -> where`` (``"attention.py:42 in forward"``, the first
    such read), for the layers that must stay float."""
    found: dict[str, str] = {}
    with contextlib.ExitStack() as stack:
        seen: set[int] = set()
        for name, module in candidates.items():
            removed = removed_by_swap(module)
            if removed and id(module) not in seen:
                seen.add(id(module))
                stack.enter_context(_watching(module, name, removed, found))
        yield found


@contextlib.contextmanager
def _watching(module: nn.Module, name: str, removed: frozenset[str], found: dict[str, str]) -> Iterator[None]:
    """``module``'s reads of ``removed`` from outside its own forward noted in ``found[name]``."""
    original = type(module)
    inside = [0]  # calls of its own forward under way (a layer may call itself)

    def __getattr__(self: nn.Module, attr: str) -> Any:
        value = original.__getattr__(self, attr)
        if attr in removed and not inside[0] and name not in found:
            found[name] = _caller(sys._getframe(1))
        return value

    def counted(forward: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            inside[0] += 1
            try:
                return forward(*args, **kwargs)
            finally:
                inside[0] -= 1

        return call

    namespace = {
        "__getattr__": __getattr__,
        "__module__": original.__module__,
        "__qualname__": original.__qualname__,
    }
    module.__class__ = type(original.__name__, (original,), namespace)
    try:
        with wrapping_forward(module, counted):
            yield
    finally:
        module.__class__ = original


def _caller(frame: Any) -> str:
    """``file.py:42 in forward`` for the frame that read the weight (the file's name only)."""
    code = frame.f_code
    return f"{os.path.basename(code.co_filename)}:{frame.f_lineno} in {code.co_name}"
