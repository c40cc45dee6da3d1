"""Pruning: structured (whole channels, physically removed) and unstructured / N:M (zeros, stored sparse).

Each verb takes its options dataclass (or keyword overrides of its fields) and returns a report:

- :func:`channels` (:class:`ChannelOptions`): remove a share of the channels of every prunable group of any
  traceable model, in place; the :class:`PruneReport` says what went and what could not, and holds the model.
- :func:`weights` (:class:`SparsityOptions`): zero the smallest weights (global, per layer, or N:M);
  :func:`keep_sparse` keeps them zero while fine-tuning; :class:`GradualPruner` schedules it;
  :func:`finalize` folds torch's prune masks.
- :func:`scan` (:class:`ScanOptions`): each layer's sensitivity to pruning, and per-layer amounts for a
  global target.
- :class:`ConfigUpdate`: the sizes a pruned Hugging Face model's ``config.json`` needs
  (:func:`slimtorch.save_pretrained` writes the folder).
"""

from slimtorch.format.delta import StructuralDelta, apply_delta
from slimtorch.prune.hf import ConfigUpdate
from slimtorch.prune.sensitivity import ScanOptions, SensitivityReport, scan
from slimtorch.prune.sparse_training import GradualPruner, keep_sparse
from slimtorch.prune.structured import ChannelOptions, PruneReport, channels
from slimtorch.prune.unstructured import SparsityOptions, SparsityReport, finalize, weights

__all__ = [
    "ChannelOptions",
    "ConfigUpdate",
    "GradualPruner",
    "PruneReport",
    "ScanOptions",
    "SensitivityReport",
    "SparsityOptions",
    "SparsityReport",
    "StructuralDelta",
    "apply_delta",
    "channels",
    "finalize",
    "keep_sparse",
    "scan",
    "weights",
]
