"""The int4 codec's range search and packing, compiled by numba: imported only through
:mod:`slimtorch.format.codecs.int4_fast`, which sets numba's cache folder first.

torch's path evaluates each of the nine clipping candidates as six passes over every group (about 70% of
an int4 shrink); here each group is read once into registers and every candidate scored there, then its
codes written as packed nibbles in one more pass. The arithmetic is torch's, in float32 and in the same
order, except the sums of squared errors, which numba may reassociate (``fastmath={"reassoc"}``: the one
freedom that lets the loop run on vector lanes, about five times faster): a near-tie between two candidates
may fall the other way, which changes the group's range, never its error bound.
"""

from __future__ import annotations

import numpy as np
from numba import njit

CUTS = (0.0, 0.015, 0.03)  # slimtorch.format.codecs.lossy.CLIP_STEPS (int4_fast checks they agree)
_CUTS = np.array(CUTS, dtype=np.float64)


@njit(
    "void(float32[:, ::1], float32[::1], float32[::1])",
    cache=True,
    nogil=True,
    boundscheck=False,
    fastmath={"reassoc"},
)
def searched_ranges(g, low, high):  # typed by numba's signature above
    """Per group (a row of ``g``), the range whose 16-step rounding leaves the least squared error among
    the full range with its ends pulled in by ``_CUTS`` of it: ``low`` and ``high`` are read (the group's
    extremes) and overwritten."""
    groups, size = g.shape
    u = np.empty(size, np.float32)
    fifteen = np.float32(15)
    for i in range(groups):
        lo, hi = low[i], high[i]
        span = hi - lo
        safe = span if span > 0 else np.float32(1)
        for j in range(size):
            u[j] = (g[i, j] - lo) / safe
        best_error, best_low, best_high = np.inf, np.float32(0), np.float32(0)
        for a in range(3):
            for b in range(3):
                start = np.float32(_CUTS[a])
                up = np.float32(15.0 / (1.0 - _CUTS[a] - _CUTS[b]))
                down = np.float32((1.0 - _CUTS[a] - _CUTS[b]) / 15.0)
                error = np.float32(0)
                for j in range(size):
                    code = min(max(np.rint((u[j] - start) * up), np.float32(0)), fifteen)
                    diff = code * down + start - u[j]
                    error += diff * diff
                if error < best_error:
                    best_error = error
                    best_low, best_high = np.float32(_CUTS[a]), np.float32(_CUTS[b])
        low[i] = lo + best_low * span
        high[i] = hi - best_high * span


@njit(
    "void(float32[:, ::1], float32[::1], float32[::1], uint8[:, ::1])",
    cache=True,
    nogil=True,
    boundscheck=False,
)
def packed_codes(g, scales, zeros, out):  # typed by numba's signature above
    """Codes ``rint((x - zero) / scale)`` in 0..15 of each group (a row of ``g``, its scale and zero point
    in float32), two a byte, the first in the low nibble: ``out`` is (groups, size / 2)."""
    groups, size = g.shape
    fifteen = np.float32(15)
    for i in range(groups):
        s = scales[i] if scales[i] > 0 else np.float32(1)
        z = zeros[i]
        for j in range(0, size, 2):
            a = min(max(np.rint((g[i, j] - z) / s), np.float32(0)), fifteen)
            b = min(max(np.rint((g[i, j + 1] - z) / s), np.float32(0)), fifteen)
            out[i, j // 2] = np.uint8(a) | (np.uint8(b) << np.uint8(4))
