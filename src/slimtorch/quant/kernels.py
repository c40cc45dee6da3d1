"""The matrix kernels behind quantized layers, and which one runs fastest on this machine, found by timing.

The kernels of a scheme compute the same product up to the activation codes they take:

- ``int8-dynamic``: each row of the input is quantized to int8 on the fly (symmetric, its own scale), the
  product is accumulated exactly in int32, and the result is scaled back per row and per output channel.
  ``onednn`` runs it through oneDNN's int8 matmul (VNNI / AMX where the CPU has them) on a weight packed
  once; ``int_mm`` through ``torch._int_mm``; ``reference`` in float64. The three give the same outputs.
  Where oneDNN's 8-bit product saturates (CPUs without VNNI: :func:`onednn_exact`), ``onednn-u7`` takes
  7-bit asymmetric codes per row instead (:data:`slimtorch.quant.rowcodes.CODES`), exact there, its
  outputs within the accuracy rule (:data:`ACCURACY_FACTOR`) of the 8-bit ones.
- ``int8-weight`` and ``int4-weight``: the weight is dequantized in the input's dtype and multiplied.
  ``dequantize`` does that in two steps (any device, any dtype); ``int8pack`` / ``int4pack`` are torch's
  fused weight-only kernels (``_weight_int8pack_mm``, ``_weight_int4pack_mm_for_cpu``), fast for bfloat16
  inputs and small batches, slow for float32.

:class:`KernelChoice` times each candidate on the real input the first time a layer shape meets a batch
size (rounded up to a power of two), checks that it agrees with the reference kernel (for int8-dynamic: its
error against the float product, at most :data:`ACCURACY_FACTOR` times the reference's), and remembers
the fastest; later calls look it up. Nothing is assumed about the CPU: a kernel that fails or disagrees
here is never chosen, and the decision says why (:attr:`KernelDecision.refused`).

Under ``torch.compile`` a layer is one opaque operator, ``slimtorch::quantized_layer`` (``quantized_rnn``
for an LSTM / GRU): its real kernel runs this eager path, timing and cached packed weights included, and a
fake kernel gives dynamo the output's shape. The in-graph alternatives measured slower compiled on the
benchmark's 4096 x 11008 layer: ``torch._int_mm`` 2.3x slower than oneDNN at batch 8, the int4 weight
dequantized by inductor tens of times slower than ``int4pack-bf16``, and inductor cannot lower
``_weight_int8pack_mm`` on an input it casts to bfloat16. One exception: in a graph whose batch size is
fixed, an int8-dynamic Linear is traced around the kernel chosen for that size (its rows quantized by the
operator ``slimtorch::quantize_rows``, then ``torch._int_mm`` or ``slimtorch::onednn_product``, the
scaling left to inductor to fuse into what follows; see
:meth:`slimtorch.quant.modules.Int8DynamicLinear.compiled_forward`).
"""

from __future__ import annotations

import functools
import itertools
import math
import statistics
import threading
import time
import weakref
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import torch

from slimtorch.quant import rowcodes

FALLBACKS = ("dequantize", "reference")
"""References that are real contenders: a quantized kernel is chosen only if it beats them (by
:data:`FALLBACK_MARGIN`). On an AVX2 EPYC ``torch._int_mm`` took 73 ms on 128 rows of a 384x1536 layer,
the float64 reference 5.3: a kernel is there to be faster, and is timed against the path it replaces
(torch.ao's, the other peer, in ``benchmarks/int8_latency.py``)."""
TRIALS = 3
AGREEMENT = 1e-3  # relative L2 error a candidate may have against the reference kernel
BF16_AGREEMENT = 1e-2  # for candidates that compute a float32 product in bfloat16
ACCURACY_FACTOR = 3.0
"""Where a choice knows the float product (an int8-dynamic layer: the input times the dequantized
weight), a kernel is admitted if its error against it is at most this many times the reference's: the
reference computes the scheme exactly (8-bit codes per row), a kernel with coarser activation codes errs
more. Measured on a 384x1536 MiniLM-shaped layer, 128 rows, relative to the reference's error: 7-bit codes
per row 1.9x, torch.ao's 7-bit codes per tensor 2.6x (4-7x on MiniLM's real activations), oneDNN's 8-bit
product saturating on an AVX2 CPU without VNNI 19x."""
SLOW = 4.0  # a candidate this many times slower than the fastest in the first round is timed no more
_TINY = torch.finfo(torch.float32).tiny


def quantize_rows(x: torch.Tensor, codes: str = "uint8") -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of a float matrix as activation codes of the kind a kernel takes (:data:`rowcodes.CODES`:
    ``uint8``, ``round(x / scale) + 128``; ``int8``, the same bits but the top one, as ``torch._int_mm``
    takes them; ``uint7``, ``round(x / scale) + 64`` with half the levels) and their float32 scales (M, 1).

    Symmetric per row: ``scale = max|row| / levels``, rounded half to even. With numba installed one fused
    pass computes them (:mod:`slimtorch.quant.rowcodes`, the same bits, several times faster); otherwise,
    or where it does not apply, :func:`quantize_rows_torch`.
    """
    x = x.float()
    fused = rowcodes.quantize_rows_fused(x, codes)
    return fused if fused is not None else quantize_rows_torch(x, codes)


def quantize_rows_torch(x: torch.Tensor, codes: str = "uint8") -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_rows` in torch operations, for any input.

    The codes are rounded in float, cast to int8 and moved up by their offset on their bytes: torch casts
    float to int8 with vector instructions but float to uint8 element by element, 3 to 4 times slower (as
    slow as the rest of this together). The rows are multiplied by the scales' reciprocals: a division runs
    at half the speed.
    """
    offset, levels = rowcodes.CODES[codes]
    x = x.float()
    if codes in rowcodes.ASYMMETRIC:
        return _asymmetric_rows(x, levels)
    # max and min in two reads beat abs().amax(), which writes a temporary as large as x
    largest = torch.maximum(x.amax(dim=1, keepdim=True), x.amin(dim=1, keepdim=True).neg_())
    scale = largest.div_(levels).clamp_(min=_TINY)
    values = torch.mul(x, scale.reciprocal()).round_().to(torch.int8)  # within [-levels, levels]: exact
    if offset:
        return values.view(torch.uint8).bitwise_xor_(128), scale  # +128 is the top bit flipped
    return values, scale


def _asymmetric_rows(x: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``uint7`` codes (:data:`rowcodes.CODES`) and each row's ``(scale, scale * zero)``, (M, 2)."""
    low = x.amin(dim=1, keepdim=True).clamp_(max=0) if x.shape[1] else x.new_zeros(x.shape[0], 1)
    high = x.amax(dim=1, keepdim=True).clamp_(min=0) if x.shape[1] else x.new_zeros(x.shape[0], 1)
    scale = (high - low).div_(levels).clamp_(min=_TINY)
    inverse = scale.reciprocal()
    zero = torch.mul(low, inverse).neg_().round_()
    values = torch.mul(x, inverse).round_().add_(zero).clamp_(0, levels).to(torch.uint8)
    return values, torch.cat((scale, scale * zero), dim=1)


def shift_back(
    product: torch.Tensor, params: torch.Tensor, weight_sums: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """The product of ``uint7`` codes (zero point 0, scaled per output channel) back to the layer's output:
    ``product * scale - shift * weight_sums + bias`` per row, where ``weight_sums`` are the weight's scaled
    row sums, so that the rows' zero points come off in one rank-one term. In place."""
    fused = rowcodes.shift_product_fused(product, params, weight_sums, bias)
    if fused is not None:
        return fused
    product.mul_(params[:, :1]).sub_(params[:, 1:] * weight_sums)
    return product if bias is None else product.add_(bias)


def shift_epilogue(
    weight_sums: torch.Tensor, bias: torch.Tensor | None
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """:func:`shift_back` for one layer, prepared once (its weight sums and bias held as numba reads
    them): a call ``(product, params) -> output``, in place."""
    fused = rowcodes.shift_epilogue(weight_sums, bias)

    def shift(product: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
        done = None if fused is None else fused(product, params)
        if done is not None:
            return done
        product.mul_(params[:, :1]).sub_(params[:, 1:] * weight_sums)
        return product if bias is None else product.add_(bias)

    return shift


def split_epilogue(
    codes: str, weight_sums: torch.Tensor | None, bias: torch.Tensor | None, widths: list[int]
) -> Callable[[torch.Tensor, torch.Tensor], list[torch.Tensor]]:
    """The epilogue of several layers whose products were made as one, their columns side by side
    (``widths`` each): a call ``(product, row parameters) -> [each layer's output]``, the same floats
    each layer's own epilogue gives (:func:`scale_back`; :func:`shift_epilogue` for ``uint7`` codes,
    with the layers' scaled weight sums side by side), in place, each output a view of its columns
    (rows ``sum(widths)`` apart: what attention's reshapes and Llama's MLP take as they are).
    ``bias``: the layers' biases side by side."""
    bounds = list(itertools.accumulate(widths, initial=0))
    slices = [slice(start, end) for start, end in itertools.pairwise(bounds)]
    if codes in rowcodes.ASYMMETRIC:
        assert weight_sums is not None
        epilogue = shift_epilogue(weight_sums, bias)
    else:

        def epilogue(product: torch.Tensor, row_scale: torch.Tensor) -> torch.Tensor:
            return scale_back(product, row_scale, bias)

    def split(product: torch.Tensor, params: torch.Tensor) -> list[torch.Tensor]:
        out = epilogue(product, params)
        return [out[:, columns] for columns in slices]

    return split


class SharedInputCodes:
    """The last input's row codes, per thread: attention's query, key and value layers read the same
    tensor, which is then quantized once instead of three times.

    An entry holds the input itself, so its memory cannot be reused for another tensor while cached, and
    its version counter, so an in-place change is seen. Inference-mode tensors have no version counter:
    their codes are shared only inside a scope (:meth:`open`), one call of a module known to change no
    tensor in place while its layers run (:func:`slimtorch.quant.sharing.share_input_codes` sets those
    scopes up), and forgotten when it closes. Each kind of codes (see :func:`quantize_rows`) is an entry
    of its own.
    """

    def __init__(self) -> None:
        self._local = threading.local()

    def codes(
        self, x: torch.Tensor, x2d: torch.Tensor, codes: str = "uint8"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        local = self._local
        if not x.is_inference():
            version = x._version
        elif getattr(local, "depth", 0):
            version = -1  # no counter; the open scope vouches that nothing changes x in place
        else:
            return quantize_rows(x2d, codes)
        last = getattr(local, "last", None)
        if (
            last is not None
            and last[0] is x
            and last[1] == version
            and last[2] == codes
            and last[3].shape[1] == x2d.shape[1]
        ):
            return last[3], last[4]
        values, scale = quantize_rows(x2d, codes)
        local.last = (x, version, codes, values, scale)
        return values, scale

    def open(self) -> None:
        """Enter a scope in which inference-mode inputs share codes too (scopes nest)."""
        self._local.depth = getattr(self._local, "depth", 0) + 1

    def close(self) -> None:
        """Leave the innermost scope, forgetting what was cached: outside it, the input may change."""
        self._local.depth = max(getattr(self._local, "depth", 0) - 1, 0)
        self._local.last = None

    def clear(self) -> None:
        self._local.last = None


SHARED_INPUTS = SharedInputCodes()


def scale_back(product: torch.Tensor, row_scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``product * row_scale + bias`` in place, in one pass (``product`` is float32, already per-column)."""
    if bias is None:
        return product.mul_(row_scale)
    return torch.addcmul(bias, product, row_scale, out=product)


# -- int8 x int8 ------------------------------------------------------------------------------------------
def onednn_available() -> bool:
    return hasattr(torch.ops, "onednn") and hasattr(torch.ops.onednn, "qlinear_pointwise")


def onednn_pack(qweight: torch.Tensor) -> torch.Tensor:
    """The int8 weight (out, in) in oneDNN's blocked layout, packed once per layer."""
    return torch.ops.onednn.qlinear_prepack(qweight, None)


def onednn_product(
    codes: torch.Tensor, packed: torch.Tensor, weight_scale: torch.Tensor, zero_point: int = 128
) -> torch.Tensor:
    """The product of ``codes`` and the packed weight, scaled per output channel, not yet per row
    (:func:`scale_back` does that, and adds the bias; for ``uint7`` codes, zero point 0,
    :func:`shift_back`)."""
    # oneDNN takes unsigned activations with one zero point: the +128 codes with zero point 128 are the
    # signed values exactly. Its per-channel weight scale is applied inside; the per-row scale after.
    zero_points = _zero_points(weight_scale.shape[0])
    return torch.ops.onednn.qlinear_pointwise(
        codes, 1.0, zero_point, packed, weight_scale, zero_points, None, 1.0, 0, torch.float32, "none", [], ""
    )


def onednn_runner(
    packed: torch.Tensor,
    weight_scale: torch.Tensor,
    zero_point: int,
    epilogue: Callable[[torch.Tensor, torch.Tensor], Any],
) -> Callable[[torch.Tensor, torch.Tensor], Any]:
    """:func:`onednn_product` then ``epilogue(product, row parameters)`` for one packed weight, as one
    call bound once: at batch 1 a layer's call is a few dozen microseconds of Python around the product,
    and the operator's lookup and arguments are a part of that."""
    operator = torch.ops.onednn.qlinear_pointwise.default
    zero_points = _zero_points(weight_scale.shape[0])

    def run(codes: torch.Tensor, params: torch.Tensor) -> Any:
        product = operator(
            codes,
            1.0,
            zero_point,
            packed,
            weight_scale,
            zero_points,
            None,
            1.0,
            0,
            torch.float32,
            "none",
            [],
            "",
        )
        return epilogue(product, params)

    return run


@functools.cache
def onednn_exact(codes: str) -> bool:
    """Whether oneDNN's int8 product is exact on this CPU for activation codes of that kind (``uint8``:
    up to 255, zero point 128; ``uint7``: up to 127, zero point 0), probed once a process on the worst
    case: every code at its top, every weight 127.

    Without VNNI, oneDNN (like fbgemm) multiplies bytes with ``vpmaddubsw``, which adds each pair of
    products into a saturating int16: codes up to 255 overflow it (on an AVX2 EPYC the product of a real
    MiniLM layer came out at cosine 0.990 against the float layer), codes up to 127 cannot."""
    if not onednn_available():
        return False
    top, zero_point = {"uint8": (255, 128), "uint7": (127, 0)}[codes]
    width = 256
    try:
        weight = torch.full((8, width), 127, dtype=torch.int8)
        values = torch.full((4, width), top, dtype=torch.uint8)
        product = onednn_product(values, onednn_pack(weight), torch.ones(8), zero_point)
    except (RuntimeError, NotImplementedError):
        return False
    return bool(torch.all(product == float((top - zero_point) * 127 * width)))


@functools.lru_cache(maxsize=256)
def _zero_points(n: int) -> torch.Tensor:
    """The weight zero points oneDNN asks for: all zero (the weight codes are symmetric), made once."""
    return torch.zeros(n, dtype=torch.int32)


def int_mm_int8_linear(
    codes: torch.Tensor,
    row_scale: torch.Tensor,
    qweight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """The product through ``torch._int_mm``, from signed codes (``quantize_rows(x, signed=True)``: turning
    +128 codes into them costs as much as a third of the product at batch 1)."""
    product = torch._int_mm(codes, qweight.t())
    fused = rowcodes.scale_product_fused(product, weight_scale, row_scale, bias)
    return fused if fused is not None else scale_back(torch.mul(product, weight_scale), row_scale, bias)


def reference_int8_linear(
    codes: torch.Tensor,
    row_scale: torch.Tensor,
    qweight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """The same product in float64, exact for any size: what the other kernels are checked against."""
    product = (codes.double() - 128) @ qweight.double().t()
    return scale_back(product.float().mul_(weight_scale), row_scale, bias)


# -- weight-only ----------------------------------------------------------------------------------------
ALIGNMENT = 64  # torch's own allocations are 64-byte aligned; its fused weight-only kernels assume it


def aligned(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, or a contiguous copy if its data does not start on a 64-byte boundary.

    The bfloat16 ``_weight_int8pack_mm`` uses aligned vector loads: on a weight mapped from a file, where
    safetensors aligns data to 8 bytes only, it crashes the process instead of raising.
    """
    if tensor.is_contiguous() and tensor.data_ptr() % ALIGNMENT == 0:
        return tensor
    copy = torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device)
    return copy.copy_(tensor)


def int4pack_scales(scale: torch.Tensor, zero: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Our int4 ``code * scale + zero`` as the fused kernel's ``(code - 8) * scale + zero'``, laid out as
    (groups, out, 2)."""
    shifted = zero.float() + 8 * scale.float()
    return torch.stack((scale.float(), shifted), dim=2).transpose(0, 1).contiguous().to(dtype)


PACK_BLOCK = 4 << 20
"""Codes converted to ``_weight_int4pack_mm_for_cpu``'s layout at a time (:func:`int4pack_weight`), so that
the conversion's temporaries are a block's (torch's own conversion takes int32, 4 bytes a code: a Llama
head of 131M codes converted whole took 655 MiB for a moment). 32000x4096 codes: 86 ms in blocks of 4M,
100 in blocks of 1M or of 16M."""

INT4PACK_LAYOUTS = {"halves-32": (32, True), "halves-64": (64, True), "pairs-32": (32, False)}
"""How ``_convert_weight_to_int4pack_for_cpu`` lays out a block of output rows, one per CPU build of the
kernel: name -> (rows a block packs, whether a byte pairs row ``i`` with row ``i + rows/2`` of the block
(else rows ``2i`` and ``2i + 1``)); each block stored input column by input column, the first row of a
pair in the low nibble. Seen here: ``halves-32`` on AVX2, ``pairs-32`` on the default build; AVX-512's
is tried as ``halves-64``. Which one this process's kernel uses is found by converting a probe
(:func:`int4pack_layout`): a layout that matches none leaves the conversion to torch."""


@functools.cache
def int4pack_layout() -> str | None:
    """The :data:`INT4PACK_LAYOUTS` entry that reproduces torch's conversion here, byte for byte, on random
    codes (None: none does; :func:`int4pack_weight` then calls torch's conversion)."""
    packed = torch.randint(0, 256, (192, 128), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    expected = torch._convert_weight_to_int4pack_for_cpu(_unpacked_int32(packed), 1)
    for name in INT4PACK_LAYOUTS:
        if torch.equal(_int4pack_as(name, packed), expected):
            return name
    return None


def _unpacked_int32(packed_codes: torch.Tensor) -> torch.Tensor:
    """Codes packed two per byte, low nibble first, one per int32 (what torch's conversion takes)."""
    codes = torch.empty(packed_codes.shape[0], 2 * packed_codes.shape[1], dtype=torch.int32)
    codes[:, 0::2] = packed_codes & 15  # not torch.stack: 20 times slower on bytes
    codes[:, 1::2] = packed_codes >> 4
    return codes


def _int4pack_as(layout: str, packed_codes: torch.Tensor, into: torch.Tensor | None = None) -> torch.Tensor:
    """Codes packed two per byte along the input (rows a multiple of the layout's block) in ``layout``,
    straight from byte to byte: the code of input column ``2j`` is byte ``j``'s low nibble, of ``2j + 1``
    its high one, so each output byte is two nibbles of two rows' byte ``j``. 8x faster than unpacking to
    int32 for torch's conversion (11008x4096 through :func:`int4pack_weight`: 17 ms against 146), in a
    quarter of the memory. Written into ``into`` (contiguous, the same shape) when given."""
    block, halves = INT4PACK_LAYOUTS[layout]
    rows, half = packed_codes.shape
    if halves:
        first, second = packed_codes.view(rows // block, 2, block // 2, half).unbind(1)
    else:
        first, second = packed_codes.view(rows // block, block // 2, 2, half).unbind(2)
    out = torch.empty(rows, half, dtype=torch.uint8) if into is None else into
    out = out.view(rows // block, half, 2, block // 2)
    out[:, :, 0] = ((first & 15) | (second << 4)).transpose(1, 2)  # input column 2j
    out[:, :, 1] = ((first >> 4) | (second & 0xF0)).transpose(1, 2)  # input column 2j + 1
    return out.view(rows, half)


def int4pack_weight(
    packed_codes: torch.Tensor, in_features: int, packed: Callable[[torch.Tensor], Any] | None = None
) -> torch.Tensor:
    """Codes packed two per byte (low nibble first) as the (out, in/2) layout ``_weight_int4pack_mm_for_cpu``
    takes, converted a block of rows at a time (a multiple of 64 rows, which every layout packs
    independently: a test holds it to the whole conversion), by :func:`int4pack_layout`'s byte-wide
    passes where one matches this process's kernel, else by torch's conversion. ``packed`` is called with
    each block of ``packed_codes`` once it is converted (a caller gives its pages back)."""
    rows = packed_codes.shape[0]
    layout = int4pack_layout() if in_features == 2 * packed_codes.shape[1] else None
    if layout is not None and rows % INT4PACK_LAYOUTS[layout][0]:
        layout = None
    step = max(64, PACK_BLOCK // max(in_features, 1) // 64 * 64)
    out = torch.empty(rows, in_features // 2, dtype=torch.uint8)
    for start in range(0, rows, step):
        block = packed_codes[start : start + step]
        if layout is not None:
            _int4pack_as(layout, block, into=out[start : start + step])
        else:
            wide = _unpacked_int32(block)[:, :in_features].contiguous()
            out[start : start + step] = torch._convert_weight_to_int4pack_for_cpu(wide, 1)
        if packed is not None:
            packed(block)
    return out


# -- choosing ---------------------------------------------------------------------------------------------
FALLBACK_MARGIN = 1.15
"""How many times faster than every other candidate a fallback (:data:`FALLBACKS`, the float path) must
run to be chosen. A quantized kernel is there to be the faster one: a close call goes to it, and a busy
spell of the machine that slows it while the fallback runs must not hand the layer to the float path."""
CLOSE = 1.25  # a lead (after the margin) below this is a close call
NOISY = 0.25  # a candidate whose median round is this much above its best one was timed on a busy machine
CONFIRM_TRIALS = 8  # rounds a fallback must lead for before it wins, when timings allow that many
MAX_TRIALS = 16
ROUNDS_BUDGET_S = 2.0  # no round past the first TRIALS starts once the rounds have taken this long


@dataclass(frozen=True)
class KernelDecision:
    """What one kernel choice measured: the kernel chosen, each timed candidate's best round (seconds), and
    the rounds taken (0 when one candidate was left and nothing was timed)."""

    kernel: str
    seconds: dict[str, float]
    rounds: int
    refused: dict[str, str] = field(default_factory=dict)
    """The candidates not admitted on this machine, and why (``"error 19.3x the reference's"``)."""

    @property
    def ratio(self) -> float:
        """How many times faster the chosen kernel ran than the fastest other one: 1.0 when it ran alone,
        below 1 when a fallback was faster by less than :data:`FALLBACK_MARGIN`."""
        others = [t for name, t in self.seconds.items() if name != self.kernel]
        return min(others) / self.seconds[self.kernel] if others else 1.0

    def describe(self) -> str:
        """``quantized_rnn, 4.81x dequantize (3 rounds)``: the choice and the measurement behind it."""
        others = [n for n in self.seconds if n != self.kernel]
        if not others:
            said = f"{self.kernel} (the only candidate that agreed)"
        else:
            runner_up = min(others, key=self.seconds.__getitem__)
            said = f"{self.kernel}, {self.ratio:.2f}x {runner_up} ({self.rounds} rounds)"
        refused = "; ".join(f"{name} refused: {why}" for name, why in self.refused.items())
        return f"{said}; {refused}" if refused else said

    def to_dict(self) -> dict[str, Any]:
        return {
            "kernel": self.kernel,
            "seconds": dict(self.seconds),
            "rounds": self.rounds,
            "ratio": self.ratio,
            "refused": dict(self.refused),
        }


class KernelChoice:
    """Which kernel is fastest for a layer shape and batch size, measured on first use and remembered.

    One instance is shared by every quantized layer of the process (:data:`CHOICES`), so twelve layers of
    the same shape are timed once. ``clear()`` forgets what was measured (after changing
    ``torch.set_num_threads``, the key already tells them apart). ``clock`` is what the runs are timed
    with (tests pass a fake one).
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._best: dict[Hashable, str] = {}
        self._decisions: dict[Hashable, KernelDecision] = {}
        self._lock = threading.Lock()
        self._clock = clock

    def best(
        self,
        key: Hashable,
        candidates: Mapping[str, Callable[[], torch.Tensor]],
        reference: str,
        tolerance: Mapping[str, float] | None = None,
        truth: Callable[[], torch.Tensor] | None = None,
    ) -> str:
        """The name of the fastest candidate that agrees with ``reference`` (timed once per key): within
        ``tolerance[name]`` (default :data:`AGREEMENT`) relative L2 error of its output; or, given the
        float product ``truth``, within :data:`ACCURACY_FACTOR` times the reference's error of it."""
        name = self._best.get(key)
        if name is not None:
            return name
        with self._lock:
            name = self._best.get(key)
            if name is None:
                decision = _fastest(candidates, reference, tolerance or {}, self._clock, truth)
                self._decisions[key], name = decision, decision.kernel
                self._best[key] = name
        return name

    def known(self, key: Hashable) -> bool:
        """Whether ``key`` has its kernel already (timed, or set by hand)."""
        return key in self._best

    def measured(self) -> dict[Hashable, str]:
        return dict(self._best)

    def decisions(self) -> dict[Hashable, KernelDecision]:
        """What each timed choice measured (not the choices set by hand), by key.

        Example:
            >>> [d.describe() for d in CHOICES.decisions().values()]  # doctest: +SKIP
            ['quantized_rnn, 4.81x dequantize (3 rounds)']
        """
        return dict(self._decisions)

    def clear(self) -> None:
        self._best.clear()
        self._decisions.clear()


CHOICES = KernelChoice()


def batch_bucket(rows: int) -> int:
    """Batch sizes timed together: 1, 2, 4, 8 ... (a 100-row batch runs what 128 rows measured fastest)."""
    return 1 << max(0, math.ceil(math.log2(max(rows, 1))))


def _fastest(
    candidates: Mapping[str, Callable[[], torch.Tensor]],
    reference: str,
    tolerance: Mapping[str, float],
    clock: Callable[[], float] = time.perf_counter,
    truth: Callable[[], torch.Tensor] | None = None,
) -> KernelDecision:
    """The fastest candidate among those that agree with the reference, by each one's best round.

    The runs are taken in turns, one of each candidate per round, so that a busy moment of the machine
    slows them alike instead of the one that happened to be timed then. :data:`TRIALS` rounds decide a
    clear lead on quiet timings; a close call on noisy ones, or a fallback ahead, takes more (see
    :func:`_settled`), up to :data:`MAX_TRIALS` rounds or :data:`ROUNDS_BUDGET_S`. A candidate
    :data:`SLOW` times slower than the fastest in the first round is timed no more."""
    agreeing, refused = _agreeing(candidates, reference, tolerance, truth)
    if len(agreeing) == 1:
        return KernelDecision(agreeing[0], {}, 0, refused)
    times: dict[str, list[float]] = {name: [] for name in agreeing}
    spent = 0.0
    for done in range(1, MAX_TRIALS + 1):
        for name in times:
            times[name].append(_timed(candidates[name], clock))
        spent += sum(t[-1] for t in times.values())
        if done == 1:
            fastest = min(t[0] for t in times.values())
            lagging = [name for name, t in times.items() if t[0] > SLOW * fastest]
            finished = {name: times.pop(name) for name in lagging}
        if done >= TRIALS and (_settled(times, done) or spent >= ROUNDS_BUDGET_S):
            break
    best = {name: min(t) for name, t in {**finished, **times}.items()}
    return KernelDecision(_leader({name: min(t) for name, t in times.items()})[0], best, done, refused)


def _agreeing(
    candidates: Mapping[str, Callable[[], torch.Tensor]],
    reference: str,
    tolerance: Mapping[str, float],
    truth: Callable[[], torch.Tensor] | None = None,
) -> tuple[list[str], dict[str, str]]:
    """The candidates admitted on this input (the reference too when it is a real contender, or when
    nothing else agrees), and why each other one was not. Without ``truth``, a candidate must be within
    tolerance of the reference's output; with it (the float product), its error against that must be at
    most :data:`ACCURACY_FACTOR` times the reference's."""
    expected = candidates[reference]().float()
    if truth is None:
        target, allowed = expected, None
    else:
        target = truth().float()
        allowed = ACCURACY_FACTOR * float(torch.linalg.vector_norm(expected - target))
    norm = max(float(torch.linalg.vector_norm(target)), 1e-12)
    agreeing: list[str] = []
    refused: dict[str, str] = {}
    for name, run in candidates.items():
        if name == reference:
            continue
        try:
            out = run()
        except (RuntimeError, NotImplementedError) as failure:
            first = str(failure).splitlines()[0][:80] if str(failure) else "error"
            refused[name] = f"cannot run here ({first})"
            continue
        if out.shape != expected.shape:
            refused[name] = f"gave shape {tuple(out.shape)}, not {tuple(expected.shape)}"
            continue
        error = float(torch.linalg.vector_norm(out.float() - target))
        limit = tolerance.get(name, AGREEMENT) * norm if allowed is None else allowed + AGREEMENT * norm
        if not error <= limit:  # nan too: a kernel that is wrong on this machine is never chosen
            refused[name] = _why_refused(error, norm, allowed)
            continue
        agreeing.append(name)
    if reference in FALLBACKS or not agreeing:
        agreeing.append(reference)
    return agreeing, refused


def _why_refused(error: float, norm: float, allowed: float | None) -> str:
    if allowed is None:
        return f"{error / norm:.2g} relative error against the reference"
    times = f"{error / allowed * ACCURACY_FACTOR:.1f}x" if allowed > 0 else "above"
    return f"error {error / norm:.2g} against the float product, {times} the reference's"


def _leader(best: Mapping[str, float]) -> tuple[str, float]:
    """The candidate with the least time, a fallback's counted :data:`FALLBACK_MARGIN` times longer, and
    its lead: the runner-up's counted time over its own."""
    counted = {name: t * (FALLBACK_MARGIN if name in FALLBACKS else 1.0) for name, t in best.items()}
    first, *rest = sorted(counted, key=counted.__getitem__)
    lead = min(counted[name] for name in rest) / max(counted[first], 1e-12) if rest else math.inf
    return first, lead


def _settled(times: Mapping[str, list[float]], rounds: int) -> bool:
    """Whether the rounds so far decide the choice. A busy machine shows as a candidate whose typical
    round is well above its best; a neighbour's spike can slow a quantized kernel's few rounds several
    times over (it makes several threads wait on one), so a fallback ahead must lead clearly, on quiet
    timings, for :data:`CONFIRM_TRIALS` rounds. A quantized kernel ahead needs a clear lead or quiet
    timings: noise that slowed the fallback only strengthens the preference the margin states anyway."""
    leader, lead = _leader({name: min(t) for name, t in times.items()})
    noisy = any(statistics.median(t) > (1 + NOISY) * min(t) for t in times.values())
    if leader in FALLBACKS:
        return lead >= CLOSE and not noisy and rounds >= CONFIRM_TRIALS
    return lead >= CLOSE or not noisy


def in_turn(make: Callable[[], list[Callable[[], torch.Tensor]]]) -> Callable[[], torch.Tensor]:
    """One candidate for :meth:`KernelChoice.best` that runs the calls ``make()`` returns one after the
    other, a call each time it is run, ``make`` called on its first run only (a shape timed already by
    another layer runs nothing).

    Example:
        >>> run = in_turn(lambda: [lambda: torch.zeros(1), lambda: torch.ones(1)])
        >>> [float(run()) for _ in range(3)]
        [0.0, 1.0, 0.0]
    """
    calls: list[Callable[[], torch.Tensor]] = []
    turns = itertools.count()

    def run() -> torch.Tensor:
        if not calls:
            calls.extend(make())
        return calls[next(turns) % len(calls)]()

    return run


def _timed(run: Callable[[], torch.Tensor], clock: Callable[[], float] = time.perf_counter) -> float:
    start = clock()
    run()
    return clock() - start


# -- torch.compile -----------------------------------------------------------------------------------------
class CompiledLayer(Protocol):
    """What the compiled operators call back into: the layer's eager forward and its output's shape."""

    def eager_forward(self, *args: Any) -> Any: ...

    def fake_forward(self, *args: Any) -> Any: ...


class ProductLayer(CompiledLayer, Protocol):
    """What ``slimtorch::onednn_product`` calls back into: an int8-dynamic Linear's oneDNN product."""

    out_features: int

    def onednn_product(self, codes: torch.Tensor, zero_point: int = 128) -> torch.Tensor: ...


_LAYERS: weakref.WeakValueDictionary[int, CompiledLayer] = weakref.WeakValueDictionary()
_HANDLES = itertools.count()


def compile_handle(layer: CompiledLayer) -> int:
    """A number naming ``layer`` inside a compiled graph (an operator takes tensors and numbers, not
    modules); held weakly, so a graph never keeps a layer alive. Each copy of a layer gets its own."""
    handle = next(_HANDLES)
    _LAYERS[handle] = layer
    return handle


def compiled_layer(handle: int) -> Any:
    """The layer :func:`compile_handle` named ``handle``."""
    return _LAYERS[handle]


@torch.library.custom_op("slimtorch::quantized_layer", mutates_args=())
def quantized_layer(x: torch.Tensor, layer: int) -> torch.Tensor:
    """A quantized Linear or convolution, as ``torch.compile`` sees it: its eager forward, run as is.

    Outputs are made contiguous, as the fake kernel promises (a no-op unless a kernel returned a view).
    No input codes are shared from one call to the next (:data:`SHARED_INPUTS` is emptied around each):
    inductor writes a later value into a dead input's buffer in place, which bumps no version counter, so
    the next layer's input can be the same tensor, at the same version, holding other numbers."""
    SHARED_INPUTS.clear()
    try:
        return _LAYERS[layer].eager_forward(x).contiguous()
    finally:
        SHARED_INPUTS.clear()


@quantized_layer.register_fake
def _quantized_layer_shape(x: torch.Tensor, layer: int) -> torch.Tensor:
    return _LAYERS[layer].fake_forward(x).contiguous()


def _quantize_rows_op(x: torch.Tensor, codes: str) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_rows` as one operator of a compiled graph: numba's one pass, where inductor's own
    would fuse it into the op before and compute that op twice (a GELU's ``erf`` for the row maxima, then
    again for the codes: 253 us on MiniLM's 128 x 1536 rows, against 53 for the GELU alone).

    Declared with :class:`torch.library.Library`, not ``custom_op``: it is called per layer per forward,
    and ``custom_op``'s Python wrapper costs 3-6 us a call more (MiniLM: 24 calls a forward)."""
    return quantize_rows(x, codes)


def _quantize_rows_shapes(x: torch.Tensor, codes: str) -> tuple[torch.Tensor, torch.Tensor]:
    values = x.new_empty(x.shape, dtype=torch.int8 if codes == "int8" else torch.uint8)
    return values, x.new_empty((x.shape[0], 1), dtype=torch.float32)


def _onednn_product_op(codes: torch.Tensor, layer: int, zero_point: int) -> torch.Tensor:
    """:func:`onednn_product` of an int8-dynamic layer, as one operator of a compiled graph."""
    # ``layer`` is the handle of the int8-dynamic Linear whose traced graph calls this (the only layer
    # that does): an int in the graph, it cannot carry that type
    return cast(ProductLayer, _LAYERS[layer]).onednn_product(codes, zero_point)


def _onednn_product_shape(codes: torch.Tensor, layer: int, zero_point: int) -> torch.Tensor:
    rows, columns = codes.shape[0], cast(ProductLayer, _LAYERS[layer]).out_features  # as above
    return codes.new_empty((rows, columns), dtype=torch.float32)


_LIBRARY = torch.library.Library("slimtorch", "FRAGMENT")
_LIBRARY.define("quantize_rows(Tensor x, str codes) -> (Tensor, Tensor)")
_LIBRARY.impl("quantize_rows", _quantize_rows_op, "CompositeExplicitAutograd")
torch.library.register_fake("slimtorch::quantize_rows", _quantize_rows_shapes, lib=_LIBRARY)
_LIBRARY.define("onednn_product(Tensor codes, int layer, int zero_point) -> Tensor")
_LIBRARY.impl("onednn_product", _onednn_product_op, "CompositeExplicitAutograd")
torch.library.register_fake("slimtorch::onednn_product", _onednn_product_shape, lib=_LIBRARY)
quantize_rows_op = torch.ops.slimtorch.quantize_rows.default
onednn_product_op = torch.ops.slimtorch.onednn_product.default


@torch.library.custom_op("slimtorch::quantized_rnn", mutates_args=())
def quantized_rnn(x: torch.Tensor, hx: list[torch.Tensor], layer: int) -> list[torch.Tensor]:
    """A quantized LSTM / GRU as ``torch.compile`` sees it: output, then ``h`` (and ``c``), flat."""
    return [t.contiguous() for t in _LAYERS[layer].eager_forward(x, hx)]  # batch_first outputs are views


@quantized_rnn.register_fake
def _quantized_rnn_shapes(x: torch.Tensor, hx: list[torch.Tensor], layer: int) -> list[torch.Tensor]:
    return _LAYERS[layer].fake_forward(x, hx)
