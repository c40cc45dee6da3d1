"""Which layers :func:`slimtorch.quantize` swaps, which it leaves float and why, and ``skip`` patterns that
name nothing (an error: a typo would otherwise quantize the very layer it meant to keep).

A :class:`Target` is a layer to swap: an ``nn.Linear``, ``nn.Embedding``, HF ``Conv1D``, convolution, or
an ``nn.LSTM`` / ``nn.GRU`` with the matrices to code (each matrix is also a *unit*: the sensitivity
check and ``skip`` can keep one of them float, ``"lstm.weight_ih_l0"``).
"""

from __future__ import annotations

import fnmatch
from dataclasses import asdict, dataclass, field

import torch
from torch import nn
from torch.nn.utils import parametrize

from slimtorch.errors import OptionError
from slimtorch.format.names import unmatched_pattern
from slimtorch.graph.layers import is_hf_conv1d
from slimtorch.quant.build import float_weight
from slimtorch.quant.conv import quantizable_conv
from slimtorch.quant.modules import QuantizedWeight
from slimtorch.quant.recorded import quantizable_type
from slimtorch.quant.recurrent import QuantizedRecurrent, is_recurrent, recurrent_matrices, unsupported
from slimtorch.schemes import quantizing
from slimtorch.schemes import scheme as scheme_row

SIGNIFICANT = 0.01
"""Share of the model's weight bytes from which a layer left float is listed on its own in the report."""


@dataclass(frozen=True)
class Target:
    """A layer to quantize; for an LSTM / GRU, the matrices to code."""

    name: str
    module: nn.Module
    matrices: tuple[str, ...] = ()

    def weights(self) -> dict[str, torch.Tensor]:
        """Each unit's float weight (out, in ...), by unit name: the layer's, or each coded matrix's."""
        if is_recurrent(self.module):
            return {f"{self.name}.{m}": getattr(self.module, m) for m in self.matrices}
        return {self.name: float_weight(self.module)}

    def nbytes(self) -> int:
        return sum(w.numel() * w.element_size() for w in self.weights().values())


@dataclass(frozen=True)
class FloatLayer:
    """A layer (or an LSTM / GRU matrix) left float, holding a share of the model's weights worth listing."""

    name: str
    kind: str
    bytes: int
    reason: str

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


@dataclass
class Choice:
    """The layers to quantize, and why every other one with weights stays float (name -> reason)."""

    targets: list[Target] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)


def check_skip_patterns(model: nn.Module, skip: tuple[str, ...]) -> None:
    """Refuse a ``skip`` pattern that matches no module (nor an LSTM / GRU matrix) of ``model``.

    Example:
        >>> check_skip_patterns(torch.nn.Sequential(torch.nn.Linear(2, 2)), ("1",))
        Traceback (most recent call last):
        slimtorch.errors.OptionError: skip pattern '1' matches no module of the model (closest: 0)
    """
    names = [name for name, _ in model.named_modules() if name]
    names += [
        f"{n}.{m}" for n, mod in model.named_modules() if is_recurrent(mod) for m in recurrent_matrices(mod)
    ]
    unmatched = unmatched_pattern(skip, names)
    if unmatched is not None:
        pattern, close = unmatched
        shown = ", ".join(close or names[:3])
        raise OptionError(f"skip pattern {pattern!r} matches no module of the model (closest: {shown})")


def choose_targets(model: nn.Module, scheme: str, skip: tuple[str, ...], embeddings: bool) -> Choice:
    """The layers ``quantize`` swaps, and the reason each other layer with weights stays float."""
    owners: dict[int, list[str]] = {}
    for name, module in model.named_modules():
        for attr, tensor in module._parameters.items():
            if tensor is not None:
                owners.setdefault(id(tensor), []).append(f"{name}.{attr}" if name else attr)
    choice = Choice()
    for name, module in model.named_modules():
        if isinstance(module, QuantizedWeight):
            continue
        why = _why_not(name, module, scheme, skip, embeddings)
        if why is not None:
            if why:
                choice.skipped[name] = why
            continue
        if not is_recurrent(module):
            why = _weight_problem(module.weight, f"{name}.weight" if name else "weight", owners)
            if why:
                choice.skipped[name] = why
            else:
                choice.targets.append(Target(name, module))
            continue
        matrices = []
        for matrix in recurrent_matrices(module):
            unit = f"{name}.{matrix}"
            pattern = next((p for p in skip if fnmatch.fnmatchcase(unit, p)), None)
            why = f"matches skip pattern {pattern!r}" if pattern else None
            why = why or _weight_problem(getattr(module, matrix), unit, owners)
            if why:
                choice.skipped[unit] = why
            else:
                matrices.append(matrix)
        if matrices:
            choice.targets.append(Target(name, module, tuple(matrices)))
    return choice


def _weight_problem(weight: torch.Tensor, owner: str, owners: dict[int, list[str]]) -> str | None:
    if not weight.is_floating_point() or weight.is_meta:
        return "its weight is not a float tensor with values"
    others = [other for other in owners.get(id(weight), []) if other != owner]
    if others:
        other = others[0].rpartition(".")[0] or others[0]
        return f"its weight is tied to {other!r} (quantizing one would untie them)"
    return None


def _why_not(
    name: str, module: nn.Module, scheme: str, skip: tuple[str, ...], embeddings: bool
) -> str | None:
    """Why a layer stays float; None: it is quantized; "": not a layer anyone would expect quantized."""
    if parametrize.is_parametrized(module):
        return "its weight is computed by a parametrization (weight norm, spectral norm ...) on every call"
    if isinstance(module, (nn.Linear, nn.Embedding)) and not quantizable_type(module):
        base = "Linear" if isinstance(module, nn.Linear) else "Embedding"
        return f"{type(module).__name__} subclasses nn.{base}; its owner may use the weight directly"
    kind = _kind(module)
    if kind is not None and not scheme_row(scheme).quantizes(kind):
        one, many = KIND_WORDS[kind]
        return f"{scheme} has no {one} kernel ({' and '.join(quantizing(kind))} quantize {many})"
    if isinstance(module, nn.modules.conv._ConvNd) and not quantizable_conv(module):
        return "transposed, or padded other than with zeros: only plain zero-padded convolutions are swapped"
    if isinstance(module, nn.RNNBase) and not is_recurrent(module):
        if type(module) is nn.RNN:
            return "nn.RNN has no quantized kernel here (nn.LSTM and nn.GRU have)"
        return f"{type(module).__name__} subclasses an RNN; its own code may read the weights"
    if not quantizable_type(module):
        return ""
    pattern = next((p for p in skip if fnmatch.fnmatchcase(name, p)), None)
    if pattern is not None:
        return f"matches skip pattern {pattern!r}"
    if is_recurrent(module):
        return unsupported(module)
    if isinstance(module, nn.Embedding):
        if not embeddings:
            return "embeddings stay float (embeddings=False)"
        if module.max_norm is not None:
            return "max_norm renormalises rows in place on lookup"
    return None


KIND_WORDS = {
    "linear": ("linear", "linear layers"),
    "embedding": ("embedding", "embeddings"),
    "conv": ("convolution", "convolutions"),
    "recurrent": ("LSTM / GRU", "LSTM and GRU layers"),
}
"""How a refusal names each kind of layer (:data:`slimtorch.schemes.LAYER_KINDS`) a scheme may leave out."""


def _kind(module: nn.Module) -> str | None:
    """Which of a scheme row's layer kinds ``module`` is (None: none a scheme swaps)."""
    if isinstance(module, nn.modules.conv._ConvNd):
        return "conv"
    if is_recurrent(module):
        return "recurrent"
    if isinstance(module, nn.Embedding):
        return "embedding"
    return "linear" if isinstance(module, nn.Linear) or is_hf_conv1d(module) else None


def weight_bytes(model: nn.Module) -> int:
    """Bytes of a model's float weight matrices (parameters of two dimensions or more)."""
    return sum(
        t.numel() * t.element_size() for t in model.parameters() if t.is_floating_point() and t.dim() >= 2
    )


def kept_float(
    model: nn.Module, skipped: dict[str, str], listed: set[str], total: int
) -> tuple[list[FloatLayer], str]:
    """The layers of the (quantized) model still holding float weight matrices, largest first: those
    with at least :data:`SIGNIFICANT` of the ``total`` weight bytes, and every one in ``listed``; and a
    line summing up the others (empty when there are none)."""
    found: dict[str, FloatLayer] = {}
    for name, module in model.named_modules():
        for attr, tensor in module._parameters.items():
            if tensor is None or not tensor.is_floating_point() or tensor.dim() < 2:
                continue  # biases and norms: vectors, never quantized by anyone
            matrix = f"{name}.{attr}" if name else attr
            owner, kind = _owner(name, matrix, module, model, skipped)
            reason = skipped.get(matrix) or skipped.get(owner) or _default_reason(module, attr)
            size = tensor.numel() * tensor.element_size() + (found[owner].bytes if owner in found else 0)
            found[owner] = FloatLayer(owner, kind, size, reason)
    layers = sorted(found.values(), key=lambda layer: -layer.bytes)
    shown = [layer for layer in layers if layer.bytes >= SIGNIFICANT * total or layer.name in listed]
    rest = [layer for layer in layers if layer not in shown]
    summary = f"{len(rest)} smaller layer(s), {sum(r.bytes for r in rest)} bytes of weights, also float"
    return shown, summary if rest else ""


def _owner(
    name: str, matrix: str, module: nn.Module, model: nn.Module, skipped: dict[str, str]
) -> tuple[str, str]:
    """Who a float matrix belongs to, as the report names it: an LSTM / GRU matrix kept float on its own
    by its own name, a parametrization's tensors by the layer whose weight they make."""
    if isinstance(module, QuantizedRecurrent):
        return matrix, module.mode
    if isinstance(module, nn.RNNBase) and matrix in skipped:
        return matrix, type(module).__name__
    if ".parametrizations." in f"{name}.":
        layer = name.partition(".parametrizations")[0] if not name.startswith("parametrizations") else ""
        return layer, type(model.get_submodule(layer)).__name__.removeprefix("Parametrized")
    return name, type(module).__name__


def _default_reason(module: nn.Module, attr: str) -> str:
    if isinstance(module, nn.MultiheadAttention):
        return f"nn.MultiheadAttention multiplies its {attr} in its own code: there is no layer to swap"
    return f"{type(module).__name__} uses its parameter {attr!r} in its own code: quantize swaps layers only"
