"""Training and inference memory: a step's peak, predicted on fake tensors and measured on real ones.

- :func:`estimate`: forward, backward and optimizer step on fake tensors; the peak, its breakdown by
  category, phase and module, and the peak as a line in the batch size.
- :func:`profile`: the same step for real, with the allocator's own high-water mark beside it.
- :func:`find_batch_size`: the largest batch in a budget, predicted, then confirmed in a few real steps.
- :func:`fit`: checkpointing, mixed precision and offload chosen to fit a budget, and applied.
- :func:`default_device`: what ``device=None`` means everywhere here: CUDA if torch sees it, else the CPU.
- :func:`rank_memory` (and ``estimate(..., parallel="fsdp", world_size=N)``): each rank's peak under DDP,
  ZeRO-1 or FSDP2; :func:`smallest_world_size`: the fewest ranks that fit a budget.
- :func:`measure_host`: what the CPU allocator adds to the live tensors of a real run (RSS growth).
- :func:`generation_memory`: a causal language model's weights plus the KV cache ``generate`` keeps at a
  context, and the longest context a budget holds.

Each verb takes its options (:class:`StepOptions`, :class:`BatchSizeOptions`, :class:`FitOptions`) or
their fields as keywords, and returns a report (:class:`MemoryReport`, :class:`BatchSizeResult`,
:class:`FitPlan`).
"""

from slimtorch.memory.allocator import HostMemory, measure_host
from slimtorch.memory.batch_size import BatchSizeResult, find_batch_size, is_out_of_memory
from slimtorch.memory.device import default_device
from slimtorch.memory.estimating import CATEGORIES, MemoryReport, StepMemory, estimate, measure_peak, profile
from slimtorch.memory.fitting import FitPlan, fit
from slimtorch.memory.generation import GenerationMemory, generation_memory
from slimtorch.memory.options import OPTIMIZERS, PRECISIONS, BatchSizeOptions, FitOptions, StepOptions
from slimtorch.memory.parallel import (
    ParallelStep,
    RankMemory,
    parallel_step,
    rank_memory,
    smallest_world_size,
)
from slimtorch.memory.step import checkpoint_blocks

__all__ = [
    "CATEGORIES",
    "OPTIMIZERS",
    "PRECISIONS",
    "BatchSizeOptions",
    "BatchSizeResult",
    "FitOptions",
    "FitPlan",
    "GenerationMemory",
    "HostMemory",
    "MemoryReport",
    "ParallelStep",
    "RankMemory",
    "StepMemory",
    "StepOptions",
    "checkpoint_blocks",
    "default_device",
    "estimate",
    "find_batch_size",
    "fit",
    "generation_memory",
    "is_out_of_memory",
    "measure_host",
    "measure_peak",
    "parallel_step",
    "profile",
    "rank_memory",
    "smallest_world_size",
]
