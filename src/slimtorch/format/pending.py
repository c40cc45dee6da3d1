"""Checksums still being verified under loaded tensors, and the wait for them.

``load_model(verify="before-use")`` returns once the model holds the file's mapped bytes; the checks run
on threads of their own and each module's forward waits for its own tensors'. A step that reads weights
without a forward (save, quantize, prune, export) calls :func:`wait_for_checks` first, so it never
copies or measures bytes that turn out corrupt.

Pending checks are found by address: a tensor mapped from a file under verification lies inside one of
its parts' byte ranges, whatever view, state dict or module holds it. So a state dict of a loaded model
waits as its model does, and when nothing is pending the wait is one dictionary lookup. The registry is
process-wide because tensors carry no reference to the load that made them.
"""

from __future__ import annotations

import bisect
import itertools
import threading
from collections.abc import Iterable
from typing import Protocol

import torch
from torch import nn


class Checks(Protocol):
    """What a load leaves running: ``wait`` blocks until every check is done and raises the first
    mismatch (a :class:`~slimtorch.errors.FormatError` naming the file and tensor)."""

    def wait(self) -> None: ...


_lock = threading.Lock()
_tokens = itertools.count()
_held: dict[int, tuple[list[int], list[int], Checks]] = {}
"""token -> (sorted starts, their ends, the checks covering those byte ranges)"""


def hold(ranges: Iterable[tuple[int, int]], checks: Checks) -> int:
    """Mark the ``[start, end)`` address ranges as under ``checks`` until :func:`release`; returns the
    token to release them with."""
    ordered = sorted(ranges)
    token = next(_tokens)
    with _lock:
        _held[token] = ([s for s, _ in ordered], [e for _, e in ordered], checks)
    return token


def release(token: int) -> None:
    """The ranges of ``token`` are verified (or will never be): tensors there no longer wait."""
    with _lock:
        _held.pop(token, None)


def wait_for_checks(tensors: nn.Module | Iterable[torch.Tensor]) -> None:
    """Block until the checksums under ``tensors`` (a model's parameters and buffers, or any tensors) are
    verified; raise :class:`~slimtorch.errors.FormatError` if one of them failed. Returns at once for
    tensors no load is still verifying.

    Example:
        >>> wait_for_checks(torch.nn.Linear(2, 2))  # nothing pending: returns at once
    """
    if not _held:
        return
    if isinstance(tensors, nn.Module):
        tensors = itertools.chain(tensors.parameters(), tensors.buffers())
    addresses = [t.data_ptr() for t in tensors if isinstance(t, torch.Tensor) and _mapped_on_cpu(t)]
    with _lock:
        held = list(_held.values())
    for starts, ends, checks in held:
        if any(_inside(address, starts, ends) for address in addresses):
            checks.wait()


def _mapped_on_cpu(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` can be bytes of a mapped file: dense (a sparse tensor has no data pointer to ask
    for, and asking raises), on the CPU, with elements."""
    return (
        tensor.layout == torch.strided
        and tensor.device.type == "cpu"
        and tensor.numel() > 0
        and not tensor.is_meta
    )


def _inside(address: int, starts: list[int], ends: list[int]) -> bool:
    i = bisect.bisect_right(starts, address) - 1
    return i >= 0 and address < ends[i]
