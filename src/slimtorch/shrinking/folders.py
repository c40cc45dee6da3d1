"""Folder outputs: which layout they get (:mod:`slimtorch.format.hf_layout`), the model config that goes
with their weights, and the files copied along from a model folder."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from slimtorch.errors import FormatError, SlimtorchError
from slimtorch.format.hf_layout import base_prefix, ct_weights, inner_config, resolve_layout
from slimtorch.format.policy import TensorPolicy
from slimtorch.format.source import TensorSource
from slimtorch.format.untrusted import load_json
from slimtorch.models.hub import config_model
from slimtorch.sources.companions import Companions, find_companions
from slimtorch.sources.hf_folder import weight_files


@dataclass
class Folder:
    """What a folder output holds besides its weights: its layout (:mod:`slimtorch.format.hf_layout`), the
    model's config (None: no ``config.json`` to write), and for ``hf`` the model's base prefix and the
    coded tensors whose layers quantize their inputs (``int8-dynamic``)."""

    layout: str = "slim"
    config: dict[str, Any] | None = None
    base_prefix: str = ""
    dynamic: frozenset[str] = frozenset()
    notes: list[str] = field(default_factory=list)


def model_config(model: torch.nn.Module) -> dict[str, Any] | None:
    """A transformers model's config as ``config.json`` holds it, naming the model's class as
    ``save_pretrained`` does (None for other models)."""
    config = getattr(model, "config", None)
    to_dict = getattr(config, "to_dict", None)
    if not callable(to_dict):
        return None
    values = to_dict()
    values["architectures"] = values.get("architectures") or [type(model).__name__]
    return values


def choose_layout(
    config: dict[str, Any] | None,
    asked: str | None,
    out: Path,
    policy: TensorPolicy,
    model: torch.nn.Module | None = None,
) -> tuple[Folder, TensorPolicy]:
    """The layout of the output and the policy that writes it: ``hf`` quantizes only what
    compressed-tensors expresses, which the model ``config`` describes tells (``model``: built already)."""
    if out.suffix == ".safetensors":
        config = None  # one file: no config.json goes with it
    layout = resolve_layout(asked, config is not None, out)
    folder = Folder(layout, config)
    if layout == "slim":
        return folder, policy
    if policy.entropy:
        raise SlimtorchError(
            f"{out}: --entropy stores parts transformers cannot read; use it with --layout slim"
        )
    if policy.quantize and model is None:
        model = config_model(config)  # type: ignore[arg-type]
    if policy.quantize and model is None:
        if asked == "hf":
            raise SlimtorchError(
                f"{out}: transformers cannot build the model config.json describes, so which weights "
                "compressed-tensors can hold is unknown; use --layout slim"
            )
        folder.layout = "slim"
        folder.notes.append("written in the slim layout: transformers cannot build this config's model")
        return folder, policy
    folder.base_prefix = base_prefix(model) if model is not None else ""
    weights = ct_weights(model) if model is not None else set()
    if policy.codec == "int4":
        # compressed-tensors' int4 is for Linear layers: embeddings go int8, which it holds, not float
        int4 = ct_weights(model, 4) if model is not None else set()
        policy = replace(policy, stored_as={**dict.fromkeys(weights - int4, "int8"), **policy.stored_as})
    return folder, replace(policy, layout="hf", hf_weights=frozenset(weights))


def config_file(found: Path | bytes | None) -> dict[str, Any] | None:
    """The model's config from a ``config.json`` to copy along (its path, or its bytes), unwrapped from a
    slim layout's; None when there is none."""
    if found is None:
        return None
    path = found if isinstance(found, Path) else Path("config.json")
    text = found.read_bytes() if isinstance(found, Path) else found
    config = inner_config(load_json(path, text, "config.json"), path)
    if not isinstance(config, dict):
        raise FormatError(path, f"expected a JSON object, found a {type(config).__name__}")
    return config


def refuse_foreign_codes(source: TensorSource, config: Mapping[str, Any] | None) -> None:
    """A folder another tool quantized (``quantization_config`` in its config, weights not slim): its
    tensors are codes under that tool's names, which a shrink would copy as plain weights and drop the
    config that says how to read them. Refused until slimtorch reads them."""
    quantization = (config or {}).get("quantization_config")
    if isinstance(quantization, Mapping) and not source.coded:
        method = quantization.get("quant_method", "an unknown method")
        raise FormatError(
            source.path,
            f"its weights are quantized ({method}, per config.json's quantization_config) and slimtorch "
            "does not read that format yet; give the float model (transformers: from_pretrained with "
            "dequantize, then save_pretrained)",
        )


def companions_of(source: Path, out: Path) -> Companions:
    """The files a model folder ``source`` holds besides its weights (tokenizer, config), copied along
    into a folder output."""
    if not source.is_dir() or out.suffix == ".safetensors":
        return Companions({})
    weight_files(source)  # the folder was read as a model folder
    return find_companions(source)
