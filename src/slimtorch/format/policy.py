"""Which codec chain each tensor gets: the rules ``slimtorch.save`` and ``slimtorch shrink`` share.

:class:`ShrinkOptions` holds the user's choices; :class:`TensorPolicy` is what the codec functions follow:
those choices plus what a run derives (``unquantized``, ``stored_as``, the layout written, ``hf_weights``).

- Integers, booleans and anything matched by ``skip`` stay exact (sparse where that is smaller). A
  ``skip`` pattern that matches no tensor is an error (:func:`check_patterns`): a typo would otherwise
  quantize what it meant to keep.
- ``dtype`` converts floating-point tensors (the loaded model is then in that dtype).
- ``quantize`` (a scheme's name of :data:`slimtorch.schemes.WRITTEN`, ``"int8-weight"`` or
  ``"int4-weight"``; stored by the row's codec, :attr:`TensorPolicy.codec`) applies to weights only:
  floating-point parameters with at least two dimensions and :data:`QUANTIZE_MIN_ELEMENTS` elements.
  Norms, biases and small tensors keep their precision. Embeddings are quantized per row like any weight
  (int8's output channels are their rows) unless ``quantize_embeddings=False``. Names in ``unquantized``
  are not quantized; names in ``stored_as`` get ``"int8"`` or ``"float16"`` instead of that codec: shrink
  and save fill it with the few weights whose rounding error would dominate and with recurrent layers'
  weights (:mod:`slimtorch.format.sensitive`) unless ``quantize_all=True``. int4 groups hold
  :data:`SHRINK_INT4_GROUP_SIZE` values unless told otherwise.
- ``sparse="auto"`` stores a tensor as bitmask + non-zeros only when that saves at least
  :data:`SPARSE_MIN_SAVING` bytes over dense (a decode costs more than reading a few KiB): after
  int8, on the codes (values that round to zero are zeros); before int4, on the weights.
- ``entropy=True`` adds zstandard where it saves at least 5%.
- ``layout="hf"`` (a Hugging Face folder transformers reads, :mod:`slimtorch.format.hf_layout`): nothing is
  sparse; only the weights in ``hf_weights`` (those of ``nn.Linear`` and ``nn.Embedding`` layers, which
  compressed-tensors expresses) are quantized, int4 in groups that fit their rows, each with a zero point on
  its integer grid (asymmetric: on all-MiniLM-L6-v2 the symmetric grid took the worst sentence cosine to 0.88)
  (shrink stores embeddings as int8 under int4: compressed-tensors' int4 is for Linear layers); the
  others keep their precision.
"""

from __future__ import annotations

import fnmatch
import math
import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, fields

import torch

from slimtorch.errors import OptionError
from slimtorch.format.codecs import CodecError, Encoded, encode
from slimtorch.format.codecs.chain import extend
from slimtorch.format.codecs.lossy import ErrorStats, check_group_size
from slimtorch.format.container import DTYPES
from slimtorch.format.hf_layout import int4_fits
from slimtorch.format.names import unmatched_pattern
from slimtorch.format.scan import count_zeros
from slimtorch.schemes import BY_NAME as SCHEME_ROWS
from slimtorch.schemes import WRITER_FORMS, WRITTEN

QUANTIZE_MIN_ELEMENTS = 4096
SHRINK_INT4_GROUP_SIZE = 32
"""Shrink's int4 groups: 32, not quantize's :data:`~slimtorch.format.codecs.lossy.INT4_GROUP_SIZE` (128,
which the packed kernel computes fast). On all-MiniLM-L6-v2 the worst sentence embedding's cosine goes from
0.92 to 0.96 (0.94 at 64), for a file 62% of the int8 one instead of 53%; wider clipping searches gained less
(+0.01)."""
SPARSE_MIN_SAVING = 4096
"""Bytes a tensor must save to be stored sparse. A coded tensor costs its load ~40 us of Python (map its
parts, check and decode them) where reading 4 KiB takes ~8 us from a disk and ~1 us from the page cache:
a freshly built BERT-base's 98 all-zero biases, stored sparse, saved 0.06% of its file and cost its load
7 ms (the load's own work, the model's build aside, went from 21.5 to 14.6 ms with 86 of them dense)."""
EMBEDDING = re.compile(r"(^|\.)(\w*embed\w*|wte|wpe|shared)(\.|$)", re.IGNORECASE)
_STORABLE = set(DTYPES.values())
_CASTS = {"fp16": torch.float16, "float16": torch.float16, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class CodecChoices:
    """The choices every tensor's codec follows, checked once: what :class:`ShrinkOptions` (the user's) and
    :class:`TensorPolicy` (a run's) share."""

    dtype: torch.dtype | None = None
    """Convert floating-point tensors: ``"fp16"``, ``"bf16"`` (or the torch dtype); None keeps them."""
    quantize: str | None = None
    """Quantize weights by a scheme's name, as ``--scheme`` and :func:`slimtorch.quantize` name it:
    ``"int8-weight"`` (a scale per output channel) or ``"int4-weight"`` (in groups), the rows the writers
    store as they say (:data:`slimtorch.schemes.WRITTEN`); None keeps them."""
    group_size: int = SHRINK_INT4_GROUP_SIZE
    """Values per int4 group."""
    sparse: str = "auto"
    """``"auto"``: store zeros as bitmask + non-zeros where that saves :data:`SPARSE_MIN_SAVING` bytes;
    ``"off"``: always dense."""
    entropy: bool = False
    """Add zstandard over the stored parts where it saves at least 5% (slower load)."""
    quantize_embeddings: bool = True
    """Quantize embeddings per row like any weight; False keeps their precision."""
    skip: Sequence[str] = ()
    """Glob patterns of tensor names kept exact (no conversion, no quantization); each must match."""

    def __post_init__(self) -> None:
        if isinstance(self.dtype, str):
            if self.dtype not in _CASTS:
                raise OptionError(f"dtype must be fp16 or bf16, not {self.dtype!r}")
            object.__setattr__(self, "dtype", _CASTS[self.dtype])
        _check_quantize(self.quantize)
        if self.sparse not in ("auto", "off"):
            raise OptionError(f"sparse must be auto or off, not {self.sparse!r}")
        check_group_size(self.group_size)
        _as_tuple(self, "skip")


@dataclass(frozen=True)
class ShrinkOptions(CodecChoices):
    """How :func:`slimtorch.shrink`, :func:`slimtorch.save`, :func:`slimtorch.save_model` and
    :func:`slimtorch.save_pretrained` store tensors, and how ``shrink`` reads its checkpoint: the user's
    choices, what a recipe records. The defaults are lossless (drop nothing, convert nothing).

    Example:
        >>> ShrinkOptions(quantize="int8-weight", skip=["lm_head.*"]).skip
        ('lm_head.*',)
    """

    quantize_all: bool = False
    """Quantize every weight, even the few whose error would dominate (stored at a higher precision by
    default, see :mod:`slimtorch.format.sensitive`)."""
    layout: str | None = None
    """A folder output's layout: ``"hf"`` (``from_pretrained`` reads it), ``"slim"`` (any codec); None:
    ``hf`` where a ``config.json`` goes with the weights, else ``slim`` (see
    :mod:`slimtorch.format.hf_layout`)."""
    shard_bytes: int | None = None
    """Largest shard of a folder output (None: 2 GB; a ``.safetensors`` output is one file)."""
    keep_optimizer: bool = False
    """``shrink`` only: keep optimizer and training state (dropped by default)."""
    keep_names: bool = False
    """``shrink`` only: keep a training wrapper prefix such as ``model.`` (removed by default)."""
    keep_objects: bool = True
    """``shrink`` only: keep the checkpoint's non-tensor values that are plain data (a config, an epoch)
    as JSON; False drops them all."""
    allow_globals: Sequence[str] = ()
    """``shrink`` only: extra globals trusted in pickles, as for :func:`slimtorch.open`."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.layout not in (None, "hf", "slim"):
            raise OptionError(f"layout must be hf or slim, not {self.layout!r}")
        if self.shard_bytes is not None and (isinstance(self.shard_bytes, bool) or self.shard_bytes < 1):
            raise OptionError(f"shard_bytes must be a positive number of bytes, not {self.shard_bytes!r}")
        _as_tuple(self, "allow_globals")

    def reading_given(self) -> str | None:
        """The first of shrink's reading choices set to other than its default (None: none is): the
        save verbs take a state dict or a model, so they have nothing to read and refuse them."""
        return next((name for name, default in READING.items() if getattr(self, name) != default), None)


def _check_quantize(value: object) -> None:
    """Refuse a ``quantize`` other than None or a written scheme's name, in one line saying what to write:
    the codec names the option took before 0.1.0 (``"int8"``) point at their scheme, and a scheme the
    writers cannot store as it says (dynamic, grouped int8) at :func:`slimtorch.quantize` and ``save_model``,
    which store its layers as they are."""
    if value is None or value in WRITTEN:
        return
    accepted = " or ".join(WRITTEN)
    raise OptionError(f"quantize takes a scheme name: {accepted}, not {value!r}{_quantize_hint(value)}")


def _quantize_hint(value: object) -> str:
    """What to write instead of ``value``, in parentheses ("" when there is nothing to say)."""
    if not isinstance(value, str):
        return ""
    if value in WRITER_FORMS:
        named = " or ".join(name for name in WRITTEN if SCHEME_ROWS[name].writer_form == value)
        return f" ({value} is {named})"
    row = SCHEME_ROWS.get(value)
    if row is None:
        return ""
    why = "is a form the writers cannot store as it says"
    if row.dynamic:
        why = "quantizes activations as the model runs, which no file holds"
    return f" ({value} {why}: slimtorch.quantize(model, {value!r}), then save_model keeps its layers)"


def _as_tuple(options: CodecChoices, name: str) -> None:
    """A sequence option held as a tuple (frozen options hash and compare); one string is refused, for it
    would be read as its characters."""
    value = getattr(options, name)
    if isinstance(value, str):
        raise OptionError(f"{name} takes a list, not the string {value!r}")
    object.__setattr__(options, name, tuple(value))


READING: dict[str, object] = {
    "keep_optimizer": False,
    "keep_names": False,
    "keep_objects": True,
    "allow_globals": (),
}
"""Shrink's choices about reading a checkpoint, with their defaults."""


@dataclass(frozen=True)
class TensorPolicy(CodecChoices):
    """What the codec functions below follow: the codec choices of a :class:`ShrinkOptions`, plus what a
    run derives from the model and its weights (never a user's choice, so never in a recipe)."""

    unquantized: frozenset[str] = frozenset()
    """Exact tensor names left unquantized (still converted by ``dtype``)."""
    stored_as: Mapping[str, str] = field(default_factory=dict)
    """Exact tensor names stored as ``"int8"`` or ``"float16"`` instead of :attr:`codec`: the weights
    quantizing would hurt most, chosen per run (storage forms of single tensors, not schemes)."""
    layout: str = "slim"
    """The layout being written: ``"hf"`` (parts transformers reads as they are) or ``"slim"``."""
    hf_weights: frozenset[str] = frozenset()
    """Under ``layout="hf"``, the weights compressed-tensors can hold quantized."""

    @classmethod
    def of(cls, options: ShrinkOptions) -> TensorPolicy:
        """The policy of ``options``' codec choices, before a run adds what it derives."""
        return cls(**{f.name: getattr(options, f.name) for f in fields(CodecChoices)})

    @property
    def codec(self) -> str | None:
        """The codec ``quantize`` stores weights with (``"int8"``, ``"int4"``: the row's
        :attr:`~slimtorch.schemes.Scheme.writer_form`), None when not quantizing. The one place a scheme's
        name becomes a codec: the functions below, the sensitive weights and the ``hf`` layout branch on
        codecs, the words ``stored_as`` and the codec chains use."""
        return None if self.quantize is None else SCHEME_ROWS[self.quantize].writer_form

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


def quantizable(name: str, x: torch.Tensor, category: str, policy: TensorPolicy) -> bool:
    return (
        policy.quantize is not None
        and weight_like(category, x.dtype, tuple(x.shape))
        and not policy.skipped(name)
        and name not in policy.unquantized
        and (policy.quantize_embeddings or not EMBEDDING.search(name))
        and (policy.layout != "hf" or name in policy.hf_weights)
    )


def convert(name: str, x: torch.Tensor, policy: TensorPolicy) -> torch.Tensor:
    """The tensor in the dtype it will load as (``dtype`` applies to floats wider than it, not skipped)."""
    target = policy.dtype
    if target is None or not x.dtype.is_floating_point or policy.skipped(name):
        return x
    if x.dtype.itemsize <= target.itemsize or x.dtype not in (torch.float32, torch.float64, torch.float16):
        return x
    converted = x.to(target)
    if target == torch.float16 and bool(torch.isinf(converted).any() & torch.isfinite(x).all()):
        return x  # beyond float16's range: keep it exact rather than store infinities
    return converted


def encode_tensor(
    name: str, x: torch.Tensor, category: str, policy: TensorPolicy, measure: ErrorStats | None = None
) -> Encoded:
    """Encode one tensor (already converted by :func:`convert`) by the rules above; an int8 codec fills
    ``measure`` with its stored values' error against ``x`` as it goes (its blocks counted: 0 if it did not
    run)."""
    x = x.detach().contiguous()
    if x.dtype not in _STORABLE:
        return encode(x, ["bytes"])
    sparse = policy.sparse == "auto" and policy.layout != "hf"
    encoded = None
    kind = policy.stored_as.get(name, policy.codec)
    if kind is not None and quantizable(name, x, category, policy):
        try:
            encoded = _quantized(x, kind, policy, sparse, measure)
        except CodecError:
            encoded = None  # inf or nan in the weight: a scale cannot hold them, store it exactly
    if encoded is None:
        encoded = Encoded({"": x}, [])
        if sparse and _sparse_pays(x.numel(), count_zeros(x), x.element_size()):
            encoded = extend(encoded, "sparse")
    if policy.entropy:
        encoded = extend(encoded, "zstd")
    return encoded


def _quantized(
    x: torch.Tensor, kind: str, policy: TensorPolicy, sparse: bool, measure: ErrorStats | None = None
) -> Encoded | None:
    if kind == "float16":
        # Cast back to the weight's dtype on load; a weight already 16-bit stays as it is.
        return encode(x, [("cast", {"to": "float16"})]) if x.dtype.itemsize > 2 else None
    if kind == "int8" and policy.layout == "hf" and policy.codec == "int4":
        return None  # one compressed-tensors format a folder: int8 codes beside int4 ones would go dense
    if kind == "int8":
        return _sparse_codes(encode(x, [("int8", {"measure": measure})]), sparse)
    group = policy.group_size
    if policy.layout == "hf":  # compressed-tensors' int4: a zero point a group, whole groups along rows
        fits = int4_fits(tuple(x.shape), group)
        return encode(x, [("int4", {"group_size": group, "integer_zero": True})]) if fits else None
    zeros = count_zeros(x) if sparse else 0
    if int4_bytes(x.numel(), zeros, group, sparse) < _int4_bytes(x.numel(), group):
        return encode(x, ["sparse", ("int4", {"group_size": group})])
    return encode(x, [("int4", {"group_size": group, "flat": int4_flat(tuple(x.shape), group)})])


def _sparse_codes(encoded: Encoded, sparse: bool) -> Encoded:
    """int8 codes as bitmask + non-zero codes where that saves :data:`SPARSE_MIN_SAVING` bytes (a pruned
    weight's zeros stay zeros)."""
    codes = encoded.parts.get("q")
    if sparse and codes is not None and _sparse_pays(codes.numel(), count_zeros(codes), 1):
        return extend(encoded, "sparse")
    return encoded


def finish_coded(encoded: Encoded, policy: TensorPolicy) -> Encoded:
    """A tensor that arrives encoded (a quantized layer's parts): sparse int8 codes and zstd, as asked."""
    encoded = _sparse_codes(encoded, policy.sparse == "auto" and policy.layout != "hf")
    return extend(encoded, "zstd") if policy.entropy else encoded


# -- sizes: what the codecs above store, shared with inspect's "what you could save" -----------------------
def sparse_bytes(numel: int, zeros: int, itemsize: float) -> int:
    """Bitmask (one bit per element) plus the non-zero values."""
    return math.ceil(numel / 8) + math.ceil((numel - zeros) * itemsize)


def _sparse_pays(numel: int, zeros: int, itemsize: int) -> bool:
    return numel * itemsize - sparse_bytes(numel, zeros, itemsize) >= SPARSE_MIN_SAVING


def lossless_bytes(numel: int, zeros: int, itemsize: int, sparse: bool = True) -> int:
    """A tensor stored exactly: dense, or sparse where that is smaller."""
    dense = numel * itemsize
    return sparse_bytes(numel, zeros, itemsize) if sparse and _sparse_pays(numel, zeros, itemsize) else dense


def int8_bytes(shape: Sequence[int], zeros: int, sparse: bool = True) -> int:
    """int8 codes (sparse where that is smaller) plus a float32 scale per output channel."""
    rows = shape[0] if len(shape) >= 2 else 1
    return lossless_bytes(math.prod(shape), zeros, 1, sparse) + 4 * rows


def int4_bytes(numel: int, zeros: int, group_size: int, sparse: bool = True) -> int:
    """int4 (float16 scale and zero point per group), after sparse where that saves
    :data:`SPARSE_MIN_SAVING` bytes."""
    dense = _int4_bytes(numel, group_size)
    packed = math.ceil(numel / 8) + _int4_bytes(numel - zeros, group_size)
    return packed if sparse and dense - packed >= SPARSE_MIN_SAVING else dense


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
