"""The one-pass row quantization, compiled by numba: imported only through :mod:`slimtorch.quant.rowcodes`,
which sets numba's cache folder first.

Importing this module compiles the kernel for its one signature (or loads it from numba's cache, after the
first time): the cost lands where a layer is made, never inside a timed forward, and an input of any other
type is refused by numba instead of compiled on the spot.
"""

from __future__ import annotations

import numpy as np
from numba import njit

_TINY = np.float32(np.finfo(np.float32).tiny)
_ABS = np.int32(0x7FFFFFFF)  # an IEEE float's bits without the sign: |x|, ordered as integers
_NOT_FINITE = np.int32(0x7F800000)  # |x| bits at or above this: inf or nan
_NEGATIVE_INFINITY = np.uint32(0xFF800000)  # unsigned bits at or above this: -inf or a nan with its sign set


@njit(
    "Tuple((uint8[:, ::1], float32[:, ::1], boolean))(float32[:, ::1], int32, float32)",
    cache=True,
    nogil=True,
    boundscheck=False,
)
def quantize_rows(x, offset, levels):  # typed by numba's signature above
    """Codes ``rint(x / scale) + offset`` as bytes and scales ``max|row| / levels`` (at least float32's
    tiny), each row read twice: once for its largest magnitude, once to write its codes. ``False`` if a row
    is not finite. Offset 128 and 127 levels give the unsigned codes oneDNN takes; offset 0 the signed ones
    ``torch._int_mm`` takes, as their two's-complement bytes (the cast to uint8 keeps the low 8 bits);
    offset 64 and 63 levels the 7-bit codes of CPUs whose int8 products saturate.

    The largest magnitude is taken on the floats' bits as integers: that loop vectorizes without
    fast-math (a float max does not, for nan's sake), and a nan or inf shows as bits past infinity's.
    Scale, reciprocal, product and round-half-to-even are the float32 operations torch's path does, in
    the same order, so the codes and scales are bit for bit the same."""
    rows, cols = x.shape
    bits = x.view(np.int32)
    codes = np.empty((rows, cols), np.uint8)
    scales = np.empty((rows, 1), np.float32)
    scale_bits = scales.view(np.int32)
    for i in range(rows):
        top = np.int32(0)
        for j in range(cols):
            magnitude = np.int32(
                bits[i, j] & _ABS
            )  # int32 explicitly: numba would widen it, halving the lanes
            if magnitude > top:
                top = magnitude
        if top >= _NOT_FINITE:
            return codes, scales, False
        scale_bits[i, 0] = top  # the largest magnitude as a float
        scale = max(scales[i, 0] / levels, _TINY)
        scales[i, 0] = scale
        inverse = np.float32(1) / scale
        for j in range(cols):
            codes[i, j] = np.uint8(np.int32(np.rint(x[i, j] * inverse)) + offset)
    return codes, scales, True


@njit(
    "float32[:, ::1](int32[:, ::1], float32[::1], float32[:, ::1], float32[::1])",
    cache=True,
    nogil=True,
    boundscheck=False,
    fastmath={"contract"},  # torch's addcmul multiplies and adds in one fused instruction: so must this
)
def scale_product(product, weight_scale, row_scale, bias):  # typed by numba's signature above
    """``float(product) * weight_scale * row_scale + bias`` (no bias when it is empty) in one pass: the
    float32 operations, in the order, that torch's ``mul`` then ``addcmul`` do in two."""
    rows, cols = product.shape
    out = np.empty((rows, cols), np.float32)
    for i in range(rows):
        scale = row_scale[i, 0]
        if bias.size:
            for j in range(cols):
                out[i, j] = np.float32(product[i, j]) * weight_scale[j] * scale + bias[j]
        else:
            for j in range(cols):
                out[i, j] = np.float32(product[i, j]) * weight_scale[j] * scale
    return out


@njit(
    "Tuple((uint8[:, ::1], float32[:, ::1], boolean))(float32[:, ::1], float32)",
    cache=True,
    nogil=True,
    boundscheck=False,
    fastmath={"nnan", "ninf", "nsz"},  # no nan or inf reaches the float operations: the bits are checked
)
def quantize_rows_asymmetric(x, levels):  # typed by numba's signature above
    """Codes ``rint(x / scale) + zero`` within ``[0, levels]`` and each row's ``(scale, scale * zero)``,
    where ``scale = (max - min) / levels`` over the row and 0 (zero stays exact) and ``zero =
    rint(-min / scale)``; ``False`` if a row is not finite. The float32 operations of
    :func:`slimtorch.quant.kernels.quantize_rows_torch`, in its order, so the codes are the same bits.

    The row's extremes are found on the floats' bits as integers, two reductions that vectorize (a float
    min and max do not, here: 3x slower): as signed integers the largest is the largest positive float;
    as unsigned ones, the largest above the sign bit is the most negative float. Past infinity's bits,
    either way, is an inf or a nan."""
    rows, cols = x.shape
    signed = x.view(np.int32)
    unsigned = x.view(np.uint32)
    codes = np.empty((rows, cols), np.uint8)
    params = np.empty((rows, 2), np.float32)
    extremes = np.empty(2, np.int32)  # a row's max and min as bits, read back as floats
    as_floats = extremes.view(np.float32)
    top = np.float32(levels)
    for i in range(rows):
        high = np.int32(0)  # +0.0: the range holds zero
        low = np.uint32(0x80000000)  # -0.0
        for j in range(cols):
            high = max(high, signed[i, j])
            low = max(low, unsigned[i, j])
        if high >= _NOT_FINITE or low >= _NEGATIVE_INFINITY:
            return codes, params, False
        extremes[0] = high
        extremes[1] = np.int32(low)
        scale = max((as_floats[0] - as_floats[1]) / top, _TINY)
        inverse = np.float32(1) / scale
        zero = np.rint(-as_floats[1] * inverse)
        params[i, 0] = scale
        params[i, 1] = scale * zero
        for j in range(cols):
            code = np.rint(x[i, j] * inverse) + zero
            codes[i, j] = np.uint8(np.int32(min(max(code, np.float32(0)), top)))
    return codes, params, True


@njit(
    "void(float32[:, ::1], float32[:, ::1], float32[::1], float32[::1])",
    cache=True,
    nogil=True,
    boundscheck=False,
    fastmath={"contract"},
)
def shift_product(product, params, weight_sums, bias):  # typed by numba's signature above
    """In place: ``product * scale - shift * weight_sums + bias`` per row (``params`` holds each row's
    scale and shift), in one pass; no bias when it is empty."""
    rows, cols = product.shape
    for i in range(rows):
        scale = params[i, 0]
        shift = params[i, 1]
        if bias.size:
            for j in range(cols):
                product[i, j] = product[i, j] * scale - shift * weight_sums[j] + bias[j]
        else:
            for j in range(cols):
                product[i, j] = product[i, j] * scale - shift * weight_sums[j]
