"""Example inputs a model accepts, chosen from the model itself, and the check that it does accept them.

- a Hugging Face text model (its config has a vocabulary, its forward takes ``input_ids``): keyword
  inputs ``input_ids`` and ``attention_mask`` (and ``token_type_ids`` where the config has token types, and
  ``decoder_input_ids`` for an encoder-decoder), a batch of two sequences of :data:`TEXT_LENGTH` tokens, the
  second one padded, ids drawn from the ordinary part of the vocabulary, never a special token;
- a Hugging Face vision model: one image of the config's size and channels;
- any other model: its class attribute ``example_input_shape`` if it has one, else :data:`DEFAULT_SHAPE`;
  token ids when its first layer is an ``nn.Embedding``, else normal noise in the model's dtype.

An explicit shape always wins (``(batch, length)`` for a text model). Whatever was chosen is run through
the model once; a model that rejects it is one :class:`~slimtorch.errors.SlimtorchError` naming the shape.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, TypeGuard

import torch
from torch import nn

from slimtorch.errors import SlimtorchError

DEFAULT_SHAPE = (1, 3, 224, 224)
TEXT_LENGTH = 64
TEXT_BATCH = 2
ORDINARY_TOKENS_FROM = 1000
"""first id drawn in a large vocabulary: special, byte and unused tokens sit below it in most"""


@dataclass(frozen=True)
class Example:
    """Inputs for one call ``model(*args, **kwargs)``, and where their shape came from."""

    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    origin: str = "the default"

    @property
    def shape(self) -> tuple[int, ...]:
        """The main input's shape: ``input_ids``' for a text model, the first tensor's otherwise."""
        main = self.kwargs.get("input_ids", next(iter(self.kwargs.values()), None))
        tensors = [main] if main is not None else list(self.args)
        first = next((t for t in tensors if isinstance(t, torch.Tensor)), None)
        return tuple(first.shape) if first is not None else ()

    @property
    def shape_text(self) -> str:
        return ",".join(str(size) for size in self.shape)


def example_for(
    model: nn.Module, input_shape: tuple[int, ...] | None = None, *, max_length: int | None = None
) -> Example:
    """The example inputs for ``model`` (see the module's docstring); ``input_shape`` overrides the size.

    Example:
        >>> example_for(nn.Linear(8, 2), (4, 8)).args[0].shape
        torch.Size([4, 8])
    """
    generator = torch.Generator().manual_seed(0)
    config = getattr(model, "config", None)
    if _is_text(model, config) and (input_shape is None or len(input_shape) == 2):
        batch, length = input_shape or (TEXT_BATCH, _text_length(config, max_length))
        origin = "the given shape" if input_shape else "token ids for the model's config"
        return Example(kwargs=_tokens(model, config, batch, length, generator), origin=origin)
    hint = getattr(model, "example_input_shape", None)
    if input_shape is not None:
        sizes, origin = tuple(input_shape), "the given shape"
    elif config is not None and getattr(config, "image_size", None):
        sizes, origin = _image_shape(config), "an image of the model's config"
    elif _is_shape(hint):
        sizes, origin = tuple(hint), f"{type(model).__name__}.example_input_shape"
    else:
        sizes, origin = DEFAULT_SHAPE, "the default"
    embedding = _first_layer(model)
    if isinstance(embedding, (nn.Embedding, nn.EmbeddingBag)):
        return Example((torch.randint(0, embedding.num_embeddings, sizes, generator=generator),), {}, origin)
    return Example((torch.randn(sizes, generator=generator, dtype=_float_dtype(model)),), {}, origin)


def fresh(example: Example, generator: torch.Generator) -> Example:
    """Another input like ``example``: new noise, new token ids from the same range at the same unpadded
    positions; masks and token types kept."""
    mask = example.kwargs.get("attention_mask")
    args = tuple(_fresh(value, None, None, generator) for value in example.args)
    kwargs = {name: _fresh(value, name, mask, generator) for name, value in example.kwargs.items()}
    return Example(args, kwargs, example.origin)


def check_accepts(model: nn.Module, example: Example, name: str) -> None:
    """Run ``example`` through ``model`` once (no grad; fake tensors for a model on the meta device); a
    failure becomes one line that names the shape and says how to give another.

    Example:
        >>> check_accepts(nn.Linear(8, 2), Example((torch.randn(1, 3),)), "net")
        Traceback (most recent call last):
        ...
        slimtorch.errors.SlimtorchError: net does not accept an input of shape 1,3 (RuntimeError: ...
    """
    try:
        if any(t.is_meta for t in (*model.parameters(), *model.buffers())):
            from slimtorch.memory import estimate  # fake tensors: meta kernels alone fail on .item()

            estimate(model, example.kwargs or example.args, mode="inference", device="cpu")
        else:
            with torch.no_grad():
                model(*example.args, **example.kwargs)
    except SlimtorchError:
        raise
    except Exception as exc:  # whatever the model's own code raises on a wrong input
        first = (str(exc).strip().splitlines() or [""])[0]
        raise SlimtorchError(
            f"{name} does not accept an input of shape {example.shape_text} ({type(exc).__name__}: "
            f"{first}): give the right one with --input-shape"
        ) from exc


def _is_text(model: nn.Module, config: Any) -> bool:
    if config is None or not isinstance(getattr(config, "vocab_size", None), int):
        return False
    return not getattr(config, "image_size", None) and "input_ids" in _forward_names(model)


def _text_length(config: Any, max_length: int | None) -> int:
    limits = [
        max_length,
        getattr(config, "max_position_embeddings", None),
        getattr(config, "n_positions", None),
    ]
    return min([TEXT_LENGTH, *(n for n in limits if isinstance(n, int) and n > 0)])


def _tokens(
    model: nn.Module, config: Any, batch: int, length: int, generator: torch.Generator
) -> dict[str, torch.Tensor]:
    vocab = int(config.vocab_size)
    low = ORDINARY_TOKENS_FROM if vocab > 2 * ORDINARY_TOKENS_FROM else max(1, vocab // 10)
    ids = torch.randint(low, vocab, (batch, length), generator=generator)
    for special in _special_ids(config):
        ids[ids == special] = low
    mask = torch.ones_like(ids)
    if batch > 1 and length >= 4:  # the last sequence padded: what a batch of real sentences looks like
        pad = getattr(config, "pad_token_id", None)
        mask[-1, length - length // 4 :] = 0
        ids[-1, length - length // 4 :] = pad if isinstance(pad, int) and 0 <= pad < vocab else 0
    names = _forward_names(model)
    inputs = {"input_ids": ids}
    if "attention_mask" in names:
        inputs["attention_mask"] = mask
    if "token_type_ids" in names and getattr(config, "type_vocab_size", None):
        inputs["token_type_ids"] = torch.zeros_like(ids)
    if getattr(config, "is_encoder_decoder", False) and "decoder_input_ids" in names:
        inputs["decoder_input_ids"] = ids[:, : max(1, length // 4)].clone()
    return inputs


def _special_ids(config: Any) -> set[int]:
    found: set[int] = set()
    for key in ("pad", "bos", "eos", "sep", "cls", "unk", "mask", "decoder_start"):
        value = getattr(config, f"{key}_token_id", None)
        for item in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(item, int):
                found.add(item)
    return found


def _image_shape(config: Any) -> tuple[int, ...]:
    size = config.image_size
    height, width = (size, size) if isinstance(size, int) else tuple(size)[:2]
    return (1, int(getattr(config, "num_channels", 3) or 3), int(height), int(width))


def _fresh(value: Any, name: str | None, mask: torch.Tensor | None, generator: torch.Generator) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    if value.is_floating_point():
        return torch.randn(value.shape, generator=generator, dtype=value.dtype)
    if name is not None and not name.endswith("input_ids"):
        return value  # masks, token types, positions: the structure of the input, not its content
    keep = mask.bool() if mask is not None and mask.shape == value.shape else torch.ones_like(value).bool()
    used = value[keep]
    if not used.numel():
        return value
    drawn = torch.randint(int(used.min()), int(used.max()) + 1, value.shape, generator=generator)
    return torch.where(keep, drawn.to(value.dtype), value)


def forward_names(model: nn.Module) -> list[str]:
    """The names of the model's positional forward arguments (what the exported inputs are called)."""
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p.name for p in _forward_parameters(model) if p.kind in positional]


def _forward_names(model: nn.Module) -> set[str]:
    """Every argument name the model's forward takes (keyword-only ones too)."""
    return {p.name for p in _forward_parameters(model)}


def _forward_parameters(model: nn.Module) -> list[inspect.Parameter]:
    """The parameters of ``model.forward`` ([] where Python cannot tell: a builtin, a C extension)."""
    try:
        return list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        return []


def _first_layer(model: nn.Module) -> nn.Module | None:
    """The first module, in definition order, that holds parameters of its own."""
    return next((m for m in model.modules() if next(m.parameters(recurse=False), None) is not None), None)


def _float_dtype(model: nn.Module) -> torch.dtype:
    floats = (p.dtype for p in model.parameters() if p.is_floating_point())
    return next(floats, torch.get_default_dtype())


def _is_shape(value: Any) -> TypeGuard[tuple[int, ...] | list[int]]:
    return (
        isinstance(value, (tuple, list)) and bool(value) and all(isinstance(n, int) and n > 0 for n in value)
    )
