"""Lossy codecs: ``cast`` (to float16 / bfloat16), ``int8`` (per output channel) and ``int4`` (group-wise).

Error bounds, per element (``x`` the input, in the dtype it had):

- ``cast``: round to nearest in the target dtype: ``|err| <= 2**-11 |x|`` (float16, normal range) or
  ``2**-8 |x|`` (bfloat16). Values beyond float16's range are refused, not turned into infinity.
- ``int8``: symmetric, one float32 scale per output channel (row of ``x.reshape(rows, -1)``):
  ``|err| <= scale / 2`` with ``scale = max|row| / 127``.
- ``int4``: asymmetric, groups of ``group_size`` consecutive values along a row (or along the flattened
  tensor, ``flat=True``), codes 0..15 packed two per
  byte, a scale and a zero point (the value of code 0) per group, float16 when they fit, else float32:
  ``|err| <= scale / 2 + 2**-10 * max|group|`` with ``scale = (max - min) / 15`` of the group.

The decoded tensor is computed in float32 and rounded once to the input's dtype, which adds that dtype's
own rounding (relative ``2**-8`` for bfloat16). All three refuse non-finite values: a scale cannot hold them.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping

import torch

from slimtorch.io.codecs.chain import CodecError, parse_dtype, part, register, require

ROW_BLOCK_ELEMENTS = 1 << 22  # work on ~4 Mi elements at a time: cache-friendly, bounded temporaries
INT4_GROUP_SIZES = range(32, 257)
_FP16_TINY = torch.finfo(torch.float16).tiny
_FP16_MAX = torch.finfo(torch.float16).max


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as a matrix whose rows are its output channels (a 0-d or 1-d tensor is one row)."""
    if x.dim() >= 2:
        return x.reshape(x.shape[0], math.prod(x.shape[1:]))
    return x.reshape(1, x.numel())


def row_blocks(rows: int, cols: int) -> Iterator[slice]:
    step = max(1, ROW_BLOCK_ELEMENTS // max(cols, 1))
    for start in range(0, rows, step):
        yield slice(start, min(rows, start + step))


def _require_float(x: torch.Tensor, codec: str) -> None:
    if not x.dtype.is_floating_point or x.dtype.itemsize > 8:
        raise CodecError(f"{codec} needs a floating-point tensor, got {x.dtype}")
    if x.numel() and x.dtype in (torch.float8_e8m0fnu,):
        raise CodecError(f"{codec} does not take {x.dtype}")
    if not bool(torch.isfinite(x).all()):
        raise CodecError(f"{codec} needs finite values (the tensor holds inf or nan)")


class Cast:
    name, primary, lossless = "cast", "", False

    def encode(self, x: torch.Tensor, to: str = "float16") -> tuple[torch.Tensor, dict, dict]:
        target = parse_dtype(to)
        if target not in (torch.float16, torch.bfloat16, torch.float32):
            raise CodecError(f"cast goes to float16, bfloat16 or float32, not {to}")
        _require_float(x, "cast")
        y = x.to(target)
        if bool(torch.isinf(y).any()):
            raise CodecError(f"values beyond the range of {to}")
        return y, {}, {"to": to}

    def decode(self, primary: torch.Tensor, parts: Mapping[str, torch.Tensor], stage: dict) -> torch.Tensor:
        require(primary.dtype == parse_dtype(stage.get("to")), "cast part has the wrong dtype")
        return primary.to(parse_dtype(stage["dtype"]))


class Int8:
    name, primary, lossless = "int8", "q", False

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, dict, dict]:
        _require_float(x, "int8")
        rows = as_rows(x)
        q = torch.empty(rows.shape, dtype=torch.int8)
        scale = torch.empty(rows.shape[0], dtype=torch.float32)
        for block in row_blocks(*rows.shape):
            values = rows[block].to(torch.float32)
            s = values.abs().amax(dim=1) / 127 if values.shape[1] else values.new_zeros(values.shape[0])
            scale[block] = s
            values = values / torch.where(s > 0, s, 1).unsqueeze(1)
            q[block] = values.round_().clamp_(-127, 127)
        return q.reshape(x.shape), {"scale": scale}, {}

    def decode(self, primary: torch.Tensor, parts: Mapping[str, torch.Tensor], stage: dict) -> torch.Tensor:
        dtype, shape = parse_dtype(stage["dtype"]), tuple(stage["shape"])
        require(primary.dtype == torch.int8 and tuple(primary.shape) == shape, "int8 codes do not fit")
        rows = as_rows(primary)
        scale = part(parts, "scale", torch.float32)
        require(tuple(scale.shape) == (rows.shape[0],), "int8 scale has the wrong shape")
        out = torch.empty(rows.shape, dtype=dtype)
        for block in row_blocks(*rows.shape):
            if dtype == torch.float32:
                out[block].copy_(rows[block]).mul_(scale[block].unsqueeze(1))
            else:
                out[block] = rows[block].to(torch.float32).mul_(scale[block].unsqueeze(1))
        return out.reshape(shape)


class Int4:
    name, primary, lossless = "int4", "q4", False

    def encode(
        self, x: torch.Tensor, group_size: int = 128, flat: bool = False
    ) -> tuple[torch.Tensor, dict, dict]:
        """``flat=True`` groups the tensor as one long row: no padding when rows are shorter than a group."""
        if group_size not in INT4_GROUP_SIZES or group_size % 2:
            raise CodecError(f"int4 group size must be even, 32 to 256, not {group_size}")
        _require_float(x, "int4")
        rows = x.reshape(1, x.numel()) if flat else as_rows(x)
        n_rows, cols = rows.shape
        groups = math.ceil(cols / group_size)
        padded = groups * group_size
        scales = torch.empty(n_rows, groups, dtype=torch.float32)
        zeros = torch.empty(n_rows, groups, dtype=torch.float32)
        for block in row_blocks(n_rows, padded):
            g = _grouped(rows[block], group_size, padded)
            low, high = g.amin(dim=2), g.amax(dim=2)
            scales[block], zeros[block] = (high - low) / 15, low
        side_dtype = torch.float16 if _fits_fp16(scales, zeros) else torch.float32
        scales, zeros = scales.to(side_dtype), zeros.to(side_dtype)
        packed = torch.empty(n_rows, padded // 2, dtype=torch.uint8)
        for block in row_blocks(n_rows, padded):
            g = _grouped(rows[block], group_size, padded)
            s = scales[block].to(torch.float32).unsqueeze(2)
            q = (g - zeros[block].to(torch.float32).unsqueeze(2)).div_(torch.where(s > 0, s, 1))
            q = q.round_().clamp_(0, 15).to(torch.uint8).reshape(g.shape[0], padded)
            packed[block] = q[:, 0::2] | (q[:, 1::2] << 4)
        return packed, {"scale": scales, "zero": zeros}, {"group_size": group_size, "flat": flat}

    def decode(self, primary: torch.Tensor, parts: Mapping[str, torch.Tensor], stage: dict) -> torch.Tensor:
        dtype, shape = parse_dtype(stage["dtype"]), tuple(stage["shape"])
        group_size = stage.get("group_size")
        require(isinstance(group_size, int) and group_size in INT4_GROUP_SIZES, "bad int4 group size")
        n_rows = shape[0] if len(shape) >= 2 and not stage.get("flat") else 1
        cols = math.prod(shape) // n_rows if n_rows else math.prod(shape[1:])
        groups = math.ceil(cols / group_size)
        padded = groups * group_size
        require(
            primary.dtype == torch.uint8 and tuple(primary.shape) == (n_rows, padded // 2),
            "int4 codes do not fit the shape",
        )
        scales, zeros = part(parts, "scale"), part(parts, "zero")
        for side in (scales, zeros):
            require(side.dtype in (torch.float16, torch.float32), "int4 scales must be float16 or float32")
            require(tuple(side.shape) == (n_rows, groups), "int4 scales have the wrong shape")
        out = torch.empty(n_rows, cols, dtype=dtype)
        for block in row_blocks(n_rows, padded):
            p = primary[block]
            q = torch.stack((p & 15, p >> 4), dim=2).reshape(p.shape[0], groups, group_size)
            values = q.to(torch.float32).mul_(scales[block].to(torch.float32).unsqueeze(2))
            values.add_(zeros[block].to(torch.float32).unsqueeze(2))
            out[block] = values.reshape(p.shape[0], padded)[:, :cols]
        return out.reshape(shape)


def _grouped(rows: torch.Tensor, group_size: int, padded: int) -> torch.Tensor:
    """Rows as (rows, groups, group_size) in float32, the last group padded with the row's last value."""
    values = rows.to(torch.float32)
    if padded > values.shape[1] and values.shape[1]:
        fill = values[:, -1:].expand(values.shape[0], padded - values.shape[1])
        values = torch.cat((values, fill), dim=1)
    elif padded > values.shape[1]:
        values = values.new_zeros(values.shape[0], padded)
    return values.reshape(values.shape[0], -1, group_size)


def _fits_fp16(scales: torch.Tensor, zeros: torch.Tensor) -> bool:
    """float16 keeps scales and zero points to 2**-11 relative only inside its normal range."""
    for side in (scales.abs(), zeros.abs()):
        nonzero = side[side > 0]
        if nonzero.numel() and (nonzero.max() > _FP16_MAX / 2 or nonzero.min() < _FP16_TINY):
            return False
    return True


CAST, INT8, INT4 = register(Cast()), register(Int8()), register(Int4())
