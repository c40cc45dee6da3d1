"""Pruning: structured (whole channels, physically removed) and unstructured / N:M (zeros, stored sparse).

- :func:`channels`: remove a share of the channels of every prunable group of any traceable model.
- :func:`channels_with_report`: the same, plus what was removed and what could not be.
- :class:`ConfigUpdate`: the sizes a pruned Hugging Face model's ``config.json`` needs
  (:func:`slimtorch.save_pretrained` writes the folder).
- :func:`weights`: zero the smallest weights (global, per layer, or N:M); :func:`keep_sparse` keeps them
  zero while fine-tuning; :class:`GradualPruner` schedules it; :func:`finalize` folds torch's prune masks.
- :func:`scan`: each layer's sensitivity to pruning, and per-layer amounts for a global target.
"""

from slimtorch.format.delta import StructuralDelta, apply_delta
from slimtorch.prune.hf import ConfigUpdate
from slimtorch.prune.sensitivity import SensitivityReport, scan
from slimtorch.prune.structured import PruneReport, channels, channels_with_report
from slimtorch.prune.unstructured import GradualPruner, SparsityReport, finalize, keep_sparse, weights

__all__ = [
    "ConfigUpdate",
    "GradualPruner",
    "PruneReport",
    "SensitivityReport",
    "SparsityReport",
    "StructuralDelta",
    "apply_delta",
    "channels",
    "channels_with_report",
    "finalize",
    "keep_sparse",
    "scan",
    "weights",
]
