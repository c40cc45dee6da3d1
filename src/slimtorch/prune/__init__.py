"""Pruning: structured (whole channels, physically removed).

- :func:`channels`: remove a share of the channels of every prunable group of any traceable model.
- :func:`channels_with_report`: the same, plus what was removed and what could not be.
- :func:`save_pretrained`: a pruned Hugging Face model as a folder ``from_pretrained`` reads.
"""

from slimtorch.prune.delta import StructuralDelta, apply_delta
from slimtorch.prune.hf import ConfigUpdate, save_pretrained
from slimtorch.prune.structured import PruneReport, channels, channels_with_report

__all__ = [
    "ConfigUpdate",
    "PruneReport",
    "StructuralDelta",
    "apply_delta",
    "channels",
    "channels_with_report",
    "save_pretrained",
]
