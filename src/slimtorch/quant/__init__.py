"""Quantization that is fast on CPU and stays quantized on disk.

- :func:`quantize` (``model, QuantizeOptions | scheme, **overrides -> QuantizeReport``): swap
  ``nn.Linear``, ``nn.Embedding``, ``nn.LSTM`` and ``nn.GRU`` layers (and convolutions, for the weight-only
  schemes) for quantized ones (``int8-dynamic``, ``int8-weight``, ``int4-weight``) in place, keeping float
  the few whose error would dominate; the report holds the model and lists every layer left float with the
  reason.
- :mod:`slimtorch.quant.modules`, :mod:`slimtorch.quant.recurrent`: the quantized layers; their buffers
  are the slim format's codec parts.
- :mod:`slimtorch.quant.kernels`: the int8 / int4 kernels, and the fastest one here, found by timing.
"""

from slimtorch.quant.conv import Int4WeightConv, Int8WeightConv
from slimtorch.quant.convert import (
    LayerResult,
    QuantizeReport,
    dequantize,
    model_bytes,
    quantize,
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
from slimtorch.quant.options import QuantizeOptions
from slimtorch.quant.recurrent import Int4WeightRecurrent, Int8DynamicRecurrent, Int8WeightRecurrent
from slimtorch.quant.targets import FloatLayer
from slimtorch.schemes import SCHEMES

__all__ = [
    "CHOICES",
    "SCHEMES",
    "FloatLayer",
    "Int4Embedding",
    "Int4WeightConv",
    "Int4WeightLinear",
    "Int4WeightRecurrent",
    "Int8DynamicLinear",
    "Int8DynamicRecurrent",
    "Int8Embedding",
    "Int8WeightConv",
    "Int8WeightLinear",
    "Int8WeightRecurrent",
    "LayerResult",
    "QuantizeOptions",
    "QuantizeReport",
    "QuantizedWeight",
    "dequantize",
    "model_bytes",
    "quantize",
]
