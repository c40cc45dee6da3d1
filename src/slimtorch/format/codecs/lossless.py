"""Lossless codecs: ``sparse`` (a packed bitmask plus the non-zero values) and ``bytes`` (raw bytes for dtypes
safetensors has no name for).

``sparse`` drops every element equal to zero and stores one bit per element (1 = kept, little-endian bit
order, packed with NumPy) plus the kept values in order. Decoding is exact except that a negative zero comes
back as +0.0: ``weight_orig * weight_mask`` from ``torch.nn.utils.prune`` is full of -0.0, and those must
count as zeros for pruning to shrink anything. NaN is not zero and is kept.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
import torch

from slimtorch.format.codecs.base import require
from slimtorch.format.codecs.chain import CodecError, parse_dtype, part, register

_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_SIGN_FREE = {1: 0x7F, 2: 0x7FFF, 4: 0x7FFF_FFFF, 8: 0x7FFF_FFFF_FFFF_FFFF}


def words(flat: torch.Tensor) -> torch.Tensor:
    """A 1-d tensor's bits as integers, one row per element: (n,) or, for 16-byte dtypes, (n, 2)."""
    size = flat.element_size()
    if size == 16:
        return flat.view(torch.int64).reshape(-1, 2)
    return flat.view(_WORDS[size])


def nonzero_mask(flat: torch.Tensor) -> torch.Tensor:
    """Which elements of a 1-d tensor are not zero (-0.0 counts as zero; NaN does not)."""
    if flat.dtype == torch.bool:
        return flat.clone()
    if flat.dtype == torch.float8_e8m0fnu:  # this format has no zero
        return torch.ones(flat.shape, dtype=torch.bool)
    if flat.dtype in (torch.float8_e4m3fnuz, torch.float8_e5m2fnuz):
        # No negative zero in these: their sign-bit-only pattern 0x80 is NaN, which must be kept.
        return flat.view(torch.uint8) != 0
    bits = words(flat)
    if flat.dtype.is_floating_point or flat.dtype.is_complex:
        # Compare the bits without the sign bit of each float (of each half of a complex).
        per_float = flat.element_size() // (2 if flat.dtype.is_complex else 1)
        per_element = flat.element_size() // per_float
        bits = flat.view(_WORDS[per_float]).reshape(flat.numel(), per_element) & _SIGN_FREE[per_float]
        return (bits != 0).any(dim=1) if bits.dim() == 2 else bits != 0
    return bits != 0 if bits.dim() == 1 else (bits != 0).any(dim=1)


class Sparse:
    name, primary, lossless = "sparse", "values", True

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, dict, dict]:
        flat = x.contiguous().reshape(-1)
        keep = nonzero_mask(flat)
        mask = torch.from_numpy(np.packbits(keep.numpy(), bitorder="little"))
        try:
            values = flat[keep]
        except (RuntimeError, NotImplementedError):  # float8 and friends have no indexing kernel
            values = _take(flat, keep)
        return values, {"mask": mask}, {}

    def decode(self, primary: torch.Tensor, parts: Mapping[str, torch.Tensor], stage: dict) -> torch.Tensor:
        dtype, shape = parse_dtype(stage["dtype"]), tuple(stage["shape"])
        numel = math.prod(shape)
        mask = part(parts, "mask", torch.uint8)
        require(tuple(mask.shape) == (math.ceil(numel / 8),), "sparse mask has the wrong length")
        require(primary.dtype == dtype and primary.dim() == 1, "sparse values have the wrong dtype")
        if not primary.numel() and not mask.numpy().any():  # all zeros (a new model's biases): no scatter
            return torch.zeros(shape, dtype=dtype)
        keep = np.unpackbits(mask.numpy(), count=numel, bitorder="little").view(np.bool_)
        kept = int(np.count_nonzero(keep))
        require(kept == primary.numel(), f"sparse mask keeps {kept} values but {primary.numel()} are stored")
        source = words(primary.contiguous()).numpy()
        # np.zeros takes fresh zero pages from the OS (calloc) instead of writing zeros, so the only pass
        # over the output is the scatter of the kept values.
        target = np.zeros(numel if source.ndim == 1 else (numel, 2), dtype=source.dtype)
        target[keep] = source
        return torch.from_numpy(target.reshape(-1)).view(dtype).reshape(shape)


def _take(flat: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Boolean selection through the integer view, for dtypes without an indexing kernel."""
    picked = words(flat)[keep]
    return picked.reshape(-1).view(flat.dtype)


class Bytes:
    """The raw bytes of a tensor whose dtype safetensors cannot name (complex128, bit-packed types)."""

    name, primary, lossless = "bytes", "bytes", True

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, dict, dict]:
        return x.contiguous().reshape(-1).view(torch.uint8), {}, {}

    def decode(self, primary: torch.Tensor, parts: Mapping[str, torch.Tensor], stage: dict) -> torch.Tensor:
        dtype, shape = parse_dtype(stage["dtype"]), tuple(stage["shape"])
        need = math.prod(shape) * dtype.itemsize
        require(primary.dtype == torch.uint8 and primary.numel() == need, "byte part has the wrong size")
        try:
            return primary.contiguous().view(dtype).reshape(shape)
        except RuntimeError as exc:
            raise CodecError(f"cannot view bytes as {dtype}: {exc}") from exc


SPARSE, BYTES = register(Sparse()), register(Bytes())
