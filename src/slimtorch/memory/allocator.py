"""What the CPU allocator adds: a run's resident memory (RSS) against the tensor bytes it kept alive.

:func:`estimate` and :func:`profile` count live tensor bytes; the operating system counts pages. The two
differ on the CPU by what is not a tensor (autograd's records, Python objects, the kernels' scratch and
caches, library code paged in on first use) and by what malloc keeps after a free (freed chunks it holds
for reuse, fragmentation). :func:`measure_host` runs a callable (real training steps) and reports both, so
a user sizing RAM sees the number that matters and the ratio between them.

Three readings over the same run:

- the process's RSS: before, after and at its highest (psutil, or ``/proc/self/statm`` without it; read
  on a background thread every ``interval_s`` and after every op, so a peak inside the run is seen);
- glibc's ``mallinfo2`` where present: bytes in use (``uordblks + hblkhd``) and bytes the heap holds
  (``arena + hblkhd``), the difference being freed memory malloc has not given back;
- the CPU tensor storages alive, from a dispatch mode that sees every storage an op allocates and a weak
  reference that frees it with its last tensor (the same idea as :class:`~slimtorch.memory.timeline.
  StorageTimeline`, without its event log: the measurement must not grow the heap it measures).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import math
import os
import sys
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from slimtorch.errors import OptionError
from slimtorch.format.verbs import Report


@dataclass(frozen=True)
class HostMemory(Report):
    """A run's resident memory beside the tensor bytes it kept alive (all in bytes).

    ``rss_growth`` is what the run added to the process at its highest: size RAM as ``rss_before`` plus
    that. ``ratio`` says how much more than its tensors the run cost; multiply a live-tensor figure (the
    peak :func:`~slimtorch.memory.estimate` gives) by it.
    """

    SCHEMA: ClassVar[str] = "slimtorch.host_memory/1"

    rss_before: int
    """the process's resident memory before the run (0 when no reader: see ``notes``)"""
    rss_peak: int
    """its highest during the run"""
    rss_after: int
    """after the run, with what the run returned still alive"""
    rss_growth: int
    """``rss_peak - rss_before``: what the run added at its highest"""
    live_tensor_peak: int
    """the most bytes of CPU tensor storages made by the run and alive at once"""
    ratio: float | None
    """``rss_growth / live_tensor_peak``; None when the run kept no tensor alive"""
    malloc_in_use: int | None
    """glibc's heap in use (``uordblks + hblkhd``) at its highest, above where it stood before; None
    without ``mallinfo2``"""
    malloc_held: int | None
    """the bytes glibc's heap holds (``arena + hblkhd``) at its highest, above where they stood before:
    beyond ``malloc_in_use``, freed memory malloc keeps for reuse"""
    notes: tuple[str, ...] = ()
    """what was not measured and why"""


def measure_host(run: Callable[[], Any], *, interval_s: float = 0.002) -> HostMemory:
    """Run ``run()`` once and measure the process's RSS growth against the CPU tensor bytes it kept alive.

    Measure in a fresh process (or the first run of its kind): a second run in the same process reuses
    the heap the first one freed, and its growth is close to nothing. RSS counts pages written, not
    reserved: ``torch.empty`` that is never filled adds no RSS.

    Example:
        >>> from slimtorch.memory.allocator import measure_host
        >>> host = measure_host(lambda: torch.ones(2**24))  # 64 MiB, written
        >>> host.rss_growth >= 60 * 2**20, host.live_tensor_peak == 64 * 2**20
        (True, True)
    """
    if not interval_s > 0:
        raise OptionError(f"interval_s must be a positive number of seconds, not {interval_s!r}")
    notes: list[str] = []
    rss = _rss_reader(notes)
    heap = mallinfo2()
    if heap is None:
        notes.append("no glibc mallinfo2 here: malloc_in_use and malloc_held not measured")
    tensors = _LiveStorages(lambda: None)
    with tensors:  # the first op under a dispatch mode imports ~70 MiB of torch: not the run's
        torch.empty(0)
    gc.collect()
    sampler = _Sampler(rss, heap)
    tensors = _LiveStorages(sampler.sample)
    stop = threading.Event()
    thread = threading.Thread(target=_sample_until, args=(sampler, stop, interval_s), daemon=True)
    thread.start()
    try:
        with tensors:
            result = run()
        sampler.sample()
        rss_after = sampler.rss_now()
        del result
    finally:
        stop.set()
        thread.join()
    notes += tensors.notes()
    return _host_memory(sampler, tensors.peak, rss_after, notes)


def _host_memory(sampler: _Sampler, live_peak: int, rss_after: int, notes: list[str]) -> HostMemory:
    growth = sampler.rss_peak - sampler.rss_before
    in_use = held = None
    if sampler.heap_before is not None:
        in_use = sampler.heap_peak[0] - sampler.heap_before[0]
        held = sampler.heap_peak[1] - sampler.heap_before[1]
    ratio = growth / live_peak if live_peak > 0 and sampler.has_rss else None
    return HostMemory(
        rss_before=sampler.rss_before,
        rss_peak=sampler.rss_peak,
        rss_after=rss_after,
        rss_growth=growth,
        live_tensor_peak=live_peak,
        ratio=ratio if ratio is None or math.isfinite(ratio) else None,
        malloc_in_use=in_use,
        malloc_held=held,
        notes=tuple(notes),
    )


# -- the readings -----------------------------------------------------------------------------------------
class _Sampler:
    """The highest RSS and heap readings seen, from the background thread and after every op alike."""

    def __init__(self, rss: Callable[[], int] | None, heap: Callable[[], tuple[int, int]] | None) -> None:
        self._rss, self._heap = rss, heap
        self._lock = threading.Lock()
        self.has_rss = rss is not None
        self.rss_before = self.rss_peak = self.rss_now()
        self.heap_before = heap() if heap else None
        self.heap_peak = self.heap_before or (0, 0)

    def rss_now(self) -> int:
        return self._rss() if self._rss else 0

    def sample(self) -> None:
        rss = self.rss_now()
        heap = self._heap() if self._heap else None
        with self._lock:
            self.rss_peak = max(self.rss_peak, rss)
            if heap is not None:
                self.heap_peak = (max(self.heap_peak[0], heap[0]), max(self.heap_peak[1], heap[1]))


def _sample_until(sampler: _Sampler, stop: threading.Event, interval_s: float) -> None:
    while not stop.wait(interval_s):
        sampler.sample()


def _rss_reader(notes: list[str]) -> Callable[[], int] | None:
    """psutil's RSS where installed (any OS); else Linux's ``/proc/self/statm``; else none, said in notes."""
    try:
        import psutil
    except ImportError:
        psutil = None
    if psutil is not None:
        process = psutil.Process()
        return lambda: int(process.memory_info().rss)
    if sys.platform.startswith("linux") and os.path.exists("/proc/self/statm"):
        notes.append("psutil not installed: RSS read from /proc/self/statm")
        page = os.sysconf("SC_PAGE_SIZE")
        return lambda: _statm_rss(page)
    notes.append("psutil not installed and no /proc/self/statm: RSS not measured (pip install psutil)")
    return None


def _statm_rss(page: int) -> int:
    with open("/proc/self/statm", "rb") as statm:
        return int(statm.read().split()[1]) * page


class _MallInfo2(ctypes.Structure):
    _fields_: ClassVar = [
        (name, ctypes.c_size_t)
        for name in (
            *("arena", "ordblks", "smblks", "hblks", "hblkhd"),
            *("usmblks", "fsmblks", "uordblks", "fordblks", "keepcost"),
        )
    ]


@functools.cache
def mallinfo2() -> Callable[[], tuple[int, int]] | None:
    """glibc's (bytes in use, bytes held) by malloc, main arena and mmap'd chunks; None off glibc."""
    name = ctypes.util.find_library("c")
    try:
        function = getattr(ctypes.CDLL(name), "mallinfo2", None) if name else None
    except OSError:
        return None
    if function is None:
        return None
    function.restype = _MallInfo2

    def read() -> tuple[int, int]:
        info = function()
        return int(info.uordblks + info.hblkhd), int(info.arena + info.hblkhd)

    return read


# -- the live tensors -------------------------------------------------------------------------------------
class _LiveStorages(TorchDispatchMode):
    """The CPU storages ops allocate while it is active: bytes alive now and at the most. ``after_op``
    runs after every op (the RSS sampler's reading).

    The weak reference is on the storage, not the tensor: a storage outlives the tensor an op returned
    when something wraps it without an op (``nn.Parameter``, ``.data``), and torch keeps a storage's
    Python object as long as the storage lives, so its finalizer runs when the bytes are freed."""

    def __init__(self, after_op: Callable[[], None]) -> None:
        super().__init__()
        self._after_op = after_op
        self._bytes: dict[int, int] = {}  # storage address -> bytes, while alive
        self.current = self.peak = 0
        self._unseen = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # An output on an input's storage (a view, an in-place op, out=) allocated nothing: one on a
        # storage made before the run (a weight an optimizer updates) is not the run's.
        inputs = {
            _address(value) for value in tree_flatten((args, kwargs))[0] if isinstance(value, torch.Tensor)
        }
        for value in tree_flatten(out)[0]:
            if isinstance(value, torch.Tensor):
                self._track(value, inputs)
        self._after_op()
        return out

    def _track(self, tensor: torch.Tensor, inputs: set[int | None]) -> None:
        try:
            storage = tensor.untyped_storage()
        except (NotImplementedError, RuntimeError):  # sparse and other storage-less layouts
            self._unseen += 1
            return
        address, nbytes = storage._cdata, storage.nbytes()
        if storage.device.type != "cpu" or (address not in self._bytes and address in inputs):
            return
        if address not in self._bytes:
            self._bytes[address] = 0
            weakref.finalize(storage, self._release, address)
        # out= ops resize a storage they were given: count it at its largest
        self.current += max(nbytes - self._bytes[address], 0)
        self._bytes[address] = max(nbytes, self._bytes[address])
        self.peak = max(self.peak, self.current)

    def _release(self, address: int) -> None:
        self.current -= self._bytes.pop(address)

    def notes(self) -> list[str]:
        """What the count leaves out, for :attr:`HostMemory.notes`."""
        if not self._unseen:
            return []
        return [f"{self._unseen} tensors without a storage (sparse layouts) not counted as live bytes"]


def _address(tensor: torch.Tensor) -> int | None:
    try:
        return tensor.untyped_storage()._cdata
    except (NotImplementedError, RuntimeError):
        return None
