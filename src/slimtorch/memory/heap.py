"""What a CPU training run makes resident: glibc's malloc, modelled over the run's allocations.

A loop's live tensor bytes are not what the operating system counts. Measured on this project's
benchmark models (``benchmarks/allocator_overhead.py``), a real loop's RSS grows 1.26-1.65x its peak of
live tensor bytes, and the gap is malloc's: its heap held, in every run measured, what RSS grew by, within
1%. Three of glibc's rules make it:

- a block of at least the mmap threshold gets pages of its own, given back when it is freed; but the
  threshold starts at 128 KiB and rises to the size of the largest such block freed (up to 32 MiB), so
  from a loop's first backward pass on, nearly every activation lives in the heap;
- the heap gives memory back only from its top: a freed block below it stays resident, for reuse;
- freed blocks are reused by later requests that fit them, and in a training process they are hardly
  ever merged with their neighbours: the small objects a step allocates between its tensors (autograd's
  records, tensor headers, kernels' small buffers, tens of thousands a step) sit between them.

Replaying a real loop's complete malloc trace (every call, recorded with an ``LD_PRELOAD`` shim) through
glibc itself reproduces its RSS growth within 3.5%; replaying only its tensors misses 13-29%, because the
small objects keep freed blocks apart, and so do the kernels' own scratch blocks that no tensor shows (a
oneDNN convolution reorders its input and output; an ``mm`` on an expanded gradient copies it).
:func:`resident_peak` replays a step's tensor allocations, with the scratch :func:`kernel_scratch` knows
of, through a model of those rules: blocks at the threshold or above are mapped on their own; below it, the
first freed block (by address) large enough is reused, never merged with a neighbour, else the top grows;
the top comes down when the block at its edge is freed. What is not malloc's, library code paged in on
first use, is :data:`CODE_PAGES`. Against real loops (the measured table is in the README) it is within
15% in 11 of 12 cases (CNNs, transformers, an LSTM; the worst +15.5%); oneDNN's compiled kernels (mapped
code) are not counted.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

MMAP_THRESHOLD = 128 * 2**10
"""glibc's ``M_MMAP_THRESHOLD`` before any mapped block is freed"""
MMAP_THRESHOLD_MAX = 32 * 2**20
"""the most it rises to (``DEFAULT_MMAP_THRESHOLD_MAX`` on 64-bit)"""
PAGE = 4096
CODE_PAGES = 20 * 2**20
"""what a CPU training loop's kernels page in of torch's and oneDNN's libraries on first use (file pages
RSS counts): 13-23 MiB measured over the six models of ``benchmarks/allocator_overhead.py`` (torch 2.13,
x86-64), the same order whatever the batch"""
HEADER = 16  # a malloc chunk's size field and alignment slack
ALIGNMENT = 64  # PyTorch's CPU allocator asks posix_memalign for 64-byte blocks

Scratch = tuple[int, int, tuple[int, ...]]
"""(index in the events where an op's outputs begin, where they end, the op's scratch blocks in bytes)"""

_aten = torch.ops.aten
_BLAS = {_aten.mm.default, _aten.addmm.default, _aten.bmm.default}


def kernel_scratch(func: Any, args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> tuple[int, ...]:
    """The blocks ``func``'s CPU kernel allocates and frees inside itself, in bytes, where known.

    Found with a malloc trace of real steps, each block matched to the op running when it was made:
    oneDNN's convolution reorders its input and its output to a blocked layout; its backward, the output's
    gradient and the input (twice); batch norm's backward makes one input-sized buffer; BLAS copies an
    input that is expanded (a stride of 0: the gradient of a ``sum``) before it multiplies.
    """
    if func not in _SCRATCH:
        return ()
    tensors = [value for value in tree_leaves((args, kwargs, out)) if isinstance(value, torch.Tensor)]
    return tuple(size for size in _SCRATCH[func](tensors) if size > 0)


def _convolution(tensors: list[torch.Tensor]) -> list[int]:
    return [_nbytes(tensors[0]), _nbytes(tensors[-1])]  # the input, the output (the last tensor)


def _convolution_backward(tensors: list[torch.Tensor]) -> list[int]:
    gradient, source = tensors[0], tensors[1]
    return [_nbytes(gradient), _nbytes(source), _nbytes(source)]


def _expanded(tensors: list[torch.Tensor]) -> list[int]:
    return [_nbytes(t) for t in tensors if t.dim() >= 2 and t.numel() > 1 and 0 in t.stride()]


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


_SCRATCH: dict[Any, Callable[[list[torch.Tensor]], list[int]]] = {
    _aten.convolution.default: _convolution,
    _aten.convolution_backward.default: _convolution_backward,
    _aten.native_batch_norm_backward.default: lambda tensors: [_nbytes(tensors[1])],
    **dict.fromkeys(_BLAS, _expanded),
}


def resident_peak(events: Sequence[tuple[int, int]], scratch: Sequence[Scratch] = ()) -> int:
    """The most bytes the heap and the mapped blocks hold at once over ``events`` ((key, bytes): positive
    allocates the storage ``key``, negative frees it), with each op's ``scratch`` blocks made before its
    outputs and freed after them: the RSS growth a run with these allocations is predicted to cause."""
    heap = _Heap()
    starts: dict[int, list[Scratch]] = {}
    ends: dict[int, list[int]] = {}
    for op in scratch:
        starts.setdefault(op[0], []).append(op)
    for index, (key, nbytes) in enumerate(events):
        _scratch_at(index, heap, starts, ends)
        heap.event(key, nbytes)
    _scratch_at(len(events), heap, starts, ends)
    return heap.peak


def repeated(
    events: Sequence[tuple[int, int]], scratch: Sequence[Scratch], window: range, times: int
) -> tuple[list[tuple[int, int]], list[Scratch]]:
    """``events`` and ``scratch`` with the steady step (``window``, at their end) run ``times`` more.

    A steady step starts with the same storages alive as the step before it, so each storage it frees
    that was made before it (last step's gradients) has a twin among those it makes and leaves alive,
    matched by size in order: the next step frees the twin where this one freed the older storage."""
    events, scratch = list(events), list(scratch)
    step = [events[index] for index in window]
    made = [key for key, nbytes in step if nbytes > 0]
    made_here = set(made)
    freed = {key for key, nbytes in step if nbytes < 0}
    survivors: dict[int, list[int]] = {}
    for key, nbytes in step:
        if nbytes > 0 and key not in freed:
            survivors.setdefault(nbytes, []).append(key)
    twin = {
        key: survivors[-nbytes].pop(0)
        for key, nbytes in step
        if nbytes < 0 and key not in made_here and survivors.get(-nbytes)
    }
    ops = [op for op in scratch if window.start <= op[0] < window.stop]
    fresh = max((key for key, _ in events), default=0) + 1
    previous: dict[int, int] = {}  # the last copy's name for each storage the step makes
    for _ in range(times):
        names = {key: fresh + index for index, key in enumerate(made)}
        fresh += len(made)
        offset = len(events) - window.start
        for key, nbytes in step:
            if key in names:
                events.append((names[key], nbytes))
            else:  # made before the step: its twin, as the last copy named it
                events.append((previous.get(twin.get(key, key), twin.get(key, key)), nbytes))
        scratch += [(start + offset, end + offset, blocks) for start, end, blocks in ops]
        previous = names
    return events, scratch


def _scratch_at(
    index: int, heap: _Heap, starts: dict[int, list[Scratch]], ends: dict[int, list[int]]
) -> None:
    """Free the scratch of ops whose outputs ended before ``index``; make that of ops whose begin here."""
    for key in ends.pop(index, ()):
        heap.free(key)
    for _, end, blocks in starts.pop(index, ()):
        keys = [heap.allocate(nbytes) for nbytes in blocks]
        if end == index:  # an op with no new output: its scratch comes and goes at once
            for key in keys:
                heap.free(key)
        else:
            ends.setdefault(end, []).extend(keys)


class _Heap:
    """glibc's main heap and its mapped blocks, as the module's docstring models them."""

    def __init__(self) -> None:
        self.threshold = MMAP_THRESHOLD
        self.top = self.mapped = self.peak = 0
        self._holes: list[int] = []  # freed blocks' addresses, sorted
        self._hole_size: dict[int, int] = {}
        self._blocks: dict[int, tuple[int | None, int]] = {}  # key -> (address, None if mapped; size)
        self._scratch_keys = -1

    def event(self, key: int, nbytes: int) -> None:
        if key in self._blocks:
            self.free(key)
        elif nbytes > 0:
            self._place(key, nbytes)

    def allocate(self, nbytes: int) -> int:
        self._scratch_keys -= 1
        self._place(self._scratch_keys, nbytes)
        return self._scratch_keys

    def _place(self, key: int, nbytes: int) -> None:
        if nbytes >= self.threshold:
            size = -(-(nbytes + HEADER) // PAGE) * PAGE
            self._blocks[key] = (None, size)
            self.mapped += size
        else:
            self._blocks[key] = self._reuse(-(-nbytes // ALIGNMENT) * ALIGNMENT + HEADER)
        self.peak = max(self.peak, self.top + self.mapped)

    def _reuse(self, size: int) -> tuple[int, int]:
        """(address, size) of the first freed block that fits, cut to ``size`` when what is left is worth
        keeping free; else a new block at the top."""
        for index, address in enumerate(self._holes):
            room = self._hole_size[address]
            if room >= size:
                del self._holes[index], self._hole_size[address]
                if room - size < ALIGNMENT:
                    return address, room
                bisect.insort(self._holes, address + size)
                self._hole_size[address + size] = room - size
                return address, size
        address, self.top = self.top, self.top + size
        return address, size

    def free(self, key: int) -> None:
        address, size = self._blocks.pop(key)
        if address is None:
            self.mapped -= size
            if self.threshold < size <= MMAP_THRESHOLD_MAX:  # glibc's dynamic threshold
                self.threshold = size
        elif address + size == self.top:
            self.top = address
        else:
            bisect.insort(self._holes, address)
            self._hole_size[address] = size
