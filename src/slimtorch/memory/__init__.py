"""Training and inference memory: a step's peak, predicted on fake tensors and measured on real ones.

- :func:`estimate`: forward, backward and optimizer step on fake tensors; the peak, its breakdown by
  category, phase and module, and the peak as a line in the batch size.
- :func:`profile`: the same step for real, with the allocator's own high-water mark beside it.
- :func:`find_batch_size`: the largest batch in a budget, predicted, then confirmed in a few real steps.
- :func:`fit`: checkpointing, mixed precision and offload chosen to fit a budget, and applied.
- :func:`default_device`: what ``device=None`` means everywhere here: CUDA if torch sees it, else the CPU.
"""

from slimtorch.memory.batch_size import BatchSizeResult, find_batch_size, is_out_of_memory
from slimtorch.memory.device import default_device
from slimtorch.memory.estimating import CATEGORIES, MemoryReport, StepMemory, estimate, measure_peak, profile
from slimtorch.memory.fit import FitPlan, fit
from slimtorch.memory.step import OPTIMIZERS, PRECISIONS, StepPlan, checkpoint_blocks

__all__ = [
    "CATEGORIES",
    "OPTIMIZERS",
    "PRECISIONS",
    "BatchSizeResult",
    "FitPlan",
    "MemoryReport",
    "StepMemory",
    "StepPlan",
    "checkpoint_blocks",
    "default_device",
    "estimate",
    "find_batch_size",
    "fit",
    "is_out_of_memory",
    "measure_peak",
    "profile",
]
