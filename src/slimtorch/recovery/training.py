"""recover: win back what pruning cost, by fine-tuning or by distilling from the original model.

:func:`recover` trains a pruned student on any iterable of ``(inputs, targets)`` batches (a DataLoader):

- with ``teacher``: Hinton's distillation loss, KL divergence between the temperature-softened outputs,
  scaled by T squared, mixed with the task loss by ``alpha``; ``features`` adds FitNets-style matching of
  intermediate outputs through a learned 1x1 adapter, since a pruned layer is narrower than its original;
- BatchNorm statistics are re-estimated on the training data first (pruning changes what they describe);
- zeros left by unstructured pruning stay zero, whatever the optimizer (:func:`slimtorch.prune.keep_sparse`);
- ``eval_fn`` is called every ``eval_every`` steps and at the end; training stops once it reaches
  ``target``.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from slimtorch.errors import OptionError, SlimtorchError
from slimtorch.format.progress import Progress, task
from slimtorch.format.verbs import NOT_JSON, Report, resolve
from slimtorch.prune.sparse_training import keep_sparse
from slimtorch.recovery.data import output_tensor

BN_BATCHES = 50


@dataclass(frozen=True)
class RecoverOptions:
    """How :func:`recover` trains: how long (exactly one of ``steps`` or ``epochs``), how fast, how much
    it listens to a teacher, and when it stops.

    Example:
        >>> RecoverOptions(epochs=3, lr=1e-3).alpha
        0.9
    """

    steps: int | None = None
    """optimizer steps to run (going round the data as often as needed)"""
    epochs: int | None = None
    """instead of ``steps``: passes over the data (it needs a length, as a DataLoader has)"""
    lr: float = 1e-3
    """the default AdamW's learning rate"""
    weight_decay: float = 0.0
    """the default AdamW's weight decay"""
    temperature: float = 4.0
    """softens the teacher's and the student's outputs in the distillation loss (positive)"""
    alpha: float = 0.9
    """the distillation loss's share of the loss, 0 to 1 (the task loss has the rest)"""
    features: Mapping[str, str] | None = None
    """student module name -> teacher module name whose outputs are matched too (FitNets)"""
    feature_weight: float = 1.0
    """the weight of the feature-matching loss"""
    target: float | None = None
    """stop once ``eval_fn`` reaches this"""
    eval_every: int | None = None
    """call ``eval_fn`` every this many steps (None: ten times in all), and at the end"""
    recalibrate_bn: bool = True
    """re-estimate BatchNorm statistics on the training data first (pruning changed what they describe)"""

    def __post_init__(self) -> None:
        if self.features is not None:
            object.__setattr__(self, "features", dict(self.features))  # the caller's later edits stay out
        if self.steps is not None and self.epochs is not None:
            raise OptionError("give exactly one of steps or epochs")
        if not 0.0 <= self.alpha <= 1.0 or self.temperature <= 0:
            raise OptionError("alpha must be in [0, 1] and temperature positive")
        if self.eval_every is not None and self.eval_every < 1:
            raise OptionError(f"eval_every must be at least 1, not {self.eval_every}")


@dataclass(frozen=True)
class RecoverReport(Report):
    """What :func:`recover` did: steps run, the last loss, the metric over time, whether it stopped early,
    and the trained model."""

    SCHEMA = "slimtorch.recover/1"

    steps: int
    final_loss: float
    metrics: list[tuple[int, float]] = field(default_factory=list)
    """(step, eval_fn's value) each time it was called"""
    stopped_early: bool = False
    model: nn.Module | None = field(default=None, repr=False, compare=False, metadata=NOT_JSON)
    """the student, trained in place"""


def recover(
    student: nn.Module,
    train_data: Iterable,
    /,
    options: RecoverOptions | None = None,
    *,
    teacher: nn.Module | None = None,
    eval_fn: Callable[[nn.Module], float] | None = None,
    optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer] | None = None,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.cross_entropy,
    progress: Progress | None = None,
    **overrides: Any,
) -> RecoverReport:
    """Fine-tune (or, with ``teacher``, distil into) ``student`` in place; returns a :class:`RecoverReport`
    that holds it.

    ``options`` is a :class:`RecoverOptions` (``overrides`` replace its fields: ``epochs=3``).
    ``optimizer`` makes the optimizer from the parameters to train (default: AdamW with ``lr`` and
    ``weight_decay``); whichever it is, zeros from unstructured pruning stay zero. ``progress`` is told of
    each step (None: silent).

    Example:
        >>> report = recover(pruned, loader, teacher=dense, epochs=3, eval_fn=accuracy)  # doctest: +SKIP
    """
    options = resolve(RecoverOptions, options, overrides, "recover")
    total = _total_steps(options, train_data)
    if options.recalibrate_bn:
        recalibrate_batchnorm(student, train_data)
    adapters = _Matcher(student, teacher, options.features) if options.features else None
    if adapters is not None:
        first = _to(next(iter(train_data))[0], _device_of(student))
        adapters.prepare(first)  # widths known before the optimizer
    trainable = list(student.parameters()) + (list(adapters.parameters()) if adapters else [])
    stepper: torch.optim.Optimizer
    if optimizer is None:
        stepper = torch.optim.AdamW(trainable, lr=options.lr, weight_decay=options.weight_decay)
    else:
        stepper = optimizer(trainable)
    every = options.eval_every or max(1, total // 10)
    metrics: list[tuple[int, float]] = []
    loss_value, step, stopped = float("nan"), 0, False
    device = _device_of(student)
    with (
        contextlib.closing(adapters) if adapters is not None else contextlib.nullcontext(),
        keep_sparse(student),
        task(progress, "recovering", total, unit="steps") as advance,
    ):
        if teacher is not None:
            teacher.eval()
        for inputs, targets in _batches(train_data, total):
            inputs, targets = _to(inputs, device), _to(targets, device)
            student.train()
            loss = _loss(student, teacher, inputs, targets, loss_fn, options.temperature, options.alpha)
            if adapters is not None:
                loss = loss + options.feature_weight * adapters.loss()
            stepper.zero_grad(set_to_none=True)
            loss.backward()
            stepper.step()
            step, loss_value = step + 1, float(loss.detach())
            if eval_fn is not None and (step % every == 0 or step == total):
                metrics.append((step, _evaluate(student, eval_fn)))
                stopped = options.target is not None and metrics[-1][1] >= options.target and step < total
            advance(1)
            if stopped:
                break
    student.eval()
    return RecoverReport(step, loss_value, metrics, stopped, student)


def recalibrate_batchnorm(model: nn.Module, data: Iterable, batches: int = BN_BATCHES) -> int:
    """Re-estimate every BatchNorm's running mean and variance from ``batches`` batches of ``data`` (a
    cumulative average, no gradients, weights untouched); returns the batches used."""
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if not norms:
        return 0
    momenta = [m.momentum for m in norms]
    for norm in norms:
        norm.reset_running_stats()
        norm.momentum = None  # cumulative moving average over the batches below
    was_training = model.training
    model.train()
    used, device = 0, _device_of(model)
    with torch.no_grad():
        for inputs, _ in itertools.islice(data, batches):
            model(_to(inputs, device))
            used += 1
    for norm, momentum in zip(norms, momenta, strict=True):
        norm.momentum = momentum
    model.train(was_training)
    return used


def distillation_loss(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float
) -> torch.Tensor:
    """Hinton et al.: KL(softmax(t / T) || softmax(s / T)) * T^2 (the T^2 keeps gradients comparable)."""
    return (
        F.kl_div(
            F.log_softmax(student_logits / temperature, dim=-1),
            F.log_softmax(teacher_logits / temperature, dim=-1),
            reduction="batchmean",
            log_target=True,
        )
        * temperature**2
    )


def _loss(student, teacher, inputs, targets, loss_fn, temperature: float, alpha: float) -> torch.Tensor:
    logits = output_tensor(student(inputs))  # a Hugging Face model's ModelOutput: its logits
    task = loss_fn(logits, targets)
    if teacher is None:
        return task
    with torch.no_grad():
        reference = output_tensor(teacher(inputs))
    return alpha * distillation_loss(logits, reference, temperature) + (1 - alpha) * task


class _Matcher:
    """Forward hooks that catch named student and teacher outputs, and 1x1 adapters from each student
    output's channels to its teacher's (pruned layers are narrower)."""

    def __init__(self, student: nn.Module, teacher: nn.Module | None, pairs: Mapping[str, str]) -> None:
        if teacher is None:
            raise SlimtorchError("features needs a teacher")
        students, teachers = dict(student.named_modules()), dict(teacher.named_modules())
        self.student, self.teacher = student, teacher
        self.pairs = dict(pairs)
        self.outputs: dict[str, torch.Tensor] = {}
        self.adapters: dict[str, nn.Module] = {}
        self.handles = []
        for s_name, t_name in self.pairs.items():
            for name, modules, key in ((s_name, students, f"s:{s_name}"), (t_name, teachers, f"t:{t_name}")):
                if name not in modules:
                    raise SlimtorchError(f"features: no module named {name!r}")
                self.handles.append(modules[name].register_forward_hook(self._keeper(key)))

    def _keeper(self, key: str):
        def keep(module: nn.Module, inputs: tuple, output: torch.Tensor) -> None:
            self.outputs[key] = output

        return keep

    def prepare(self, inputs: torch.Tensor) -> None:
        """One forward of both models on a batch, to size an adapter per pair."""
        with torch.no_grad():
            self.student(inputs)
            self.teacher(inputs)
        for s_name, t_name in self.pairs.items():
            mine, theirs = self.outputs[f"s:{s_name}"], self.outputs[f"t:{t_name}"]
            self.adapters[s_name] = _adapter(mine.shape[1], theirs.shape[1], mine.dim()).to(mine.device)

    def parameters(self) -> list[nn.Parameter]:
        return [p for adapter in self.adapters.values() for p in adapter.parameters()]

    def loss(self) -> torch.Tensor:
        losses = []
        for s_name, t_name in self.pairs.items():
            mine, theirs = self.outputs[f"s:{s_name}"], self.outputs[f"t:{t_name}"].detach()
            losses.append(F.mse_loss(self.adapters[s_name](mine), theirs))
        return torch.stack(losses).sum()

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


def _adapter(width_in: int, width_out: int, rank: int) -> nn.Module:
    if width_in == width_out:
        return nn.Identity()
    if rank == 4:
        return nn.Conv2d(width_in, width_out, 1, bias=False)
    if rank == 2:
        return nn.Linear(width_in, width_out, bias=False)
    raise SlimtorchError(f"features: cannot match {rank}-d outputs of different widths")


def _device_of(model: nn.Module) -> torch.device:
    return next((p.device for p in model.parameters()), torch.device("cpu"))


def _to(value: Any, device: torch.device) -> Any:
    """A batch's tensor on the model's device (other values as they are)."""
    return value.to(device) if isinstance(value, torch.Tensor) else value


def _evaluate(model: nn.Module, eval_fn: Callable[[nn.Module], float]) -> float:
    model.eval()
    with torch.no_grad():
        return float(eval_fn(model))


def _batches(data: Iterable, total: int):
    """``total`` batches, going round ``data`` as many times as needed."""
    produced = 0
    while produced < total:
        empty = True
        for batch in data:
            empty = False
            yield batch
            produced += 1
            if produced >= total:
                return
        if empty:
            raise SlimtorchError("the training data yielded no batch")


def _total_steps(options: RecoverOptions, data: Iterable) -> int:
    """The steps to run: ``steps``, or ``epochs`` passes over ``data`` (one of the two must be given)."""
    if options.steps is not None:
        return options.steps
    if options.epochs is None:
        raise OptionError("give exactly one of steps or epochs")
    return options.epochs * _length(data)


def _length(data: Iterable) -> int:
    try:
        return len(data)  # type: ignore[arg-type]
    except TypeError:
        raise SlimtorchError("epochs needs data with a length (a DataLoader); give steps instead") from None
