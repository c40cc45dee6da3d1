"""Pruning: structured (whole channels, physically removed).

- :func:`channels`: remove a share of the channels of every prunable group of any traceable model.
- :func:`channels_with_report`: the same, plus what was removed and what could not be.
"""

from slimtorch.prune.delta import StructuralDelta, apply_delta
from slimtorch.prune.structured import PruneReport, channels, channels_with_report

__all__ = ["PruneReport", "StructuralDelta", "apply_delta", "channels", "channels_with_report"]
