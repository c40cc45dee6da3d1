"""int8 activation codes per row in one pass, where numba is installed (``pip install slimtorch[fast]``).

:func:`slimtorch.quant.kernels.quantize_rows` takes six torch operations to quantize a matrix's rows (max,
min, scale, multiply, round, cast), each a pass over the rows, and at batch 1 each about as long as the int8
product they feed. numba compiles the same arithmetic into one kernel that reads each row twice and writes
its codes once: 3.4 to 4.5 times faster on one thread (128 to 2048 rows of 384 to 3072, ``python
benchmarks/int8_latency.py --rows``), with codes and scales bit for bit the same. Without numba, or for an
input the kernel does not take, the torch operations run, as they always did; :func:`describe` says which.

The int32 product of ``torch._int_mm`` is scaled back to float (per output channel, per row, plus the
bias) in one pass too, where torch takes two. The kernels are serial (numba's threads would compete with
torch's). torch runs its operations on ``torch.get_num_threads()`` threads in blocks of 32768 elements, so
where that could give four or more threads work (the one-thread lead), torch's path runs instead.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch

PARALLEL_GRAIN = 32768  # elements per block of torch's parallel elementwise loops (at::internal::GRAIN_SIZE)
FUSED_LEAD = 4  # the fused kernel's measured lead on one thread, rounded down: more threads than this win


def cache_folder() -> Path:
    """Where numba keeps the compiled kernel: ``$XDG_CACHE_HOME/slimtorch/numba`` (``~/.cache/...``), since
    the installed package's own folder may not be writable."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "slimtorch" / "numba"


@functools.cache
def _loaded() -> tuple[Callable | None, Callable | None, str]:
    """The compiled kernels, row quantization and product scaling (None without numba), and what
    :func:`describe` says; compiled once a process, and loaded from numba's cache after the first time
    (about a second the first time, 0.1 s after)."""
    if "numba" not in sys.modules:  # numba reads the variable once, when it is imported
        os.environ.setdefault("NUMBA_CACHE_DIR", str(cache_folder()))
    try:
        from slimtorch.quant import rowcodes_jit
    except ImportError:
        return None, None, "torch ops (numba is not installed: pip install slimtorch[fast])"
    except Exception as exc:  # numba installed but unable to compile here: the torch path still works
        return None, None, f"torch ops (numba failed to compile the fused kernels: {exc})"
    return rowcodes_jit.quantize_rows, rowcodes_jit.scale_product, "numba, one pass per row"


def prepare() -> bool:
    """Compile (or load) the fused kernels now, so that the first forward does not: whether it is usable.

    Example:
        >>> prepare()  # doctest: +SKIP
        True
    """
    return _loaded()[0] is not None


def describe() -> str:
    """Which path quantizes activation rows in this process: ``"numba, one pass per row"``, or torch's
    operations and why."""
    return _loaded()[2]


def quantize_rows_fused(x: torch.Tensor, signed: bool = False) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(codes, scales)`` as :func:`slimtorch.quant.kernels.quantize_rows` gives them, from the fused
    kernel; ``None`` where torch's path has to run: no numba, an input that is not a contiguous float32 CPU
    matrix, a row with inf or nan (torch's path gives their codes), or an input large enough for torch to
    run it on more threads than the kernel's lead.

    At batch 1 this runs in about 10 microseconds, so the checks are the cheapest that keep it safe:
    numba's signature refuses any array but a C-contiguous float32 matrix, and ``numpy()`` any tensor
    not on the CPU or with a lazy conjugate or negation."""
    kernel = _loaded()[0]
    if kernel is None or min(torch.get_num_threads(), x.numel() // PARALLEL_GRAIN) >= FUSED_LEAD:
        return None
    try:
        codes, scales, finite = kernel(x.detach().numpy(), 0 if signed else 128)
    except (TypeError, RuntimeError):
        return None
    if not finite:
        return None
    codes = torch.from_numpy(codes)
    return codes.view(torch.int8) if signed else codes, torch.from_numpy(scales)


def scale_product_fused(
    product: torch.Tensor, weight_scale: torch.Tensor, row_scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor | None:
    """``product * weight_scale * row_scale + bias`` from an int32 product in one pass, the same floats as
    ``torch.mul`` then :func:`slimtorch.quant.kernels.scale_back`; ``None`` where those have to run.

    Only the shapes are checked here (the kernel reads without bounds checks); dtypes and layouts are
    numba's signature's to refuse, as in :func:`quantize_rows_fused`, and a tensor that requires grad
    ``numpy()``'s."""
    kernel = _loaded()[1]
    if kernel is None or product.dim() != 2:
        return None
    rows, cols = product.shape
    bias = _NO_BIAS if bias is None else bias
    if row_scale.shape != (rows, 1) or weight_scale.shape != (cols,) or bias.shape not in ((0,), (cols,)):
        return None
    if min(torch.get_num_threads(), product.numel() // PARALLEL_GRAIN) >= FUSED_LEAD:
        return None
    try:
        out = kernel(product.numpy(), weight_scale.numpy(), row_scale.numpy(), bias.numpy())
    except (TypeError, RuntimeError):
        return None
    return torch.from_numpy(out)


_NO_BIAS = torch.empty(0)
