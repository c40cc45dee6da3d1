"""Wanda and SparseGPT: a language model's weights zeroed in one shot, chosen from calibration samples.

Magnitude pruning zeroes the smallest weights, blind to what they multiply: in a language model a few
input features carry activations a hundred times the rest, and a small weight on one of them matters
more than a large one elsewhere.

- **Wanda** (Sun et al., 2023) scores each weight by ``|w| * ||x||``, its magnitude times the root mean
  square of the input feature it multiplies over the calibration tokens, and zeroes the lowest scores of
  each output row (each row loses the same share). No weight is changed otherwise; it needs only each
  input's norm.
- **SparseGPT** (Frantar & Alistarh, 2023) zeroes weights one input column at a time, choosing them by
  ``w**2 / [H^-1]_ii**2`` (the output error their removal costs) in blocks of 128 columns, and moves each
  removed weight's contribution onto the columns still to come through ``H^-1``, ``H = X^T X`` of the
  inputs: the same update GPTQ makes for rounding (:mod:`slimtorch.quant.gptq`).

Both work layer by layer on each block's own inputs (:func:`slimtorch.calibration.blockwise`), and both
take an N:M pattern (at most N non-zeros in every M consecutive inputs: 2:4 runs on sparse tensor
cores) in place of a share. Only matrix layers read their input as rows of features (``nn.Linear`` and
GPT-2's ``Conv1D``); convolutions and recurrent matrices are pruned by magnitude instead, and the report
says so.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from slimtorch.calibration import Stage, blockwise
from slimtorch.calibration.moments import inverse_cholesky, out_in
from slimtorch.graph.layers import is_hf_conv1d

BLOCK = 128
"""columns SparseGPT chooses its zeros among at once, and updates together (the paper's block size)"""

Pattern = tuple[int, int]
"""N:M: at most N non-zeros in every M consecutive inputs"""


def calibrated(
    model: nn.Module,
    targets: dict[str, tuple[torch.Tensor, float]],
    method: str,
    pattern: Pattern | None,
    data: Iterable[Any],
    say: Callable[[str], None] | None = None,
) -> tuple[dict[str, str], list[str]]:
    """Prune ``targets`` (weight name -> (weight, share)) by ``method`` (``"wanda"`` or ``"sparsegpt"``)
    from the calibration ``data``, in place. Returns the weights pruned by magnitude instead (name ->
    why) and notes on how the model was calibrated."""
    modules = dict(model.named_modules())
    layers = {
        name: modules[name]
        for name in targets
        if name in modules and (type(modules[name]) is nn.Linear or is_hf_conv1d(modules[name]))
    }
    fallback = {
        name: "not a matrix layer (a convolution or a recurrent matrix): pruned by magnitude"
        for name in targets
        if name not in layers
    }

    def change(stage: Stage) -> None:
        for name, layer in stage.layers.items():
            share = targets[name][1]
            matrix = out_in(layer)
            done = False
            if method == "wanda":
                norms = stage.moments.column_norms(name)
                if norms is not None:
                    wanda_(matrix, norms, share, pattern)
                    done = True
            else:
                hessian = stage.moments.hessian(name)
                done = hessian is not None and sparsegpt_(matrix, hessian, share, pattern)
            if not done:
                fallback[name] = (
                    "never ran on the calibration data: pruned by magnitude"
                    if name not in stage.moments.rows
                    else "its inputs' X^T X could not be inverted: pruned by magnitude"
                )
                magnitude_(matrix, share, pattern)

    notes = blockwise(model, layers, data, change, full=method == "sparsegpt", say=say) if layers else []
    for name in targets:
        if name not in layers:
            magnitude_(targets[name][0], targets[name][1], pattern)
    return fallback, notes


def wanda_(weight: torch.Tensor, norms: torch.Tensor, share: float, pattern: Pattern | None) -> None:
    """Zero the lowest ``|w| * norm`` of each row of ``weight`` (out, in): ``share`` of each row, or all
    but the ``n`` highest of every ``m`` consecutive inputs."""
    score = weight.detach().abs().float() * norms.to(weight.device, torch.float32).unsqueeze(0)
    _zero_lowest(weight, score, share, pattern)


def magnitude_(weight: torch.Tensor, share: float, pattern: Pattern | None) -> None:
    """Zero the smallest ``|w|`` of each row (share) or of each N:M group: the fallback beside Wanda and
    SparseGPT, with the same comparison groups. A weight that is not a matrix is taken whole."""
    matrix = weight if weight.dim() == 2 else weight.reshape(1, -1)
    if pattern is not None and weight.dim() != 2:
        matrix = weight.movedim(1, -1).reshape(-1, weight.shape[1])  # conv: inputs last, per position
        if matrix.shape[1] % pattern[1]:
            return
        scored = matrix.abs().float()
        _zero_lowest(matrix, scored, share, pattern)
        weight.copy_(matrix.reshape(weight.movedim(1, -1).shape).movedim(-1, 1))
        return
    if pattern is not None and matrix.shape[1] % pattern[1]:
        return
    _zero_lowest(matrix, matrix.detach().abs().float(), share, pattern)


def _zero_lowest(weight: torch.Tensor, score: torch.Tensor, share: float, pattern: Pattern | None) -> None:
    rows, cols = score.shape
    with torch.no_grad():
        if pattern is not None:
            n, m = pattern
            grouped = score.reshape(rows, cols // m, m)
            lowest = grouped.topk(m - n, dim=2, largest=False).indices
            mask = torch.zeros_like(grouped, dtype=torch.bool).scatter_(2, lowest, True).reshape(rows, cols)
        else:
            k = math.floor(cols * share)
            if k == 0:
                return
            lowest = score.topk(k, dim=1, largest=False).indices
            mask = torch.zeros_like(score, dtype=torch.bool).scatter_(1, lowest, True)
        weight.masked_fill_(mask, 0)


def sparsegpt_(weight: torch.Tensor, hessian: torch.Tensor, share: float, pattern: Pattern | None) -> bool:
    """Prune ``weight`` (out, in) by SparseGPT with its inputs' ``H = X^T X / n``: ``share`` of each block
    of :data:`BLOCK` columns (so of the layer), or N:M; the weights kept are updated to make up for those
    removed. False (nothing changed) when ``H`` cannot be inverted."""
    inverse = inverse_cholesky(hessian.detach().to(torch.float32).clone())
    if inverse is None:
        return False
    cols = weight.shape[1]
    # Columns of the weight are rows here: each step reads and updates contiguous memory.
    w = weight.detach().to(torch.float32).t().contiguous()
    w[torch.diag(hessian) == 0] = 0  # inputs that were always zero: any value gives the same output
    block = BLOCK if pattern is None else pattern[1] * math.ceil(BLOCK / pattern[1])
    for start in range(0, cols, block):
        stop = min(start + block, cols)
        work = w[start:stop].clone()
        errors = torch.empty_like(work)
        local = inverse[start:stop, start:stop]
        diagonal = torch.diagonal(local).unsqueeze(1)
        removed = torch.zeros_like(work, dtype=torch.bool)
        if pattern is None:
            cost = work.square() / diagonal.square()
            k = math.floor(cost.numel() * share)
            if k:
                removed.view(-1)[cost.view(-1).topk(k, largest=False).indices] = True
        for i in range(stop - start):
            if pattern is not None and i % pattern[1] == 0:
                n, m = pattern
                cost = work[i : i + m].square() / diagonal[i : i + m].square()
                removed[i : i + m].scatter_(0, cost.topk(m - n, dim=0, largest=False).indices, True)
            kept = work[i].masked_fill(removed[i], 0)
            error = errors[i]
            torch.sub(work[i], kept, out=error).div_(local[i, i])
            work[i:].addr_(local[i, i:], error, alpha=-1)
            work[i] = kept
        w[start:stop] = work
        w[stop:] -= inverse[start:stop, stop:].t() @ errors
    with torch.no_grad():
        weight.copy_(w.t().to(weight.dtype))
    return True
