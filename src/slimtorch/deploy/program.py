"""The model as a ``torch.export`` program, and, when it cannot become one, what blocked it and where.

Export runs the forward on fake tensors and records ATen operators. What stops it is a construct in the
user's code (control flow on a tensor's values, a Python side effect, an op without a fake kernel) or a
shape it cannot keep general. The error torch raises is long and names torch's own frames; the user needs
the line of *their* code, the module it ran in, and what was tried. :func:`export_program` collects those.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import logging
import traceback
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from slimtorch.errors import SlimtorchError

TORCH_ROOT = str(Path(torch.__file__).parent)
BATCH = "batch"
SEQUENCE = "sequence"

# What a few of torch.export's failures mean, in the user's terms.
HINTS = {
    "GuardOnDataDependentSymNode": "control flow or a size that depends on a tensor's values; "
    "rewrite it with torch.cond / torch.where, or compute it outside the model",
    "UserError": "",
    "Unsupported": "a Python construct torch.export cannot trace",
    "ConstraintViolationError": "the batch dimension cannot stay dynamic (the model fixes its size); "
    "export without --dynamic-batch",
    "SequenceConstraintViolation": "the sequence length cannot stay dynamic (the model fixes it, or "
    "treats some lengths apart)",
}


@dataclass(frozen=True)
class Attempt:
    """One way of exporting that was tried, and why it failed."""

    how: str
    error: str
    kind: str
    where: str
    """the user's source line that was running, ``file:line in function: code`` (empty when unknown)"""
    module: str
    """the innermost module that was running, ``path (Class)`` (empty when unknown)"""

    def describe(self) -> str:
        hint = HINTS.get(self.kind) or self.error
        place = ", ".join(part for part in (f"in {self.module}" if self.module else "", self.where) if part)
        return f"{hint} ({place})" if place else hint


class ExportError(SlimtorchError):
    """The model could not be exported; the message names the construct, where it is, and what was tried."""

    def __init__(self, problem: str, attempts: Sequence[Attempt] = ()) -> None:
        self.attempts = tuple(attempts)
        tried = "; ".join(f"{a.how}: {a.kind}" for a in self.attempts)
        super().__init__(f"{problem}{f' [tried {tried}]' if tried else ''}")


def export_program(
    model: nn.Module,
    args: tuple,
    kwargs: dict[str, Any],
    *,
    dynamic_batch: bool = False,
    sequence: int | None = None,
) -> torch.export.ExportedProgram:
    """``torch.export`` of ``model(*args, **kwargs)``: non-strict first (it runs the Python as written),
    then strict (TorchDynamo). With ``dynamic_batch``, dimension 0 of every tensor argument is dynamic;
    with ``sequence`` (token inputs), dimension 1 too, from 1 to ``sequence``.

    Example:
        >>> program = export_program(nn.Linear(4, 2), (torch.randn(3, 4),), {})
        >>> [n.target.__name__ for n in program.graph.nodes if n.op == "call_function"]
        ['linear.default']
    """
    shapes = _dynamic_shapes(model, args, kwargs, sequence) if dynamic_batch or sequence else None
    attempts = []
    for strict in (False, True):
        tracker = _ModuleTracker(model) if not strict else None
        try:
            with torch.no_grad(), quiet():
                return torch.export.export(model, args, kwargs, dynamic_shapes=shapes, strict=strict)
        except Exception as exc:  # export raises many types; each is reported, not swallowed
            module = tracker.innermost() if tracker else ""
            attempts.append(_attempt(f"torch.export strict={strict}", exc, module))
        finally:
            if tracker:
                tracker.remove()
    first = attempts[0]
    said = first.describe()
    detail = "" if first.error in said else f"; torch.export says: {first.error}"
    raise ExportError(f"cannot export the model: {said}{detail}", attempts)


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Silence what export and the ONNX exporter print and log while they work (graphs of failed
    attempts, skipped torchvision ops, optimizer folding tries): failures still raise, and are reported."""
    disabled = logging.root.manager.disable
    logging.disable(logging.CRITICAL)
    try:
        with (
            contextlib.redirect_stdout(io.StringIO()),
            contextlib.redirect_stderr(io.StringIO()),
            warnings.catch_warnings(),
        ):
            warnings.simplefilter("ignore", FutureWarning)  # torch's own pytree deprecations
            yield
    finally:
        logging.disable(disabled)


def module_of(node: torch.fx.Node) -> str:
    """``path (Class)`` of the module a graph node was traced in, from export's ``nn_module_stack``."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path, kind = list(stack.values())[-1]
    name = kind.__name__ if isinstance(kind, type) else str(kind).rsplit(".", 1)[-1]
    return f"{path.removeprefix('L__self__.') or '(model)'} ({name})"


def _dynamic_shapes(model: nn.Module, args: tuple, kwargs: dict[str, Any], sequence: int | None) -> tuple:
    batch = torch.export.Dim(BATCH, min=1, max=1 << 16)
    length = torch.export.Dim(SEQUENCE, min=1, max=sequence) if sequence else None

    def spec(value: Any) -> Any:
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            return None
        return {0: batch, 1: length} if length is not None and value.dim() > 1 else {0: batch}

    shapes = tuple(spec(a) for a in args)
    kinds = [p.kind for p in inspect.signature(model.forward).parameters.values()]
    if kinds and kinds[0] == inspect.Parameter.VAR_POSITIONAL:  # forward(*args): one entry holds them all
        shapes = (shapes,)
    return (*shapes, {k: spec(v) for k, v in kwargs.items()}) if kwargs else shapes


def _attempt(how: str, exc: BaseException, module: str) -> Attempt:
    text = str(exc).strip()
    first = text.splitlines()[0] if text else type(exc).__name__
    kind = type(exc).__name__
    if "data-dependent" in text or "data dependent" in text:
        kind = "GuardOnDataDependentSymNode"
    elif ("Constraints violated" in text or "specialized" in text) and SEQUENCE in text:
        kind = "SequenceConstraintViolation"
    elif "Constraints violated" in text or ("specialized" in text and BATCH in text):
        kind = "ConstraintViolationError"
    return Attempt(how, first[:300], kind, _user_frame(exc), module)


def _user_frame(exc: BaseException) -> str:
    """The last frame of the traceback outside torch: the user's line that was running."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith(TORCH_ROOT)]
    frames = [f for f in frames if "/slimtorch/deploy/" not in f.filename]
    if not frames:
        return ""
    frame = frames[-1]
    return f"{Path(frame.filename).name}:{frame.lineno} in {frame.name}: {(frame.line or '').strip()}"


class _ModuleTracker:
    """Forward hooks that remember which modules are running, so a failure can name the innermost one."""

    def __init__(self, model: nn.Module) -> None:
        self._stack: list[str] = []
        self._handles = []
        for name, module in model.named_modules():
            label = f"{name or '(model)'} ({type(module).__name__})"
            self._handles.append(module.register_forward_pre_hook(self._enter(label)))
            # not always_call: a forward that raises leaves its module on the stack, to be named
            self._handles.append(module.register_forward_hook(self._leave()))

    def _enter(self, label: str):
        def hook(module: nn.Module, args: Any) -> None:
            self._stack.append(label)

        return hook

    def _leave(self):
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if self._stack:
                self._stack.pop()

        return hook

    def innermost(self) -> str:
        return self._stack[-1] if self._stack else ""

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
