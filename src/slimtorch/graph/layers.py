"""What slimtorch knows about layer types beyond torch.nn: Hugging Face's ``Conv1D``, attention heads.

Shared by the MAC counter, the pruner (which must keep size attributes true) and the config writer of
pruned Hugging Face models, so that each recognises these layers the same way.
"""

from __future__ import annotations

import torch
from torch import nn

HEAD_SIZES = ("attention_head_size", "head_dim", "head_size")
QUERIES = ("query", "q_proj", "q_lin", "q")


def is_hf_conv1d(module: nn.Module) -> bool:
    """Hugging Face's GPT-2 ``Conv1D``: a linear layer whose weight is stored [in, out], width in ``nf``."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf")


def head_size(module: nn.Module) -> int | None:
    """Features per head of an attention module (None: not an attention module we know)."""
    sizes = [getattr(module, name, None) for name in HEAD_SIZES]
    return next((size for size in sizes if isinstance(size, int)), None)


def output_width(module: nn.Module) -> int | None:
    """A matrix layer's outputs, whether its weight is a float matrix or codes: its weight's rows (columns
    for GPT-2's ``Conv1D``: what pruning cuts, before any size attribute follows), else ``out_features`` or
    ``nf`` (a quantized layer keeps codes, no ``weight``); None for anything else."""
    weight = module._parameters.get("weight") if isinstance(module, nn.Module) else None
    if isinstance(weight, torch.Tensor) and weight.dim() == 2:
        return weight.shape[-1] if is_hf_conv1d(module) else weight.shape[0]
    for attribute in ("out_features", "nf"):
        width = getattr(module, attribute, None)
        if isinstance(width, int) and not isinstance(width, bool):
            return width
    return None


def query_width(module: nn.Module) -> int | None:
    """The width of an attention module's queries: its query projection's rows, or a third of a fused
    q/k/v projection's outputs (GPT-2's ``c_attn`` with ``split_size``)."""
    queries = [getattr(module, name, None) for name in QUERIES]
    query = next((q for q in queries if isinstance(q, nn.Module) and output_width(q) is not None), None)
    if query is not None:
        return output_width(query)
    fused = getattr(module, "c_attn", None)
    if fused is not None and hasattr(module, "split_size"):
        width = output_width(fused)
        return width // 3 if width is not None else None
    return None


def query_heads(module: nn.Module) -> int | None:
    """How many query heads an attention module has now, from its projections' widths."""
    size, width = head_size(module), query_width(module)
    return width // size if size and width is not None else None
