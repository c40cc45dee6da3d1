"""Building quantized layers: from a float layer (its weight encoded by the codecs, or by GPTQ), or empty
on the meta device for :func:`slimtorch.load_model` to fill; each scheme's layer classes, as its row in
:mod:`slimtorch.schemes` names them. LSTM and GRU layers are in :mod:`slimtorch.quant.recurrent`."""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from slimtorch.format.codecs import Encoded, encode
from slimtorch.format.codecs.lossy import encoded_on_meta
from slimtorch.graph.layers import is_hf_conv1d
from slimtorch.quant.conv import quantizable_conv
from slimtorch.quant.gptq import gptq_int4
from slimtorch.quant.modules import QuantizedWeight
from slimtorch.quant.recurrent import encode_matrices, is_recurrent
from slimtorch.schemes import scheme as scheme_row


@functools.cache
def layer_class(scheme: str, kind: str) -> type[QuantizedWeight]:
    """The class that quantizes float layers of ``kind`` under ``scheme`` (:data:`slimtorch.schemes.ROWS`
    names it by dotted path); a kind the scheme leaves float is a ``KeyError``."""
    module, _, name = scheme_row(scheme).layers[kind].partition(":")
    found = getattr(importlib.import_module(module), name)
    if not (isinstance(found, type) and issubclass(found, QuantizedWeight)):
        raise TypeError(f"scheme {scheme}: {kind} layers' class {module}:{name} is not a QuantizedWeight")
    return found


INT4_GRIDS = ("", "symmetric", "integer_zero")
"""Where int4 groups put their zero points: anywhere (the slim layout), at code 8 (``symmetric``), or on a
code of each group's own (``integer_zero``): the last two are what compressed-tensors reads as stored."""


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
    row = scheme_row(scheme)
    chain = row.codec_chain(group_size, grid)
    if is_recurrent(module):
        coded = encode_matrices(module, matrices, scheme, chain)
        return _built(scheme, "recurrent", module, coded)
    weight = float_weight(module).detach()
    encoded = None
    if hessian is not None and row.codec == "int4":
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
        return _built(scheme, "recurrent", module, coded)
    return _build(module, scheme, _meta_encoded(list(float_weight_shape(module)), scheme, group_size, dtype))


def _meta_encoded(shape: list[int], scheme: str, group_size: int, dtype: torch.dtype) -> Encoded:
    """The parts the scheme's codec stage makes from a weight of ``shape``, empty, as the codec says."""
    (stage,) = scheme_row(scheme).codec_chain(group_size)
    return encoded_on_meta(stage, shape, dtype)


def float_weight(module: nn.Module) -> torch.Tensor:
    """The weight as (out, in): Hugging Face's ``Conv1D`` (GPT-2) stores it transposed."""
    weight = module.weight
    if not isinstance(weight, torch.Tensor):  # the targets are layers whose weight is a tensor
        raise TypeError(f"{type(module).__name__}.weight is a {type(weight).__name__}, not a tensor")
    return weight.t() if is_hf_conv1d(module) else weight


def float_weight_shape(module: nn.Module) -> tuple[int, ...]:
    return tuple(float_weight(module).shape)


def _build(module: nn.Module, scheme: str, encoded: Encoded) -> QuantizedWeight:
    if quantizable_conv(module):
        return _built(scheme, "conv", module, module.bias, encoded)
    if isinstance(module, nn.Embedding):
        size = (module.num_embeddings, module.embedding_dim, module.padding_idx)
        return _built(scheme, "embedding", *size, encoded)
    bias = module.bias if isinstance(module.bias, torch.Tensor) else None
    out_features, in_features = float_weight_shape(module)
    return _built(scheme, "linear", in_features, out_features, bias, encoded)


def _built(scheme: str, kind: str, *args: Any) -> QuantizedWeight:
    """A layer of ``kind`` under ``scheme``, from the arguments every class of that kind takes (a type
    checker cannot see them through the table: they differ by kind, not by scheme)."""
    make: Callable[..., QuantizedWeight] = layer_class(scheme, kind)
    return make(*args)
