"""Deploy: a model to a small, verified bundle that runs without PyTorch, and what that runtime costs.

- :func:`export`: ``torch.export`` to ``model.onnx`` (onnxruntime, optionally int8) or ``model.pt2``,
  checked against eager PyTorch, written as a bundle with its runner, requirements and manifest.
- :func:`measure_footprint`: the bundle's requirements installed alone in a clean venv, its sample run
  there, the installed bytes per package, beside torch's own footprint measured the same way.
- :func:`operators`: the operators a model needs from libtorch, as PyTorch's selective-build list.
"""

from slimtorch.deploy.export import (
    FP32,
    INT8,
    INT8_TEXT,
    ExportReport,
    OutputError,
    TensorSpec,
    Tolerance,
    export,
)
from slimtorch.deploy.footprint import Baseline, FootprintReport, PackageBytes, torch_baseline
from slimtorch.deploy.footprint import footprint as measure_footprint
from slimtorch.deploy.ops import Operator, OperatorList, operators
from slimtorch.deploy.program import ExportError

__all__ = [
    "FP32",
    "INT8",
    "INT8_TEXT",
    "Baseline",
    "ExportError",
    "ExportReport",
    "FootprintReport",
    "Operator",
    "OperatorList",
    "OutputError",
    "PackageBytes",
    "TensorSpec",
    "Tolerance",
    "export",
    "measure_footprint",
    "operators",
    "torch_baseline",
]
