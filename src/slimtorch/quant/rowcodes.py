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
from typing import Any

import torch

from slimtorch.format.cache import cache_folder as _cache_folder

CODES = {"uint8": (128, 127), "int8": (0, 127), "uint7": (0, 127)}
"""The activation codes a kernel takes -> (offset, levels). ``uint8``: ``rint(x / scale) + 128`` with
``scale = max|row| / 127``, oneDNN's (zero point 128); ``int8``: the same without the offset,
``torch._int_mm``'s. ``uint7``: asymmetric, ``rint(x / scale) + zero`` within ``[0, 127]``, ``scale =
(max - min) / 127`` and a zero point per row: for CPUs without VNNI, whose int8 instruction (``vpmaddubsw``)
adds two byte products into a saturating int16 (255 x 127 x 2 overflows it, 127 x 127 x 2 does not). Its
row parameters are ``(scale, scale * zero)`` side by side, (M, 2), not the (M, 1) scales of the others.
Asymmetric 7-bit codes lose little against symmetric 8-bit ones where a row is skewed (a GELU's output):
on the real all-MiniLM-L6-v2, output cosine 0.9930 against 0.9943 for symmetric 8-bit and 0.9875 for
symmetric 7-bit."""
ASYMMETRIC = frozenset({"uint7"})
PARALLEL_GRAIN = 32768  # elements per block of torch's parallel elementwise loops (at::internal::GRAIN_SIZE)
FUSED_LEAD = 4  # the fused kernel's measured lead on one thread, rounded down: more threads than this win


def cache_folder() -> Path:
    """Where numba keeps the compiled kernel: ``$XDG_CACHE_HOME/slimtorch/numba`` (``~/.cache/...``), since
    the installed package's own folder may not be writable."""
    return _cache_folder("numba")


@functools.cache
def _loaded() -> tuple[Any, str]:
    """The compiled kernels' module (None without numba) and what :func:`describe` says; compiled once a
    process, and loaded from numba's cache after the first time (about a second the first time, 0.1 s
    after)."""
    if "numba" not in sys.modules:  # numba reads the variable once, when it is imported
        os.environ.setdefault("NUMBA_CACHE_DIR", str(cache_folder()))
    try:
        from slimtorch.quant import rowcodes_jit
    except ImportError:
        return None, "torch ops (numba is not installed: pip install slimtorch[fast])"
    except Exception as exc:  # numba installed but unable to compile here: the torch path still works
        return None, f"torch ops (numba failed to compile the fused kernels: {exc})"
    return rowcodes_jit, "numba, one pass per row"


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
    return _loaded()[1]


def quantize_rows_fused(x: torch.Tensor, codes: str = "uint8") -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(codes, scales)`` as :func:`slimtorch.quant.kernels.quantize_rows` gives them, from the fused
    kernel; ``None`` where torch's path has to run: no numba, an input that is not a contiguous float32 CPU
    matrix, a row with inf or nan (torch's path gives their codes), or an input large enough for torch to
    run it on more threads than the kernel's lead.

    At batch 1 this runs in about 10 microseconds, so the checks are the cheapest that keep it safe:
    numba's signature refuses any array but a C-contiguous float32 matrix, and ``numpy()`` any tensor
    not on the CPU or with a lazy conjugate or negation."""
    jit = _loaded()[0]
    if jit is None or min(torch.get_num_threads(), x.numel() // PARALLEL_GRAIN) >= FUSED_LEAD:
        return None
    offset, levels = CODES[codes]
    try:
        if codes in ASYMMETRIC:
            values, scales, finite = jit.quantize_rows_asymmetric(x.detach().numpy(), levels)
        else:
            values, scales, finite = jit.quantize_rows(x.detach().numpy(), offset, levels)
    except (TypeError, RuntimeError):
        return None
    if not finite:
        return None
    values = torch.from_numpy(values)
    return values.view(torch.int8) if codes == "int8" else values, torch.from_numpy(scales)


def scale_product_fused(
    product: torch.Tensor, weight_scale: torch.Tensor, row_scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor | None:
    """``product * weight_scale * row_scale + bias`` from an int32 product in one pass, the same floats as
    ``torch.mul`` then :func:`slimtorch.quant.kernels.scale_back`; ``None`` where those have to run.

    Only the shapes are checked here (the kernel reads without bounds checks); dtypes and layouts are
    numba's signature's to refuse, as in :func:`quantize_rows_fused`, and a tensor that requires grad
    ``numpy()``'s."""
    jit = _loaded()[0]
    if jit is None or product.dim() != 2:
        return None
    rows, cols = product.shape
    bias = _NO_BIAS if bias is None else bias
    if row_scale.shape != (rows, 1) or weight_scale.shape != (cols,) or bias.shape not in ((0,), (cols,)):
        return None
    if min(torch.get_num_threads(), product.numel() // PARALLEL_GRAIN) >= FUSED_LEAD:
        return None
    try:
        out = jit.scale_product(product.numpy(), weight_scale.numpy(), row_scale.numpy(), bias.numpy())
    except (TypeError, RuntimeError):
        return None
    return torch.from_numpy(out)


_NO_BIAS = torch.empty(0)


def shift_product_fused(
    product: torch.Tensor, params: torch.Tensor, weight_sums: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor | None:
    """``product * scale - shift * weight_sums + bias`` per row, in place and in one pass (``params``: the
    ``uint7`` rows' ``(scale, shift)``), the float32 operations :func:`slimtorch.quant.kernels.shift_back`
    does in three; ``None`` where those have to run."""
    jit = _loaded()[0]
    if jit is None or product.dim() != 2:
        return None
    rows, cols = product.shape
    bias = _NO_BIAS if bias is None else bias
    if params.shape != (rows, 2) or weight_sums.shape != (cols,) or bias.shape not in ((0,), (cols,)):
        return None
    if min(torch.get_num_threads(), product.numel() // PARALLEL_GRAIN) >= FUSED_LEAD:
        return None
    try:
        jit.shift_product(product.numpy(), params.numpy(), weight_sums.numpy(), bias.detach().numpy())
    except (TypeError, RuntimeError):
        return None
    return product


def shift_epilogue(
    weight_sums: torch.Tensor, bias: torch.Tensor | None
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor | None] | None:
    """:func:`shift_product_fused` for one layer, its weight sums and bias made numpy arrays once: a call
    converts only the product and the row parameters (converting all four took 40 of the 55 microseconds
    a call cost, at 128 rows of a 384-wide layer). ``None`` without numba; the returned call gives
    ``None`` where torch's operations have to run."""
    jit = _loaded()[0]
    if jit is None:
        return None
    sums = weight_sums.detach().float().contiguous()
    extra = _NO_BIAS if bias is None else bias.detach().float().contiguous()
    sums_array, bias_array, cols = sums.numpy(), extra.numpy(), sums.shape[0]

    def shift(product: torch.Tensor, params: torch.Tensor) -> torch.Tensor | None:
        rows = product.shape[0]
        if product.shape != (rows, cols) or params.shape != (rows, 2):
            return None
        if min(torch.get_num_threads(), product.numel() // PARALLEL_GRAIN) >= FUSED_LEAD:
            return None
        try:
            jit.shift_product(product.numpy(), params.numpy(), sums_array, bias_array)
        except (TypeError, RuntimeError):
            return None
        return product

    shift.keep = (sums, extra)  # type: ignore[attr-defined]  # the arrays' memory lives as long as the call
    return shift
