"""The operators a model needs from libtorch, written as the operator list of PyTorch's selective build.

A libtorch built with only one model's operators is much smaller, but it must keep every operator the
dispatcher is asked for while the model runs, not only those the model's code calls: ``aten::linear`` calls
``aten::t`` and ``aten::addmm`` through the dispatcher, ``aten::conv2d`` reaches ``aten::convolution``,
``aten::_convolution`` and, on CPU, ``aten::mkldnn_convolution``. So the list has two sources:

- root operators, the ones the forward itself calls: the ATen graph ``torch.export`` captures;
- every operator the dispatcher runs when the model runs eagerly on the example, nested calls included,
  recorded by PyTorch's profiler through the hook (RecordFunction) that PyTorch's own model tracer uses.
  A ``TorchDispatchMode`` would not do: it sees a kernel's outermost call, not the operators it calls.

Names follow torchgen, ``namespace::name.overload`` with no suffix for the default overload
(``aten::add.Tensor``, ``aten::conv2d``): the names ``SelectiveBuilder.is_operator_selected`` matches.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import tempfile
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

import torch
from torch import nn
from torch.autograd.profiler import profile

from slimtorch.errors import SlimtorchError
from slimtorch.format.verbs import Report, resolve
from slimtorch.graph.capture import as_args, capture

# Kineto writes "USDT:2026-01-01 10:00:00 123:123 File.cpp:52] profiler_start" on stderr at each start/stop.
_KINETO_LOG = re.compile(r"[A-Z]+:\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \d+:\d+ \S+\.cpp:\d+\] ")


@dataclass(frozen=True)
class Operator:
    """One operator the build must keep."""

    name: str
    """torchgen's name: ``aten::add.Tensor``, or ``aten::conv2d`` for a default overload"""
    root: bool
    """called by the model's forward itself (a node of the torch.export graph)"""
    count: int
    """calls in the eager run, or nodes in the graph for an operator only the graph has"""
    all_overloads: bool = False
    """the name carries no overload (this torch's profiler records none), so the build keeps them all"""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class OperatorOptions:
    """How :func:`operators` runs the model to record what it needs.

    Example:
        >>> OperatorOptions(training=True).training
        True
    """

    training: bool = False
    """Run in train mode with a backward pass too, so the list holds what on-device training needs."""


@dataclass(frozen=True)
class OperatorList(Report):
    """The operators a model uses, roots first; ``to_yaml`` gives the file selective build reads."""

    SCHEMA: ClassVar[str] = "slimtorch.operators/1"
    DERIVED: ClassVar[dict[str, dict[str, Any]]] = {
        "total": {"type": "integer"},
        "roots": {"type": "integer"},
        "torch": {"type": "string"},
    }

    operators: tuple[Operator, ...]
    notes: tuple[str, ...] = ()
    """what could not be recorded, and why"""
    training: bool = False
    """recorded with a backward pass too: the build is for training on device"""

    @property
    def total(self) -> int:
        """How many operators the build keeps."""
        return len(self.operators)

    @property
    def roots(self) -> int:
        """Of :attr:`total`, those the model's forward calls itself."""
        return sum(op.root for op in self.operators)

    @property
    def torch(self) -> str:
        """The torch the operators were recorded with (names and overloads change between versions)."""
        return torch.__version__

    def to_yaml(self, model_name: str) -> str:
        """The model operator list for ``SELECTED_OP_LIST``, with a comment that says how to use it.

        Example:
            >>> text = operators(nn.Linear(4, 2), torch.randn(1, 4)).to_yaml("linear")
            >>> '"aten::addmm":' in text, "include_all_operators: false" in text
            (True, True)
        """
        name, total = " ".join(model_name.split()), self.total
        header = [
            f"# The operators {name} uses, as the operator list of PyTorch's selective build.",
            f"# Written by slimtorch with torch {torch.__version__}: {total} operators, {self.roots} called",
            f"# by the model's forward (is_root_operator: true), {total - self.roots} called inside them.",
            "# To build libtorch with only these, set SELECTED_OP_LIST to this file and TRACING_BASED=1",
            "# (which makes the build read this format), e.g.",
            "#   SELECTED_OP_LIST=$PWD/ops.yaml TRACING_BASED=1 scripts/build_pytorch_android.sh",
            "# Kernel dtypes are not recorded: include_all_non_op_selectives keeps every dtype.",
            *(f"# note: {' '.join(note.split())}" for note in self.notes),
            "include_all_operators: false",
            "include_all_non_op_selectives: true",
            "debug_info:",
            *(f"  - {json.dumps(line)}" for line in (f"model: {name}", f"torch: {torch.__version__}")),
            "operators:" if self.operators else "operators: {}",
        ]
        training = json.dumps(self.training)  # JSON's true and false are YAML's too
        for op in self.operators:
            header += [
                f"  {json.dumps(op.name)}:",
                f"    is_root_operator: {json.dumps(op.root)}",
                f"    is_used_for_training: {training}",
                f"    include_all_overloads: {json.dumps(op.all_overloads)}",
            ]
        header += ["kernel_metadata: {}", "custom_classes: []", "build_features: []"]
        return "\n".join(header) + "\n"


def operators(
    model: nn.Module,
    example_inputs: Sequence[Any] | Any,
    /,
    options: OperatorOptions | None = None,
    **overrides: Any,
) -> OperatorList:
    """The operators ``model(*example_inputs)`` needs: those its forward calls and those called inside them.

    The model runs in eval mode under ``torch.no_grad()``, or with ``training=True`` (an
    :class:`OperatorOptions` field) in train mode with a backward pass (so backward operators are listed
    too); it is left as it was: modes, buffers, gradients.

    Example:
        >>> ops = operators(nn.Linear(4, 2), torch.randn(1, 4))
        >>> [(op.name, op.root) for op in ops.operators if op.name in ("aten::linear", "aten::addmm")]
        [('aten::linear', True), ('aten::addmm', False)]
    """
    training = resolve(OperatorOptions, options, overrides, "operators").training
    args = as_args(example_inputs)
    with _left_as_it_was(model, training):
        calls, with_overloads = _dispatched(model, args, training)
        roots, notes = _roots(model, args)
    if not with_overloads:
        notes.append(
            f"torch {torch.__version__}'s profiler records no overload names: the operators called inside "
            "others are listed by name, with all their overloads"
        )
    ordered = sorted(set(calls) | set(roots), key=lambda name: (name not in roots, name))
    listed = (
        Operator(name, name in roots, calls[name] or roots[name], not with_overloads and name in calls)
        for name in ordered
    )
    return OperatorList(tuple(listed), tuple(notes), training)


def _dispatched(model: nn.Module, args: tuple[Any, ...], training: bool) -> tuple[Counter[str], bool]:
    """Every operator the dispatcher runs in one eager forward (and backward), and how often; and whether
    the names carry their overload."""
    config = _overload_names_config()
    grad = contextlib.nullcontext() if training else torch.no_grad()
    with _without_kineto_log(), grad, profile(use_kineto=True, experimental_config=config) as profiler:
        try:
            output = model(*args)
            if training:
                _backward(output)
        except Exception as exc:  # the model's own error, on the user's input: say so in one line
            raise SlimtorchError(f"the model failed on the example input: {_first_line(exc)}") from exc
    with _without_kineto_log():
        events = profiler.function_events
    names = (_operator_name(event.name, event.overload_name or "") for event in events)
    # autograd nodes and record_function labels are events, not operators: they have no name here
    calls = Counter(name for name in names if name is not None)
    return calls, config is not None


def _roots(model: nn.Module, args: tuple[Any, ...]) -> tuple[Counter[str], list[str]]:
    """The operators the forward calls, by graph node; no roots and a note when torch.export fails."""
    try:
        graph = capture(model, args)
    except SlimtorchError as exc:
        return Counter(), [f"no operator is marked is_root_operator: {exc}"]
    return Counter(
        _overload_name(node.target)
        for node in graph.graph.nodes
        if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload)
    ), []


def _overload_name(op: torch._ops.OpOverload) -> str:
    schema = op._schema
    return f"{schema.name}.{schema.overload_name}" if schema.overload_name else schema.name


def _operator_name(name: str, overload: str) -> str | None:
    """torchgen's name for a profiler event, or None when the event is not an operator."""
    if "::" not in name:
        return None
    try:
        overloads = {schema.overload_name for schema in torch._C._jit_get_schemas_for_operator(name)}
    except RuntimeError:  # a label such as "autograd::engine::evaluate_function: AddmmBackward0"
        return None
    if not overloads or (overload and overload not in overloads):
        return None
    return f"{name}.{overload}" if overload else name


def _overload_names_config() -> Any:
    """Kineto's option to record overload names; None where this torch has no such option."""
    try:
        from torch._C._profiler import _ExperimentalConfig

        return _ExperimentalConfig(capture_overload_names=True)
    except (ImportError, TypeError):
        return None


def _backward(output: Any) -> None:
    """Backward of the sum of every output that has a gradient (a tensor, or one in a tuple, list or dict)."""
    tensors = [t for t in _tensors(output) if t.requires_grad]
    if not tensors:
        raise SlimtorchError("training=True: no output of the model requires grad, so there is no backward")
    torch.autograd.backward(tensors, [torch.ones_like(t) for t in tensors])


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):  # Hugging Face's ModelOutput is a dict
        for item in value.values():
            yield from _tensors(item)


@contextlib.contextmanager
def _left_as_it_was(model: nn.Module, training: bool) -> Iterator[None]:
    """Run in the mode the build is for, then restore each module's mode, the buffers (BatchNorm statistics
    move in train mode) and the parameters' gradients (a backward pass fills them)."""
    modes = [(module, module.training) for module in model.modules()]
    buffers = [(b, b.detach().clone()) for b in model.buffers()] if training else []
    grads = [(p, p.grad) for p in model.parameters()] if training else []
    model.train(training)
    try:
        yield
    finally:
        for module, mode in modes:
            module.training = mode
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)
        for parameter, grad in grads:
            parameter.grad = grad


@contextlib.contextmanager
def _without_kineto_log() -> Iterator[None]:
    """Drop the lines Kineto logs on stderr (file descriptor 2) while profiling; keep every other line."""
    sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:  # no stderr at all: nothing to filter
        yield
        return
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            lines = caught.read().decode(errors="replace").splitlines(keepends=True)
            sys.stderr.write("".join(line for line in lines if not _KINETO_LOG.match(line)))


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
