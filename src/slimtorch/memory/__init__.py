"""Training and inference memory: a step's peak, predicted on fake tensors and measured on real ones.

- :func:`estimate`: forward, backward and optimizer step on fake tensors; the peak, its breakdown by
  category, phase and module, and the peak as a line in the batch size.
- :func:`profile`: the same step for real, with the allocator's own high-water mark beside it.
"""

from slimtorch.memory.estimating import CATEGORIES, MemoryReport, StepMemory, estimate, profile
from slimtorch.memory.step import OPTIMIZERS, PRECISIONS, StepPlan, checkpoint_blocks

__all__ = [
    "CATEGORIES",
    "OPTIMIZERS",
    "PRECISIONS",
    "MemoryReport",
    "StepMemory",
    "StepPlan",
    "checkpoint_blocks",
    "estimate",
    "profile",
]
