"""Sparsity while training: zeros left by :func:`~slimtorch.prune.weights` stay zero, whatever trains.

:class:`ZeroMasks` holds them with three hooks (gradients, every optimizer's step, the model's forward);
:func:`keep_sparse` does it for one ``with`` block of fine-tuning and :class:`GradualPruner` raises the
sparsity step by step during training (Zhu and Gupta's schedule).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from slimtorch.errors import OptionError
from slimtorch.prune.unstructured import prunable_weights, weights


class ZeroMasks:
    """Hold the zeros of a model's prunable weights at zero, whatever trains it, until :meth:`remove`.

    Masking the gradients is not enough: momentum, and Adam's moments gathered before a weight was pruned,
    move it again with a zero gradient. So three hooks: each weight's gradient is masked (plain SGD, and
    weight decay, then never move a zero); the weights are masked again after the step of every
    ``torch.optim`` optimizer that holds one of them (a global step post-hook: no optimizer needs naming);
    and before every forward of the model, should anything else have moved them (written only then, so a
    graph still waiting for its backward is left intact). :meth:`update` takes the weights' zeros now as
    the masks, after pruning further.

    Example:
        >>> masks = ZeroMasks(model)  # doctest: +SKIP
        >>> train(model, torch.optim.AdamW(model.parameters()))  # doctest: +SKIP
        >>> masks.remove()  # doctest: +SKIP
    """

    def __init__(self, model: nn.Module) -> None:
        self.weights = prunable_weights(model)
        self.masks: dict[str, torch.Tensor] = {}
        """weight name -> True where the weight may be non-zero; weights with no zero have none"""
        self.update()
        ids, me = {id(w) for w in self.weights.values()}, weakref.ref(self)

        def after_step(optimizer: torch.optim.Optimizer, *_: Any) -> None:
            masks = me()  # weak: a global hook must not keep a forgotten model alive
            if masks is not None and any(id(p) in ids for g in optimizer.param_groups for p in g["params"]):
                masks.apply()

        self._handles = [w.register_hook(self._gradient_hook(k)) for k, w in self.weights.items()]
        every_optimizer = register_optimizer_step_post_hook(after_step)
        weakref.finalize(self, every_optimizer.remove)
        self._handles.append(every_optimizer)
        self._handles.append(
            model.register_forward_pre_hook(lambda module, args: self.apply(moved_only=True))
        )

    def update(self) -> None:
        """Take each weight's zeros now as its mask (call after pruning further)."""
        with torch.no_grad():
            masks = {k: w != 0 for k, w in self.weights.items()}
        self.masks = {k: mask for k, mask in masks.items() if not bool(mask.all())}

    def apply(self, *, moved_only: bool = False) -> None:
        """Zero every masked weight again (``moved_only``: only weights with a masked entry not zero)."""
        with torch.no_grad():
            for key in self.masks:
                weight = self.weights[key]
                mask = self._mask(key, weight)
                if not moved_only or bool(weight.masked_select(~mask).any()):
                    weight.mul_(mask)

    def remove(self) -> None:
        """Drop every hook (the zeros stay where they are)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _mask(self, key: str, like: torch.Tensor) -> torch.Tensor:
        mask = self.masks[key]
        if mask.device != like.device:  # the model moved since the masks were taken
            mask = self.masks[key] = mask.to(like.device)
        return mask

    def _gradient_hook(self, key: str):
        def hook(grad: torch.Tensor) -> torch.Tensor | None:
            return grad * self._mask(key, grad) if key in self.masks else None

        return hook


@contextlib.contextmanager
def keep_sparse(model: nn.Module) -> Iterator[dict[str, torch.Tensor]]:
    """Hold every pruned weight's zeros at zero while fine-tuning inside the block, with any optimizer
    (see :class:`ZeroMasks`): exact after every optimizer step. The hooks are gone when the block ends.

    Example:
        >>> with keep_sparse(model):  # doctest: +SKIP
        ...     train(model, torch.optim.AdamW(model.parameters(), weight_decay=0.01), data)
    """
    masks = ZeroMasks(model)
    try:
        yield masks.masks
    finally:
        masks.remove()
        masks.apply()


class GradualPruner:
    """Raise sparsity from 0 to ``amount`` between ``start`` and ``end`` steps (Zhu and Gupta's cubic
    schedule: fast at first, gently at the end); call :meth:`step` after each optimizer step.

    Zeros hold between pruning steps, with any optimizer (a :class:`ZeroMasks` on the model): the weights
    are exact after every optimizer step and every :meth:`step`. :meth:`remove` (or leaving a ``with``
    block) drops the hooks once training is over.

    Example:
        >>> pruner = GradualPruner(model, 0.9, start=0, end=1000, every=100)  # doctest: +SKIP
        >>> for batch in data:  # doctest: +SKIP
        ...     train_step(batch); pruner.step()
    """

    def __init__(
        self,
        model: nn.Module,
        amount: float,
        *,
        start: int,
        end: int,
        every: int = 1,
        method: str = "global_magnitude",
    ) -> None:
        if end <= start or every < 1:
            raise OptionError("a schedule needs start < end and every >= 1")
        self.model, self.amount, self.method = model, amount, method
        self.start, self.end, self.every = start, end, every
        self.steps = 0
        self.masks = ZeroMasks(model)

    def target(self, step: int) -> float:
        """The sparsity the schedule asks for at ``step``."""
        progress = min(1.0, max(0.0, (step - self.start) / (self.end - self.start)))
        return self.amount * (1 - (1 - progress) ** 3)

    def step(self) -> float | None:
        """Advance one step; prune to the schedule's sparsity when it is due. Returns the sparsity set."""
        self.steps += 1
        self.masks.apply()  # first undo what the optimizer moved, so old zeros stay among the smallest
        on_beat = (self.steps - self.start) % self.every == 0 or self.steps == self.end
        if self.steps < self.start or self.steps > self.end or not on_beat:
            return None
        share = self.target(self.steps)
        weights(self.model, share, method=self.method)
        self.masks.update()
        return share

    def remove(self) -> None:
        """Drop the hooks that hold the zeros (they stay zero until the weights are trained again)."""
        self.masks.apply()
        self.masks.remove()

    def __enter__(self) -> GradualPruner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()
