"""One training or inference step of a model, run on fake tensors (an estimate) or real ones (a
measurement), with every storage recorded by a :class:`~slimtorch.memory.timeline.StorageTimeline`.

The model is left as it was: its parameters and buffers are replaced, for the step only, by tensors
made here (fake ones of the same shape under ``FakeTensorMode``) and put back afterwards. A model built
on the meta device (``with torch.device("meta"): model = ...``) is enough for an estimate, so a
7B-parameter model costs no real memory.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
    UnsupportedFakeTensorException,
    UnsupportedOperatorException,
)
from torch.utils.checkpoint import checkpoint

from slimtorch.errors import OptionError, SlimtorchError
from slimtorch.graph.capture import as_args
from slimtorch.memory.options import OPTIMIZERS, StepOptions
from slimtorch.memory.timeline import StorageTimeline

CUDA_BLOCK = 512  # the CUDA caching allocator hands out multiples of 512 bytes
DONE = "done"


@dataclass
class StepRecord:
    """The timeline of one step and which storages played which role in it."""

    timeline: StorageTimeline
    parameters: set[int]
    buffers: set[int]
    inputs: set[int]
    gradients: set[int]
    optimizer_state: set[int]


def run_step(
    model: nn.Module,
    example: Any,
    batch_size: int | None,
    plan: StepOptions,
    *,
    fake: bool,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    timeline: StorageTimeline | None = None,
) -> StepRecord:
    """Run one step of ``model`` on ``example`` (resized to ``batch_size`` rows) and record its memory;
    ``plan.device`` is named (the verb resolves None to this machine's before it gets here)."""
    # Fake tensors live on the CPU whatever the plan's device (a CPU-only torch cannot run autograd on
    # fake CUDA tensors): CUDA shows in the allocator's rounding, and CPU autocast stands in for CUDA's.
    device = torch.device(plan.device) if not fake else torch.device("cpu")
    rounding = CUDA_BLOCK if torch.device(plan.device).type == "cuda" else 1
    timeline = timeline or StorageTimeline(rounding)
    args, kwargs = _split(example)
    args, kwargs = _resized(args, batch_size), _resized(kwargs, batch_size)
    # real tensors a loss function closes over (the targets) join the fake ones as they are
    mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext()
    with mode, _checkpointed(model, plan.checkpointing):
        tensors = _step_tensors(model, plan, device, fake)
        args, kwargs = _inputs(args, device, fake), _inputs(kwargs, device, fake)
        record = StepRecord(timeline, set(), set(), set(), set(), set())
        parameters = {name for name, _ in model.named_parameters(remove_duplicate=False)}
        for name, tensor in tensors.items():
            (record.parameters if name in parameters else record.buffers).add(timeline.track(tensor))
        for value in _flat_tensors((args, kwargs)):
            record.inputs.add(timeline.track(value))
        with _swapped(model, tensors), _named_modules(model, timeline), timeline:
            try:
                _forward_backward(model, tensors, args, kwargs, plan, device, timeline, loss_fn, record)
            except UNSIMULABLE as exc:
                raise SlimtorchError(_unsimulable(exc, timeline.modules, model)) from None
            timeline.phase = DONE  # what follows is this simulation letting go of the step's tensors
    return record


# What fake tensors cannot do: an output whose shape depends on the data (bincount, nonzero, unique), a
# value read back into Python (``.item()``, ``if x.any()``), an operator without a shape rule.
UNSIMULABLE = (
    DynamicOutputShapeException,
    DataDependentOutputException,
    UnsupportedOperatorException,
    UnsupportedFakeTensorException,
)


def _unsimulable(exc: Exception, modules: list[str], model: nn.Module) -> str:
    """One line: which operator, in which module, could not run on fake tensors, and what to do."""
    func = getattr(exc, "func", None)
    where = ""
    if modules:  # the innermost module whose forward was running ("" is the model itself)
        where = f" in module {modules[-1]!r}" if modules[-1] else f" in {type(model).__name__}.forward"
    if isinstance(exc, DynamicOutputShapeException | DataDependentOutputException):
        why = f"{func} has an output that depends on the input's values{where}"
    elif func is not None:
        why = f"{func} has no shape rule for fake tensors{where}"
    else:
        why = f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}{where}"
    return (
        f"memory.estimate cannot simulate this model's step without data: {why}; measure it with "
        "slimtorch.memory.profile on real inputs, or make the step's "
        "shapes independent of the data (fixed-size inputs)"
    )


def _forward_backward(
    model: nn.Module,
    tensors: dict[str, torch.Tensor],
    args: Any,
    kwargs: Any,
    plan: StepOptions,
    device: torch.device,
    timeline: StorageTimeline,
    loss_fn: Callable[[Any], torch.Tensor] | None,
    record: StepRecord,
) -> None:
    train = plan.mode == "train"
    autocast = (
        torch.autocast(device.type, dtype=plan.autocast_dtype)
        if plan.autocast_dtype is not None
        else contextlib.nullcontext()
    )
    grad = torch.enable_grad() if train else torch.no_grad()
    saved = timeline.watch_saved() if train else contextlib.nullcontext()
    with timeline.in_phase("forward"), grad, saved, autocast:
        output = model(*args, **kwargs)
        loss = (loss_fn or default_loss)(output) if train else None
    if not train:
        return
    del output
    with timeline.in_phase("backward"):
        loss.backward()
        del loss
    trainable = list({id(t): t for t in tensors.values() if t.requires_grad}.values())  # tied ones once
    record.gradients = {timeline.key_of(t.grad) for t in trainable if t.grad is not None} - {None}
    with timeline.in_phase("optimizer"):
        optimizer = OPTIMIZERS[plan.optimizer](trainable)
        optimizer.step()
    record.optimizer_state = {
        timeline.key_of(value)
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor)
    } - {None}


def default_loss(output: Any) -> torch.Tensor:
    """The sum of the first floating-point tensor of the output (logits, a last hidden state ...)."""
    for value in _flat_tensors(output):
        if value.is_floating_point():
            return value.float().sum()
    raise SlimtorchError("the model's output holds no floating-point tensor to take a loss from")


# -- the step's tensors ---------------------------------------------------------------------------------
def _step_tensors(
    model: nn.Module, plan: StepOptions, device: torch.device, fake: bool
) -> dict[str, torch.Tensor]:
    """One new tensor per parameter and buffer of the model (tied names share one), in the plan's dtype."""
    made: dict[int, torch.Tensor] = {}
    tensors: dict[str, torch.Tensor] = {}
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    for name, original in named:
        if id(original) not in made:
            made[id(original)] = _like(original, plan, device, fake)
        tensors[name] = made[id(original)]
    return tensors


def _like(original: torch.Tensor, plan: StepOptions, device: torch.device, fake: bool) -> torch.Tensor:
    dtype = original.dtype
    if plan.weight_dtype is not None and dtype.is_floating_point:
        dtype = plan.weight_dtype
    if fake or original.is_meta:
        tensor = torch.empty(original.shape, dtype=dtype, device=device)
        if original.is_meta and not fake and dtype.is_floating_point:
            tensor.normal_(0, 0.02)  # a real run of a meta model: values that keep activations finite
    else:
        tensor = original.detach().to(device=device, dtype=dtype, copy=True)
    trainable = isinstance(original, nn.Parameter) and original.requires_grad and plan.mode == "train"
    return nn.Parameter(tensor, requires_grad=True) if trainable else tensor


def _inputs(value: Any, device: torch.device, fake: bool) -> Any:
    if isinstance(value, torch.Tensor):
        if fake:
            return torch.empty(value.shape, dtype=value.dtype, device=device)
        return value.to(device)
    if isinstance(value, dict):
        return {k: _inputs(v, device, fake) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_inputs(v, device, fake) for v in value)
    return value


def _split(example: Any) -> tuple[tuple, dict]:
    if isinstance(example, dict):
        return (), dict(example)
    return as_args(example), {}


def _resized(value: Any, batch_size: int | None) -> Any:
    """Every tensor's first dimension made ``batch_size`` by repeating its rows (values stay realistic)."""
    if batch_size is None:
        return value
    if isinstance(value, torch.Tensor):
        if value.dim() == 0 or value.shape[0] == batch_size:
            return value
        rows = torch.arange(batch_size) % value.shape[0]
        return value[rows]
    if isinstance(value, dict):
        return {k: _resized(v, batch_size) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_resized(v, batch_size) for v in value)
    return value


def _flat_tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _flat_tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _flat_tensors(item)
    elif hasattr(value, "to_tuple"):  # a Hugging Face ModelOutput
        yield from _flat_tensors(value.to_tuple())


@contextlib.contextmanager
def _swapped(model: nn.Module, tensors: dict[str, torch.Tensor]) -> Iterator[None]:
    """The step's tensors in the model's place for the whole step (checkpointing recomputes parts of the
    forward during backward, so ``torch.func.functional_call``'s swap, undone after the forward, would
    not do); the model's own tensors are put back afterwards, whatever happens."""
    originals = []
    for name, tensor in tensors.items():
        owner, _, attr = name.rpartition(".")
        module = model.get_submodule(owner)
        table = module._parameters if attr in module._parameters else module._buffers
        originals.append((table, attr, table[attr]))
        table[attr] = tensor
    try:
        yield
    finally:
        for table, attr, original in originals:
            table[attr] = original


# -- module names and checkpointing -----------------------------------------------------------------------
@contextlib.contextmanager
def _named_modules(model: nn.Module, timeline: StorageTimeline) -> Iterator[None]:
    """Keep ``timeline.modules`` the stack of modules whose forward is running."""

    def enter(name: str) -> Callable[..., None]:
        def hook(*_: Any) -> None:
            timeline.modules.append(name)

        return hook

    def leave(*_: Any) -> None:  # a forward hook must return None, or it replaces the output
        if timeline.modules:
            timeline.modules.pop()

    handles = []
    for name, module in model.named_modules():
        handles.append(module.register_forward_pre_hook(enter(name)))
        handles.append(module.register_forward_hook(leave))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def checkpoint_blocks(model: nn.Module) -> list[str]:
    """The repeated blocks of a model: the entries of its longest ``nn.ModuleList`` (transformer layers)."""
    lists = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m)]
    if not lists:
        return []
    name, longest = max(lists, key=lambda item: len(item[1]))
    return [f"{name}.{index}" if name else str(index) for index in range(len(longest))]


@contextlib.contextmanager
def _checkpointed(model: nn.Module, which: str | tuple[str, ...] | None) -> Iterator[None]:
    """Run the chosen modules under non-reentrant activation checkpointing for the duration of the step."""
    if which is None:
        yield
        return
    names = checkpoint_blocks(model) if which == "blocks" else list(which)
    modules = dict(model.named_modules())
    unknown = [name for name in names if name not in modules]
    if unknown or not names:
        raise OptionError(
            f"checkpointing names no module of the model ({unknown[0]!r})"
            if unknown
            else "checkpointing='blocks' found no repeated blocks (no nn.ModuleList): name the modules"
        )
    undo = [checkpoint_forward(modules[name]) for name in names]
    try:
        yield
    finally:
        for restore in reversed(undo):
            restore()


def checkpoint_forward(module: nn.Module) -> Callable[[], None]:
    """Run ``module``'s forward under non-reentrant activation checkpointing; returns what undoes it."""
    return replace_forward(module, functools.partial(checkpoint, module.forward, use_reentrant=False))


def replace_forward(module: nn.Module, forward: Callable[..., Any]) -> Callable[[], None]:
    """Give ``module`` another forward for a while; returns what puts its own back (an instance's own
    forward, if it had one, else the class's)."""
    own = module.__dict__.get("forward")
    module.forward = forward  # type: ignore[method-assign]

    def restore() -> None:
        if own is None:
            module.__dict__.pop("forward", None)
        else:
            module.forward = own  # type: ignore[method-assign]

    return restore
