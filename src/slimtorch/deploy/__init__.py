"""Deploy: a model to a small, verified bundle that runs without PyTorch, and what that runtime costs.

- :func:`export`: ``torch.export`` → ``model.onnx`` (onnxruntime, optionally int8) or ``model.pt2``, checked
  against eager PyTorch, written as a bundle with its runner, requirements and manifest.
"""

from slimtorch.deploy.export import FP32, INT8, ExportReport, OutputError, TensorSpec, Tolerance, export
from slimtorch.deploy.program import ExportError

__all__ = ["FP32", "INT8", "ExportError", "ExportReport", "OutputError", "TensorSpec", "Tolerance", "export"]
