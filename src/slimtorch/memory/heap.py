"""What a CPU training run makes resident: glibc's malloc, modelled over the run's allocations.

A loop's live tensor bytes are not what the operating system counts. Measured on this project's
benchmark models (``benchmarks/allocator_overhead.py``), a real loop's RSS grows 1.26-1.65x its peak of
live tensor bytes, and the gap is malloc's: its heap held, in every run measured, what RSS grew by, within
1%. Three of glibc's rules make it:

- a block of at least the mmap threshold gets pages of its own, given back when it is freed; but the
  threshold starts at 128 KiB and rises to the size of the largest such block freed (up to 32 MiB), so
  from a loop's first backward pass on, nearly every activation lives in the heap;
- the heap gives memory back only from its top: a freed block below it stays resident, for reuse;
- a request takes the smallest freed block that fits it (best fit: glibc keeps large free chunks in
  size-sorted bins), and in a training process freed blocks are hardly ever merged with their
  neighbours: the small objects a step allocates between its tensors (autograd's records, tensor
  headers, kernels' small buffers, tens of thousands a step) sit between them.

Replaying a real loop's complete malloc trace (every call, recorded with an ``LD_PRELOAD`` shim) through
glibc itself reproduces its RSS growth within 3.5%; replaying only its tensors misses 13-29%, because the
small objects keep freed blocks apart, and so do the kernels' own scratch blocks that no tensor shows (a
oneDNN convolution reorders its input and output; an ``mm`` on an expanded gradient copies it), and
the order they come and go in: a reorder freed before the op's output is made leaves a hole the output
fills.
:func:`resident_peak` replays a step's tensor allocations, with the scratch :func:`kernel_scratch` knows
of, through a model of those rules: blocks at the threshold or above are mapped on their own; below it, the
smallest freed block large enough is reused, never merged with a neighbour, else the top grows; the top
comes down when the block at its edge is freed. (Taking the first block by address instead fragments the
heap step after step where a model's blocks come in a few sizes, such as a U-Net's: +36 MiB in the third
step at batch 16, against a real heap flat from the second.) What is not malloc's, library code paged in
on first use, is :data:`CODE_PAGES`. Against real loops (the measured table is in docs/how-to/memory.md) it is
within 15% in every case measured (CNNs, transformers, an LSTM); oneDNN's compiled kernels (mapped code)
are not counted.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from typing import Any

import torch

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
"""(index in the events where an op's outputs begin, where they end, the op's scratch program: see
:func:`kernel_scratch`)"""

_aten = torch.ops.aten
_BLAS = {_aten.mm.default, _aten.addmm.default, _aten.bmm.default}


def kernel_scratch(func: Any, args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> tuple[int, ...]:
    """What ``func``'s CPU kernel allocates and frees inside itself, where known, as a program in the
    order malloc sees it: ``n > 0`` makes a block of ``n`` bytes, ``-n`` frees the last live one of ``n``
    bytes, ``0`` is where the op's outputs are made (a program without it runs before them); blocks still
    alive at the end are freed after the outputs.

    Found with a malloc trace of real steps, each block matched to the op running when it was made (the
    order matters: a block freed before an output is made leaves a hole the output fills). oneDNN's
    convolution (:func:`_onednn_forward`) reorders its input and weights to a blocked layout, freed before
    the output, and computes into a blocked output, freed after; its backward is two such passes; batch
    norm's backward makes one input-sized buffer; BLAS copies an input that is expanded (a stride of 0:
    the gradient of a ``sum``) before it multiplies.
    """
    if func not in _SCRATCH:
        return ()
    named = {argument.name: value for argument, value in zip(func._schema.arguments, args, strict=False)}
    program = tuple(_SCRATCH[func]({**named, **kwargs}, out))
    return program if any(size > 0 for size in program) else ()


def _convolution(a: dict[str, Any], out: Any) -> list[int]:
    """A convolution forward; a transposed one runs oneDNN's backward-data pass."""
    if not _onednn(a["input"], a["weight"]):
        return []
    copy = _contiguous_copy(a["input"])
    if a["transposed"]:
        return [*copy, *_onednn_backward_data(a["input"], a["weight"], out, a["stride"]), 0]
    return [*copy, *_onednn_forward(a["input"], a["weight"], out, a["stride"]), 0]


def _convolution_backward(a: dict[str, Any], out: Any) -> list[int]:
    """The gradient of the input (a pass in the other direction: backward-data, or a forward for a
    transposed convolution), the outputs, then the weights' gradient (both activations reordered)."""
    gradient, source, weight = a["grad_output"], a["input"], a["weight"]
    if not _onednn(source, weight):
        return []
    program = _contiguous_copy(gradient)
    if a["output_mask"][0]:
        if a["transposed"]:
            program += _onednn_forward(gradient, weight, out[0], a["stride"])
        else:
            program += _onednn_backward_data(gradient, weight, out[0], a["stride"])
    program.append(0)
    if a["output_mask"][1]:
        activation, difference = (gradient, source) if a["transposed"] else (source, gradient)
        program += _onednn_weights(activation, difference, weight)
    return program


def _onednn_forward(
    source: torch.Tensor, weight: torch.Tensor, result: torch.Tensor, stride: Any
) -> list[int]:
    """Reorder the source (not when it has fewer channels than a block: oneDNN's first-layer kernel reads
    it as it is) and the weights, compute into a blocked result; free the reorders, keep the result
    until the output is made. A strided 1x1 convolution first gathers each thread's input pixels."""
    gather = 0
    if weight.shape[2:].numel() == 1 and any(step > 1 for step in stride):
        gather = torch.get_num_threads() * source.shape[1] * result.shape[2:].numel() * source.element_size()
    reordered = _blocked(source) if source.shape[1] >= _channel_block() else 0
    blocks = [gather, reordered, _nbytes(weight)]
    return [*_made(blocks), _blocked(result), *_freed(reversed(blocks))]


def _onednn_backward_data(
    source: torch.Tensor, weight: torch.Tensor, result: torch.Tensor, stride: Any
) -> list[int]:
    """As :func:`_onednn_forward`, the source always reordered; a strided pass makes a second blocked
    result once the reorders are freed, and both are alive when the output is made."""
    blocks = [_blocked(source), _nbytes(weight)]
    strided = [_blocked(result)] if any(step > 1 for step in stride) else []
    return [*_made(blocks), _blocked(result), *_freed(reversed(blocks)), *strided]


def _onednn_weights(activation: torch.Tensor, difference: torch.Tensor, weight: torch.Tensor) -> list[int]:
    """The weights' gradient: both activations reordered (the one the forward pass read, not when it has
    fewer channels than a block) and a blocked gradient, after the op's outputs."""
    reordered = _blocked(activation) if activation.shape[1] >= _channel_block() else 0
    blocks = [_blocked(difference), reordered, _nbytes(weight)]
    return [*_made(blocks), *_freed(reversed(blocks))]


def _onednn(source: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ATen hands this convolution to oneDNN: a batch of more than one, fp32 or bf16, on a build
    with it (otherwise ATen's own kernels, whose scratch is not modelled)."""
    return (
        torch.backends.mkldnn.is_available()
        and source.dim() == 4
        and source.shape[0] > 1
        and weight.dtype in (torch.float32, torch.bfloat16)
    )


def _channel_block() -> int:
    """oneDNN's channel block: 16 with AVX-512, 8 with AVX2 (channels padded up to a multiple of it)."""
    return 16 if torch.backends.cpu.get_cpu_capability().startswith("AVX512") else 8


def _blocked(tensor: torch.Tensor) -> int:
    """``tensor``'s bytes in oneDNN's blocked layout: its channels padded up to a multiple of a block."""
    block = _channel_block()
    channels = tensor.shape[1]
    return _nbytes(tensor) // max(channels, 1) * (-(-channels // block) * block)


def _contiguous_copy(tensor: torch.Tensor) -> list[int]:
    """ATen's contiguous copy of a strided operand (a slice of ``cat``'s gradient, an expanded one),
    made before the kernel runs and freed after it."""
    return [] if tensor.is_contiguous() else [_nbytes(tensor)]


def _made(blocks: Any) -> list[int]:
    return [size for size in blocks if size > 0]


def _freed(blocks: Any) -> list[int]:
    return [-size for size in blocks if size > 0]


def _batch_norm_backward(a: dict[str, Any], out: Any) -> list[int]:
    return [_nbytes(a["input"])]


def _expanded(a: dict[str, Any], out: Any) -> list[int]:
    tensors = [value for value in a.values() if isinstance(value, torch.Tensor)]
    return [_nbytes(t) for t in tensors if t.dim() >= 2 and t.numel() > 1 and 0 in t.stride()]


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


_SCRATCH: dict[Any, Callable[[dict[str, Any], Any], list[int]]] = {
    _aten.convolution.default: _convolution,
    _aten.convolution_backward.default: _convolution_backward,
    _aten.native_batch_norm_backward.default: _batch_norm_backward,
    **dict.fromkeys(_BLAS, _expanded),
}


def resident_peak(events: Sequence[tuple[int, int]], scratch: Sequence[Scratch] = ()) -> int:
    """The most bytes the heap and the mapped blocks hold at once over ``events`` ((key, bytes): positive
    allocates the storage ``key``, negative frees it), with each op's ``scratch`` program run around its
    outputs: the RSS growth a run with these allocations is predicted to cause."""
    heap = _Heap()
    starts: dict[int, list[Scratch]] = {}
    ends: dict[int, list[_Pending]] = {}
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


_Pending = tuple[tuple[int, ...], list[tuple[int, int]]]
"""what is left of an op's scratch program once its outputs are made, and its live blocks (bytes, key)"""


def _scratch_at(
    index: int, heap: _Heap, starts: dict[int, list[Scratch]], ends: dict[int, list[_Pending]]
) -> None:
    """Finish the scratch programs of ops whose outputs ended before ``index``; run those of ops whose
    outputs begin here up to their outputs (all of it for an op with no new output)."""
    for rest, live in ends.pop(index, ()):
        _finish(rest, heap, live)
    for _, end, program in starts.pop(index, ()):
        split = program.index(0) if 0 in program else len(program)
        live = []  # typed by the loop above: (bytes, key) of the blocks made and not freed
        _run(program[:split], heap, live)
        if end == index:
            _finish(program[split:], heap, live)
        else:
            ends.setdefault(end, []).append((program[split:], live))


def _run(steps: Sequence[int], heap: _Heap, live: list[tuple[int, int]]) -> None:
    """Run a scratch program's ``steps`` on ``heap`` (``live``: its blocks made and not yet freed)."""
    for size in steps:
        if size > 0:
            live.append((size, heap.allocate(size)))
        elif size < 0:
            index = max(i for i, (nbytes, _) in enumerate(live) if nbytes == -size)
            heap.free(live.pop(index)[1])


def _finish(steps: Sequence[int], heap: _Heap, live: list[tuple[int, int]]) -> None:
    """Run the rest of a scratch program, then free its blocks still alive, the last made first."""
    _run(steps, heap, live)
    for _, key in reversed(live):
        heap.free(key)
    live.clear()


class _Heap:
    """glibc's main heap and its mapped blocks, as the module's docstring models them."""

    def __init__(self) -> None:
        self.threshold = MMAP_THRESHOLD
        self.top = self.mapped = self.peak = 0
        self._holes: list[tuple[int, int]] = []  # freed blocks (size, address), sorted
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
        """(address, size) of the smallest freed block that fits (glibc's best fit from its size-sorted
        bins; the lowest address among equals), cut to ``size`` when what is left is worth keeping free;
        else a new block at the top."""
        index = bisect.bisect_left(self._holes, (size, -1))
        if index == len(self._holes):
            address, self.top = self.top, self.top + size
            return address, size
        room, address = self._holes.pop(index)
        if room - size < ALIGNMENT:
            return address, room
        bisect.insort(self._holes, (room - size, address + size))
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
            bisect.insort(self._holes, (size, address))
