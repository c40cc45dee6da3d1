"""The model a command works on, and a sample input for it: a factory spec or a Hugging Face folder.

Shared by ``slimtorch prune`` and ``slimtorch quantize``: the same MODEL argument, ``--weights``,
``--input-shape`` and ``--allow-global``, and the same rules for the example input (token ids for a text
model, images for a vision config, a random tensor of ``--input-shape`` for anything else).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from slimtorch.cli.arguments import add_allow_global
from slimtorch.cli.model_spec import SPEC_HELP, resolve_factory
from slimtorch.errors import SlimtorchError
from slimtorch.graph.capture import random_like
from slimtorch.io.loader import load_model

DEFAULT_SHAPE = (1, 3, 224, 224)


@dataclass
class CommandModel:
    model: torch.nn.Module
    example: tuple
    folder: Path | None
    """the Hugging Face folder it came from (None: a factory)"""

    def samples(self, count: int) -> list[tuple]:
        """``count`` inputs like the example: the example, then fresh random ones of its shape and kind."""
        return [self.example, *(tuple(random_like(t) for t in self.example) for _ in range(count - 1))]


def add_model_arguments(parser: argparse.ArgumentParser, default_shape: str) -> None:
    parser.add_argument("model", metavar="MODEL", help=SPEC_HELP + ", or a Hugging Face model folder")
    parser.add_argument(
        "--weights", metavar="PATH", help="checkpoint to load into the model first (any format)"
    )
    parser.add_argument(
        "--input-shape",
        type=shape,
        default=DEFAULT_SHAPE,
        metavar="N,C,H,W",
        help=f"shape of the example input (default {default_shape}; token ids for a text model)",
    )
    add_allow_global(parser)


def command_model(args: argparse.Namespace) -> CommandModel:
    folder = Path(args.model)
    if folder.is_dir() and (folder / "config.json").is_file():
        model, example = _hugging_face(folder, args)
        return CommandModel(model, example, folder)
    model, example = _from_factory(args)
    return CommandModel(model, example, None)


def shape(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated shape: {text!r}") from None
    if not sizes or any(size < 1 for size in sizes):
        raise argparse.ArgumentTypeError(f"sizes must be positive: {text!r}")
    return sizes


def _from_factory(args: argparse.Namespace) -> tuple[torch.nn.Module, tuple]:
    factory = resolve_factory(args.model)
    if args.weights:
        model = load_model(args.weights, factory, allow_globals=tuple(args.allow_global))
    else:
        model = factory()
        if not isinstance(model, torch.nn.Module):
            raise SlimtorchError(f"{args.model} returned a {type(model).__name__}, not a torch.nn.Module")
    return model, (torch.randn(args.input_shape),)


def _hugging_face(folder: Path, args: argparse.Namespace) -> tuple[torch.nn.Module, tuple]:
    """The folder's model (its class from config.json, its weights through slimtorch's safe loader) and
    an example input: token ids, or images for a vision config (``--input-shape`` overrides)."""
    config, model_class = _hf_class(folder)
    model = load_model(folder, lambda: model_class(config), allow_globals=tuple(args.allow_global))
    return model, _example(config, args.input_shape)


def _hf_class(folder: Path) -> tuple[Any, Any]:
    """config.json read by transformers, and the model class its ``architectures`` names."""
    try:
        import transformers
    except ImportError:
        raise SlimtorchError(
            "a Hugging Face folder needs transformers: pip install 'slimtorch[hf]'"
        ) from None
    try:
        config = transformers.AutoConfig.from_pretrained(folder)
    except (OSError, ValueError) as exc:
        raise SlimtorchError(f"{folder}/config.json: {exc}") from None
    architecture = (config.architectures or [None])[0]
    model_class = getattr(transformers, architecture or "", None)
    if model_class is None:
        raise SlimtorchError(
            f"{folder}: config.json names no architecture transformers knows ({architecture})"
        )
    return config, model_class


def meta_model(args: argparse.Namespace) -> tuple[torch.nn.Module, tuple]:
    """The model built on the meta device (shapes, no memory, no weights read) and an example input:
    what a memory estimate needs, for models larger than RAM too."""
    folder = Path(args.model)
    if folder.is_dir() and (folder / "config.json").is_file():
        config, model_class = _hf_class(folder)
        with torch.device("meta"):
            return model_class(config), _example(config, args.input_shape)
    factory = resolve_factory(args.model)
    with torch.device("meta"):
        model = factory()
    if not isinstance(model, torch.nn.Module):
        raise SlimtorchError(f"{args.model} returned a {type(model).__name__}, not a torch.nn.Module")
    return model, (torch.randn(args.input_shape),)


def _example(config: Any, input_shape: tuple[int, ...]) -> tuple:
    """Token ids for a text config, images for a vision one; ``--input-shape`` overrides the size."""
    if input_shape != DEFAULT_SHAPE:
        sizes = input_shape
    elif hasattr(config, "image_size"):
        sizes = (1, getattr(config, "num_channels", 3), config.image_size, config.image_size)
    else:
        sizes = (1, min(128, getattr(config, "max_position_embeddings", 128)))
    if len(sizes) == 2:
        return (torch.randint(0, config.vocab_size, sizes),)
    return (torch.randn(sizes),)
