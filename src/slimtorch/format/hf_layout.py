"""Folder layouts: ``hf`` (transformers reads the weights as they are) and ``slim`` (only slimtorch does).

Both are slim files (metadata, seal and CRCs in each safetensors header): :func:`slimtorch.load_model`
reads either. They differ in how each logical tensor's parts are named and shaped:

- ``hf``: every tensor under its own name, dense, in a dtype transformers casts from (a float16 cast stays
  float16); int8 and int4 weights of ``nn.Linear`` and ``nn.Embedding`` layers in the compressed-tensors
  format (int8: ``<layer>.weight`` codes and ``<layer>.weight_scale`` (out, 1); int4: groups with a zero
  point each, ``weight_packed`` int32 words, ``weight_scale``, ``weight_zero_point`` (eight rows' codes a
  word, as compressed-tensors packs them) and ``weight_shape``; symmetric groups, no zero point, where a
  quantized model made them so), described by a ``quantization_config``
  in ``config.json`` whose groups name exactly the quantized layers, with ``dequantize: true`` (transformers
  decodes them at load; vLLM and compressed-tensors read the codes). The same bytes serve both readers: the
  int4 words are our nibbles, read as bytes; the int8 scale is our scale as a column. What compressed-tensors
  cannot express is written dense, never half-described.
- ``slim``: codec parts (``name::q`` ...), smaller; a ``config.json`` beside it names the model type
  ``slimtorch`` (:func:`refusing_config`), so ``from_pretrained`` refuses the folder instead of loading
  random weights, and slimtorch's readers take the real config from inside it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from slimtorch.errors import FormatError, OptionError, SlimtorchError
from slimtorch.format.codecs import Encoded
from slimtorch.format.codecs.chain import undo
from slimtorch.format.codecs.lossy import is_int4_group_size, pack_points, zero_points

LAYOUTS = ("hf", "slim")
REFUSING_TYPE = "slimtorch"
REFUSING_NOTE = "weights in the slim format: load with slimtorch.load_model(folder)"
REFUSING_DTYPE = "slimtorch.load_model"
QUANT_METHOD = "compressed-tensors"
CT_TYPES = (nn.Linear, nn.Embedding)
"""The layers compressed-tensors quantizes (exact types: a subclass's owner may read the weight itself)."""
INT8_ACTIVATIONS = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}
"""What ``int8-dynamic`` does to a Linear's input, as compressed-tensors says it: int8 per token (row),
symmetric, scaled on each call. Our kernel scales by max|row| / 127, compressed-tensors by max|row| / 127.5
(codes -128..127), so the two round activations onto grids 0.4% apart: outputs differ by about the int8
rounding of the activations (measured in tests/test_hf_outputs.py)."""


def resolve_layout(asked: str | None, has_config: bool, where: object) -> str:
    """The layout to write: ``asked``, else ``hf`` for a folder that gets a ``config.json``, else ``slim``;
    ``hf`` without a config to write is refused (transformers could not open the folder anyway)."""
    if asked is not None and asked not in LAYOUTS:
        raise OptionError(f"unknown layout {asked!r} (known: {', '.join(LAYOUTS)})")
    if asked == "hf" and not has_config:
        raise SlimtorchError(
            f"{where}: --layout hf writes a Hugging Face folder, which needs a config.json: give a Hugging "
            "Face folder as input, a transformers model, or a folder output of one (or use --layout slim)"
        )
    return asked or ("hf" if has_config else "slim")


# -- config.json -------------------------------------------------------------------------------------------
def refusing_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """A ``config.json`` that transformers refuses, holding the real config: ``AutoModel`` and
    ``AutoConfig`` refuse the model type ``slimtorch`` ("does not recognize this architecture"); a model
    class's own ``from_pretrained`` (``BertModel``), which would build its default config from it, fails
    on the dtype ("module 'torch' has no attribute 'slimtorch.load_model'") instead of loading a model of
    default sizes with the coded weights missing.

    Example:
        >>> refusing_config({"model_type": "bert"})["slimtorch"]["config"]
        {'model_type': 'bert'}
    """
    return {
        "model_type": REFUSING_TYPE,
        "dtype": REFUSING_DTYPE,
        "torch_dtype": REFUSING_DTYPE,  # the name transformers 4 reads
        REFUSING_TYPE: {"note": REFUSING_NOTE, "config": dict(config)},
    }


def inner_config(raw: Any, path: Path) -> Any:
    """The real config of a ``config.json`` as read: unwrapped from :func:`refusing_config`'s wrapper,
    else as it is; a wrapper without a config object inside is refused.

    Example:
        >>> inner_config(refusing_config({"model_type": "bert"}), Path("config.json"))
        {'model_type': 'bert'}
    """
    if not isinstance(raw, dict) or raw.get("model_type") != REFUSING_TYPE:
        return raw
    inner = raw.get(REFUSING_TYPE)
    config = inner.get("config") if isinstance(inner, dict) else None
    if not isinstance(config, dict) or config.get("model_type") == REFUSING_TYPE:
        raise FormatError(path, "a slimtorch config.json without the model's config inside (damaged?)")
    return config


def folder_config(
    config: Mapping[str, Any], layout: str, quantization: Mapping[str, Any] | None, dtype: torch.dtype | None
) -> dict[str, Any]:
    """The ``config.json`` to write: for ``hf`` the model's config with ``quantization_config`` (or none
    when nothing was written quantized) and the dtype the floats were cast to; for ``slim`` the refusing
    wrapper around it. Any ``quantization_config`` of the input is dropped: the weights are ours now."""
    config = {k: v for k, v in inner_config(dict(config), Path("config.json")).items()}
    config.pop("quantization_config", None)
    if dtype is not None:
        name = str(dtype).removeprefix("torch.")
        config["dtype"] = name
        config.pop("torch_dtype", None)
    if layout == "slim":
        return refusing_config(config)
    if quantization:
        config["quantization_config"] = dict(quantization)
    return config


def write_config(folder: Path, config: Mapping[str, Any]) -> Path:
    """Write ``config.json`` into ``folder`` (a staging folder) and return its path."""
    path = folder / "config.json"
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return path


# -- parts as compressed-tensors names them ------------------------------------------------------------------
@dataclass(frozen=True)
class CtScheme:
    """How one layer's weight was written in the compressed-tensors format (what its config group says)."""

    bits: int
    group_size: int | None = None
    activations: bool = False
    symmetric: bool = True
    """int4 only: False for groups with a zero point each (``weight_zero_point``)"""

    def group(self, targets: list[str]) -> dict[str, Any]:
        weights: dict[str, Any] = {
            "num_bits": self.bits,
            "type": "int",
            "symmetric": self.symmetric,
            "dynamic": False,
        }
        if self.bits == 4:
            weights |= {"strategy": "group", "group_size": self.group_size}
        else:
            weights |= {"strategy": "channel"}
        return {
            "targets": targets,
            "weights": weights,
            "input_activations": dict(INT8_ACTIVATIONS) if self.activations else None,
            "output_activations": None,
            "format": self.format,
        }

    @property
    def format(self) -> str:
        if self.bits == 4:
            return "pack-quantized"
        return "int-quantized" if self.activations else "naive-quantized"


def ct_layers(model: nn.Module) -> dict[str, str]:
    """Module name -> ``"Linear"`` / ``"Embedding"`` for the layers compressed-tensors can quantize: those
    whose weight is their own (an embedding tied to the output layer would be read compressed by the
    Linear transformers ties to it, which fails)."""
    owners: dict[int, int] = {}
    for module in model.modules():
        for tensor in module._parameters.values():
            if tensor is not None:
                owners[id(tensor)] = owners.get(id(tensor), 0) + 1
    return {
        name: type(m).__name__
        for name, m in model.named_modules()
        if type(m) in CT_TYPES and owners.get(id(m.weight)) == 1
    }


def ct_weights(model: nn.Module, bits: int = 8) -> set[str]:
    """The weight names (``<layer>.weight``) compressed-tensors can hold quantized to ``bits`` (int4:
    Linear layers only; its packed form replaces an Embedding's weight, which transformers then cannot
    initialise), with and without the model's base prefix (a checkpoint of ``BertForMaskedLM`` names
    ``bert.encoder...``, one of ``BertModel`` ``encoder...``)."""
    prefix = base_prefix(model)
    layers = ct_layers(model)
    names = {f"{n}.weight" if n else "weight" for n, kind in layers.items() if bits == 8 or kind == "Linear"}
    if prefix:
        names |= {n[len(prefix) + 1 :] for n in names if n.startswith(f"{prefix}.")}
        names |= {f"{prefix}.{n}" for n in names}
    return names


def base_prefix(model: nn.Module) -> str:
    """The transformers model's ``base_model_prefix`` (``bert``, ``model``, ``transformer``), or ``""``."""
    prefix = getattr(model, "base_model_prefix", "")
    return prefix if isinstance(prefix, str) else ""


def transposed_weights(model: nn.Module) -> set[str]:
    """Weights stored (in, out): Hugging Face's ``Conv1D`` (GPT-2), whose float weight is the transpose of
    the Linear it computes; compressed-tensors does not quantize them."""
    from slimtorch.graph.layers import is_hf_conv1d

    return {f"{name}.weight" for name, m in model.named_modules() if is_hf_conv1d(m)}


def int4_fits(shape: tuple[int, ...] | list[int], group_size: int) -> bool:
    """Whether compressed-tensors' int4 groups hold a weight of ``shape`` as our codes do: whole groups per
    row (no padding) and whole int32 words (8 codes) per row."""
    return len(shape) == 2 and shape[1] % group_size == 0 and shape[1] % 8 == 0


def ct_form(tensor: str, encoded: Encoded) -> tuple[Encoded, dict[str, str], CtScheme] | None:
    """An int8 / int4 encoding of the weight ``<layer>.weight`` as compressed-tensors names and shapes it:
    (parts, physical keys by role, scheme), or None when it cannot (int4 with a float zero point, groups
    that do not fit, a tensor not 2-d). Later lossless stages (sparse codes, zstd) are undone: the codes
    are the same.

    int8 with a scale per group of inputs is None too: compressed-tensors has an 8-bit ``group``
    strategy, but it needs whole groups along every row (ours may end short), and nothing here shows
    that transformers' loader decodes it; written as a column of per-channel scales it would decode to
    garbage. The callers then store the dequantized weight (a float layer holding the same values)."""
    if not encoded.stages or not tensor.endswith("weight"):
        return None
    stage = dict(encoded.stages[0])
    shape, layer = stage.get("shape") or [], tensor.removesuffix("weight")
    if len(shape) != 2:
        return None
    parts = undo(encoded.parts, encoded.stages, keep=1) if len(encoded.stages) > 1 else dict(encoded.parts)
    if stage["codec"] == "int8":
        if "group_size" in stage:
            return None
        coded = {"q": parts["q"], "scale": parts["scale"].reshape(-1, 1)}
        keys = {"q": tensor, "scale": f"{layer}weight_scale"}
        return Encoded(coded, [stage]), keys, CtScheme(8)
    group, points = stage.get("group_size"), stage.get("integer_zero") is True
    if (
        stage["codec"] != "int4"
        or not (stage.get("symmetric") or points)
        or stage.get("flat")
        or not is_int4_group_size(group)
        or not int4_fits(shape, group)
    ):
        return None
    coded = {
        "q4": parts["q4"].view(torch.int32),
        "scale": parts["scale"],
        "shape": torch.tensor(shape, dtype=torch.int64),
    }
    keys = {"q4": f"{layer}weight_packed", "scale": f"{layer}weight_scale", "shape": f"{layer}weight_shape"}
    if points:  # each group's zero point is -code * scale exactly (the codec made it so)
        codes = zero_points(parts["zero"], parts["scale"]).to(torch.uint8)
        coded["zp"], keys["zp"] = pack_points(codes), f"{layer}weight_zero_point"
    scheme = CtScheme(4, group, symmetric=not points)
    return Encoded(coded, [{**stage, "packing": "int32"}]), keys, scheme


def quantization_config(schemes: Mapping[str, CtScheme], base_prefix: str = "") -> dict[str, Any] | None:
    """The ``quantization_config`` for the weights written in the compressed-tensors format (weight name ->
    scheme): one config group per scheme, whose targets match exactly those layers, whether transformers
    loads the model with its base prefix (``bert.``) or without; None when there are none."""
    if not schemes:
        return None
    by_scheme: dict[CtScheme, list[str]] = {}
    for tensor, scheme in schemes.items():
        by_scheme.setdefault(scheme, []).append(_target(tensor.removesuffix(".weight"), base_prefix))
    groups = {f"group_{i}": scheme.group(sorted(t)) for i, (scheme, t) in enumerate(by_scheme.items())}
    formats = {scheme.format for scheme in by_scheme}
    return {
        "quant_method": QUANT_METHOD,
        "format": formats.pop() if len(formats) == 1 else "mixed-precision",
        "quantization_status": "compressed",
        "config_groups": groups,
        "ignore": [],
        "kv_cache_scheme": None,
        "global_compression_ratio": None,
        # transformers then decodes the weights as it loads them. Left compressed, they are decoded by a
        # hook on the model's first call, which sentence-transformers (it calls ``model.forward``) never
        # runs: its Linear layers would multiply raw int8 codes.
        "dequantize": True,
    }


def _target(layer: str, base_prefix: str) -> str:
    """A regex matching the layer's name, with or without the model's base prefix in front."""
    if base_prefix and layer.startswith(f"{base_prefix}."):
        layer = layer[len(base_prefix) + 1 :]
    return rf"re:(^|.*\.){re.escape(layer)}$"


def weight_names(schemes: Iterable[str]) -> list[str]:
    """For messages: a few names, then how many more."""
    names = sorted(schemes)
    return names[:3] + ([f"... ({len(names) - 3} more)"] if len(names) > 3 else [])
