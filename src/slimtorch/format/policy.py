"""Which codec chain each tensor gets: the rules ``slimtorch.save`` and ``slimtorch shrink`` share.

- Integers, booleans and anything matched by ``skip`` stay exact (sparse where that is smaller). A
  ``skip`` pattern that matches no tensor is an error (:func:`check_patterns`): a typo would otherwise
  quantize what it meant to keep.
- ``dtype`` converts floating-point tensors (the loaded model is then in that dtype).
- ``quantize`` applies to weights only: floating-point parameters with at least two dimensions and
  :data:`QUANTIZE_MIN_ELEMENTS` elements. Norms, biases and small tensors keep their precision. Embeddings
  are quantized per row like any weight (int8's output channels are their rows) unless
  ``quantize_embeddings=False``. Names in ``unquantized`` are not quantized; names in ``stored_as`` get
  ``"int8"`` or ``"float16"`` instead of ``quantize``: shrink and save fill it with the few weights whose
  rounding error would dominate and with recurrent layers' weights (:mod:`slimtorch.format.sensitive`)
  unless ``quantize_all=True``. int4 groups hold :data:`SHRINK_INT4_GROUP_SIZE` values unless told otherwise.
- ``sparse="auto"`` stores a tensor as bitmask + non-zeros only when that is smaller than dense: after
  int8, on the codes (values that round to zero are zeros); before int4, on the weights.
- ``entropy=True`` adds zstandard where it saves at least 5%.
- ``layout="hf"`` (a Hugging Face folder transformers reads, :mod:`slimtorch.format.hf_layout`): nothing is
  sparse; only the weights in ``hf_weights`` (those of ``nn.Linear`` and ``nn.Embedding`` layers, which
  compressed-tensors expresses) are quantized, int4 on the symmetric grid in groups that fit their rows
  (shrink stores embeddings as int8 under int4: compressed-tensors' int4 is for Linear layers); the
  others keep their precision.
"""

from __future__ import annotations

import fnmatch
import math
import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from slimtorch.errors import OptionError
from slimtorch.format.codecs import CodecError, Encoded, encode
from slimtorch.format.codecs.chain import extend
from slimtorch.format.codecs.lossy import check_group_size
from slimtorch.format.container import DTYPES
from slimtorch.format.hf_layout import int4_fits
from slimtorch.format.names import unmatched_pattern
from slimtorch.format.scan import count_zeros

QUANTIZE_MIN_ELEMENTS = 4096
SHRINK_INT4_GROUP_SIZE = 32
"""Shrink's int4 groups: 32, not quantize's :data:`~slimtorch.format.codecs.lossy.INT4_GROUP_SIZE` (128,
which the packed kernel computes fast). On all-MiniLM-L6-v2 the worst sentence embedding's cosine goes from
0.92 to 0.96 (0.94 at 64), for a file 62% of the int8 one instead of 53%; wider clipping searches gained less
(+0.01)."""
SPARSE_MIN_ELEMENTS = 64  # below this the saving is smaller than the extra header entry
EMBEDDING = re.compile(r"(^|\.)(\w*embed\w*|wte|wpe|shared)(\.|$)", re.IGNORECASE)
_STORABLE = set(DTYPES.values())
_CASTS = {"fp16": torch.float16, "float16": torch.float16, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class ShrinkOptions:
    """What to do to each tensor; the defaults are lossless (drop nothing, convert nothing)."""

    dtype: torch.dtype | None = None
    quantize: str | None = None
    group_size: int = SHRINK_INT4_GROUP_SIZE
    sparse: str = "auto"
    entropy: bool = False
    quantize_embeddings: bool = True
    skip: Sequence[str] = field(default_factory=tuple)
    quantize_all: bool = False
    """Quantize every weight, even those whose error would dominate (see ``unquantized``)."""
    unquantized: Collection[str] = field(default_factory=frozenset)
    """Exact tensor names left unquantized (still converted by ``dtype``)."""
    stored_as: Mapping[str, str] = field(default_factory=dict)
    """Exact tensor names stored as ``"int8"`` or ``"float16"`` instead of ``quantize``."""
    layout: str = "slim"
    """``"hf"``: parts transformers reads as they are (see the module docstring); ``"slim"``: any codec."""
    hf_weights: Collection[str] = field(default_factory=frozenset)
    """Under ``layout="hf"``, the weights compressed-tensors can hold quantized."""

    def __post_init__(self) -> None:
        if isinstance(self.dtype, str):
            if self.dtype not in _CASTS:
                raise OptionError(f"dtype must be fp16 or bf16, not {self.dtype!r}")
            object.__setattr__(self, "dtype", _CASTS[self.dtype])
        if self.quantize not in (None, "int8", "int4"):
            raise OptionError(f"quantize must be int8 or int4, not {self.quantize!r}")
        if self.sparse not in ("auto", "off"):
            raise OptionError(f"sparse must be auto or off, not {self.sparse!r}")
        check_group_size(self.group_size)
        object.__setattr__(self, "skip", tuple(self.skip))
        object.__setattr__(self, "unquantized", frozenset(self.unquantized))
        if any(kind not in ("int8", "float16") for kind in self.stored_as.values()):
            raise OptionError(f"stored_as takes int8 or float16, not {sorted(set(self.stored_as.values()))}")
        object.__setattr__(self, "stored_as", dict(self.stored_as))
        if self.layout not in ("hf", "slim"):
            raise OptionError(f"layout must be hf or slim, not {self.layout!r}")
        object.__setattr__(self, "hf_weights", frozenset(self.hf_weights))

    @property
    def lossless(self) -> bool:
        return self.dtype is None and self.quantize is None

    def skipped(self, name: str) -> bool:
        return any(fnmatch.fnmatchcase(name, pattern) for pattern in self.skip)


def check_patterns(
    patterns: Sequence[str], names: Collection[str], removed_prefix: str | None = None
) -> None:
    """Refuse a ``skip`` pattern that matches no tensor, naming the closest names (``names`` are the names
    as stored, after shrink removed a wrapper prefix ``removed_prefix``).

    Example:
        >>> check_patterns(["fc.wieght"], ["fc.weight", "norm.bias"])
        Traceback (most recent call last):
        ...
        slimtorch.errors.OptionError: skip pattern 'fc.wieght' matches no tensor; closest names: fc.weight
    """
    unmatched = unmatched_pattern(patterns, sorted(names))
    if unmatched is None:
        return
    pattern, close = unmatched
    if removed_prefix and pattern.startswith(removed_prefix):
        hint = (
            f"names lost the wrapper prefix {removed_prefix!r}: write {pattern[len(removed_prefix) :]!r}"
            " (or keep the prefix with --keep-names)"
        )
    else:
        hint = f"closest names: {', '.join(close)}" if close else f"names look like {min(names, default='')}"
    raise OptionError(f"skip pattern {pattern!r} matches no tensor; {hint}")


def weight_like(category: str, dtype: torch.dtype, shape: Sequence[int]) -> bool:
    """A tensor quantization applies to: a floating-point parameter, at least 2-d, not small."""
    return (
        category == "parameters"
        and dtype.is_floating_point
        and len(shape) >= 2
        and math.prod(shape) >= QUANTIZE_MIN_ELEMENTS
    )


def quantizable(name: str, x: torch.Tensor, category: str, options: ShrinkOptions) -> bool:
    return (
        options.quantize is not None
        and weight_like(category, x.dtype, tuple(x.shape))
        and not options.skipped(name)
        and name not in options.unquantized
        and (options.quantize_embeddings or not EMBEDDING.search(name))
        and (options.layout != "hf" or name in options.hf_weights)
    )


def convert(name: str, x: torch.Tensor, options: ShrinkOptions) -> torch.Tensor:
    """The tensor in the dtype it will load as (``dtype`` applies to floats wider than it, not skipped)."""
    target = options.dtype
    if target is None or not x.dtype.is_floating_point or options.skipped(name):
        return x
    if x.dtype.itemsize <= target.itemsize or x.dtype not in (torch.float32, torch.float64, torch.float16):
        return x
    converted = x.to(target)
    if target == torch.float16 and bool(torch.isinf(converted).any() & torch.isfinite(x).all()):
        return x  # beyond float16's range: keep it exact rather than store infinities
    return converted


def encode_tensor(name: str, x: torch.Tensor, category: str, options: ShrinkOptions) -> Encoded:
    """Encode one tensor (already converted by :func:`convert`) by the rules above."""
    x = x.detach().contiguous()
    if x.dtype not in _STORABLE:
        return encode(x, ["bytes"])
    sparse = options.sparse == "auto" and options.layout != "hf"
    encoded = None
    if quantizable(name, x, category, options):
        try:
            encoded = _quantized(x, options.stored_as.get(name, options.quantize), options, sparse)
        except CodecError:
            encoded = None  # inf or nan in the weight: a scale cannot hold them, store it exactly
    if encoded is None:
        encoded = Encoded({"": x}, [])
        if sparse and _sparse_pays(x.numel(), count_zeros(x), x.element_size()):
            encoded = extend(encoded, "sparse")
    if options.entropy:
        encoded = extend(encoded, "zstd")
    return encoded


def _quantized(x: torch.Tensor, kind: str, options: ShrinkOptions, sparse: bool) -> Encoded | None:
    if kind == "float16":
        # Cast back to the weight's dtype on load; a weight already 16-bit stays as it is.
        return encode(x, [("cast", {"to": "float16"})]) if x.dtype.itemsize > 2 else None
    if kind == "int8" and options.layout == "hf" and options.quantize == "int4":
        return None  # one compressed-tensors format a folder: int8 codes beside int4 ones would go dense
    if kind == "int8":
        return _sparse_codes(encode(x, ["int8"]), sparse)
    group = options.group_size
    if options.layout == "hf":  # compressed-tensors' int4: symmetric, whole groups along rows, or float
        fits = int4_fits(tuple(x.shape), group)
        return encode(x, [("int4", {"group_size": group, "symmetric": True})]) if fits else None
    zeros = count_zeros(x) if sparse else 0
    if int4_bytes(x.numel(), zeros, group, sparse) < _int4_bytes(x.numel(), group):
        return encode(x, ["sparse", ("int4", {"group_size": group})])
    return encode(x, [("int4", {"group_size": group, "flat": int4_flat(tuple(x.shape), group)})])


def _sparse_codes(encoded: Encoded, sparse: bool) -> Encoded:
    """int8 codes as bitmask + non-zero codes where that is smaller (a pruned weight's zeros stay zeros)."""
    codes = encoded.parts.get("q")
    if sparse and codes is not None and _sparse_pays(codes.numel(), count_zeros(codes), 1):
        return extend(encoded, "sparse")
    return encoded


def finish_coded(encoded: Encoded, options: ShrinkOptions) -> Encoded:
    """A tensor that arrives encoded (a quantized layer's parts): sparse int8 codes and zstd, as asked."""
    encoded = _sparse_codes(encoded, options.sparse == "auto" and options.layout != "hf")
    return extend(encoded, "zstd") if options.entropy else encoded


# -- sizes: what the codecs above store, shared with inspect's "what you could save" -----------------------
def sparse_bytes(numel: int, zeros: int, itemsize: float) -> int:
    """Bitmask (one bit per element) plus the non-zero values."""
    return math.ceil(numel / 8) + math.ceil((numel - zeros) * itemsize)


def _sparse_pays(numel: int, zeros: int, itemsize: int) -> bool:
    return numel >= SPARSE_MIN_ELEMENTS and sparse_bytes(numel, zeros, itemsize) < numel * itemsize


def lossless_bytes(numel: int, zeros: int, itemsize: int, sparse: bool = True) -> int:
    """A tensor stored exactly: dense, or sparse where that is smaller."""
    dense = numel * itemsize
    return sparse_bytes(numel, zeros, itemsize) if sparse and _sparse_pays(numel, zeros, itemsize) else dense


def int8_bytes(shape: Sequence[int], zeros: int, sparse: bool = True) -> int:
    """int8 codes (sparse where that is smaller) plus a float32 scale per output channel."""
    rows = shape[0] if len(shape) >= 2 else 1
    return lossless_bytes(math.prod(shape), zeros, 1, sparse) + 4 * rows


def int4_bytes(numel: int, zeros: int, group_size: int, sparse: bool = True) -> int:
    """int4 (float16 scale and zero point per group), after sparse where that is smaller."""
    dense = _int4_bytes(numel, group_size)
    packed = math.ceil(numel / 8) + _int4_bytes(numel - zeros, group_size)
    return packed if sparse and packed < dense else dense


def int4_flat(shape: Sequence[int], group_size: int) -> bool:
    """Whether int4 groups run along the flattened tensor instead of along rows.

    Groups follow rows (what int4 matmul kernels want, and rows differ in scale) unless padding each row
    to whole groups would add more than an eighth to it (a row of 600 takes 19 groups of 32: 608 codes)."""
    cols = math.prod(shape) // shape[0] if shape and shape[0] else 0
    return -cols % group_size * 8 > cols


def int4_stored_bytes(shape: Sequence[int], zeros: int, group_size: int, sparse: bool = True) -> int:
    """What shrink writes for a weight quantized to int4: sparse then flat int4 where that is smaller,
    else int4 in groups along rows (padded) or along the flattened tensor (:func:`int4_flat`)."""
    numel = math.prod(shape)
    if int4_bytes(numel, zeros, group_size, sparse) < _int4_bytes(numel, group_size):
        return int4_bytes(numel, zeros, group_size, sparse)
    if int4_flat(shape, group_size):
        return _int4_bytes(numel, group_size)
    rows = shape[0]
    return rows * _int4_bytes(numel // rows, group_size)


def _int4_bytes(numel: int, group_size: int) -> int:
    """int4 size without row padding (float16 scales): codes, plus a scale and a zero point per group."""
    return math.ceil(numel / group_size) * (group_size // 2 + 4)
