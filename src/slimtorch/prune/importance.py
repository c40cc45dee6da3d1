"""Channel importance: one score per channel of a group; the lowest scores are pruned first.

An importance is any callable ``(group, tensors) -> scores``: ``tensors`` maps state_dict keys to the
model's current tensors, ``scores`` is a 1-d float tensor of ``group.size``. The built-in ones:

- ``"l2"`` / ``"l1"``: the norm of everything a channel touches (the weights that make it, the norms'
  vectors, the input slices of the layers that read it), as Torch-Pruning's group importance does;
- ``"bn_scale"``: the magnitude of the BatchNorm scale (gamma) of the channel (network slimming), for
  groups that have one; others fall back to ``"l2"``;
- ``"taylor"``: the first-order Taylor estimate of the loss change, ``|w * dL/dw|`` summed over the
  channel's weights; it reads the gradients left by the caller's ``loss.backward()``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from slimtorch.errors import OptionError, SlimtorchError
from slimtorch.graph.spaces import ChannelGroup, Slice

Importance = Callable[[ChannelGroup, Mapping[str, torch.Tensor]], torch.Tensor]


def _per_channel(group: ChannelGroup, values: Callable[[str], torch.Tensor], slices: list[Slice], p: int):
    """Sum over ``slices`` of each channel's L1 norm (p=1) or squared L2 norm (p=2, rooted at the end)."""
    scores = torch.zeros(group.size, dtype=torch.float64)
    channels = torch.arange(group.size)
    for piece in slices:
        tensor = values(piece.key)
        picked = tensor.index_select(piece.dim, piece.indices(channels))
        picked = picked.movedim(piece.dim, 0).reshape(group.size, -1)
        scores += picked.abs().sum(1) if p == 1 else picked.pow(2).sum(1)
    return scores if p == 1 else scores.sqrt()


def _weights(tensors: Mapping[str, torch.Tensor]) -> Callable[[str], torch.Tensor]:
    return lambda key: tensors[key].detach().to(torch.float64)


def l2(group: ChannelGroup, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
    return _per_channel(group, _weights(tensors), [s for s in group.slices if not _is_statistic(s)], 2)


def l1(group: ChannelGroup, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
    return _per_channel(group, _weights(tensors), [s for s in group.slices if not _is_statistic(s)], 1)


def bn_scale(group: ChannelGroup, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
    gammas = [
        s for s in group.slices if s.role == "norm" and s.key.endswith(".weight") and _has_stats(s, tensors)
    ]
    return _per_channel(group, _weights(tensors), gammas, 1) if gammas else l2(group, tensors)


def taylor(group: ChannelGroup, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
    grads = {s.key: grad for s in group.slices if (grad := tensors[s.key].grad) is not None}
    with_grad = [s for s in group.slices if s.key in grads]
    if not with_grad:
        raise SlimtorchError(
            "taylor importance needs gradients: run the model on a batch and loss.backward() before pruning"
        )

    def contribution(key: str) -> torch.Tensor:
        return (tensors[key].detach() * grads[key]).to(torch.float64)

    return _per_channel(group, contribution, with_grad, 1)


def _is_statistic(piece: Slice) -> bool:
    """Running statistics describe the data, not the weights: they take no part in a weight norm."""
    return piece.key.endswith(("running_mean", "running_var", "num_batches_tracked"))


def _has_stats(piece: Slice, tensors: Mapping[str, torch.Tensor]) -> bool:
    return piece.key.removesuffix("weight") + "running_var" in tensors


BUILT_IN: dict[str, Importance] = {"l2": l2, "l1": l1, "bn_scale": bn_scale, "taylor": taylor}


def scorer(importance: str | Importance) -> Importance:
    """The scoring function an importance names (a callable is its own); an unknown name is an error."""
    if callable(importance):
        return importance
    try:
        return BUILT_IN[importance]
    except KeyError:
        known = ", ".join(sorted(BUILT_IN))
        raise OptionError(f"unknown importance {importance!r} (known: {known}, or a callable)") from None
