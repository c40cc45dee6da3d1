"""Data loading, measured: the DataLoader settings that feed a training loop fastest on this machine.

- :func:`tune`: times ``torch.utils.data.DataLoader`` over ``num_workers``, ``prefetch_factor``,
  ``persistent_workers`` and (with CUDA) ``pin_memory`` in a bounded time, and returns the fastest
  settings with every candidate's samples/s (:class:`TuneReport`); :class:`TuneOptions` says how.
"""

from slimtorch.data.options import TuneOptions
from slimtorch.data.report import Candidate, Trial, TuneReport
from slimtorch.data.tuning import tune

__all__ = ["Candidate", "Trial", "TuneOptions", "TuneReport", "tune"]
