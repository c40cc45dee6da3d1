"""Building quantized layers: from a float layer (its weight encoded by the codecs, or by GPTQ), or empty
on the meta device for :func:`slimtorch.load_model` to fill; the registries of layer classes by scheme.
LSTM and GRU layers are in :mod:`slimtorch.quant.recurrent`."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from slimtorch.format.codecs import Encoded, encode
from slimtorch.format.source import dtype_name
from slimtorch.graph.layers import is_hf_conv1d
from slimtorch.quant.conv import Int4WeightConv, Int8WeightConv, quantizable_conv
from slimtorch.quant.gptq import gptq_int4
from slimtorch.quant.modules import (
    Int4Embedding,
    Int4WeightLinear,
    Int8DynamicLinear,
    Int8Embedding,
    Int8WeightLinear,
    QuantizedWeight,
)
from slimtorch.quant.recurrent import RECURRENT_LAYERS, encode_matrices, is_recurrent

LINEAR = {cls.SCHEME: cls for cls in (Int8DynamicLinear, Int8WeightLinear, Int4WeightLinear)}
EMBEDDING = {"int8-dynamic": Int8Embedding, "int8-weight": Int8Embedding, "int4-weight": Int4Embedding}
CONV = {cls.SCHEME: cls for cls in (Int8WeightConv, Int4WeightConv)}
SCHEMES = tuple(LINEAR)


INT4_GRIDS = ("", "symmetric", "integer_zero")
"""Where int4 groups put their zero points: anywhere (the slim layout), at code 8 (``symmetric``), or on a
code of each group's own (``integer_zero``): the last two are what compressed-tensors reads as stored."""


def codec_chain(scheme: str, group_size: int, grid: str = "") -> list:
    """The codec stage a scheme's weights go through (int4 groups follow rows, as its kernels want;
    ``grid``: one of :data:`INT4_GRIDS`)."""
    if scheme.startswith("int8"):
        return ["int8"]
    return [("int4", {"group_size": group_size, "flat": False, **({grid: True} if grid else {})})]


def quantized_from(
    module: nn.Module,
    scheme: str,
    group_size: int,
    hessian: torch.Tensor | None = None,
    matrices: Sequence[str] = (),
    grid: str = "",
) -> QuantizedWeight:
    """The quantized twin of an ``nn.Linear``, ``nn.Embedding`` or convolution, its weight encoded by the
    codecs; with the layer's input moments ``hessian``, int4 codes are chosen by GPTQ instead of
    rounding. An ``nn.LSTM`` / ``nn.GRU`` has the ``matrices`` named coded, the others kept float.
    ``grid`` puts int4 zero points where a Hugging Face folder's int4 needs them (:data:`INT4_GRIDS`)."""
    chain = codec_chain(scheme, group_size, grid)
    if is_recurrent(module):
        coded = encode_matrices(module, matrices, scheme, chain)
        return RECURRENT_LAYERS[scheme](module, coded)
    weight = float_weight(module).detach()
    encoded = None
    if hessian is not None and scheme == "int4-weight":
        encoded = gptq_int4(weight, hessian, group_size, grid)
    encoded = encoded or encode(weight, chain)
    return _build(module, scheme, encoded)


def quantized_on_meta(
    module: nn.Module, scheme: str, group_size: int, dtype: torch.dtype, matrices: Sequence[str] = ()
) -> QuantizedWeight:
    """The same layer with empty parts on the meta device, for :func:`slimtorch.load_model` to fill."""
    if is_recurrent(module):
        shapes = {name: list(getattr(module, name).shape) for name in matrices}
        coded = {name: _meta_encoded(shape, scheme, group_size, dtype) for name, shape in shapes.items()}
        return RECURRENT_LAYERS[scheme](module, coded)
    return _build(module, scheme, _meta_encoded(list(float_weight_shape(module)), scheme, group_size, dtype))


def _meta_encoded(shape: list[int], scheme: str, group_size: int, dtype: torch.dtype) -> Encoded:
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
    return Encoded(parts, [stage])


def _meta(shape: list[int], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


def float_weight(module: nn.Module) -> torch.Tensor:
    """The weight as (out, in): Hugging Face's ``Conv1D`` (GPT-2) stores it transposed."""
    return module.weight.t() if is_hf_conv1d(module) else module.weight


def float_weight_shape(module: nn.Module) -> tuple[int, ...]:
    return tuple(float_weight(module).shape)


def _build(module: nn.Module, scheme: str, encoded: Encoded) -> QuantizedWeight:
    if quantizable_conv(module):
        return CONV[scheme](module, module.bias, encoded)
    if isinstance(module, nn.Embedding):
        return EMBEDDING[scheme](module.num_embeddings, module.embedding_dim, module.padding_idx, encoded)
    bias = module.bias if isinstance(module.bias, torch.Tensor) else None
    out_features, in_features = float_weight_shape(module)
    return LINEAR[scheme](in_features, out_features, bias, encoded)
