"""What the memory verbs can be asked: the step simulated, the batch-size search, the fit to a budget.

Each verb takes its frozen options dataclass (or None) and keyword overrides of its fields
(:func:`slimtorch.format.verbs.resolve`): :class:`StepOptions` for :func:`~slimtorch.memory.estimate` and
:func:`~slimtorch.memory.profile`, :class:`BatchSizeOptions` for :func:`~slimtorch.memory.find_batch_size`,
:class:`FitOptions` for :func:`~slimtorch.memory.fit`. A bad value is an :class:`OptionError` when the
options are made, before any step runs; each check is written once here and shared.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from slimtorch.errors import OptionError

OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "adamw": torch.optim.AdamW,
    "adam": torch.optim.Adam,
    "sgd": lambda params: torch.optim.SGD(params, lr=0.01, momentum=0.9),
    "sgd-no-momentum": lambda params: torch.optim.SGD(params, lr=0.01),
    "adagrad": torch.optim.Adagrad,
    "rmsprop": torch.optim.RMSprop,
}
PRECISIONS = ("fp32", "bf16-mixed", "fp16-mixed", "bf16", "fp16")
PARALLEL = ("ddp", "zero1", "fsdp", "fsdp-offload")
"""Strategies :mod:`slimtorch.memory.parallel` models (its ``STRATEGIES``)."""
MODES = ("train", "inference")
FIT_MARGIN = 0.05
BATCH_SIZE_MARGIN = 0.02


@dataclass(frozen=True)
class StepOptions:
    """The step :func:`~slimtorch.memory.estimate` simulates and :func:`~slimtorch.memory.profile` runs.

    Example:
        >>> StepOptions(precision="bf16-mixed", checkpointing=["layers.0", "layers.1"]).checkpointing
        ('layers.0', 'layers.1')
    """

    mode: str = "train"
    """``"train"`` (forward, backward, optimizer step) or ``"inference"`` (forward, no grad)"""
    optimizer: str = "adamw"
    """one of :data:`OPTIMIZERS` (train mode): torch's own optimizer runs on the step's tensors"""
    precision: str = "fp32"
    """``"fp32"``; ``"bf16-mixed"`` / ``"fp16-mixed"`` (fp32 weights, autocast; fp16-mixed trains through
    a ``torch.amp.GradScaler``, as PyTorch's AMP recipe does); ``"bf16"`` / ``"fp16"`` (weights in that
    dtype)"""
    checkpointing: str | tuple[str, ...] | None = None
    """None; ``"blocks"`` (each entry of the longest ``nn.ModuleList``, non-reentrant); or module names"""
    device: str | None = None
    """``"cuda"`` (sizes rounded as CUDA's caching allocator rounds them) or ``"cpu"``; None: this
    machine's (CUDA if torch sees one). ``estimate`` may plan for CUDA anywhere; ``profile`` runs there"""
    batch_sizes: tuple[int, ...] | None = None
    """batch sizes to step at (the inputs' first dimension is resized); None: the inputs' own"""
    set_to_none: bool = True
    """train mode: gradients freed after each optimizer step (``zero_grad``'s default), or, False, kept
    as zeros through the next step's forward and backward"""
    accumulation: int = 1
    """train mode: micro-batches of ``batch_sizes`` rows whose gradients add up before each optimizer
    step (gradient accumulation)"""
    parallel: str | None = None
    """``"ddp"``, ``"zero1"``, ``"fsdp"`` or ``"fsdp-offload"``: also give each rank's peak under that
    strategy on ``world_size`` ranks (:mod:`slimtorch.memory.parallel`); batch sizes are then per rank"""
    world_size: int = 1
    """ranks of ``parallel``"""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise OptionError(f"mode must be train or inference, not {self.mode!r}")
        if self.mode == "train":
            check_optimizer(self.optimizer)
        if self.precision not in PRECISIONS:
            raise OptionError(f"unknown precision {self.precision!r} (known: {', '.join(PRECISIONS)})")
        object.__setattr__(self, "device", check_device(self.device))
        object.__setattr__(self, "checkpointing", _checkpointing(self.checkpointing))
        object.__setattr__(self, "batch_sizes", _batch_sizes(self.batch_sizes))
        if not isinstance(self.set_to_none, bool):
            raise OptionError(f"set_to_none must be True or False, not {self.set_to_none!r}")
        if not _positive_int(self.accumulation):
            raise OptionError(
                f"accumulation must be a positive integer of micro-batches, not {self.accumulation!r}"
            )
        if self.parallel not in (None, *PARALLEL):
            raise OptionError(f"parallel must be one of {', '.join(PARALLEL)}, not {self.parallel!r}")
        if not _positive_int(self.world_size) or (self.world_size > 1 and self.parallel is None):
            raise OptionError(
                f"world_size must be a positive integer, with parallel= when above 1, not {self.world_size!r}"
            )

    @property
    def weight_dtype(self) -> torch.dtype | None:
        return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.precision)

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        return {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}.get(self.precision)


@dataclass(frozen=True)
class BatchSizeOptions:
    """How :func:`~slimtorch.memory.find_batch_size` searches.

    Example:
        >>> BatchSizeOptions(budget=40 * 2**30, max_trials=2).margin
        0.02
    """

    budget: int | None = None
    """bytes the step may use; None: the CUDA device's free memory (required on the CPU)"""
    margin: float = BATCH_SIZE_MARGIN
    """share of the budget kept free, for what a step's peak varies by"""
    max_trials: int = 3
    """trials at most, each two real steps of the loop, the second measured (an out-of-memory error
    ends a trial)"""
    device: str | None = None
    """where the training step runs; None: the estimate's device"""

    def __post_init__(self) -> None:
        object.__setattr__(self, "budget", check_budget(self.budget))
        check_margin(self.margin)
        if not _positive_int(self.max_trials):
            raise OptionError(f"max_trials must be a positive integer, not {self.max_trials!r}")
        object.__setattr__(self, "device", check_device(self.device))


@dataclass(frozen=True)
class FitOptions:
    """What :func:`~slimtorch.memory.fit` fits a training step into, and which levers it may pull.

    Example:
        >>> FitOptions(budget=16 * 2**30, allow_offload=False).optimizer
        'adamw'
    """

    budget: int | None = None
    """bytes one training step may use (required: :func:`~slimtorch.memory.fit` refuses None)"""
    optimizer: str = "adamw"
    """the optimizer the model trains with (one of :data:`OPTIMIZERS`)"""
    device: str | None = None
    """where the model trains; None: this machine's (CUDA if torch sees one)"""
    allow_precision: bool = True
    """whether bf16 autocast may be pulled when checkpointing alone does not fit"""
    allow_offload: bool = True
    """whether activations may be offloaded to host memory (CUDA only) when nothing else fits"""
    margin: float = FIT_MARGIN
    """share of the budget kept free, for what the estimate misses"""
    world_size: int | str | None = None
    """ranks to plan for, each with the example's batch: None or 1, one device (when nothing fits there,
    the error names the fewest ranks that would); N, exactly N ranks; ``"auto"``, one device when a plan
    fits there, else the fewest ranks whose busiest rank fits the budget"""
    strategies: tuple[str, ...] = PARALLEL
    """the wrappers ranks may use (:data:`PARALLEL`), tried in this order at each count"""
    max_world_size: int = 1024
    """the most ranks ``world_size="auto"`` proposes"""
    allow_checkpointing: bool = True
    """whether blocks may be checkpointed (False: ranks before recomputation, when ranks are allowed)"""
    apply: bool = True
    """whether the plan is applied to the model; False only chooses, so the device may then be CUDA on a
    machine without it (a plan for a GPU, made anywhere)"""

    def __post_init__(self) -> None:
        object.__setattr__(self, "budget", check_budget(self.budget))
        check_optimizer(self.optimizer)
        object.__setattr__(self, "device", check_device(self.device))
        for name in ("allow_precision", "allow_offload", "allow_checkpointing", "apply"):
            if not isinstance(getattr(self, name), bool):
                raise OptionError(f"{name} must be True or False, not {getattr(self, name)!r}")
        check_margin(self.margin)
        if self.world_size not in (None, "auto") and not _positive_int(self.world_size):
            raise OptionError(
                f"world_size must be None, a positive integer or 'auto', not {self.world_size!r}"
            )
        if not _positive_int(self.max_world_size):
            raise OptionError(f"max_world_size must be a positive integer, not {self.max_world_size!r}")
        object.__setattr__(self, "strategies", _strategies(self.strategies))


# -- one check per idea -------------------------------------------------------------------------------------
def check_optimizer(name: str) -> None:
    """Refuse an optimizer this package cannot build."""
    if name not in OPTIMIZERS:
        raise OptionError(f"unknown optimizer {name!r} (known: {', '.join(OPTIMIZERS)})")


def check_device(device: Any) -> str | None:
    """``device`` as a string (a ``torch.device`` too), refused unless it is a CPU or CUDA device."""
    if device is None:
        return None
    try:
        kind = torch.device(device).type
    except (RuntimeError, TypeError):
        kind = None
    if kind not in ("cpu", "cuda"):
        raise OptionError(f"device must be cpu or cuda, not {device!r}")
    return str(device)


def check_budget(budget: Any) -> int | None:
    """A budget in whole bytes (a float is rounded down), refused unless positive."""
    if budget is None:
        return None
    if isinstance(budget, bool) or not isinstance(budget, int | float) or not budget >= 1:
        raise OptionError(f"budget must be a positive number of bytes, not {budget!r}")
    return int(budget)


def check_margin(margin: Any) -> None:
    """A margin is a share of the budget: 0 (none) up to, not including, 1 (all of it)."""
    if isinstance(margin, bool) or not isinstance(margin, int | float) or not 0 <= margin < 1:
        raise OptionError(f"margin must be a share of the budget, 0 to below 1, not {margin!r}")


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _checkpointing(which: Any) -> str | tuple[str, ...] | None:
    """None, ``"blocks"`` or a tuple of module names (a list is taken; ``["blocks"]`` is ``"blocks"``,
    as the command line's ``--checkpointing blocks`` gives it; an empty list is None)."""
    if which is None or isinstance(which, str):
        return which
    names = tuple(which)
    if any(not isinstance(name, str) for name in names):
        raise OptionError(f"checkpointing takes module names, not {which!r}")
    if names == ("blocks",):
        return "blocks"
    return names or None


def _strategies(which: Any) -> tuple[str, ...]:
    """A non-empty tuple of :data:`PARALLEL` names (a list or one name is taken)."""
    names = (which,) if isinstance(which, str) else tuple(which) if isinstance(which, list | tuple) else ()
    if not names or any(name not in PARALLEL for name in names):
        raise OptionError(f"strategies must be a list of {', '.join(PARALLEL)}, not {which!r}")
    return names


def _batch_sizes(sizes: Any) -> tuple[int, ...] | None:
    if sizes is None:
        return None
    if isinstance(sizes, int):
        raise OptionError(f"batch_sizes is a list of batch sizes, not one: batch_sizes=[{sizes}]")
    sizes = tuple(sizes)
    if not sizes or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in sizes):
        raise OptionError(f"batch sizes must be positive integers, not {list(sizes)!r}")
    return sizes
