"""Giving a mapped file's pages back to the system: for offload (:mod:`slimtorch.loading.offload`), for a
quantized layer's codes once a kernel has packed its own copy of them (:mod:`slimtorch.quant.modules`), and
for the lookup tables a load verified (:mod:`slimtorch.loading.loader`: an embedding reads only the rows of
the tokens it is given).

A private, never-written file mapping can drop its pages at any time (``madvise(MADV_DONTNEED)``, Linux):
the next read faults them in again from the page cache with the same bytes. Only memory that is such a
mapping may be released this way (anonymous memory would read back as zeros), so every range is checked
against ``/proc/self/maps`` first.
"""

from __future__ import annotations

import bisect
import ctypes
import mmap
import sys
from collections.abc import Callable
from typing import Any

import numpy
import torch

from slimtorch.errors import OptionError

PAGE = mmap.PAGESIZE


def _libc_madvise() -> Callable[[int, int], int] | None:
    """``madvise(address, length, MADV_DONTNEED)`` on Linux, where it drops a private file mapping's
    pages (re-read from the page cache on the next touch); None elsewhere, where its meaning differs."""
    advice = getattr(mmap, "MADV_DONTNEED", None)
    if not sys.platform.startswith("linux") or advice is None:
        return None
    try:
        call = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    call.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return lambda address, length: call(address, length, advice)


def _libc_malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``: the decoded tensors of one unit are freed after its forward, but glibc
    raises its mmap threshold to their size and then keeps such blocks in its heap (measured: +36 MiB
    over one unit for 64 MiB blocks); trimming returns them. None where the C library has none."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None


_MADVISE = _libc_madvise()
_MALLOC_TRIM = _libc_malloc_trim()
RELEASE = "madvise" if _MADVISE is not None else "none"
"""How offloaded pages leave memory here: ``"madvise"`` (Linux), or ``"none"`` (other systems: offload
is refused there until it can be tested)."""


def release_pages(tensors: Any, *, fresh: bool = False) -> int:
    """Give back the whole pages inside each mapped CPU tensor (``MADV_DONTNEED``); returns the bytes
    released. Only for tensors that are a private file mapping never written: anonymous memory would read
    back as zeros. ``fresh`` reads the process's mappings again first: a caller that cannot tell a mapped
    tensor from one in memory now at an address a file was once mapped at (whatever a layer holds) must
    not trust the ranges remembered from an earlier call.

    Example:
        >>> release_pages([mapped_weight])  # doctest: +SKIP
        16777216
    """
    if _MADVISE is None:
        return 0
    if fresh:
        refresh_maps()
    released = 0
    for tensor in tensors:
        if tensor.device.type != "cpu" or tensor.numel() == 0:
            continue
        span = 1 + sum(
            (size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride(), strict=True)
        )
        start, end = tensor.data_ptr(), tensor.data_ptr() + span * tensor.element_size()
        low, high = -(-start // PAGE) * PAGE, end // PAGE * PAGE
        if high > low and _file_backed(start, end):
            if _MADVISE(low, high - low) != 0:
                raise OSError(ctypes.get_errno(), "madvise(MADV_DONTNEED) failed")
            released += high - low
    return released


def release_unwritten(tensors: Any) -> int:
    """:func:`release_pages` of the mapped CPU tensors among ``tensors`` that this process never wrote to
    (:func:`written`), the process's mappings read again first: for callers holding tensors that may be
    mapped, or copies in memory, or mapped and written since. Returns the bytes released."""
    unwritten = [t for t in tensors if t.device.type == "cpu" and written(t) is False]
    return release_pages(unwritten, fresh=True) if unwritten else 0


PAGEMAP_FILE_OR_SHARED = 1 << 61
PAGEMAP_SWAPPED = 1 << 62
PAGEMAP_PRESENT = 1 << 63


def written(tensor: torch.Tensor) -> bool | None:
    """Whether any page of a mapped CPU tensor was written in this process (a private mapping's written
    page is the process's own anonymous copy, which :func:`release_pages` would throw away); None where
    the pages cannot be read (not Linux). From ``/proc/self/pagemap``: a page in memory that is not the
    file's, or one swapped out (only anonymous pages are), was written."""
    if not sys.platform.startswith("linux"):
        return None
    if tensor.numel() == 0:
        return False
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()  # the codes are contiguous
    first, last = start // PAGE, (end - 1) // PAGE
    try:
        with open("/proc/self/pagemap", "rb") as pagemap:
            pagemap.seek(first * 8)
            entries = numpy.frombuffer(pagemap.read((last - first + 1) * 8), dtype=numpy.uint64)
    except OSError:
        return None
    present = (entries & numpy.uint64(PAGEMAP_PRESENT)) != 0
    own = present & ((entries & numpy.uint64(PAGEMAP_FILE_OR_SHARED)) == 0)
    swapped = (entries & numpy.uint64(PAGEMAP_SWAPPED)) != 0
    return bool(own.any() or swapped.any())


_file_maps: list[tuple[int, int]] = []
"""Address ranges of this process's file mappings (``/proc/self/maps``), read again on a miss."""


def refresh_maps() -> None:
    """Read this process's file mappings again (``/proc/self/maps``): :func:`release_pages` without
    ``fresh`` trusts the ranges read last. A new list, never one changed in place: a load's checking
    thread gives an embedding's pages back while a forward packs a layer's."""
    global _file_maps
    _file_maps = _read_file_maps()


def _file_backed(start: int, end: int) -> bool:
    """``[start, end)`` lies in one mapping of a file: the only memory whose pages may be dropped."""
    for fresh in (False, True):
        if fresh:
            refresh_maps()
        maps = _file_maps
        i = bisect.bisect_right(maps, (start, sys.maxsize)) - 1
        if i >= 0 and maps[i][0] <= start and end <= maps[i][1]:
            return True
    return False


def _read_file_maps() -> list[tuple[int, int]]:
    ranges = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[4] != "0" and not fields[5].startswith("["):
                low, high = fields[0].split("-")
                ranges.append((int(low, 16), int(high, 16)))
    return sorted(ranges)


def trim_heap() -> None:
    """Return the C heap's free memory to the system (glibc's ``malloc_trim``; nothing elsewhere)."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def check_platform() -> None:
    """Refuse offload where pages cannot be released (it would hold the whole model after one forward)."""
    if RELEASE == "none":
        raise OptionError(
            "offload='disk' releases pages with Linux's madvise(MADV_DONTNEED); this system "
            f"({sys.platform}) has no tested way to release them yet"
        )
