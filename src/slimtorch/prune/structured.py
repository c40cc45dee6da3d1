"""Structured pruning: remove whole channels, physically, from every tensor that carries them.

:func:`channels` captures the model's graph, finds its channel groups (:mod:`slimtorch.graph.channels`),
scores each channel, removes the lowest-scoring ones from every weight, bias, running statistic and
module attribute (``out_channels``, ``in_features``, ``num_features``, depthwise ``groups`` ...) of the
group, and returns the same module object, smaller. What changed is recorded as a
:class:`StructuralDelta`, the part of a pruned model that its class alone cannot rebuild.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from slimtorch.errors import OptionError, SlimtorchError
from slimtorch.format.delta import StructuralDelta, record
from slimtorch.graph.capture import as_args, capture
from slimtorch.graph.channels import channel_groups
from slimtorch.graph.layers import head_size, is_hf_conv1d, query_width
from slimtorch.graph.macs import count_macs
from slimtorch.graph.slots import model_slots, replace
from slimtorch.graph.spaces import ChannelGroup
from slimtorch.prune.budget import ratio_for_budget
from slimtorch.prune.importance import Importance, resolve


@dataclass(frozen=True)
class PruneReport:
    """What :func:`channels` removed; ``to_dict()`` for ``--json``."""

    groups: int
    pruned_groups: int
    channels_before: int
    channels_after: int
    params_before: int
    params_after: int
    frozen: dict[str, int]
    """reason -> number of groups it kept from pruning"""
    delta: StructuralDelta

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def channels(
    model: nn.Module,
    example_inputs: Sequence[Any] | Any,
    *,
    ratio: float | None = None,
    target_params: int | None = None,
    target_macs: int | None = None,
    importance: str | Importance = "l2",
    scope: str = "layer",
    round_to: int | None = None,
    ignore: Iterable[str | nn.Module] = (),
    iterative_steps: int = 1,
    example_kwargs: Mapping[str, Any] | None = None,
) -> nn.Module:
    """Remove channels from every prunable group; returns ``model`` itself, physically smaller.

    Args:
        model: any module ``torch.export`` can trace with ``example_inputs`` (a no_grad trace).
        ratio: share of channels to remove, 0 to 1: of each group (``scope="layer"``), or of all channels
            with the lowest normalised scores across groups (``scope="global"``).
        target_params, target_macs: instead of ``ratio``, the smallest ratio that brings the parameter
            count (or the MACs of ``example_inputs``) to at most this.
        importance: ``"l2"``, ``"l1"``, ``"bn_scale"``, ``"taylor"`` (needs gradients: run
            ``loss.backward()`` first) or a callable ``(group, tensors) -> scores``.
        round_to: keep channel counts a multiple of this (hardware-friendly widths).
        ignore: modules (or their names) whose output channels must stay (a classifier, a detector head).
        iterative_steps: reach the ratio in this many steps, scoring the channels again after each.

    Example:
        >>> from tests.zoo import resnet18  # doctest: +SKIP
        >>> model = channels(resnet18(), torch.randn(1, 3, 224, 224), ratio=0.5)  # doctest: +SKIP
    """
    pruned, _ = channels_with_report(
        model,
        example_inputs,
        ratio=ratio,
        target_params=target_params,
        target_macs=target_macs,
        importance=importance,
        scope=scope,
        round_to=round_to,
        ignore=ignore,
        iterative_steps=iterative_steps,
        example_kwargs=example_kwargs,
    )
    return pruned


def channels_with_report(
    model: nn.Module,
    example_inputs: Sequence[Any] | Any,
    *,
    ratio: float | None = None,
    target_params: int | None = None,
    target_macs: int | None = None,
    importance: str | Importance = "l2",
    scope: str = "layer",
    round_to: int | None = None,
    ignore: Iterable[str | nn.Module] = (),
    iterative_steps: int = 1,
    example_kwargs: Mapping[str, Any] | None = None,
) -> tuple[nn.Module, PruneReport]:
    """:func:`channels`, plus a :class:`PruneReport` of what was removed and what could not be."""
    _check(ratio, target_params, target_macs, scope, round_to, iterative_steps)
    score = resolve(importance)
    names = _ignored_names(model, ignore)
    params_before = sum(p.numel() for p in model.parameters())
    if ratio is None:
        every, groups, scores = _analyse(model, example_inputs, example_kwargs, names, score)
        _refuse_nothing_to_prune(model, every, groups)
        measure = (
            (lambda m: sum(p.numel() for p in m.parameters()))
            if target_params is not None
            else (lambda m: count_macs(m, example_inputs, example_kwargs))
        )
        target = target_params if target_params is not None else target_macs
        ratio = ratio_for_budget(
            model,
            lambda trial, r: _apply(
                trial, groups, _lowest(groups, scores, _keep(groups, scores, r, scope, round_to))
            ),
            measure,
            int(target),  # type: ignore[arg-type]
        )
    originals: dict[str, int] = {}
    delta, first = StructuralDelta(), None
    for step in range(1, iterative_steps + 1):
        every, groups, scores = _analyse(model, example_inputs, example_kwargs, names, score)
        if first is None and ratio > 0:
            _refuse_nothing_to_prune(model, every, groups)
        first = first or every
        for group in groups:
            originals.setdefault(_identity(group), group.size)
        keep = _keep(groups, scores, ratio * step / iterative_steps, scope, round_to, originals)
        step_delta = _apply(model, groups, _lowest(groups, scores, keep))
        record(model, step_delta)  # slimtorch.save_model writes it beside the weights
        delta = delta.merge(step_delta)
    _still_runs(model, example_inputs, example_kwargs)
    frozen: dict[str, int] = {}
    for group in first or []:
        if group.reason:
            frozen[group.reason] = frozen.get(group.reason, 0) + 1
    kept = {_identity(g): keep[id(g)] for g in groups}  # the sizes the last step left
    report = PruneReport(
        groups=len(first or []),
        pruned_groups=sum(1 for key, size in originals.items() if kept.get(key, size) < size),
        channels_before=sum(originals.values()),
        channels_after=sum(kept.get(key, size) for key, size in originals.items()),
        params_before=params_before,
        params_after=sum(p.numel() for p in model.parameters()),
        frozen=frozen,
        delta=delta,
    )
    return model, report


def _still_runs(
    model: nn.Module, example_inputs: Sequence[Any] | Any, example_kwargs: Mapping[str, Any] | None
) -> None:
    """One forward pass on the example: a module that keeps a size of its own in Python code we cannot see
    (``x.view(b, self.channels, -1)``) fails here, loudly, instead of in the user's next run."""
    args = as_args(example_inputs)
    try:
        with torch.no_grad():
            model(*args, **dict(example_kwargs or {}))
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


def _check(
    ratio: float | None,
    target_params: int | None,
    target_macs: int | None,
    scope: str,
    round_to: int | None,
    iterative_steps: int,
) -> None:
    if sum(x is not None for x in (ratio, target_params, target_macs)) != 1:
        raise OptionError("give exactly one of ratio, target_params or target_macs")
    if ratio is not None and not 0.0 <= ratio < 1.0:
        raise OptionError(f"ratio must be at least 0 and below 1, not {ratio}")
    if scope not in ("layer", "global"):
        raise OptionError(f"scope must be 'layer' or 'global', not {scope!r}")
    if round_to is not None and round_to < 1:
        raise OptionError(f"round_to must be a positive integer, not {round_to}")
    if iterative_steps < 1:
        raise OptionError(f"iterative_steps must be at least 1, not {iterative_steps}")


def _analyse(
    model: nn.Module,
    example_inputs: Sequence[Any] | Any,
    example_kwargs: Mapping[str, Any] | None,
    names: list[str],
    score: Importance,
) -> tuple[list[ChannelGroup], list[ChannelGroup], dict[int, torch.Tensor]]:
    """Every group of the model as it is now, the prunable ones, and each prunable one's channel scores."""
    groups = channel_groups(capture(model, example_inputs, example_kwargs), ignore=names)
    tensors = _tensors(model)
    _fence_fixed_sizes(model, groups, tensors)
    prunable = [g for g in groups if g.prunable]
    scores = {id(g): score(g, tensors).to(torch.float64) for g in prunable}
    for group in prunable:
        if scores[id(group)].shape != (group.size,):
            raise SlimtorchError(f"importance returned {tuple(scores[id(group)].shape)}, not ({group.size},)")
    return groups, prunable, scores


RESIZABLE = (
    nn.modules.conv._ConvNd,
    nn.Linear,
    nn.modules.batchnorm._NormBase,
    nn.LayerNorm,
    nn.Embedding,
    nn.PReLU,
)


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
            if owner is None or isinstance(owner, RESIZABLE) or is_hf_conv1d(owner):
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
    by_module = {id(m): name for name, m in model.named_modules()}
    names = []
    for item in ignore:
        if isinstance(item, nn.Module):
            if id(item) not in by_module:
                raise SlimtorchError(f"ignore: a {type(item).__name__} that is not part of the model")
            names.append(by_module[id(item)])
        else:
            names.append(str(item))
    return names


def _tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        **dict(model.named_parameters(remove_duplicate=False)),
        **dict(model.named_buffers(remove_duplicate=False)),
    }


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


def _apply(model: nn.Module, groups: list[ChannelGroup], removed: dict[int, torch.Tensor]) -> StructuralDelta:
    """Cut the removed channels out of every tensor, then fix the modules' size attributes."""
    tensors = _tensors(model)
    keep: dict[tuple[str, int], torch.Tensor] = {}
    for group in groups:
        channels = removed[id(group)]
        if not len(channels):
            continue
        for piece in group.slices:
            mask = keep.setdefault(
                (piece.key, piece.dim), torch.ones(tensors[piece.key].shape[piece.dim], dtype=torch.bool)
            )
            mask[piece.indices(channels)] = False
    slots = {name: slot for slot in model_slots(model) for name in slot.names}
    delta = StructuralDelta()
    for (key, dim), mask in keep.items():  # a weight pruned on two dims is cut twice, one dim at a time
        slot = slots[key]
        new = slot.tensor.detach().index_select(dim, mask.nonzero().squeeze(1))
        replace(slot, new)
        delta.shapes.update({name: list(new.shape) for name in slot.names})
    for name, module in model.named_modules():
        changed = _resize_attributes(module)
        if changed:
            delta.attributes[name] = changed
    return delta


def _resize_attributes(module: nn.Module) -> dict[str, Any]:
    """Bring a module's size attributes in line with its (pruned) tensors; returns what changed."""
    before = _size_attributes(module)
    weight = getattr(module, "weight", None)
    if isinstance(module, nn.modules.conv._ConvNd) and weight is not None:
        transposed = module.transposed
        depthwise = module.groups > 1 and module.groups == module.in_channels == module.out_channels
        out_dim, in_dim = (1, 0) if transposed else (0, 1)
        if depthwise:
            module.groups = module.in_channels = module.out_channels = weight.shape[0]
        else:
            per_group_out = weight.shape[out_dim] * (module.groups if transposed else 1)
            module.out_channels = per_group_out
            module.in_channels = weight.shape[in_dim] * (1 if transposed else module.groups)
    elif isinstance(module, nn.Linear):
        module.out_features, module.in_features = weight.shape
    elif isinstance(module, nn.modules.batchnorm._NormBase):
        reference = weight if weight is not None else module.running_mean
        if reference is not None:
            module.num_features = reference.shape[0]
    elif isinstance(module, nn.LayerNorm) and weight is not None:
        module.normalized_shape = tuple(weight.shape)
    elif isinstance(module, nn.Embedding):
        module.num_embeddings, module.embedding_dim = weight.shape
    elif isinstance(module, nn.PReLU):
        module.num_parameters = weight.numel()
    elif is_hf_conv1d(module) and weight is not None:
        module.nf = weight.shape[1]  # Hugging Face's Conv1D (GPT-2): weight [in, out], nf = out
        if hasattr(module, "nx"):
            module.nx = weight.shape[0]
    _resize_heads(module)
    after = _size_attributes(module)
    return {k: list(v) if isinstance(v, tuple) else v for k, v in after.items() if before.get(k) != v}


def _size_attributes(module: nn.Module) -> dict[str, Any]:
    """A module's public attributes that can hold a size; a tensor kept as a plain attribute (torchfcpe
    does) is none, and comparing two of them has no single truth value."""
    return {
        k: v for k, v in vars(module).items() if not k.startswith("_") and not isinstance(v, torch.Tensor)
    }


HEAD_COUNTS = ("num_attention_heads", "num_heads", "n_head", "n_heads")


def _resize_heads(module: nn.Module) -> None:
    """An attention module's head count (and total head width) from its query projection's rows."""
    size, width = head_size(module), query_width(module)
    if not size or width is None:
        return
    if hasattr(module, "c_attn") and hasattr(module, "split_size"):
        module.split_size = width  # GPT-2 splits its fused q/k/v output by this
    heads = width // size
    for name in HEAD_COUNTS:
        if isinstance(getattr(module, name, None), int):
            setattr(module, name, heads)
    if isinstance(getattr(module, "all_head_size", None), int):
        module.all_head_size = heads * size
