"""Structured pruning: remove whole channels, physically, from every tensor that carries them.

:func:`channels` captures the model's graph, finds its channel groups (:mod:`slimtorch.graph.channels`),
scores each channel, removes the lowest-scoring ones from every weight, bias, running statistic and
module attribute (``out_channels``, ``in_features``, ``num_features``, depthwise ``groups`` ...) of the
group (:mod:`slimtorch.prune.surgery`), and leaves the same module object, smaller. What changed is
recorded as a :class:`StructuralDelta`, the part of a pruned model that its class alone cannot rebuild.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from slimtorch.errors import OptionError, SlimtorchError
from slimtorch.format.delta import StructuralDelta, record
from slimtorch.format.names import unmatched_pattern
from slimtorch.format.pending import wait_for_checks
from slimtorch.format.progress import Progress, task
from slimtorch.format.verbs import NOT_JSON, Report, resolve
from slimtorch.graph.capture import as_args, capture
from slimtorch.graph.channels import channel_groups
from slimtorch.graph.macs import count_macs
from slimtorch.graph.prunable import resizable
from slimtorch.graph.spaces import ChannelGroup
from slimtorch.prune.budget import TRIALS, ratio_for_budget
from slimtorch.prune.importance import Importance, scorer
from slimtorch.prune.surgery import cut, model_tensors

BUDGETS = ("ratio", "target_params", "target_macs")


@dataclass(frozen=True)
class ChannelOptions:
    """How :func:`channels` prunes: how much (exactly one of ``ratio``, ``target_params``, ``target_macs``),
    which channels go first, and what stays whole. Values are checked here, so a bad one fails at once.

    Example:
        >>> ChannelOptions(ratio=0.5, round_to=8).scope
        'layer'
    """

    ratio: float | None = None
    """share of channels to remove, 0 to below 1: of each group (``scope="layer"``), or of all channels,
    the lowest normalised scores across groups (``scope="global"``)"""
    target_params: int | None = None
    """instead of ``ratio``: the smallest ratio that brings the parameter count to at most this"""
    target_macs: int | None = None
    """instead of ``ratio``: the smallest ratio that brings the MACs of the example to at most this"""
    importance: str | Importance = "l2"
    """``"l2"``, ``"l1"``, ``"bn_scale"``, ``"taylor"`` (needs gradients: run ``loss.backward()`` first) or
    a callable ``(group, tensors) -> scores``"""
    scope: str = "layer"
    """``"layer"`` (each group loses ``ratio``) or ``"global"`` (the lowest scores across groups go)"""
    round_to: int | None = None
    """keep channel counts a multiple of this (hardware-friendly widths)"""
    ignore: tuple[str | nn.Module, ...] = ()
    """modules, or patterns of their names (``fnmatch``: ``classifier``, ``heads.*``), whose output channels
    must stay (a classifier, a detector head); a pattern that names no module is refused"""
    iterative_steps: int = 1
    """reach the ratio in this many steps, scoring the channels again after each"""

    def __post_init__(self) -> None:
        ignore = (self.ignore,) if isinstance(self.ignore, (str, nn.Module)) else tuple(self.ignore)
        object.__setattr__(self, "ignore", ignore)
        if sum(getattr(self, name) is not None for name in BUDGETS) > 1:
            raise OptionError("give exactly one of ratio, target_params or target_macs")
        if self.ratio is not None and not 0.0 <= self.ratio < 1.0:
            raise OptionError(f"ratio must be at least 0 and below 1, not {self.ratio}")
        if self.scope not in ("layer", "global"):
            raise OptionError(f"scope must be 'layer' or 'global', not {self.scope!r}")
        if self.round_to is not None and self.round_to < 1:
            raise OptionError(f"round_to must be a positive integer, not {self.round_to}")
        if self.iterative_steps < 1:
            raise OptionError(f"iterative_steps must be at least 1, not {self.iterative_steps}")
        scorer(self.importance)  # an unknown name fails here, not after the graph is captured


@dataclass(frozen=True)
class PruneReport(Report):
    """What :func:`channels` removed and what it kept whole, with the pruned model; ``to_dict()`` for
    ``--json``."""

    SCHEMA = "slimtorch.prune/1"

    groups: int
    pruned_groups: int
    channels_before: int
    channels_after: int
    params_before: int
    params_after: int
    frozen: dict[str, int]
    """reason -> number of groups it kept from pruning"""
    delta: StructuralDelta
    model: nn.Module | None = field(default=None, repr=False, compare=False, metadata=NOT_JSON)
    """the pruned model: the very module passed in, smaller"""


def channels(
    model: nn.Module,
    example_inputs: Sequence[Any] | Any,
    /,
    options: ChannelOptions | None = None,
    *,
    example_kwargs: Mapping[str, Any] | None = None,
    progress: Progress | None = None,
    **overrides: Any,
) -> PruneReport:
    """Remove channels from every prunable group of ``model``, in place; the report says what went and
    holds the model (``report.model`` is ``model``, physically smaller).

    Args:
        model: any module ``torch.export`` can trace with ``example_inputs`` (a no_grad trace).
        example_inputs, example_kwargs: an input the model accepts, to trace it and to check it still runs.
        options: a :class:`ChannelOptions`; ``overrides`` replace its fields (``ratio=0.5``).
        progress: told of each stage (None: silent): capturing the graph, each copy the budget search
            measures, removing channels, checking the pruned model runs; "(step 2 of 3)" with steps.

    Example:
        >>> from tests.zoo import resnet18  # doctest: +SKIP
        >>> report = channels(resnet18(), torch.randn(1, 3, 224, 224), ratio=0.5)  # doctest: +SKIP
        >>> report.params_after / report.params_before  # doctest: +SKIP
        0.26
    """
    options = resolve(ChannelOptions, options, overrides, "prune.channels")
    wait_for_checks(model)  # importance reads the weights outside a forward
    if all(getattr(options, name) is None for name in BUDGETS):
        raise OptionError("give exactly one of ratio, target_params or target_macs")
    example = _Example(example_inputs, example_kwargs, _ignored_names(model, options.ignore))
    score = scorer(options.importance)
    params_before = sum(p.numel() for p in model.parameters())
    ratio = options.ratio
    if ratio is None:
        ratio = _ratio_for_budget(model, example, score, options, progress)
    first, originals, kept, delta = _prune_in_steps(model, example, score, ratio, options, progress)
    with task(progress, "checking the pruned model runs"):
        _still_runs(model, example)
    frozen: dict[str, int] = {}
    for group in first:
        if group.reason:
            frozen[group.reason] = frozen.get(group.reason, 0) + 1
    return PruneReport(
        groups=len(first),
        pruned_groups=sum(1 for key, size in originals.items() if kept.get(key, size) < size),
        channels_before=sum(originals.values()),
        channels_after=sum(kept.get(key, size) for key, size in originals.items()),
        params_before=params_before,
        params_after=sum(p.numel() for p in model.parameters()),
        frozen=frozen,
        delta=delta,
        model=model,
    )


@dataclass(frozen=True)
class _Example:
    """What every analysis of one pruning run traces with, and the modules it keeps whole."""

    inputs: Sequence[Any] | Any
    kwargs: Mapping[str, Any] | None
    ignored: list[str]


def _ratio_for_budget(
    model: nn.Module, example: _Example, score: Importance, options: ChannelOptions, progress: Progress | None
) -> float:
    """The smallest one-step ratio whose pruned model fits ``target_params`` or ``target_macs``."""
    with task(progress, "capturing the graph"):
        every, groups, scores = _analyse(model, example, score)
    _refuse_nothing_to_prune(model, every, groups)
    if options.target_params is not None:
        target, measure = options.target_params, lambda m: sum(p.numel() for p in m.parameters())
    elif options.target_macs is not None:
        target, measure = options.target_macs, lambda m: count_macs(m, example.inputs, example.kwargs)
    else:  # channels() refuses this before it searches
        raise OptionError("give exactly one of ratio, target_params or target_macs")
    with task(progress, "finding the ratio for the budget", TRIALS, unit="steps") as advance:
        return ratio_for_budget(
            model,
            lambda trial, r: cut(
                trial,
                groups,
                _lowest(groups, scores, _keep(groups, scores, r, options.scope, options.round_to)),
            ),
            measure,
            int(target),
            advance,
        )


def _prune_in_steps(
    model: nn.Module,
    example: _Example,
    score: Importance,
    ratio: float,
    options: ChannelOptions,
    progress: Progress | None,
) -> tuple[list[ChannelGroup], dict[str, int], dict[str, int], StructuralDelta]:
    """Prune to ``ratio`` in ``options.iterative_steps`` steps, scoring again before each. Returns the
    groups found first, each group's original and final channel count (by :func:`_identity`), and the
    delta of all the steps together."""
    originals: dict[str, int] = {}
    delta, first, kept = StructuralDelta(), None, {}
    steps = options.iterative_steps
    for step in range(1, steps + 1):
        which = f" (step {step} of {steps})" if steps > 1 else ""
        with task(progress, f"capturing the graph{which}"):  # torch.export: most of a step's time
            every, groups, scores = _analyse(model, example, score)
        if first is None and ratio > 0:
            _refuse_nothing_to_prune(model, every, groups)
        first = first or every
        for group in groups:
            originals.setdefault(_identity(group), group.size)
        keep = _keep(groups, scores, ratio * step / steps, options.scope, options.round_to, originals)
        with task(progress, f"removing channels{which}"):
            step_delta = cut(model, groups, _lowest(groups, scores, keep))
        record(model, step_delta)  # slimtorch.save_model writes it beside the weights
        delta = delta.merge(step_delta)
        kept = {_identity(g): keep[id(g)] for g in groups}  # the sizes the last step left
    return first or [], originals, kept, delta


def _still_runs(model: nn.Module, example: _Example) -> None:
    """One forward pass on the example: a module that keeps a size of its own in Python code we cannot see
    (``x.view(b, self.channels, -1)``) fails here, loudly, instead of in the user's next run."""
    args = as_args(example.inputs)
    try:
        with torch.no_grad():
            model(*args, **dict(example.kwargs or {}))
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise SlimtorchError(
            f"the pruned model no longer runs ({first}): a module keeps a channel count of its own; prune a "
            "fresh copy with that module in ignore=[...]"
        ) from exc


def _refuse_nothing_to_prune(
    model: nn.Module, every: list[ChannelGroup], prunable: list[ChannelGroup]
) -> None:
    """A prune that can remove no channel is an error, not a 1.0x success: say what blocked every group
    and which modules the channel graph does not follow at all (an ``nn.LSTM`` fixes its own sizes)."""
    if prunable:
        return
    reasons: dict[str, int] = {}
    for group in every:
        reason = group.reason or "a single channel"
        reasons[reason] = reasons.get(reason, 0) + 1
    blocked = ", ".join(f"{count} by {reason}" for reason, count in reasons.items())
    grouped = {piece.key for group in every for piece in group.slices}
    opaque = sorted(
        f"{type(module).__name__} {name or 'the model'}"
        for name, module in model.named_modules()
        if any(f"{name}.{p}".lstrip(".") not in grouped for p, _ in module.named_parameters(recurse=False))
    )
    unfollowed = f"; the channel graph does not follow {', '.join(opaque[:3])}" if opaque else ""
    raise SlimtorchError(
        f"no prunable channel group ({len(every)} kept whole: {blocked or 'none found'}{unfollowed}); "
        "zero weights instead with slimtorch.prune.weights(model, amount)"
    )


def _analyse(
    model: nn.Module, example: _Example, score: Importance
) -> tuple[list[ChannelGroup], list[ChannelGroup], dict[int, torch.Tensor]]:
    """Every group of the model as it is now, the prunable ones, and each prunable one's channel scores."""
    groups = channel_groups(capture(model, example.inputs, example.kwargs), ignore=example.ignored)
    tensors = model_tensors(model)
    _fence_fixed_sizes(model, groups, tensors)
    prunable = [g for g in groups if g.prunable]
    scores = {id(g): score(g, tensors).to(torch.float64) for g in prunable}
    for group in prunable:
        if scores[id(group)].shape != (group.size,):
            raise SlimtorchError(f"importance returned {tuple(scores[id(group)].shape)}, not ({group.size},)")
    return groups, prunable, scores


def _fence_fixed_sizes(
    model: nn.Module, groups: list[ChannelGroup], tensors: Mapping[str, torch.Tensor]
) -> None:
    """Keep whole a group whose weights belong to a module that also stores their size in an attribute we
    do not know how to update (``nn.MultiheadAttention.embed_dim``): pruning it would break its forward."""
    modules = dict(model.named_modules())
    for group in groups:
        if group.reason:
            continue
        for piece in group.slices:
            owner_name = piece.key.rpartition(".")[0]
            owner = modules.get(owner_name)
            if owner is None or resizable(owner):
                continue
            size = tensors[piece.key].shape[piece.dim]
            fixed = [
                name
                for name, value in vars(owner).items()
                if not name.startswith("_") and type(value) is int and value == size
            ]
            if fixed:
                where = owner_name or "the model"
                group.reason = f"{type(owner).__name__} {where} keeps the size in {fixed[0]}"
                break


def _identity(group: ChannelGroup) -> str:
    """A name for a group that survives pruning and a new capture: the first weight that makes it."""
    return (group.keys("out") or group.keys())[0]


def _ignored_names(model: nn.Module, ignore: Iterable[str | nn.Module]) -> list[str]:
    """The names of the modules ``ignore`` gives, as modules or name patterns; one naming nothing is an
    error (a typo would otherwise quietly prune the head it meant to keep)."""
    by_module = {id(m): name for name, m in model.named_modules()}
    modules = [name for name in by_module.values() if name]
    names = []
    for item in ignore:
        if isinstance(item, nn.Module):
            if id(item) not in by_module:
                raise SlimtorchError(f"ignore: a {type(item).__name__} that is not part of the model")
            names.append(by_module[id(item)])
            continue
        unmatched = unmatched_pattern([str(item)], modules)
        if unmatched is not None:
            shown = ", ".join(unmatched[1] or modules[:3])
            raise OptionError(f"ignore: {str(item)!r} names no module of the model (closest: {shown})")
        names += [name for name in modules if fnmatch.fnmatchcase(name, str(item))]
    return names


def _rounded(keep: int, size: int, round_to: int | None) -> int:
    """At least one channel, rounded up to a multiple of ``round_to``, never more than ``size``."""
    keep = max(1, keep)
    if round_to:
        keep = max(round_to, round_to * math.ceil(keep / round_to))
    return min(size, keep)


def _keep(
    groups: list[ChannelGroup],
    scores: dict[int, torch.Tensor],
    ratio: float,
    scope: str,
    round_to: int | None,
    originals: Mapping[str, int] | None = None,
) -> dict[int, int]:
    """How many channels each group keeps, so that ``ratio`` of its original channels are gone."""
    originals = originals or {}
    original = {id(g): originals.get(_identity(g), g.size) for g in groups}
    if scope == "layer":
        return {
            id(g): min(
                g.size,
                _rounded(original[id(g)] - math.floor(original[id(g)] * ratio + 1e-9), g.size, round_to),
            )
            for g in groups
        }
    # Global: the lowest scores across groups go, each group's normalised by its mean so that groups of
    # different scales compete fairly.
    remove = sum(g.size for g in groups) - round(sum(original.values()) * (1 - ratio))
    if remove <= 0 or not groups:
        return {id(g): g.size for g in groups}
    normalised = {id(g): scores[id(g)] / scores[id(g)].mean().clamp_min(1e-12) for g in groups}
    cut = torch.cat(list(normalised.values())).kthvalue(remove).values
    return {id(g): _rounded(int((normalised[id(g)] > cut).sum()), g.size, round_to) for g in groups}


def _lowest(
    groups: list[ChannelGroup], scores: dict[int, torch.Tensor], keep: Mapping[int, int]
) -> dict[int, torch.Tensor]:
    """The channels each group loses: its lowest scores, in channel order."""
    return {id(g): torch.sort(scores[id(g)].argsort()[: g.size - keep[id(g)]]).values for g in groups}
