"""Unstructured and N:M sparsity: zeros in plain weights, nothing left behind, kept zero while training.

:func:`weights` zeroes the smallest weights in place (no ``weight_orig``, no mask buffers, no hooks), so the
model saves as it is and :func:`slimtorch.save` stores the zeros sparsely. Linear and Conv weights are
pruned, and so are the matrices of ``nn.LSTM`` / ``nn.GRU`` / ``nn.RNN`` (``weight_ih_l*``,
``weight_hh_l*``, ``weight_hr_l*``); the report says which of the model's parameters were left alone.
:func:`keep_sparse` holds those zeros at zero while fine-tuning and :class:`GradualPruner` raises the
sparsity step by step during training (both through :class:`ZeroMasks`); :func:`finalize` turns a model
pruned with ``torch.nn.utils.prune`` into the same plain form.
"""

from __future__ import annotations

import contextlib
import fnmatch
import math
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.utils import prune as torch_prune
from torch.optim.optimizer import register_optimizer_step_post_hook

from slimtorch.errors import OptionError, SlimtorchError

PRUNABLE = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)
RECURRENT = (nn.LSTM, nn.GRU, nn.RNN)
RECURRENT_MATRICES = ("weight_ih_l", "weight_hh_l", "weight_hr_l")  # each pruned as a matrix of its own
METHODS = ("global_magnitude", "layer_magnitude", "n:m")


@dataclass(frozen=True)
class SparsityReport:
    """What is zero: each pruned weight, the pruned weights together, and the whole model.

    ``layers``: share of zeros of each pruned weight (a Linear or Conv layer by its name, a recurrent
    layer's matrices as ``lstm.weight_ih_l0``); ``sparsity``: zeros among those weights; ``skipped``:
    weights N:M could not group, with the reason; ``model_sparsity``: zeros among all the model's
    parameters (biases, norms, embeddings included); ``untouched``: the share of the model's parameters
    that were not pruned, by the type of layer holding them (``{"Embedding": 0.23, "Linear": 0.002}``,
    the Linear share being biases).
    """

    layers: dict[str, float]
    sparsity: float
    skipped: dict[str, str]
    model_sparsity: float = 0.0
    untouched: dict[str, float] | None = None

    @property
    def summary(self) -> str:
        """One line: the pruned weights' sparsity, the model's, and what was left alone."""
        alone = ", ".join(
            f"{kind} ({f'{share:.1%}' if share >= 0.001 else 'under 0.1%'})"
            for kind, share in (self.untouched or {}).items()
        )
        return (
            f"{self.sparsity:.1%} zeros in the {len(self.layers)} weights pruned, "
            f"{self.model_sparsity:.1%} in the whole model"
            + (f"; parameters not pruned, by layer type: {alone}" if alone else "")
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def weights(
    model: nn.Module,
    amount: float | Mapping[str, float],
    *,
    method: str = "global_magnitude",
    n: int = 2,
    m: int = 4,
) -> SparsityReport:
    """Zero the smallest-magnitude weights of every Linear, Conv and recurrent layer, in place.

    Args:
        amount: share of weights to zero, or ``{"glob pattern": share}`` by layer name (or by a recurrent
            matrix's name, ``"lstm.weight_hh_*"``; weights that match no pattern are left alone; the first
            matching pattern wins; each weight then loses its own share).
        method: ``"global_magnitude"`` (one threshold over all weights), ``"layer_magnitude"`` (each weight
            loses ``amount``) or ``"n:m"`` (at most ``n`` non-zeros in every ``m`` consecutive weights
            along the input dimension; ``amount`` then only selects the weights).

    Example:
        >>> model = nn.Sequential(nn.LSTM(16, 64), nn.Linear(64, 10))
        >>> report = weights(model, 0.9)
        >>> round(report.sparsity, 2), round(report.model_sparsity, 2), report.untouched
        (0.9, 0.88, {'LSTM': 0.0237, 'Linear': 0.0005})
    """
    if method not in METHODS:
        raise OptionError(f"method must be one of {', '.join(METHODS)}, not {method!r}")
    targets = _targets(model, amount)
    skipped: dict[str, str] = {}
    with torch.no_grad():
        if method == "n:m":
            if not 0 < n < m:
                raise OptionError(f"n:m needs 0 < n < m, not {n}:{m}")
            for name, (weight, _) in targets.items():
                problem = _n_of_m(weight, n, m)
                if problem:
                    skipped[name] = problem
        elif method == "layer_magnitude" or not isinstance(amount, (int, float)):
            for weight, share in targets.values():
                zero_up_to(weight, magnitude_threshold([weight], share))
        else:
            threshold = magnitude_threshold([weight for weight, _ in targets.values()], float(amount))
            for weight, _ in targets.values():
                zero_up_to(weight, threshold)
    return sparsity_of(model, [name for name in targets if name not in skipped], skipped)


def prunable_weights(model: nn.Module) -> dict[str, nn.Parameter]:
    """Every weight unstructured pruning handles, by name: a Linear or Conv layer's ``weight`` under the
    layer's name, each weight matrix of an LSTM, GRU or RNN under its own (``lstm.weight_ih_l0``); a
    weight shared by several layers appears once.

    Example:
        >>> list(prunable_weights(nn.Sequential(nn.GRU(4, 8), nn.Linear(8, 2))))
        ['0.weight_ih_l0', '0.weight_hh_l0', '1']
    """
    found: dict[str, nn.Parameter] = {}
    seen: set[int] = set()
    for name, module in model.named_modules():
        if isinstance(module, PRUNABLE):
            candidates = [(name, module.weight)]
        elif isinstance(module, RECURRENT):
            candidates = [
                (f"{name}.{attr}" if name else attr, param)
                for attr, param in module.named_parameters(recurse=False)
                if attr.startswith(RECURRENT_MATRICES)
            ]
        else:
            continue
        for key, param in candidates:
            if isinstance(param, nn.Parameter) and id(param) not in seen:
                seen.add(id(param))
                found[key] = param
    return found


def sparsity_of(
    model: nn.Module, names: list[str] | None = None, skipped: Mapping[str, str] | None = None
) -> SparsityReport:
    """The share of zeros of each prunable weight (``names``: only those), of them together, and of the
    whole model, with the parameters left out of ``names`` by layer type.

    Example:
        >>> sparsity_of(nn.Linear(4, 4, bias=False)).sparsity
        0.0
    """
    chosen = {k: w for k, w in prunable_weights(model).items() if names is None or k in names}
    layers, zeros, total = {}, 0, 0
    for key, weight in chosen.items():
        count = int((weight == 0).sum())
        layers[key] = count / weight.numel()
        zeros, total = zeros + count, total + weight.numel()
    pruned = {id(w) for w in chosen.values()}
    model_zeros, model_total, untouched = 0, 0, {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            model_zeros += int((param == 0).sum())
            model_total += param.numel()
            if id(param) not in pruned:
                kind = type(module).__name__
                untouched[kind] = untouched.get(kind, 0) + param.numel()
    shares = {kind: round(count / model_total, 4) for kind, count in untouched.items()} if model_total else {}
    return SparsityReport(
        layers,
        zeros / total if total else 0.0,
        dict(skipped or {}),
        model_zeros / model_total if model_total else 0.0,
        dict(sorted(shares.items(), key=lambda item: -item[1])),
    )


def _targets(model: nn.Module, amount: float | Mapping[str, float]) -> dict[str, tuple[torch.Tensor, float]]:
    targets = {}
    for name, weight in prunable_weights(model).items():
        if isinstance(amount, Mapping):
            owner, _, attr = name.rpartition(".")
            owner = owner if attr.startswith(RECURRENT_MATRICES) else name
            matches = (
                a for p, a in amount.items() if fnmatch.fnmatchcase(name, p) or fnmatch.fnmatchcase(owner, p)
            )
            share = next(matches, None)
        else:
            share = amount
        if share is None:
            continue
        if not 0.0 <= float(share) < 1.0:
            raise OptionError(f"amount for {name} must be at least 0 and below 1, not {share}")
        targets[name] = (weight, float(share))
    if not targets:
        raise SlimtorchError("no Linear, Conv or recurrent layer matches: nothing to prune")
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
                    _check_foldable(module_name, module, name)
                    torch_prune.remove(module, name)
                    folded.append(f"{module_name}.{name}" if module_name else name)
    return folded


def _check_foldable(module_name: str, module: nn.Module, name: str) -> None:
    """Refuse a mask whose shape is not its weight's: ``remove`` would broadcast ``[1, N] x [N, 1]`` into
    N**2 values (a model unpickled from a hostile file can carry any pair)."""
    weight, mask = getattr(module, f"{name}_orig", None), getattr(module, f"{name}_mask", None)
    if isinstance(weight, torch.Tensor) and isinstance(mask, torch.Tensor) and weight.shape != mask.shape:
        where = f"{module_name}.{name}" if module_name else name
        raise SlimtorchError(
            f"cannot finalize {where!r}: its pruning mask {list(mask.shape)} does not have the weight's "
            f"shape {list(weight.shape)}"
        )
