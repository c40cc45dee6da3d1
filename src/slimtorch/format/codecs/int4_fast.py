"""int4's range search and packing in numba's compiled kernels (:mod:`int4_jit`), where numba is installed
(``pip install slimtorch[fast]``), on every core torch may use; torch's operations otherwise.

On a Llama-shaped bf16 layer the search costs about a third of torch's nine candidate passes
(``python -m benchmarks.scale``). :func:`describe` says which path runs.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from slimtorch.format.cache import cache_folder

MIN_GROUPS = 256  # fewer groups than this: torch's path (the threads' hand-off costs more than it saves)


@functools.cache
def _loaded() -> tuple[Any, str]:
    """The compiled kernels' module (None without numba) and what :func:`describe` says."""
    if "numba" not in sys.modules:  # numba reads the variable once, when it is imported
        os.environ.setdefault("NUMBA_CACHE_DIR", str(cache_folder("numba")))
    try:
        from slimtorch.format.codecs import int4_jit
    except ImportError:
        return None, "torch ops (numba is not installed: pip install slimtorch[fast])"
    except Exception as exc:  # numba installed but unable to compile here: torch's path still works
        return None, f"torch ops (numba failed to compile the int4 kernels: {exc})"
    return int4_jit, "numba, one pass per group"


def describe() -> str:
    """Which path searches and packs int4 groups in this process."""
    return _loaded()[1]


@functools.cache
def _pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=max(1, torch.get_num_threads()), thread_name_prefix="slim-int4")


def _split(groups: int, call: Callable[[slice], None]) -> None:
    """``call`` on a share of the groups per thread (numba's kernels release the GIL)."""
    threads = max(1, min(torch.get_num_threads(), groups // MIN_GROUPS))
    step = -(-groups // threads)
    shares = [slice(start, min(groups, start + step)) for start in range(0, groups, step)]
    for future in [_pool().submit(call, share) for share in shares[1:]]:
        future.result()
    if shares:
        call(shares[0])


def searched_ranges(
    g: torch.Tensor, low: torch.Tensor, high: torch.Tensor, cuts: tuple[float, ...]
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(low, high)`` of each group of ``g`` (rows, groups, size; float32) after the clipping search, or
    None where torch's path has to run (no numba, too few groups, other cuts than the kernel's)."""
    jit = _loaded()[0]
    if jit is None or g.shape[0] * g.shape[1] < MIN_GROUPS or tuple(cuts) != jit.CUTS:
        return None
    flat = g.reshape(-1, g.shape[2]).contiguous().numpy()
    low_out = low.reshape(-1).contiguous().clone()
    high_out = high.reshape(-1).contiguous().clone()
    lows, highs = low_out.numpy(), high_out.numpy()
    _split(flat.shape[0], lambda s: jit.searched_ranges(flat[s], lows[s], highs[s]))
    return low_out.reshape(low.shape), high_out.reshape(high.shape)


def packed_codes(g: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor | None:
    """Packed codes (rows, groups * size / 2) of ``g`` (rows, groups, size; float32) with float32 scales
    and zero points (rows, groups), or None where torch's path has to run."""
    jit = _loaded()[0]
    if jit is None or g.shape[0] * g.shape[1] < MIN_GROUPS:
        return None
    flat = g.reshape(-1, g.shape[2]).contiguous().numpy()
    s = scales.reshape(-1).to(torch.float32).contiguous().numpy()
    z = zeros.reshape(-1).to(torch.float32).contiguous().numpy()
    out = torch.empty(flat.shape[0], flat.shape[1] // 2, dtype=torch.uint8)
    codes = out.numpy()
    _split(flat.shape[0], lambda part: jit.packed_codes(flat[part], s[part], z[part], codes[part]))
    return out.reshape(g.shape[0], -1)
