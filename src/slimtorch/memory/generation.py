"""Inference memory of a causal language model: its weights plus the KV cache of a context, and the longest
context a budget holds (the question a language-model user asks before ``generate``).

The cache is the one transformers' ``generate`` keeps: per layer a key and a value tensor of
``batch x key/value heads x tokens x head size`` in the cache's dtype (the model's, or ``dtype``). It is
read from the model's config (``num_hidden_layers``, ``num_key_value_heads`` or else ``num_attention_heads``,
``head_dim`` or else ``hidden_size / num_attention_heads``); a layer with a sliding window keeps at most its
window of tokens. After ``generate(prompt, max_new_tokens=n)`` the cache holds ``len(prompt) + n - 1``
tokens (the last token generated is never fed back). Weights count every parameter and buffer in the dtype
they will have. The prefill's own activations (the attention scores and logits of a long prompt) come on
top, for the length of that step: :func:`slimtorch.memory.estimate` with ``mode="inference"`` sizes them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from slimtorch.errors import OptionError
from slimtorch.format.verbs import Report

MAX_CONTEXT = 1 << 24


@dataclass(frozen=True)
class CacheShape:
    """What one token costs in the KV cache, per sequence: ``layers x 2 x kv_heads x head_dim x itemsize``
    bytes, each layer capped at its sliding window (``None``: the whole context)."""

    layers: int
    kv_heads: int
    head_dim: int
    itemsize: int
    windows: tuple[int | None, ...]

    @property
    def bytes_per_token(self) -> int:
        return self.layers * 2 * self.kv_heads * self.head_dim * self.itemsize

    def bytes(self, batch: int, tokens: int) -> int:
        """The cache of ``batch`` sequences of ``tokens`` tokens each."""
        per_layer = 2 * self.kv_heads * self.head_dim * self.itemsize * batch
        return sum(per_layer * (tokens if w is None else min(tokens, w)) for w in self.windows)


@dataclass
class ContextMemory:
    context: int
    kv_cache_bytes: int
    total_bytes: int


@dataclass
class GenerationMemory(Report):
    """Weights plus KV cache at each context asked, and the longest context within ``budget_bytes``."""

    SCHEMA: ClassVar[str] = "slimtorch.generation_memory/1"

    batch: int
    cache_dtype: str
    weights_bytes: int
    kv_bytes_per_token: int
    contexts: list[ContextMemory] = field(default_factory=list)
    budget_bytes: int | None = None
    largest_context: int | None = None
    """the most tokens per sequence whose weights + KV cache fit ``budget_bytes`` (0: not even one)"""


def cache_shape(config: Any, dtype: torch.dtype) -> CacheShape:
    """The KV cache's shape from a transformers config (its ``text_config`` for a multimodal one)."""
    config = getattr(config, "text_config", None) or config
    layers = _positive(config, "num_hidden_layers")
    heads = _positive(config, "num_attention_heads")
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or _positive(config, "hidden_size") // heads
    window = getattr(config, "sliding_window", None)
    kinds = getattr(config, "layer_types", None)
    if kinds is not None and len(kinds) == layers:  # Gemma-style mixes of sliding and full attention
        windows = tuple(window if kind == "sliding_attention" and window else None for kind in kinds)
    elif window and getattr(config, "use_sliding_window", True) is not False:
        windows = (int(window),) * layers
    else:
        windows = (None,) * layers
    return CacheShape(layers, int(kv_heads), int(head_dim), dtype.itemsize, windows)


def _positive(config: Any, name: str) -> int:
    value = getattr(config, name, None)
    if not isinstance(value, int) or value <= 0:
        raise OptionError(
            f"the model's config has no {name}: generation memory needs a causal language model's config"
        )
    return value


def weights_bytes(model: torch.nn.Module, dtype: torch.dtype | None = None) -> int:
    """Parameters and buffers, each stored once (tied weights too), floats in ``dtype`` when given."""
    seen, total = set(), 0
    for tensor in [*model.parameters(), *model.buffers()]:
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        itemsize = (
            dtype.itemsize if dtype is not None and tensor.is_floating_point() else tensor.element_size()
        )
        total += tensor.numel() * itemsize
    return total


def generation_memory(
    model: torch.nn.Module,
    contexts: list[int],
    *,
    batch: int = 1,
    dtype: torch.dtype | None = None,
    budget: int | None = None,
) -> GenerationMemory:
    """Weights + KV cache of ``model`` (a transformers causal LM, real or on the meta device) for each of
    ``contexts`` tokens per sequence, and the longest context ``budget`` bytes hold.

    Example:
        >>> from transformers import LlamaConfig, LlamaForCausalLM  # doctest: +SKIP
        >>> with torch.device("meta"):  # doctest: +SKIP
        ...     llama = LlamaForCausalLM(LlamaConfig(num_hidden_layers=32, num_key_value_heads=8))
        >>> report = generation_memory(llama, [8192], dtype=torch.bfloat16)  # doctest: +SKIP
        >>> report.contexts[0].kv_cache_bytes  # 32 layers, key and value, 8 x 128 x 8192  # doctest: +SKIP
        1073741824
    """
    if batch < 1 or any(not 0 < c <= MAX_CONTEXT for c in contexts):
        raise OptionError(f"batch must be >= 1 and contexts 1 to {MAX_CONTEXT:,} tokens")
    config = getattr(model, "config", None)
    if config is None:
        raise OptionError(
            "generation memory needs a transformers model (its config gives the KV cache's shape)"
        )
    cache_dtype = dtype or next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    shape = cache_shape(config, cache_dtype)
    weights = weights_bytes(model, dtype)
    rows = [ContextMemory(c, shape.bytes(batch, c), weights + shape.bytes(batch, c)) for c in contexts]
    largest = _largest_context(shape, batch, budget - weights) if budget is not None else None
    return GenerationMemory(
        batch=batch,
        cache_dtype=str(cache_dtype).removeprefix("torch."),
        weights_bytes=weights,
        kv_bytes_per_token=shape.bytes_per_token * batch,
        contexts=rows,
        budget_bytes=budget,
        largest_context=largest,
    )


def _largest_context(shape: CacheShape, batch: int, room: int) -> int:
    """The most tokens whose cache fits ``room`` bytes (the cache grows monotonically: a bisection)."""
    if room < shape.bytes(batch, 1):
        return 0
    low, high = 1, MAX_CONTEXT
    if shape.bytes(batch, high) <= room:
        return high
    while low + 1 < high:
        middle = (low + high) // 2
        low, high = (middle, high) if shape.bytes(batch, middle) <= room else (low, middle)
    return low
