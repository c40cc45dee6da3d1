"""GPTQ: 4-bit codes chosen with the layer's inputs in view (Frantar et al., 2022), from calibration data.

Rounding each weight to its nearest code ignores that errors in different inputs cancel or add up in the
layer's output. GPTQ quantizes one input column at a time and spreads each column's rounding error over
the columns not yet quantized, weighted by the inverse of the inputs' second moments ``H = X^T X / n``,
so that the output ``X W^T`` moves as little as possible. Scales and zero points are taken per group
from the weights as updated so far. The result is stored in exactly the ``int4`` codec's layout, so
nothing downstream (saving, loading, kernels) knows the codes were chosen this way.
"""

from __future__ import annotations

import math

import torch

from slimtorch.calibration.moments import inverse_cholesky
from slimtorch.format.codecs import Encoded
from slimtorch.format.codecs.lossy import fits_fp16, symmetric_scale, zero_points, zeros_at
from slimtorch.format.source import dtype_name

BLOCK = 128  # columns updated together before their error is pushed to the rest (lazy batch updates)


def gptq_int4(weight: torch.Tensor, hessian: torch.Tensor, group_size: int, grid: str = "") -> Encoded | None:
    """The int4 codec's parts for ``weight`` (out, in), codes chosen by GPTQ; None when ``in`` is not a
    whole number of groups or ``H`` cannot be inverted (the caller then rounds to nearest).
    ``grid``: ``"symmetric"`` (zero points at code 8) or ``"integer_zero"`` (each on a code of its own),
    as the codec's options of those names."""
    rows, cols = weight.shape
    if cols % group_size:
        return None
    inverse = inverse_cholesky(hessian.clone())
    if inverse is None:
        return None
    # Columns of the weight are rows here: each step reads and updates contiguous memory.
    w = weight.detach().to(torch.float32).t().contiguous()
    w[torch.diag(hessian) == 0] = 0  # inputs that were always zero: any value gives the same output
    groups = cols // group_size
    scales = torch.empty(groups, rows, dtype=torch.float32)
    zeros = torch.empty(groups, rows, dtype=torch.float32)
    codes = torch.empty(cols, rows, dtype=torch.float32)
    block = group_size * math.ceil(BLOCK / group_size)
    for start in range(0, cols, block):
        stop = min(start + block, cols)
        work = w[start:stop].clone()
        errors = torch.empty_like(work)
        local = inverse[start:stop, start:stop]
        for i in range(stop - start):
            g, first = divmod(start + i, group_size)
            if first == 0:
                scales[g], zeros[g] = _group_range(work[i : i + group_size], grid)
                inverse_scale = torch.where(scales[g] > 0, scales[g], 1).reciprocal_()
            code = codes[start + i]
            torch.mul(work[i] - zeros[g], inverse_scale, out=code).round_().clamp_(0, 15)
            error = errors[i]
            torch.addcmul(zeros[g], code, scales[g], out=error)
            error.neg_().add_(work[i]).div_(local[i, i])
            work[i:].addr_(local[i, i:], error, alpha=-1)
        w[stop:] -= inverse[start:stop, stop:].t() @ errors
    codes = codes.to(torch.uint8).t().contiguous()
    scales, zeros = scales.t().contiguous(), zeros.t().contiguous()
    side = torch.float16 if fits_fp16(scales, zeros) else torch.float32
    if grid and not fits_fp16(scales, scales):
        return None  # these grids need float16 scales (see the codec); the caller's encode refuses
    if grid == "integer_zero":  # float16 scales, float32 zero points: both exact (see the codec)
        scale_part, zero_part = scales.half(), zeros
    else:
        scale_part, zero_part = scales.to(side), zeros.to(side)
    parts = {"q4": codes[:, 0::2] | (codes[:, 1::2] << 4), "scale": scale_part, "zero": zero_part}
    stage = {
        "codec": "int4",
        "dtype": dtype_name(weight.dtype),
        "shape": [rows, cols],
        "group_size": group_size,
        "flat": False,
        **({grid: True} if grid else {}),
    }
    return Encoded(parts, [stage])


def _group_range(values: torch.Tensor, grid: str = "") -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero point of each output's group (``values`` is (group, outputs)), already rounded to
    float16 where the codec will store them so (codes are chosen against the values decoding uses)."""
    low, high = values.amin(dim=0), values.amax(dim=0)
    if grid == "integer_zero":  # the grid holds 0 exactly, at the zero point's code
        low, high = low.clamp(max=0), high.clamp(min=0)
    scale, zero = (high - low) / 15, low
    if grid == "integer_zero":
        scale = scale.half().float() if fits_fp16(scale.unsqueeze(1), scale.unsqueeze(1)) else scale
        return scale, zeros_at(zero_points(zero, scale), scale)
    if grid == "symmetric":
        scale = symmetric_scale(low, high)
        scale = scale.half().float() if fits_fp16(scale.unsqueeze(1), scale.unsqueeze(1)) else scale
        return scale, scale * -8
    if fits_fp16(scale.unsqueeze(1), zero.unsqueeze(1)):
        scale, zero = scale.half().float(), zero.half().float()
    return scale, zero
