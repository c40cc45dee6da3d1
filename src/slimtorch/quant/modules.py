"""Quantized layers whose buffers are the slim format's codec parts, so they save and load as they are.

A quantized layer keeps its weight as the parts the ``int8`` or ``int4`` codec writes (codes, scales,
zero points) in buffers, and knows the codec stage that made them. :func:`slimtorch.save_model` stores
them as the coded tensor ``<layer>.weight`` (any slim reader decodes it to the float weight), and
:func:`slimtorch.load_model` maps them back into the layer's buffers: no dequantize, no re-quantize.

``SLIM_PARTS`` tells the loader which buffer holds which part: ``{"qweight": ("weight", "q"), ...}``.

Layers: :class:`Int8DynamicLinear` (int8 weights and activations), :class:`Int8WeightLinear` and
:class:`Int4WeightLinear` (weight-only, computed in the input's dtype), :class:`Int8Embedding` and
:class:`Int4Embedding` (rows dequantized as they are looked up). They are for inference: nothing in
them trains: they compute without autograd, so no gradient flows through them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import Any, ClassVar

import torch
from torch import nn
from torch.nn import functional as F

from slimtorch.graph.layers import is_hf_conv1d
from slimtorch.io.codecs import Encoded, encode
from slimtorch.io.codecs.chain import parse_dtype
from slimtorch.io.codecs.lossy import INT4, INT8
from slimtorch.io.source import dtype_name
from slimtorch.quant import kernels
from slimtorch.quant.gptq import gptq_int4
from slimtorch.quant.kernels import BF16_AGREEMENT, CHOICES


class QuantizedWeight(nn.Module):
    """What every quantized layer shares: codec parts as buffers, the stage that made them, a kernel."""

    SCHEME: ClassVar[str]
    SLIM_PARTS: ClassVar[dict[str, tuple[str, str]]]
    KERNELS: ClassVar[tuple[str, ...]] = ()
    REFERENCE: ClassVar[str] = ""

    stage: dict[str, Any]
    kernel: str | None
    """A kernel forced by the user (None: the fastest measured here)."""

    def _init_parts(self, parts: dict[str, torch.Tensor], stage: dict[str, Any]) -> None:
        for attr, (_, role) in self.SLIM_PARTS.items():
            self.register_buffer(attr, parts[role].contiguous())  # kernels and the writer read it flat
        self.stage = stage
        self.kernel = None
        # (kernel, variant) -> (what it was made from, packed state); kept for the kernels chosen here
        self._prepared: dict[tuple[str, str], tuple[Any, Any]] = {}
        self._chosen: set[str] = set()

    @property
    def weight_dtype(self) -> torch.dtype:
        """The dtype of the float weight these parts encode (what a slim reader decodes them to)."""
        return parse_dtype(self.stage["dtype"])

    def parts(self) -> dict[str, torch.Tensor]:
        return {role: getattr(self, attr) for attr, (_, role) in self.SLIM_PARTS.items()}

    def encoded(self) -> Encoded:
        """The weight as the slim writer stores it: these parts under the codec stage that made them."""
        return Encoded(self.parts(), [dict(self.stage)])

    def dequantized(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The float weight the parts encode, in ``dtype`` (default: the original weight's dtype)."""
        codec = INT8 if self.stage["codec"] == "int8" else INT4
        parts = {role: t for role, t in self.parts().items()}
        primary = parts.pop(codec.primary)
        stage = {**self.stage, "dtype": dtype_name(dtype or self.weight_dtype)}
        return codec.decode(primary, parts, stage)

    def prepared(self, kernel: str, make: Callable[[], Any], variant: str = "") -> Any:
        """State ``kernel`` builds once from the buffers (a packed weight), rebuilt if the buffers change."""
        source = tuple((t.data_ptr(), t._version) for t in self.parts().values())
        made = self._prepared.get((kernel, variant))
        if made is None or made[0] != source:
            made = self._prepared[kernel, variant] = (source, make())
        return made[1]

    def run(
        self,
        x2d: torch.Tensor,
        candidates: dict[str, Callable[[], torch.Tensor]],
        tolerance: dict[str, float] | None = None,
    ) -> torch.Tensor:
        """Run the forced kernel, or the one measured fastest for this shape and batch size (among those
        within ``tolerance``, relative L2, of the reference). A forced kernel that cannot run this input
        (a ``-bf16`` one on bfloat16 inputs, a fused one on a shape it does not take) gives way to its
        plain twin, else to the reference."""
        name = self.kernel
        if name is not None and name not in candidates:
            name = name.removesuffix("-bf16") if name.removesuffix("-bf16") in candidates else self.REFERENCE
        if name is None:
            key = (
                type(self).__name__,
                tuple(self.stage["shape"]),
                self.stage.get("group_size"),
                kernels.batch_bucket(x2d.shape[0]),
                x2d.dtype,
                x2d.device.type,
                torch.get_num_threads(),
            )
            name = CHOICES.best(key, candidates, self.REFERENCE, tolerance or {})
            if name not in self._chosen:
                self._chosen.add(name)
                for unused in [k for k in self._prepared if k[0] not in self._chosen]:
                    del self._prepared[unused]  # a packed copy of a kernel that lost is only memory
        return candidates[name]()

    def __getstate__(self) -> dict[str, Any]:
        # Packed weights are a cache (and oneDNN's cannot be copied): copies rebuild them on first use.
        state = self.__dict__.copy()
        state["_prepared"], state["_chosen"] = {}, set()
        return state


# -- Linear ----------------------------------------------------------------------------------------------
class _QuantizedLinear(QuantizedWeight):
    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None, encoded: Encoded):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self._init_parts(encoded.parts, encoded.stages[0])

    def extra_repr(self) -> str:
        group = f", group_size={self.stage['group_size']}" if "group_size" in self.stage else ""
        return f"in_features={self.in_features}, out_features={self.out_features}{group}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():  # inference only: int8 codes have no gradient
            out = self._matmul(x, x.reshape(-1, self.in_features))
        return out.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def _matmul(self, x: torch.Tensor, x2d: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class Int8DynamicLinear(_QuantizedLinear):
    """``nn.Linear`` with int8 weights (one scale per output channel) and int8 activations quantized per
    row on each call; the product is exact in int32. The fastest kernel on this machine is chosen."""

    SCHEME = "int8-dynamic"
    SLIM_PARTS: ClassVar = {"qweight": ("weight", "q"), "weight_scale": ("weight", "scale")}
    KERNELS = ("onednn", "int_mm", "reference")
    REFERENCE = "reference"

    def _matmul(self, x: torch.Tensor, x2d: torch.Tensor) -> torch.Tensor:
        codes, row_scale = kernels.SHARED_INPUTS.codes(x, x2d)
        q, scale, bias = self.qweight, self.weight_scale, self.bias
        candidates: dict[str, Callable[[], torch.Tensor]] = {
            "reference": lambda: kernels.reference_int8_linear(codes, row_scale, q, scale, bias),
            "int_mm": lambda: kernels.int_mm_int8_linear(codes, row_scale, q, scale, bias),
        }
        if x2d.device.type == "cpu" and kernels.onednn_available():
            candidates["onednn"] = lambda: kernels.onednn_int8_linear(
                codes, row_scale, self.prepared("onednn", lambda: kernels.onednn_pack(q)), scale, bias
            )
        return self.run(x2d, candidates)


class _WeightOnlyLinear(_QuantizedLinear):
    """Weight-only layers: float activations times dequantized weights, by one of four kernels.

    ``dequantize`` (the weight dequantized, then ``F.linear``) or the fused kernel, each in the input's
    dtype, and, for float32 inputs on the CPU, the same two computed in bfloat16 (``-bf16``): where the
    CPU multiplies bfloat16 natively they are several times faster, and their extra error, at most
    :data:`BF16_AGREEMENT` of the output (checked when they are chosen), is below the weights' own.
    """

    REFERENCE = "dequantize"
    FUSED: ClassVar[str]

    def _matmul(self, x: torch.Tensor, x2d: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x2d.dtype)
        dtypes = {"": x2d.dtype}
        if x2d.dtype == torch.float32 and x2d.device.type == "cpu":
            dtypes["-bf16"] = torch.bfloat16
        candidates: dict[str, Callable[[], torch.Tensor]] = {}
        for suffix, dtype in dtypes.items():
            candidates["dequantize" + suffix] = partial(self._dequantize_linear, x2d, dtype, bias)
            if x2d.device.type == "cpu" and self._fused_fits():
                candidates[self.FUSED + suffix] = partial(self._fused_linear, x2d, dtype, bias)
        half = x2d.dtype in (torch.bfloat16, torch.float16)  # products that round like bfloat16 ones
        tolerance = {name: BF16_AGREEMENT for name in candidates if half or name.endswith("-bf16")}
        return self.run(x2d, candidates, tolerance)

    def _dequantize_linear(self, x2d: torch.Tensor, dtype: torch.dtype, bias: torch.Tensor | None):
        return _plus(F.linear(x2d.to(dtype), self.dequantized(dtype)).to(x2d.dtype), bias)

    def _fused_linear(self, x2d: torch.Tensor, dtype: torch.dtype, bias: torch.Tensor | None):
        return _plus(self._fused(kernels.aligned(x2d.to(dtype)), dtype).to(x2d.dtype), bias)

    def _fused_fits(self) -> bool:
        return True

    def _fused(self, x2d: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError


class Int8WeightLinear(_WeightOnlyLinear):
    """``nn.Linear`` with int8 weights (one scale per output channel) and float activations."""

    SCHEME = "int8-weight"
    SLIM_PARTS: ClassVar = {"qweight": ("weight", "q"), "weight_scale": ("weight", "scale")}
    KERNELS = ("dequantize", "int8pack", "dequantize-bf16", "int8pack-bf16")
    FUSED = "int8pack"

    def _fused(self, x2d: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        weight = self.prepared("int8pack", lambda: kernels.aligned(self.qweight))
        scale = self.prepared("int8pack", lambda: self.weight_scale.to(dtype), variant=str(dtype))
        return torch._weight_int8pack_mm(x2d, weight, scale)


class Int4WeightLinear(_WeightOnlyLinear):
    """``nn.Linear`` with 4-bit weights, a scale and a zero point per group of ``group_size`` inputs of each
    output channel, and float activations."""

    SCHEME = "int4-weight"
    SLIM_PARTS: ClassVar = {
        "qweight": ("weight", "q4"),
        "weight_scale": ("weight", "scale"),
        "weight_zero": ("weight", "zero"),
    }
    KERNELS = ("dequantize", "int4pack", "dequantize-bf16", "int4pack-bf16")
    FUSED = "int4pack"

    def _fused_fits(self) -> bool:
        return self.in_features % self.stage["group_size"] == 0

    def _fused(self, x2d: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        packed = self.prepared("int4pack", lambda: kernels.int4pack_weight(self.qweight, self.in_features))
        scales = self.prepared(
            "int4pack",
            lambda: kernels.int4pack_scales(self.weight_scale, self.weight_zero, dtype),
            variant=str(dtype),
        )
        return torch._weight_int4pack_mm_for_cpu(x2d, packed, self.stage["group_size"], scales)


def _plus(out: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return out if bias is None else out.add_(bias)


# -- Embedding ------------------------------------------------------------------------------------------
class _QuantizedEmbedding(QuantizedWeight):
    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None, encoded: Encoded):
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.padding_idx = num_embeddings, embedding_dim, padding_idx
        self._init_parts(encoded.parts, encoded.stages[0])

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}"

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self._rows(ids.reshape(-1)).reshape(*ids.shape, self.embedding_dim)


class Int8Embedding(_QuantizedEmbedding):
    """``nn.Embedding`` with int8 rows, one scale each; only the rows looked up are dequantized."""

    SCHEME = "int8"
    SLIM_PARTS: ClassVar = {"qweight": ("weight", "q"), "weight_scale": ("weight", "scale")}

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.qweight[ids].to(self.weight_dtype)
        return rows.mul_(self.weight_scale[ids].to(self.weight_dtype).unsqueeze(1))


class Int4Embedding(_QuantizedEmbedding):
    """``nn.Embedding`` with 4-bit rows in groups; only the rows looked up are dequantized."""

    SCHEME = "int4"
    SLIM_PARTS: ClassVar = {
        "qweight": ("weight", "q4"),
        "weight_scale": ("weight", "scale"),
        "weight_zero": ("weight", "zero"),
    }

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        stage = {**self.stage, "shape": [ids.numel(), self.embedding_dim]}
        parts = {"scale": self.weight_scale[ids], "zero": self.weight_zero[ids]}
        return INT4.decode(self.qweight[ids], parts, stage)


# -- building ---------------------------------------------------------------------------------------------
LINEAR = {cls.SCHEME: cls for cls in (Int8DynamicLinear, Int8WeightLinear, Int4WeightLinear)}
EMBEDDING = {"int8-dynamic": Int8Embedding, "int8-weight": Int8Embedding, "int4-weight": Int4Embedding}
SCHEMES = tuple(LINEAR)
QUANTIZED = (*LINEAR.values(), Int8Embedding, Int4Embedding)


def codec_chain(scheme: str, group_size: int) -> list:
    """The codec stage a scheme's weights go through (int4 groups follow rows, as its kernels want)."""
    return ["int8"] if scheme.startswith("int8") else [("int4", {"group_size": group_size, "flat": False})]


def quantized_from(
    module: nn.Module, scheme: str, group_size: int, hessian: torch.Tensor | None = None
) -> QuantizedWeight:
    """The quantized twin of an ``nn.Linear`` or ``nn.Embedding``, its weight encoded by the codecs; with
    the layer's input moments ``hessian``, int4 codes are chosen by GPTQ instead of rounding."""
    weight = float_weight(module).detach()
    encoded = None
    if hessian is not None and scheme == "int4-weight":
        encoded = gptq_int4(weight, hessian, group_size)
    encoded = encoded or encode(weight, codec_chain(scheme, group_size))
    return _build(module, scheme, encoded)


def quantized_on_meta(module: nn.Module, scheme: str, group_size: int, dtype: torch.dtype) -> QuantizedWeight:
    """The same layer with empty parts on the meta device, for :func:`slimtorch.load_model` to fill."""
    shape = list(float_weight_shape(module))
    rows, cols = shape[0], math.prod(shape[1:])
    stage: dict[str, Any] = {"dtype": dtype_name(dtype), "shape": shape}
    if scheme.startswith("int8"):
        stage = {"codec": "int8", **stage}
        parts = {"q": _meta(shape, torch.int8), "scale": _meta([rows], torch.float32)}
    else:
        stage = {"codec": "int4", **stage, "group_size": group_size, "flat": False}
        groups = -(-cols // group_size)
        parts = {
            "q4": _meta([rows, groups * group_size // 2], torch.uint8),
            "scale": _meta([rows, groups], torch.float16),
            "zero": _meta([rows, groups], torch.float16),
        }
    return _build(module, scheme, Encoded(parts, [stage]))


def _meta(shape: list[int], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


def float_weight(module: nn.Module) -> torch.Tensor:
    """The weight as (out, in): Hugging Face's ``Conv1D`` (GPT-2) stores it transposed."""
    return module.weight.t() if is_hf_conv1d(module) else module.weight


def float_weight_shape(module: nn.Module) -> tuple[int, ...]:
    return tuple(float_weight(module).shape)


def _build(module: nn.Module, scheme: str, encoded: Encoded) -> QuantizedWeight:
    if isinstance(module, nn.Embedding):
        return EMBEDDING[scheme](module.num_embeddings, module.embedding_dim, module.padding_idx, encoded)
    bias = module.bias if isinstance(module.bias, torch.Tensor) else None
    out_features, in_features = float_weight_shape(module)
    return LINEAR[scheme](in_features, out_features, bias, encoded)
