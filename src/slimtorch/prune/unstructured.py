"""Unstructured and N:M sparsity: zeros in plain weights, nothing left behind.

:func:`weights` zeroes the smallest weights in place (no ``weight_orig``, no mask buffers, no hooks), so the
model saves as it is and :func:`slimtorch.save` stores the zeros sparsely. Linear and Conv weights are
pruned, and so are the matrices of ``nn.LSTM`` / ``nn.GRU`` / ``nn.RNN`` (``weight_ih_l*``,
``weight_hh_l*``, ``weight_hr_l*``); the report says which of the model's parameters were left alone.
:func:`finalize` turns a model pruned with ``torch.nn.utils.prune`` into the same plain form;
:mod:`slimtorch.prune.sparse_training` keeps the zeros at zero while training.
"""

from __future__ import annotations

import difflib
import fnmatch
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn
from torch.nn.utils import prune as torch_prune

from slimtorch.calibration.moments import out_in
from slimtorch.errors import OptionError, SlimtorchError
from slimtorch.format.pending import wait_for_checks
from slimtorch.format.progress import Progress, announcer
from slimtorch.format.verbs import NOT_JSON, Report, resolve
from slimtorch.graph.layers import is_hf_conv1d
from slimtorch.prune.calibrated import calibrated

PRUNABLE = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)
RECURRENT = (nn.LSTM, nn.GRU, nn.RNN)
RECURRENT_MATRICES = ("weight_ih_l", "weight_hh_l", "weight_hr_l")  # each pruned as a matrix of its own
CALIBRATED = ("wanda", "sparsegpt")
"""methods that choose the zeros from calibration data (:mod:`slimtorch.prune.calibrated`)"""
METHODS = ("global_magnitude", "layer_magnitude", "n:m", *CALIBRATED)


@dataclass(frozen=True)
class SparsityOptions:
    """How :func:`weights` zeroes: how many weights (``amount``) and how they are chosen (``method``).

    Example:
        >>> SparsityOptions(0.5, method="n:m").n
        2
    """

    amount: float | Mapping[str, float] | None = None
    """share of weights to zero, or ``{"glob pattern": share}`` by layer name (or by a recurrent matrix's
    name, ``"lstm.weight_hh_*"``; weights that match no pattern are left alone; the first matching pattern
    wins; each weight then loses its own share); :func:`weights` needs one"""
    method: str = "global_magnitude"
    """``"global_magnitude"`` (one threshold over all weights), ``"layer_magnitude"`` (each weight loses
    ``amount``), ``"n:m"`` (at most ``n`` non-zeros in every ``m`` consecutive weights along the input
    dimension, the smallest zeroed; ``amount`` then only selects the weights), or from calibration data
    (:func:`weights`'s ``data``) ``"wanda"`` (the lowest ``|w| * ||x||`` of each output row) or
    ``"sparsegpt"`` (chosen by the output error they cost, the weights kept updated to make up for them):
    each layer loses ``amount``, or with ``n_m`` keeps that pattern"""
    n: int = 2
    """non-zeros kept in every ``m`` consecutive weights (``method="n:m"``)"""
    m: int = 4
    """the width of an N:M group (``method="n:m"``)"""
    skip: tuple[str, ...] = ()
    """glob patterns of layers (or of modules holding them, or recurrent matrices) whose weights stay
    dense; the rest are pruned as if the skipped ones were not there; a pattern that matches none is an
    error"""
    n_m: str | None = None
    """an N:M pattern (``"2:4"``) for ``"wanda"``, ``"sparsegpt"`` or the magnitude methods: at most N
    non-zeros in every M consecutive inputs, the lowest scores of each group zeroed; ``amount`` then only
    selects the weights (None: every one)"""

    def __post_init__(self) -> None:
        if isinstance(self.amount, Mapping):
            object.__setattr__(self, "amount", dict(self.amount))  # the caller's later edits stay out
        object.__setattr__(self, "skip", (self.skip,) if isinstance(self.skip, str) else tuple(self.skip))
        shares = self.amount.values() if isinstance(self.amount, Mapping) else [self.amount]
        for share in shares:
            if share is not None and not 0.0 <= float(share) < 1.0:
                raise OptionError(f"amount must be at least 0 and below 1, not {share}")
        if self.method not in METHODS:
            raise OptionError(f"method must be one of {', '.join(METHODS)}, not {self.method!r}")
        if self.method == "n:m" and not 0 < self.n < self.m:
            raise OptionError(f"n:m needs 0 < n < m, not {self.n}:{self.m}")
        if self.n_m is not None:
            if self.method == "n:m":
                raise OptionError('n_m names the pattern of another method: method="n:m" has n and m')
            parse_n_m(self.n_m)

    @property
    def pattern(self) -> tuple[int, int] | None:
        """``(n, m)`` where the weights keep an N:M pattern, else None."""
        if self.method == "n:m":
            return self.n, self.m
        return parse_n_m(self.n_m) if self.n_m is not None else None


def parse_n_m(text: object) -> tuple[int, int]:
    """``"2:4"`` -> ``(2, 4)``; an :class:`OptionError` for anything but N:M with 0 < N < M.

    Example:
        >>> parse_n_m("2:4")
        (2, 4)
    """
    n, sep, m = str(text).partition(":")
    if not (sep and n.isdigit() and m.isdigit() and 0 < int(n) < int(m)):
        raise OptionError(f"n_m must be N:M with 0 < N < M, such as 2:4, not {str(text)[:40]!r}")
    return int(n), int(m)


@dataclass(frozen=True)
class SparsityReport(Report):
    """What is zero: each pruned weight, the pruned weights together, and the whole model.

    ``layers``: share of zeros of each pruned weight (a Linear or Conv layer by its name, a recurrent
    layer's matrices as ``lstm.weight_ih_l0``); ``sparsity``: zeros among those weights; ``skipped``:
    weights N:M could not group, with the reason; ``model_sparsity``: zeros among all the model's
    parameters (biases, norms, embeddings included); ``untouched``: the share of the model's parameters
    that were not pruned, by the type of layer holding them (``{"Embedding": 0.23, "Linear": 0.002}``,
    the Linear share being biases); ``method``: how the zeros were chosen (with ``:2:4`` for a pattern
    other than ``"n:m"``'s); ``by_magnitude``: with ``"wanda"`` or ``"sparsegpt"``, the weights pruned by
    magnitude instead, with the reason; ``notes``: how the calibration ran; ``model``: the model, pruned
    in place.
    """

    SCHEMA = "slimtorch.sparsity/1"

    layers: dict[str, float]
    sparsity: float
    skipped: dict[str, str]
    model_sparsity: float = 0.0
    untouched: dict[str, float] | None = None
    method: str = ""
    by_magnitude: dict[str, str] = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    model: nn.Module | None = field(default=None, repr=False, compare=False, metadata=NOT_JSON)

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


def weights(
    model: nn.Module,
    /,
    options: SparsityOptions | float | Mapping[str, float] | None = None,
    *,
    data: Iterable[Any] | None = None,
    progress: Progress | None = None,
    **overrides: Any,
) -> SparsityReport:
    """Zero weights of every Linear, Conv and recurrent layer in place: the smallest magnitudes, or those
    Wanda or SparseGPT choose from calibration ``data``.

    ``options`` is a :class:`SparsityOptions`, or for short its ``amount`` alone (``weights(model, 0.9)``,
    ``weights(model, {"features.*": 0.5})``); ``overrides`` replace its fields (``method="n:m"``).
    ``data``: sample inputs for ``method="wanda"`` or ``"sparsegpt"`` (each a tensor, a tuple of
    arguments or a dict of keyword arguments; a language model's: a few batches of token ids, 128
    sequences of 2048 tokens in the papers); a model of repeated blocks is calibrated one block at a time
    (:mod:`slimtorch.calibration.sequential`). ``progress`` is told which block is calibrated.

    Example:
        >>> model = nn.Sequential(nn.LSTM(16, 64), nn.Linear(64, 10))
        >>> report = weights(model, 0.9)
        >>> round(report.sparsity, 2), round(report.model_sparsity, 2), report.untouched
        (0.9, 0.88, {'LSTM': 0.0237, 'Linear': 0.0005})
    """
    if isinstance(options, bool):  # an int to Python, but no amount: refused as resolve refuses it
        raise OptionError("prune.weights: options must be a SparsityOptions, not bool")
    if isinstance(options, (int, float, Mapping)):
        options = SparsityOptions(amount=options)
    options = resolve(SparsityOptions, options, overrides, "prune.weights")
    wait_for_checks(model)  # magnitudes are read outside a forward
    amount, method, pattern = options.amount, options.method, options.pattern
    if amount is None and pattern is None:
        raise OptionError("prune.weights needs an amount: weights(model, 0.9) or amount={'layer.*': 0.5}")
    if method in CALIBRATED and data is None:
        raise OptionError(
            f"{method} chooses the zeros from calibration data: weights(model, 0.5, method={method!r}, "
            "data=batches)"
        )
    if method not in CALIBRATED and data is not None:
        raise OptionError(f"data is read by wanda and sparsegpt only, not by {method}")
    share = 1 - pattern[0] / pattern[1] if pattern else 0.0  # with a pattern, amount only selects
    targets = _as_matrices(model, _targets(model, share if amount is None else amount, options.skip))
    skipped = _tied_elsewhere(model, targets)
    targets = {name: target for name, target in targets.items() if name not in skipped}
    by_magnitude: dict[str, str] = {}
    notes: list[str] = []
    with torch.no_grad():
        if pattern is not None:
            for name, (weight, _) in targets.items():
                problem = _groups_problem(weight, pattern)
                if problem:
                    skipped[name] = problem
            targets = {name: target for name, target in targets.items() if name not in skipped}
        if method in CALIBRATED:
            assert data is not None  # refused above
            say = announcer(progress)
            by_magnitude, notes = calibrated(model, targets, method, pattern, data, say)
        elif pattern is not None:
            for weight, _ in targets.values():
                _n_of_m(weight, *pattern)
        elif method == "layer_magnitude" or not isinstance(amount, (int, float)):
            for weight, layer_share in targets.values():
                zero_up_to(weight, magnitude_threshold([weight], layer_share))
        else:
            threshold = magnitude_threshold([weight for weight, _ in targets.values()], float(amount))
            for weight, _ in targets.values():
                zero_up_to(weight, threshold)
    label = method if pattern is None or method == "n:m" else f"{method}:{pattern[0]}:{pattern[1]}"
    report = sparsity_of(model, list(targets), skipped)
    return replace(report, method=label, by_magnitude=by_magnitude, notes=tuple(notes))


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
        if isinstance(module, PRUNABLE) or is_hf_conv1d(module):
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
    model_zeros, model_total = 0, 0
    untouched: dict[str, int] = {}  # layer type -> parameters not pruned
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
        model=model,
    )


def _targets(
    model: nn.Module, amount: float | Mapping[str, float], skip: tuple[str, ...] = ()
) -> dict[str, tuple[torch.Tensor, float]]:
    targets: dict[str, tuple[torch.Tensor, float]] = {}
    for name, weight in _without_skipped(prunable_weights(model), skip).items():
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
        targets[name] = (weight, float(share))
    if not targets:
        raise SlimtorchError("no Linear, Conv or recurrent layer matches: nothing to prune")
    return targets


def _without_skipped(found: dict[str, nn.Parameter], skip: tuple[str, ...]) -> dict[str, nn.Parameter]:
    """``found`` less the weights a ``skip`` pattern names, itself or through a module holding it
    (``features`` skips ``features.0``); a pattern that names none is an :class:`OptionError`."""
    skipped: set[str] = set()
    for pattern in skip:
        hits = {name for name in found if any(fnmatch.fnmatchcase(p, pattern) for p in _prefixes(name))}
        if not hits:
            closest = difflib.get_close_matches(pattern, list(found), n=3, cutoff=0.4)
            shown = f" (closest: {', '.join(closest)})" if closest else ""
            raise OptionError(f"skip: {pattern!r} names no Linear, Conv or recurrent layer{shown}")
        skipped |= hits
    return {name: weight for name, weight in found.items() if name not in skipped}


def _prefixes(name: str) -> list[str]:
    """``a.b.c`` and the modules holding it: ``a``, ``a.b``, ``a.b.c``."""
    parts = name.split(".")
    return [".".join(parts[: i + 1]) for i in range(len(parts))]


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


def _tied_elsewhere(model: nn.Module, targets: dict[str, tuple[torch.Tensor, float]]) -> dict[str, str]:
    """The targets whose weight another kind of module also holds (a language model's output head tied
    to its token embeddings), with why they are left dense: zeroing them would zero that table too."""
    holders: dict[int, list[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        if isinstance(module, PRUNABLE + RECURRENT) or is_hf_conv1d(module):
            continue
        for param in module.parameters(recurse=False):
            holders.setdefault(id(param), []).append(name)
    found = {}
    for name, (weight, _) in targets.items():
        base = weight._base if weight._base is not None else weight  # a Conv1D weight is seen transposed
        others = holders.get(id(base))
        if others:
            kind = type(model.get_submodule(others[0])).__name__
            found[name] = (
                f"its weight is also {others[0]}'s ({kind}): pruning it would zero that too; left dense"
            )
    return found


def _groups_problem(weight: torch.Tensor, pattern: tuple[int, int]) -> str | None:
    """Why ``weight``'s inputs cannot be grouped ``pattern[1]`` at a time (None: they can)."""
    inputs = weight.shape[1]
    return f"{inputs} inputs are not a multiple of {pattern[1]}" if inputs % pattern[1] else None


def _as_matrices(
    model: nn.Module, targets: dict[str, tuple[torch.Tensor, float]]
) -> dict[str, tuple[torch.Tensor, float]]:
    """``targets`` with each GPT-2 ``Conv1D`` weight (stored inputs first) seen as (outputs, inputs)."""
    modules = dict(model.named_modules())
    return {
        name: (out_in(modules[name]) if name in modules and is_hf_conv1d(modules[name]) else weight, share)
        for name, (weight, share) in targets.items()
    }


def _n_of_m(weight: torch.Tensor, n: int, m: int) -> str | None:
    """Keep the ``n`` largest of every ``m`` consecutive input weights; returns why a layer was skipped."""
    problem = _groups_problem(weight, (n, m))
    if problem:
        return problem
    grouped = weight.movedim(1, -1).reshape(-1, m)  # [out, (kh, kw,) in] -> groups of m inputs
    smallest = grouped.abs().topk(m - n, dim=1, largest=False).indices
    pruned = grouped.scatter(1, smallest, 0.0)
    weight.copy_(pruned.reshape(weight.movedim(1, -1).shape).movedim(-1, 1))
    return None


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
