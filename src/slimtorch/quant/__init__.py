"""Quantization that is fast on CPU and stays quantized on disk.

- :func:`quantize` / :func:`quantize_with_report`: swap ``nn.Linear`` and ``nn.Embedding`` layers (and
  convolutions, for the weight-only schemes) for quantized ones (``int8-dynamic``, ``int8-weight``,
  ``int4-weight``).
- :mod:`slimtorch.quant.modules`: the quantized layers; their buffers are the slim format's codec parts.
- :mod:`slimtorch.quant.kernels`: the int8 / int4 kernels, and the fastest one here, found by timing.
"""

from slimtorch.quant.build import SCHEMES
from slimtorch.quant.conv import Int4WeightConv, Int8WeightConv
from slimtorch.quant.convert import (
    LayerResult,
    QuantizeReport,
    dequantize,
    model_bytes,
    quantize,
    quantize_with_report,
)
from slimtorch.quant.kernels import CHOICES
from slimtorch.quant.modules import (
    Int4Embedding,
    Int4WeightLinear,
    Int8DynamicLinear,
    Int8Embedding,
    Int8WeightLinear,
    QuantizedWeight,
)

__all__ = [
    "CHOICES",
    "SCHEMES",
    "Int4Embedding",
    "Int4WeightConv",
    "Int4WeightLinear",
    "Int8DynamicLinear",
    "Int8Embedding",
    "Int8WeightConv",
    "Int8WeightLinear",
    "LayerResult",
    "QuantizeReport",
    "QuantizedWeight",
    "dequantize",
    "model_bytes",
    "quantize",
    "quantize_with_report",
]
