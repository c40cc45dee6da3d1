"""slimtorch: make PyTorch models physically smaller, faster to load and lighter on memory.

The public API:

- :func:`open`: a lazy, read-only view of any checkpoint (torch.save, safetensors, TorchScript, Hugging Face).
- :func:`inspect`: where a checkpoint's bytes go, and what could be saved.
- :func:`save` / :func:`load`: the slim format (safetensors with codecs and checksums), tensors in and out.
- :func:`shrink`: any checkpoint to a slim one, dropping what only training needs.
- :func:`load_objects`: the non-tensor values (a config, an epoch) a slim file or torch.save file keeps.
- :func:`save_model`: a model's weights plus, once pruned, its structural delta (no pickle).
- :func:`recover`: fine-tune or distil a pruned model back (BatchNorm re-estimated, zeros kept).
- :mod:`prune`: structured pruning that physically shrinks a model (``slimtorch.prune.channels``).
- :func:`quantize`: int8 / int4 layers that run fast on CPU and save and load as they are.
- :mod:`memory`: a training loop's steady-state peak memory, predicted on fake tensors
  (``slimtorch.memory.estimate``, per rank under DDP or FSDP too) and measured (``slimtorch.memory.profile``).
- :mod:`data`: DataLoader settings (workers, prefetch, pinning), measured for a dataset
  (``slimtorch.data.tune``).
- :mod:`deploy`: ``slimtorch.deploy.export`` to ONNX or ``.pt2``, verified against eager PyTorch, as a bundle
  that runs without torch; ``measure_footprint`` of its runtime; ``operators`` for a selective build.
- :func:`open_model`: the model a command works on (a Hugging Face or sentence-transformers folder, or a
  ``pkg.module:factory`` spec with weights from any checkpoint) and an example input it accepts.
- :func:`load_model`: a model built on the meta device and filled from any checkpoint, zero-copy where it
  can, decoding in parallel, staging through pinned memory to CUDA.
- :func:`slim`: every step chained toward a goal (``size=0.05x``, ``latency=2x``, ``params=0.5``) within an
  allowed metric drop, resumable, with a before/after report (HTML, charts, JSON) and a recipe.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from slimtorch._version import __version__
from slimtorch.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    FormatError,
    OptionError,
    PlaceholderWarning,
    SlimtorchError,
    UnsafeCheckpointError,
)

if TYPE_CHECKING:  # type checkers see every name; at run time each is imported when first asked for
    from slimtorch import data, deploy, memory, models, prune
    from slimtorch.format.source import ObjectInfo, TensorInfo, TensorSource
    from slimtorch.inspection import InspectOptions, InspectReport, inspect
    from slimtorch.loading import LoadOptions, LoadReport, ModelInput, load, load_model, open_model
    from slimtorch.loading.dcp_reader import SlimStorageReader
    from slimtorch.quant import QuantizeOptions, QuantizeReport, quantize
    from slimtorch.recovery import RecoverOptions, RecoverReport, recover
    from slimtorch.shrinking import ShrinkOptions, ShrinkReport, save, save_model, save_pretrained, shrink
    from slimtorch.slimming import SlimOptions, SlimReport, slim
    from slimtorch.sources import load_objects

# Where each public name lives. Importing them all would import torch, which the command line's --help
# and --version must not wait for (PEP 562: the module's __getattr__ imports a name on first use).
_HOMES = {
    "slimtorch.format.source": ("ObjectInfo", "TensorInfo", "TensorSource"),
    "slimtorch.inspection": ("InspectOptions", "InspectReport", "inspect"),
    "slimtorch.loading": ("LoadOptions", "LoadReport", "ModelInput", "load", "load_model", "open_model"),
    "slimtorch.loading.dcp_reader": ("SlimStorageReader",),  # imports torch.distributed.checkpoint (~1 s)
    "slimtorch.quant": ("QuantizeOptions", "QuantizeReport", "quantize"),
    "slimtorch.recovery": ("RecoverOptions", "RecoverReport", "recover"),
    "slimtorch.shrinking": (
        "ShrinkOptions",
        "ShrinkReport",
        "save",
        "save_model",
        "save_pretrained",
        "shrink",
    ),
    "slimtorch.slimming": ("SlimOptions", "SlimReport", "slim"),
    "slimtorch.sources": ("load_objects", "open_checkpoint"),
}
_HOME_OF = {name: home for home, names in _HOMES.items() for name in names}


def __getattr__(name: str) -> Any:
    """A public name or a step's package (``slimtorch.prune``), imported the first time it is asked for."""
    if name in _HOME_OF:
        value = getattr(importlib.import_module(_HOME_OF[name]), name)
    elif not name.startswith("_") and importlib.util.find_spec(f"slimtorch.{name}") is not None:
        value = importlib.import_module(f"slimtorch.{name}")
    else:
        raise AttributeError(f"module 'slimtorch' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


def open(path: str | os.PathLike[str], *, allow_globals: Iterable[str] = ()) -> TensorSource:
    """Open a checkpoint lazily: names, dtypes, shapes and storages now, tensor data only when asked.

    Reads torch.save files (zip and legacy, nested training checkpoints included), safetensors files,
    TorchScript archives and Hugging Face model folders (single file or sharded). The format is told by
    content, not by extension. No code from the file ever runs: pickles go through torch's ``weights_only``
    unpickler. numpy arrays, scalars and dtypes are read as data; any other class or function off torch's
    list is kept as an inert placeholder, never built nor imported (a :class:`PlaceholderWarning` names
    them), so the tensors always open; a global that can run code (``os.system``, ``builtins.eval``)
    raises :class:`UnsafeCheckpointError` naming it.

    Args:
        path: a file, a Hugging Face model folder, or a Hub repo id (``org/name[@revision]``) found in the
            local Hugging Face cache (never downloaded).
        allow_globals: dotted names (``"mypkg.Config"``) you trust the file to use beyond torch's safe list.

    Example:
        >>> import slimtorch
        >>> source = slimtorch.open("checkpoint.pt")  # doctest: +SKIP
        >>> source.names()[:2]  # doctest: +SKIP
        ['model.embed.weight', 'model.blocks.0.attn.qkv.weight']
        >>> source.get("model.embed.weight").shape  # doctest: +SKIP
        torch.Size([8000, 256])
    """
    from slimtorch.sources import open_checkpoint

    return open_checkpoint(path, allow_globals=allow_globals)


__all__ = [
    "CheckpointError",
    "CheckpointNotFoundError",
    "FormatError",
    "InspectOptions",
    "InspectReport",
    "LoadOptions",
    "LoadReport",
    "ModelInput",
    "ObjectInfo",
    "OptionError",
    "PlaceholderWarning",
    "QuantizeOptions",
    "QuantizeReport",
    "RecoverOptions",
    "RecoverReport",
    "ShrinkOptions",
    "ShrinkReport",
    "SlimOptions",
    "SlimReport",
    "SlimStorageReader",
    "SlimtorchError",
    "TensorInfo",
    "TensorSource",
    "UnsafeCheckpointError",
    "__version__",
    "data",
    "deploy",
    "inspect",
    "load",
    "load_model",
    "load_objects",
    "memory",
    "models",
    "open",
    "open_model",
    "prune",
    "quantize",
    "recover",
    "save",
    "save_model",
    "save_pretrained",
    "shrink",
    "slim",
]
