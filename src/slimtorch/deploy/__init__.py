"""Deploy: a model to a small, verified bundle that runs without PyTorch, and what that runtime costs.

- :func:`export`: ``torch.export`` to ``model.onnx`` (onnxruntime, optionally int8) or ``model.pt2``,
  checked against eager PyTorch, written as a bundle with its runner, requirements and manifest
  (:class:`ExportOptions` say how, :class:`ExportReport` says what came of it).
- :func:`footprint` (also :func:`measure_footprint`): the bundle's requirements installed alone in a
  clean venv, its sample run there, the installed bytes per package, beside torch's own footprint
  measured the same way (:class:`FootprintOptions`, :class:`FootprintReport`).
- :func:`operators`: the operators a model needs from libtorch, as PyTorch's selective-build list
  (:class:`OperatorOptions`, :class:`OperatorList`).
"""

from slimtorch.deploy.export import (
    FP32,
    INT8,
    INT8_TEXT,
    ExportOptions,
    ExportReport,
    OutputError,
    TensorSpec,
    Tolerance,
    export,
)
from slimtorch.deploy.footprint import (
    Baseline,
    FootprintOptions,
    FootprintReport,
    PackageBytes,
    footprint,
    torch_baseline,
)
from slimtorch.deploy.ops import Operator, OperatorList, OperatorOptions, operators
from slimtorch.deploy.program import ExportError

measure_footprint = footprint
"""The name the docs have used since the first release: the same function as :func:`footprint`."""

__all__ = [
    "FP32",
    "INT8",
    "INT8_TEXT",
    "Baseline",
    "ExportError",
    "ExportOptions",
    "ExportReport",
    "FootprintOptions",
    "FootprintReport",
    "Operator",
    "OperatorList",
    "OperatorOptions",
    "OutputError",
    "PackageBytes",
    "TensorSpec",
    "Tolerance",
    "export",
    "footprint",
    "measure_footprint",
    "operators",
    "torch_baseline",
]
