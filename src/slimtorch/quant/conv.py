"""Convolutions with int8 or int4 weights (weight-only): the weight dequantized on each call, then the
float convolution, in the input's dtype or in bfloat16 where that is faster (see
:meth:`~slimtorch.quant.modules.QuantizedWeight.weight_only`).

The weight of ``nn.Conv2d`` (out, in / groups, kh, kw) is coded like any other: one int8 scale per output
channel, or int4 groups along each output channel's ``in / groups * kh * kw`` values.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from slimtorch.format.codecs import Encoded
from slimtorch.quant.modules import INT4_PARTS, INT8_PARTS, QuantizedWeight

CONVOLVE = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
FLOAT = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}
SETTINGS = ("in_channels", "out_channels", "kernel_size", "stride", "padding", "dilation", "groups")


class _QuantizedConv(QuantizedWeight):
    KERNELS = ("dequantize", "dequantize-bf16")
    REFERENCE = "dequantize"

    def __init__(self, conv: nn.Module, bias: torch.Tensor | None, encoded: Encoded) -> None:
        super().__init__()
        for name in SETTINGS:
            setattr(self, name, getattr(conv, name))
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self._init_parts(encoded.parts, encoded.stages[0])

    def extra_repr(self) -> str:
        return ", ".join(f"{name}={getattr(self, name)}" for name in SETTINGS)

    def float_module(self) -> nn.Module:
        settings = {name: getattr(self, name) for name in SETTINGS}
        conv = FLOAT[len(self.kernel_size)](**settings, bias=self.bias is not None, device="meta")
        conv.weight = nn.Parameter(self.dequantized(), requires_grad=False)
        if self.bias is not None:
            conv.bias = nn.Parameter(self.bias.detach().clone(), requires_grad=False)
        return conv

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        convolve = CONVOLVE[len(self.kernel_size)]
        if torch.compiler.is_exporting():  # the codes stay in the program, dequantized in its graph
            bias = None if self.bias is None else self.bias.to(x.dtype)
            weight = self.dequantized(x.dtype)
            return convolve(x, weight, bias, self.stride, self.padding, self.dilation, self.groups)
        if torch.compiler.is_compiling():
            return self.compiled_forward(x)
        return self.eager_forward(x)

    def fake_forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = x.new_empty(self.stage["shape"])  # a fake tensor: only the output's shape is computed
        convolve = CONVOLVE[len(self.kernel_size)]
        return convolve(x, weight, None, self.stride, self.padding, self.dilation, self.groups)

    def eager_forward(self, x: torch.Tensor) -> torch.Tensor:
        convolve = CONVOLVE[len(self.kernel_size)]

        def plain(dtype: torch.dtype) -> torch.Tensor:
            bias = None if self.bias is None else self.bias.to(dtype)
            weight = self.dequantized(dtype)
            out = convolve(x.to(dtype), weight, bias, self.stride, self.padding, self.dilation, self.groups)
            return out.to(x.dtype)

        with torch.no_grad():  # inference only, like every quantized layer
            return self.weight_only(x, plain)


class Int8WeightConv(_QuantizedConv):
    """``nn.Conv1d/2d/3d`` with int8 weights, one scale per output channel."""

    SCHEME = "int8-weight"
    SLIM_PARTS = INT8_PARTS


class Int4WeightConv(_QuantizedConv):
    """``nn.Conv1d/2d/3d`` with 4-bit weights in groups along each output channel."""

    SCHEME = "int4-weight"
    SLIM_PARTS = INT4_PARTS


def quantizable_conv(module: nn.Module) -> bool:
    """``nn.Conv1d/2d/3d`` themselves (not transposed), zero-padded: what these layers reproduce."""
    return type(module) in (nn.Conv1d, nn.Conv2d, nn.Conv3d) and module.padding_mode == "zeros"
