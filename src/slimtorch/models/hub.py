"""Hugging Face model folders: the model class their ``config.json`` names, built without running their code.

``config.json`` is read by ``transformers.AutoConfig`` (old folders too: a config written by transformers
4.8 reads in 5.x) and the model is the class its ``architectures`` names when transformers has it, else
``AutoModel`` for its ``model_type``. A config with ``auto_map`` points at Python files in the folder; those
are never imported: the folder is refused with the reason before transformers sees it, and transformers is
always called with ``trust_remote_code=False`` (left unset, it asks "[y/N]" on stdin, and ``yes |`` answers
it). Weights are not read here: :func:`slimtorch.load_model` puts them into the model this builds.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from slimtorch.errors import FormatError, SlimtorchError
from slimtorch.format.hf_layout import REFUSING_TYPE, inner_config
from slimtorch.format.untrusted import MAX_JSON_BYTES, load_json


def is_model_folder(path: Path) -> bool:
    """Whether ``path`` is a Hugging Face model folder (a folder with a ``config.json``).

    Example:
        >>> is_model_folder(Path("bert-base-uncased"))  # doctest: +SKIP
        True
    """
    return path.is_dir() and (path / "config.json").is_file()


def read_config(folder: Path) -> Any:
    """``folder/config.json`` as transformers reads it; a config that maps to code in the folder is refused.

    Example:
        >>> read_config(Path("bert-folder")).model_type  # doctest: +SKIP
        'bert'
    """
    transformers = require_transformers()
    path = folder / "config.json"
    raw = read_json(path, "JSON config")
    if not isinstance(raw, dict):
        raise FormatError(path, f"expected a JSON object, found a {type(raw).__name__}")
    if "auto_map" in raw:
        # auto_map names Python files of the folder; building the model would import and run them.
        raise SlimtorchError(
            f"{path}: auto_map points the model at Python code in the folder, and slimtorch never runs code "
            f"from a model folder; give a factory you trust (package.module:factory) and --weights {folder}"
        )
    if raw.get("model_type") == REFUSING_TYPE:  # a slim-layout folder: the real config is inside
        return config_from_dict(inner_config(raw, path), path)
    try:
        return transformers.AutoConfig.from_pretrained(folder, trust_remote_code=False)
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise SlimtorchError(f"{path}: transformers cannot read it ({first})") from None


def config_from_dict(values: dict[str, Any], path: Path | str = "config.json") -> Any:
    """A transformers config from the values of a ``config.json`` (as ``AutoConfig`` would build it).

    Example:
        >>> config_from_dict({"model_type": "bert", "hidden_size": 64}).hidden_size  # doctest: +SKIP
        64
    """
    transformers = require_transformers()
    if "auto_map" in values:
        raise SlimtorchError(f"{path}: auto_map points the model at Python code; slimtorch never runs it")
    model_type = values.get("model_type")
    try:
        config_class = transformers.CONFIG_MAPPING[model_type]
        return config_class.from_dict({k: v for k, v in values.items() if k != "model_type"})
    except (KeyError, ValueError, TypeError, RecursionError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise SlimtorchError(f"{path}: transformers cannot read it ({first})") from None


def read_json(path: Path, what: str = "JSON") -> Any:
    """A JSON file of a model folder, read through :func:`~slimtorch.format.untrusted.load_json`: at most
    ``MAX_JSON_BYTES`` are read (a 10 GB ``config.json``, or one linked to ``/dev/zero``, is refused without
    being read), and a parse error is a :class:`FormatError` naming the file.

    Example:
        >>> read_json(Path("bert-folder/config.json"))["model_type"]  # doctest: +SKIP
        'bert'
    """
    with open(path, "rb") as stream:
        text = stream.read(MAX_JSON_BYTES + 1)
    if len(text) > MAX_JSON_BYTES:
        raise FormatError(path, f"{what} is larger than the {MAX_JSON_BYTES:,} bytes allowed")
    return load_json(path, text, what)


def model_factory(config: Any, **options: Any) -> Callable[[], nn.Module]:
    """A function building the model ``config.architectures[0]`` names (``AutoModel`` when transformers
    has no such class), with random weights: :func:`slimtorch.load_model` builds it on the meta device.

    Example:
        >>> build = model_factory(read_config(Path("bert-folder")))  # doctest: +SKIP
        >>> type(build()).__name__  # doctest: +SKIP
        'BertModel'
    """
    model_class = model_class_of(config)
    if model_class is not None:
        return lambda: model_class(config, **options)
    transformers = require_transformers()

    def from_config() -> nn.Module:
        try:
            return transformers.AutoModel.from_config(config, trust_remote_code=False, **options)
        except ValueError as exc:
            first = (str(exc).strip().splitlines() or ["unknown model type"])[0]
            raise SlimtorchError(f"transformers has no model for this config.json ({first})") from None

    return from_config


def model_class_of(config: Any) -> type[nn.Module] | None:
    """The transformers class ``config.architectures[0]`` names, or None when transformers lacks it."""
    transformers = require_transformers()
    architecture = (getattr(config, "architectures", None) or [None])[0]
    found = getattr(transformers, architecture, None) if isinstance(architecture, str) else None
    return found if isinstance(found, type) and issubclass(found, nn.Module) else None


def checkpoint_renames(model: nn.Module, file_names: Iterable[str]) -> list[tuple[str, str]]:
    """(name in the file, name in the model) for the tensors transformers renames when it loads ``model``'s
    checkpoints: transformers 5 renamed modules of many models (ViT's ``encoder.layer.0.attention.attention.
    query`` is ``layers.0.attention.q_proj``) and still saves and reads the old names. Empty for transformers
    4, for a model that is not a transformers model, and for names the model already has.

    A checkpoint transformers would *combine* tensors of (fused experts, merged projections) is refused: a
    renaming cannot express that, and slimtorch loads tensors as they are stored.

    Example:
        >>> checkpoint_renames(vit, ["encoder.layer.0.attention.attention.query.weight"])  # doctest: +SKIP
        [('encoder.layer.0.attention.attention.query.weight', 'layers.0.attention.q_proj.weight')]
    """
    try:
        from transformers import PreTrainedModel
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key
    except ImportError:  # transformers 4: checkpoints hold the modules' own names
        return []
    if not isinstance(model, PreTrainedModel):
        return []
    transforms = get_model_conversion_mapping(model)
    if not transforms:
        return []
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]  # as transformers splits them
    own = set(model.state_dict())
    pairs = []
    for name in file_names:
        if name in own:
            continue
        renamed, combined = rename_source_key(name, renamings, converters)
        if combined is not None:
            raise SlimtorchError(
                f"tensor {name!r}: transformers combines it with others when it loads this checkpoint "
                f"({combined}); slimtorch loads tensors as stored, so it cannot build {type(model).__name__} "
                "from this checkpoint"
            )
        if renamed != name:
            pairs.append((name, renamed))
    return pairs


def config_model(config: Mapping[str, Any]) -> nn.Module | None:
    """The transformers model ``config`` describes, built on the meta device (no memory, no init): which
    layers are ``nn.Linear`` is what decides the compressed-tensors format. None when transformers cannot
    build it (an unknown architecture)."""
    try:
        build = model_factory(config_from_dict(dict(inner_config(dict(config), Path("config.json")))))
        with torch.device("meta"):
            return build()
    except Exception:
        return None


def require_transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise SlimtorchError(
            "a Hugging Face folder needs transformers: pip install 'slimtorch[hf]'"
        ) from None
    return transformers
