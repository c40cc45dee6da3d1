"""Unstructured and N:M sparsity: zeros in plain weights, nothing left behind, kept zero while training.

:func:`weights` zeroes the smallest weights in place (no ``weight_orig``, no mask buffers, no hooks), so the
model saves as it is and :func:`slimtorch.save` stores the zeros sparsely. :func:`keep_sparse` holds those
zeros at zero while fine-tuning; :class:`GradualPruner` raises the sparsity step by step during training;
:func:`finalize` turns a model pruned with ``torch.nn.utils.prune`` into the same plain form.
"""

from __future__ import annotations

import contextlib
import fnmatch
import math
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass

import torch
from torch import nn
from torch.nn.utils import prune as torch_prune

from slimtorch.errors import SlimtorchError

PRUNABLE = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)
METHODS = ("global_magnitude", "layer_magnitude", "n:m")


@dataclass(frozen=True)
class SparsityReport:
    """Zeros per pruned weight and overall; ``skipped``: layers N:M could not group, with the reason."""

    layers: dict[str, float]
    sparsity: float
    skipped: dict[str, str]

    def to_dict(self) -> dict:
        return asdict(self)


def weights(
    model: nn.Module,
    amount: float | Mapping[str, float],
    *,
    method: str = "global_magnitude",
    n: int = 2,
    m: int = 4,
) -> SparsityReport:
    """Zero the smallest-magnitude weights of every Linear and Conv layer, in place.

    Args:
        amount: share of weights to zero, or ``{"glob pattern": share}`` by layer name (layers that match
            no pattern are left alone; the first matching pattern wins; each layer then loses its own share).
        method: ``"global_magnitude"`` (one threshold over all layers), ``"layer_magnitude"`` (each layer
            loses ``amount``) or ``"n:m"`` (at most ``n`` non-zeros in every ``m`` consecutive weights
            along the input dimension; ``amount`` then only selects the layers).

    Example:
        >>> model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
        >>> round(weights(model, 0.9).sparsity, 2)
        0.9
    """
    if method not in METHODS:
        raise SlimtorchError(f"method must be one of {', '.join(METHODS)}, not {method!r}")
    targets = _targets(model, amount)
    skipped: dict[str, str] = {}
    with torch.no_grad():
        if method == "n:m":
            if not 0 < n < m:
                raise SlimtorchError(f"n:m needs 0 < n < m, not {n}:{m}")
            for name, (module, _) in targets.items():
                problem = _n_of_m(module.weight, n, m)
                if problem:
                    skipped[name] = problem
        elif method == "layer_magnitude" or not isinstance(amount, (int, float)):
            for module, share in targets.values():
                zero_up_to(module.weight, magnitude_threshold([module.weight], share))
        else:
            threshold = magnitude_threshold([module.weight for module, _ in targets.values()], float(amount))
            for module, _ in targets.values():
                zero_up_to(module.weight, threshold)
    return sparsity_of(model, [name for name in targets if name not in skipped], skipped)


def sparsity_of(
    model: nn.Module, names: list[str] | None = None, skipped: Mapping[str, str] | None = None
) -> SparsityReport:
    """The share of zeros of each prunable layer's weight (``names``: only those) and overall."""
    layers, zeros, total = {}, 0, 0
    for name, module in model.named_modules():
        if isinstance(module, PRUNABLE) and (names is None or name in names):
            count = int((module.weight == 0).sum())
            layers[name] = count / module.weight.numel()
            zeros, total = zeros + count, total + module.weight.numel()
    return SparsityReport(layers, zeros / total if total else 0.0, dict(skipped or {}))


def _targets(model: nn.Module, amount: float | Mapping[str, float]) -> dict[str, tuple[nn.Module, float]]:
    targets = {}
    for name, module in model.named_modules():
        if not isinstance(module, PRUNABLE):
            continue
        if isinstance(amount, Mapping):
            share = next((a for pattern, a in amount.items() if fnmatch.fnmatchcase(name, pattern)), None)
        else:
            share = amount
        if share is None:
            continue
        if not 0.0 <= float(share) < 1.0:
            raise SlimtorchError(f"amount for {name} must be at least 0 and below 1, not {share}")
        targets[name] = (module, float(share))
    if not targets:
        raise SlimtorchError("no Linear or Conv layer matches: nothing to prune")
    return targets


def magnitude_threshold(tensors: list[torch.Tensor], share: float) -> float | None:
    """The magnitude at or below which ``share`` of the values lie (None: prune nothing)."""
    count = sum(t.numel() for t in tensors)
    k = math.floor(count * share)
    if k == 0:
        return None
    magnitudes = torch.cat([t.detach().abs().reshape(-1).float() for t in tensors])
    return float(magnitudes.kthvalue(k).values)


def zero_up_to(weight: torch.Tensor, threshold: float | None) -> None:
    if threshold is not None:
        weight.masked_fill_(weight.abs() <= threshold, 0)


def _n_of_m(weight: torch.Tensor, n: int, m: int) -> str | None:
    """Keep the ``n`` largest of every ``m`` consecutive input weights; returns why a layer was skipped."""
    inputs = weight.shape[1]
    if inputs % m:
        return f"{inputs} inputs are not a multiple of {m}"
    grouped = weight.movedim(1, -1).reshape(-1, m)  # [out, (kh, kw,) in] -> groups of m inputs
    smallest = grouped.abs().topk(m - n, dim=1, largest=False).indices
    pruned = grouped.scatter(1, smallest, 0.0)
    weight.copy_(pruned.reshape(weight.movedim(1, -1).shape).movedim(-1, 1))
    return None


@contextlib.contextmanager
def keep_sparse(model: nn.Module) -> Iterator[dict[str, torch.Tensor]]:
    """Hold every pruned weight's zeros at zero while fine-tuning inside the block.

    Gradients of zeroed weights are zeroed as they are accumulated, and the weights are masked again
    before every forward, so neither the optimizer (momentum, weight decay) nor anything else brings them
    back. The hooks are gone when the block ends.

    Example:
        >>> with keep_sparse(model):  # doctest: +SKIP
        ...     train(model, optimizer, data)
    """
    masks: dict[str, torch.Tensor] = {}
    handles = []
    for name, module in model.named_modules():
        if not isinstance(module, PRUNABLE) or not bool((module.weight == 0).any()):
            continue
        mask = module.weight.detach() != 0
        masks[name] = mask
        handles.append(module.weight.register_hook(lambda grad, mask=mask: grad * mask))
        remask = module.register_forward_pre_hook(lambda mod, args, mask=mask: _mask(mod.weight, mask))
        handles.append(remask)
    try:
        yield masks
    finally:
        for handle in handles:
            handle.remove()
        modules = dict(model.named_modules())
        for name, mask in masks.items():
            _mask(modules[name].weight, mask)


def _mask(weight: torch.Tensor, mask: torch.Tensor) -> None:
    with torch.no_grad():
        weight.mul_(mask)


class GradualPruner:
    """Raise sparsity from 0 to ``amount`` between ``start`` and ``end`` steps (Zhu and Gupta's cubic
    schedule: fast at first, gently at the end); call :meth:`step` after each optimizer step.

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
            raise SlimtorchError("a schedule needs start < end and every >= 1")
        self.model, self.amount, self.method = model, amount, method
        self.start, self.end, self.every = start, end, every
        self.steps = 0

    def target(self, step: int) -> float:
        """The sparsity the schedule asks for at ``step``."""
        progress = min(1.0, max(0.0, (step - self.start) / (self.end - self.start)))
        return self.amount * (1 - (1 - progress) ** 3)

    def step(self) -> float | None:
        """Advance one step; prune to the schedule's sparsity when it is due. Returns the sparsity set."""
        self.steps += 1
        on_beat = (self.steps - self.start) % self.every == 0 or self.steps == self.end
        if self.steps < self.start or self.steps > self.end or not on_beat:
            return None
        share = self.target(self.steps)
        weights(self.model, share, method=self.method)
        return share


def finalize(model: nn.Module) -> list[str]:
    """Fold ``torch.nn.utils.prune`` re-parametrisations (``weight = weight_orig * weight_mask``) into plain
    parameters and drop their masks and hooks; returns the names folded.

    Example:
        >>> torch.nn.utils.prune.l1_unstructured(layer, "weight", amount=0.5)  # doctest: +SKIP
        >>> finalize(model)  # doctest: +SKIP
        ['layer.weight']
    """
    folded = []
    for module_name, module in model.named_modules():
        for hook in list(module._forward_pre_hooks.values()):
            names = [h._tensor_name for h in getattr(hook, "_pruning_methods", [hook])]
            if isinstance(hook, torch_prune.BasePruningMethod):
                for name in dict.fromkeys(names):
                    torch_prune.remove(module, name)
                    folded.append(f"{module_name}.{name}" if module_name else name)
    return folded
