"""Pruned Hugging Face models as folders ``from_pretrained`` reads: the pruned sizes in ``config.json``
(found by :func:`slimtorch.prune.hf.config_update`) beside the weights :func:`save_model` writes."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from torch import nn

from slimtorch.format.policy import ShrinkOptions
from slimtorch.format.progress import Progress
from slimtorch.prune.hf import config_update
from slimtorch.shrinking.report import ShrinkReport
from slimtorch.shrinking.saving import resolve_save_options, save_model


def save_pretrained(
    model: nn.Module,
    folder: str | os.PathLike[str],
    /,
    options: ShrinkOptions | None = None,
    *,
    companions: Mapping[str, Path] | None = None,
    metadata: Mapping[str, Any] | None = None,
    progress: Progress | None = None,
    **overrides: Any,
) -> ShrinkReport:
    """Write ``config.json`` with the pruned sizes and the weights as a slim ``model.safetensors``, with
    ``companions`` (the input folder's tokenizer and other files, from
    :func:`~slimtorch.sources.companions.companion_files`) copied along; the new ``config.json`` replaces
    the input's. The report's ``config_update`` holds the new sizes and what no config can express.

    Options and ``overrides`` are :func:`save_model`'s; without ``options`` nothing is stored sparse in the
    ``hf`` layout (``ShrinkOptions(sparse="off")``), and zeros are in the ``slim`` one (``sparse="auto"``).
    The folder is in the ``hf`` layout unless ``layout="slim"`` (:mod:`slimtorch.format.hf_layout`): with
    ``quantize="int8-weight"`` or ``"int4-weight"`` its Linear weights are in the compressed-tensors
    format, so ``from_pretrained`` reads the folder when
    ``config_update`` lists no problems (and refuses it when the sizes differ from the config's); the slim
    layout's config makes ``from_pretrained`` refuse it.

    Example:
        >>> slimtorch.prune.channels(bert, (input_ids,), ratio=0.5)  # doctest: +SKIP
        >>> slimtorch.save_pretrained(bert, "bert-half").config_update.problems  # doctest: +SKIP
        []
        >>> transformers.BertModel.from_pretrained("bert-half")  # doctest: +SKIP
    """
    # The hf layout is for from_pretrained, which reads no sparse tensor; the slim layout stores zeros sparse.
    default = ShrinkOptions(sparse="auto" if overrides.get("layout") == "slim" else "off")
    options = resolve_save_options(options or default, overrides, "save_pretrained")
    update = config_update(model)
    # transformers' PretrainedConfig: a plain attribute, which torch types as a module's tensor or submodule
    current: Any = model.config
    config = current.__class__.from_dict(current.to_dict())
    for key, value in update.values.items():
        setattr(config, key, value)
    # the class to build, as model_config (and transformers' save_pretrained) names it
    config.architectures = getattr(config, "architectures", None) or [type(model).__name__]
    with tempfile.TemporaryDirectory() as staging:
        config.save_pretrained(staging)  # goes into the folder with the weights, in the same atomic swap
        extras = {**(companions or {}), **{name: Path(staging) / name for name in os.listdir(staging)}}
        report = save_model(
            model, Path(folder), options, extra_files=extras, metadata=metadata, progress=progress
        )
    return replace(report, config_update=update)
