"""How much of a tensor's memory is in this process (Linux): for tests of pages given back."""

from __future__ import annotations

import numpy
import torch

from slimtorch.format import pages


def resident(tensor: torch.Tensor) -> float:
    """The share of a CPU tensor's pages present in this process's memory (``/proc/self/pagemap``)."""
    start = tensor.data_ptr()
    first, last = start // pages.PAGE, (start + tensor.nbytes - 1) // pages.PAGE
    with open("/proc/self/pagemap", "rb") as pagemap:
        pagemap.seek(first * 8)
        entries = numpy.frombuffer(pagemap.read((last - first + 1) * 8), dtype=numpy.uint64)
    return float(((entries & numpy.uint64(pages.PAGEMAP_PRESENT)) != 0).mean())
