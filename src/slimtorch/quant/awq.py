"""AWQ: int4 weights with their salient input channels protected, from calibration data (Lin et al., 2023).

A weight's rounding error costs what the input it multiplies carries: in a language model a few input
channels carry activations far larger than the rest. AWQ multiplies each input column of a layer's weight
by ``s_j = rms(x_j) ** alpha`` before rounding (a large channel gets finer steps relative to its weights)
and divides the layer's input by the same ``s`` where it is made: the weight of the norm before the
layer, or the output rows of the Linear before it. The float model computes the same function; only the
int4 codes change. ``alpha`` is searched on a grid for each group of layers that reads one input,
minimizing their output error ``tr(dW H dW^T)`` through the inputs' ``H = X^T X / n`` (the moments GPTQ
reads, :mod:`slimtorch.calibration`), one decoder block at a time.

Where the scales can be folded is known by layer names, for the Llama family (Llama, Mistral, Qwen2,
SmolLM: ``input_layernorm`` -> q, k, v; ``post_attention_layernorm`` -> gate, up; ``up_proj`` -> down;
``v_proj`` -> o when their widths match, not under grouped-query attention). Layers elsewhere are rounded
to nearest as without AWQ, and the notes say how many.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from slimtorch.calibration import Stage, blockwise

GRID = 20
"""alphas tried, 0 to 1 (the paper's grid)"""
FOLDS = (
    ("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
    ("self_attn.v_proj", ("self_attn.o_proj",)),
    ("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj")),
    ("mlp.up_proj", ("mlp.down_proj",)),
)
"""(where the input is made, the layers reading it), by names inside a decoder block"""


def awq_scale(
    model: nn.Module,
    layers: dict[str, nn.Module],
    samples: Iterable[Any],
    group_size: int,
    say: Callable[[str], None] | None = None,
) -> list[str]:
    """Scale the input channels of ``layers`` (Linears by name) where the scales can be folded, in place;
    returns notes: how many were scaled, and those left as they were."""
    scaled: list[str] = []

    def change(stage: Stage) -> None:
        block = _module(model, stage.name)
        if block is None:
            return
        for producer_name, reader_names in FOLDS:
            producer = _module(block, producer_name)
            readers = [r for r in (_module(block, name) for name in reader_names) if isinstance(r, nn.Linear)]
            names = [f"{stage.name}.{name}" for name in reader_names]
            if producer is None or len(readers) != len(names) or not all(n in stage.layers for n in names):
                continue
            hessian = stage.moments.hessian(names[0])
            if hessian is None or not _folds_into(producer, readers[0].in_features):
                continue
            _fold(producer, readers, _search([r.weight for r in readers], hessian, group_size))
            scaled.extend(names)

    notes = blockwise(model, layers, samples, change, full=True, say=say)
    left = len(layers) - len(scaled)
    note = f"AWQ scaled the inputs of {len(scaled)} of {len(layers)} Linear layers"
    if left:
        verb = "has" if left == 1 else "have"
        note += f"; {left} {verb} no known place to fold the scales (rounded to nearest)"
    notes.append(note)
    return notes


def _module(root: nn.Module, name: str) -> nn.Module | None:
    try:
        return root.get_submodule(name)
    except AttributeError:
        return None


def _folds_into(producer: nn.Module, width: int) -> bool:
    """Whether ``producer``'s output channels are the ``width`` inputs to scale: a norm's weight of that
    width, or a Linear with that many outputs."""
    if isinstance(producer, nn.Linear):
        return producer.out_features == width
    weight = getattr(producer, "weight", None)
    return isinstance(weight, torch.Tensor) and weight.dim() == 1 and weight.numel() == width


def _search(weights: list[torch.Tensor], hessian: torch.Tensor, group_size: int) -> torch.Tensor:
    """The scales ``rms(x) ** alpha`` (normalized around 1) whose int4 rounding costs the readers the least
    output error, alpha on :data:`GRID` points from 0 (no scaling) to 1."""
    h = hessian.to(torch.float32)
    rms = torch.diagonal(h).clamp(min=1e-12).sqrt()
    best, chosen = float("inf"), torch.ones_like(rms)
    for step in range(GRID):
        alpha = step / GRID
        scales = rms.pow(alpha)
        scales = scales / (scales.max() * scales.min()).sqrt()
        error = 0.0
        for weight in weights:
            w = weight.detach().to(torch.float32)
            delta = fake_int4(w * scales, group_size) / scales - w
            error += float(torch.einsum("oi,ij,oj->", delta, h, delta))
        if error < best:
            best, chosen = error, scales
    return chosen


def fake_int4(weight: torch.Tensor, group_size: int) -> torch.Tensor:
    """``weight`` (out, in) rounded to asymmetric int4 in groups of ``group_size`` inputs and back (the
    int4 codec's default grid; a last partial group is its own group)."""
    rows, cols = weight.shape
    padded = -cols % group_size
    w = nn.functional.pad(weight, (0, padded), value=0.0) if padded else weight
    groups = w.reshape(rows, -1, group_size)
    low, high = groups.amin(dim=2, keepdim=True), groups.amax(dim=2, keepdim=True)
    step = ((high - low) / 15).clamp(min=1e-12)
    codes = ((groups - low) / step).round().clamp(0, 15)
    return (codes * step + low).reshape(rows, -1)[:, :cols]


def _fold(producer: nn.Module, readers: list[nn.Linear], scales: torch.Tensor) -> None:
    """Readers' input columns times ``scales``, the producer's output divided by them: the same function."""
    with torch.no_grad():
        for reader in readers:
            reader.weight.mul_(scales.to(reader.weight.dtype).unsqueeze(0))
        if isinstance(producer, nn.Linear):
            producer.weight.div_(scales.to(producer.weight.dtype).unsqueeze(1))
            if producer.bias is not None:
                producer.bias.div_(scales.to(producer.bias.dtype))
            return
        weight = getattr(producer, "weight", None)
        assert isinstance(weight, torch.Tensor)  # _folds_into checked it
        weight.div_(scales.to(weight.dtype))
        bias = getattr(producer, "bias", None)
        if isinstance(bias, torch.Tensor):
            bias.div_(scales.to(bias.dtype))
