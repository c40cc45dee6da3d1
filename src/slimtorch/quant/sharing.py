"""Several int8-dynamic layers reading one input quantize it once.

Attention's query, key and value (and Llama's gate and up projections) read the same tensor. In the modules
known to change no tensor in place while those layers run (:data:`SHARING_PARENTS`), hooks open a scope
around each call: eagerly, :data:`slimtorch.quant.kernels.SHARED_INPUTS` keeps the last input's codes for
the scope; in a compiled graph, :data:`TRACED_SCOPES` keeps them as values of the graph while dynamo
traces (:func:`traced_codes`), so the graph holds one quantization per input.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from slimtorch.quant import kernels

SHARING_PARENTS = frozenset(
    {
        "transformers.models.bert.modeling_bert.BertSelfAttention",
        "transformers.models.bert.modeling_bert.BertCrossAttention",
        "transformers.models.llama.modeling_llama.LlamaAttention",
        "transformers.models.llama.modeling_llama.LlamaMLP",
    }
)
"""Modules whose forward hands one tensor to several of their Linears and changes no tensor in place
while those run (read in transformers 5.23): inside one call of theirs, the layers share that tensor's codes
under ``torch.inference_mode`` too, where no version counter would show such a change. Others share them
under ``no_grad`` only."""


def share_input_codes(model: nn.Module) -> int:
    """Let the int8-dynamic layers (``SHARES_INPUT_CODES``) under each module of :data:`SHARING_PARENTS`
    share their input's codes within one call of it, under any grad mode (hooks that open and close a
    scope: :class:`~slimtorch.quant.kernels.SharedInputCodes` eagerly, :data:`TRACED_SCOPES` while dynamo
    traces); how many modules were set up. Idempotent.

    Example:
        >>> share_input_codes(bert)  # doctest: +SKIP
        12
    """
    count = 0
    for parent in model.modules():
        kind = type(parent)
        if f"{kind.__module__}.{kind.__qualname__}" not in SHARING_PARENTS:
            continue
        if sum(getattr(child, "SHARES_INPUT_CODES", False) for child in parent.children()) < 2:
            continue
        if _open_sharing not in parent._forward_pre_hooks.values():
            parent.register_forward_pre_hook(_open_sharing)
            parent.register_forward_hook(_close_sharing, always_call=True)  # closed on errors too
        count += 1
    return count


def _open_sharing(module: nn.Module, args: tuple) -> None:
    if torch.compiler.is_compiling():
        TRACED_SCOPES.append({})
    else:
        kernels.SHARED_INPUTS.open()


def _close_sharing(module: nn.Module, args: tuple, output: Any) -> None:
    if torch.compiler.is_compiling():
        if TRACED_SCOPES:
            TRACED_SCOPES.pop()
    else:
        kernels.SHARED_INPUTS.close()


TRACED_SCOPES: list[dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = []
"""The sharing scopes open while dynamo traces (:data:`kernels.SHARED_INPUTS`' scopes in a compiled graph),
innermost last: per scope and kind of codes (``uint8``, ``int8``, ``uint7``), the last input quantized, its
codes and row scales, all values of the graph. Dynamo replays what a graph did to this list after the graph
runs: each scope opens and closes within one call, so the list is empty between calls."""


def traced_codes(x: torch.Tensor, x2d: torch.Tensor, codes: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``x``'s row codes in a compiled graph: one ``slimtorch::quantize_rows`` per input, shared by the
    layers of one sharing scope (query, key and value read the same input: 2 operators fewer)."""
    scope = TRACED_SCOPES[-1] if TRACED_SCOPES else None
    hit = None if scope is None else scope.get(codes)
    if hit is not None and hit[0] is x:
        return hit[1], hit[2]
    values, row_scale = kernels.quantize_rows_op(x2d, codes)
    if scope is not None:
        scope[codes] = (x, values, row_scale)
    return values, row_scale
