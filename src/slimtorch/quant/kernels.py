"""The matrix kernels behind quantized layers, and which one runs fastest on this machine, found by timing.

Every kernel of a scheme computes the same thing, so the choice changes speed, not results:

- ``int8-dynamic``: each row of the input is quantized to int8 on the fly (symmetric, its own scale), the
  product is accumulated exactly in int32, and the result is scaled back per row and per output channel.
  ``onednn`` runs it through oneDNN's int8 matmul (VNNI / AMX where the CPU has them) on a weight packed
  once; ``int_mm`` through ``torch._int_mm``. Both give bit-identical outputs.
- ``int8-weight`` and ``int4-weight``: the weight is dequantized in the input's dtype and multiplied.
  ``dequantize`` does that in two steps (any device, any dtype); ``int8pack`` / ``int4pack`` are torch's
  fused weight-only kernels (``_weight_int8pack_mm``, ``_weight_int4pack_mm_for_cpu``), fast for bfloat16
  inputs and small batches, slow for float32.

:class:`KernelChoice` times each candidate on the real input the first time a layer shape meets a batch
size (rounded up to a power of two), checks that it agrees with the reference kernel, and remembers the
fastest; later calls look it up. Nothing is assumed about the CPU: a kernel that fails or disagrees here
is simply never chosen.

Under ``torch.compile`` a layer is one opaque operator, ``slimtorch::quantized_layer`` (``quantized_rnn``
for an LSTM / GRU): its real kernel runs this eager path, timing and cached packed weights included, and a
fake kernel gives dynamo the output's shape. The in-graph alternatives measured slower compiled on the
benchmark's 4096 x 11008 layer: ``torch._int_mm`` 2.3x slower than oneDNN at batch 8, the int4 weight
dequantized by inductor tens of times slower than ``int4pack-bf16``, and inductor cannot lower
``_weight_int8pack_mm`` on an input it casts to bfloat16.
"""

from __future__ import annotations

import functools
import itertools
import math
import threading
import time
import weakref
from collections.abc import Callable, Hashable, Mapping
from typing import Any, Protocol

import torch

FALLBACKS = ("dequantize",)
"""References that are real contenders; others (float64 ``reference``) only check the rest and run when
nothing else does."""
ROW_OFFSET = 128.5  # codes + 128 as uint8, +0.5 so that truncating rounds to nearest
TRIALS = 3
AGREEMENT = 1e-3  # relative L2 error a candidate may have against the reference kernel
BF16_AGREEMENT = 1e-2  # for candidates that compute a float32 product in bfloat16
_TINY = torch.finfo(torch.float32).tiny
_OFFSET = torch.tensor(ROW_OFFSET)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of a float matrix as uint8 codes ``round(x / scale) + 128`` and their float32 scales (M, 1).

    Symmetric per row: ``scale = max|row| / 127``. Adding 128.5 and truncating rounds to nearest (ties
    up) in two passes over the input, where ``round`` then ``to`` would take three.
    """
    x = x.float()
    # max and min in two reads beat abs().amax(), which writes a temporary as large as x
    largest = torch.maximum(x.amax(dim=1, keepdim=True), x.amin(dim=1, keepdim=True).neg_())
    scale = largest.div_(127).clamp_(min=_TINY)
    return torch.addcmul(_OFFSET, x, scale.reciprocal()).to(torch.uint8), scale


class SharedInputCodes:
    """The last input's row codes, per thread: attention's query, key and value layers read the same
    tensor, which is then quantized once instead of three times.

    An entry holds the input itself, so its memory cannot be reused for another tensor while cached, and
    its version counter, so an in-place change is seen. Inference-mode tensors have no version counter
    and are never cached.
    """

    def __init__(self) -> None:
        self._local = threading.local()

    def codes(self, x: torch.Tensor, x2d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if x.is_inference():
            return quantize_rows(x2d)
        last = getattr(self._local, "last", None)
        if last is not None and last[0] is x and last[1] == x._version and last[2].shape[1] == x2d.shape[1]:
            return last[2], last[3]
        codes, scale = quantize_rows(x2d)
        self._local.last = (x, x._version, codes, scale)
        return codes, scale

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


def onednn_int8_linear(
    codes: torch.Tensor,
    row_scale: torch.Tensor,
    packed: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    # oneDNN takes unsigned activations with one zero point: the +128 codes with zero point 128 are the
    # signed values exactly. Its per-channel weight scale is applied inside; the per-row scale after.
    zero_points = _zero_points(weight_scale.shape[0])
    product = torch.ops.onednn.qlinear_pointwise(
        codes, 1.0, 128, packed, weight_scale, zero_points, None, 1.0, 0, torch.float32, "none", [], ""
    )
    return scale_back(product, row_scale, bias)


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
    signed = codes.bitwise_xor(128).view(torch.int8)  # +128 codes back to signed ones, bit for bit
    product = torch.mul(torch._int_mm(signed, qweight.t()), weight_scale)
    return scale_back(product, row_scale, bias)


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


def int4pack_weight(packed_codes: torch.Tensor, in_features: int) -> torch.Tensor:
    """Codes packed two per byte (low nibble first) as the (out, in/2) layout ``_weight_int4pack_mm_for_cpu``
    takes (it packs them the other way round)."""
    codes = torch.stack((packed_codes & 15, packed_codes >> 4), dim=2).reshape(packed_codes.shape[0], -1)
    return torch._convert_weight_to_int4pack_for_cpu(codes[:, :in_features].to(torch.int32).contiguous(), 1)


# -- choosing ---------------------------------------------------------------------------------------------
class KernelChoice:
    """Which kernel is fastest for a layer shape and batch size, measured on first use and remembered.

    One instance is shared by every quantized layer of the process (:data:`CHOICES`), so twelve layers of
    the same shape are timed once. ``clear()`` forgets what was measured (after changing
    ``torch.set_num_threads``, the key already tells them apart).
    """

    def __init__(self) -> None:
        self._best: dict[Hashable, str] = {}
        self._lock = threading.Lock()

    def best(
        self,
        key: Hashable,
        candidates: Mapping[str, Callable[[], torch.Tensor]],
        reference: str,
        tolerance: Mapping[str, float] | None = None,
    ) -> str:
        """The name of the fastest candidate that agrees with ``reference`` (timed once per key): within
        ``tolerance[name]`` (default :data:`AGREEMENT`) relative L2 error of its output."""
        name = self._best.get(key)
        if name is not None:
            return name
        with self._lock:
            name = self._best.get(key) or _fastest(candidates, reference, tolerance or {})
            self._best[key] = name
        return name

    def measured(self) -> dict[Hashable, str]:
        return dict(self._best)

    def clear(self) -> None:
        self._best.clear()


CHOICES = KernelChoice()


def batch_bucket(rows: int) -> int:
    """Batch sizes timed together: 1, 2, 4, 8 ... (a 100-row batch runs what 128 rows measured fastest)."""
    return 1 << max(0, math.ceil(math.log2(max(rows, 1))))


def _fastest(
    candidates: Mapping[str, Callable[[], torch.Tensor]], reference: str, tolerance: Mapping[str, float]
) -> str:
    """The fastest candidate (best of :data:`TRIALS` runs) among those that agree with the reference.

    The runs are taken in turns, one of each candidate per round, so that a busy moment of the machine
    slows them alike instead of the one that happened to be timed then."""
    expected = candidates[reference]().float()
    norm = float(torch.linalg.vector_norm(expected))
    agreeing: list[str] = []
    for name, run in candidates.items():
        if name == reference:
            continue
        try:
            out = run()
            limit = tolerance.get(name, AGREEMENT) * max(norm, 1e-12)
            if out.shape != expected.shape or float(torch.linalg.vector_norm(out.float() - expected)) > limit:
                continue  # a kernel that disagrees on this machine is never chosen
            agreeing.append(name)
        except (RuntimeError, NotImplementedError):
            continue  # not available for this shape, dtype or build
    if reference in FALLBACKS or not agreeing:
        agreeing.append(reference)
    timings = dict.fromkeys(agreeing, math.inf)
    for _ in range(TRIALS):
        for name in agreeing:
            timings[name] = min(timings[name], _timed(candidates[name]))
    return min(timings, key=timings.__getitem__)


def _timed(run: Callable[[], torch.Tensor]) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


# -- torch.compile -----------------------------------------------------------------------------------------
class CompiledLayer(Protocol):
    """What the compiled operators call back into: the layer's eager forward and its output's shape."""

    def eager_forward(self, *args: Any) -> Any: ...

    def fake_forward(self, *args: Any) -> Any: ...


_LAYERS: weakref.WeakValueDictionary[int, CompiledLayer] = weakref.WeakValueDictionary()
_HANDLES = itertools.count()


def compile_handle(layer: CompiledLayer) -> int:
    """A number naming ``layer`` inside a compiled graph (an operator takes tensors and numbers, not
    modules); held weakly, so a graph never keeps a layer alive. Each copy of a layer gets its own."""
    handle = next(_HANDLES)
    _LAYERS[handle] = layer
    return handle


@torch.library.custom_op("slimtorch::quantized_layer", mutates_args=())
def quantized_layer(x: torch.Tensor, layer: int) -> torch.Tensor:
    """A quantized Linear or convolution, as ``torch.compile`` sees it: its eager forward, run as is.

    Outputs are made contiguous, as the fake kernel promises (a no-op unless a kernel returned a view)."""
    return _LAYERS[layer].eager_forward(x).contiguous()


@quantized_layer.register_fake
def _quantized_layer_shape(x: torch.Tensor, layer: int) -> torch.Tensor:
    return _LAYERS[layer].fake_forward(x).contiguous()


@torch.library.custom_op("slimtorch::quantized_rnn", mutates_args=())
def quantized_rnn(x: torch.Tensor, hx: list[torch.Tensor], layer: int) -> list[torch.Tensor]:
    """A quantized LSTM / GRU as ``torch.compile`` sees it: output, then ``h`` (and ``c``), flat."""
    return [t.contiguous() for t in _LAYERS[layer].eager_forward(x, hx)]  # batch_first outputs are views


@quantized_rnn.register_fake
def _quantized_rnn_shapes(x: torch.Tensor, hx: list[torch.Tensor], layer: int) -> list[torch.Tensor]:
    return _LAYERS[layer].fake_forward(x, hx)
