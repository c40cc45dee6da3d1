"""Pruned Hugging Face models as folders that ``from_pretrained`` reads: new widths in ``config.json``.

A pruned transformers model differs from its config in sizes only. When every layer was pruned alike (the
default ``scope="layer"`` does that), the new sizes fit the config's single values (``hidden_size``,
``intermediate_size``, ``num_attention_heads``, ``num_key_value_heads``), and the class rebuilds the
pruned model by itself. When layers differ, no config can say so: the folder still loads with
:func:`slimtorch.load_model`, which applies the structural delta, and the report says why
``from_pretrained`` would not.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn

from slimtorch.errors import SlimtorchError
from slimtorch.graph.layers import head_size, output_width, query_heads

FEED_FORWARD_UP = ("intermediate.dense", "mlp.up_proj", "mlp.c_fc", "mlp.fc1", "intermediate.dense_act")
HIDDEN_KEYS = ("hidden_size", "n_embd", "d_model", "dim")
INTERMEDIATE_KEYS = ("intermediate_size", "n_inner", "ffn_dim", "hidden_dim")
HEAD_KEYS = ("num_attention_heads", "n_head", "n_heads")


@dataclass(frozen=True)
class ConfigUpdate:
    """New config values, and the sizes a config cannot express (per-layer differences)."""

    values: dict[str, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)


def config_update(model: nn.Module) -> ConfigUpdate:
    """The config values that describe ``model`` as it is now (after pruning)."""
    config = getattr(model, "config", None)
    if config is None:
        raise SlimtorchError(f"a {type(model).__name__} has no Hugging Face config")
    values: dict[str, int] = {}
    problems: list[str] = []
    input_embeddings = getattr(model, "get_input_embeddings", None)  # a transformers PreTrainedModel's
    embeddings = input_embeddings() if input_embeddings is not None else None
    if isinstance(embeddings, nn.Embedding):  # a vision model's patch embedding is a convolution
        for key in HIDDEN_KEYS:
            if isinstance(getattr(config, key, None), int):
                values[key] = embeddings.weight.shape[1]
    modules = dict(model.named_modules())
    widths = {width for n, m in modules.items() if n.endswith(FEED_FORWARD_UP) and (width := output_width(m))}
    _single(values, problems, config, INTERMEDIATE_KEYS, widths, "feed-forward width", unset_too=True)
    heads = {count for m in modules.values() if (count := query_heads(m)) is not None}
    _single(values, problems, config, HEAD_KEYS, heads, "attention head count")
    if isinstance(getattr(config, "num_key_value_heads", None), int):
        kv = {
            width // size
            for m in modules.values()
            if _has(m, "k_proj", "head_dim") and (width := output_width(m.k_proj)) and (size := head_size(m))
        }
        _single(values, problems, config, ("num_key_value_heads",), kv, "key/value head count")
    sizes = {
        size for m in modules.values() if query_heads(m) is not None and (size := head_size(m)) is not None
    }
    hidden_now = [values.get(key, getattr(config, key, None)) for key in HIDDEN_KEYS]
    hidden = next((size for size in hidden_now if isinstance(size, int)), None)
    heads_now = next((values[k] for k in HEAD_KEYS if k in values), None)
    explicit = isinstance(getattr(config, "head_dim", None), int)
    if not explicit and hidden and heads_now and sizes and sizes != {hidden // heads_now}:
        derived = hidden // heads_now
        problems.append(
            f"heads of {sorted(sizes)[0]} features in a hidden size of {hidden}: this config derives the "
            f"head size as hidden_size / num_attention_heads = {derived}"
        )
    return ConfigUpdate(values, problems)


def _single(
    values: dict,
    problems: list,
    config: Any,
    keys: tuple[str, ...],
    found: set,
    what: str,
    unset_too: bool = False,
) -> None:
    """Set ``keys`` the config has to the one value found; ``unset_too``: also those left None (GPT-2's
    ``n_inner`` = None means 4 x hidden, which pruning the hidden size would change)."""
    if not found:
        return
    if len(found) > 1:
        problems.append(f"the layers have different {what}s ({sorted(found)}): a config holds one")
        return
    for key in keys:
        value = getattr(config, key, "absent")
        if isinstance(value, int) or (unset_too and value is None):
            values[key] = next(iter(found))


def _has(module: nn.Module, *names: str) -> bool:
    return all(hasattr(module, name) for name in names)
