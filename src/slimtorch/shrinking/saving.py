"""shrink and save: write tensors to the slim format, keeping only what carries information.

:func:`shrink` reads any checkpoint and writes a slim one: it drops optimizer and training state, folds
``torch.nn.utils.prune`` re-parametrizations (``weight = weight_orig * weight_mask``), stores tied and
duplicated tensors once, keeps the checkpoint's other plain-data values as JSON
(:mod:`slimtorch.sources.objects`) and encodes each tensor by the rules of :mod:`slimtorch.format.policy`,
storing at a higher precision the few weights quantizing would hurt most (:mod:`slimtorch.format.sensitive`).
:func:`save` does the same for an in-memory state dict and :func:`save_model` for a model; all of them take
one :class:`~slimtorch.format.policy.ShrinkOptions` and plan by one planner
(:mod:`slimtorch.shrinking.planning`).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from slimtorch._version import __version__
from slimtorch.errors import OptionError, SlimtorchError
from slimtorch.format.codecs import Encoded
from slimtorch.format.codecs.chain import parse_dtype
from slimtorch.format.delta import StructuralDelta, delta_of
from slimtorch.format.hf_layout import ct_form, ct_weights, transposed_weights
from slimtorch.format.pending import wait_for_checks
from slimtorch.format.policy import (
    EMBEDDING,
    READING,
    ShrinkOptions,
    TensorPolicy,
    check_patterns,
    convert,
    quantizable,
)
from slimtorch.format.progress import Progress
from slimtorch.format.sensitive import higher_precision, rounding_error
from slimtorch.format.source import FileRest, dtype_name
from slimtorch.format.verbs import resolve
from slimtorch.inspection.breakdown import inspect
from slimtorch.models.hub import config_model
from slimtorch.schemes import BY_NAME as SCHEME_ROWS
from slimtorch.shrinking.folders import (
    Folder,
    choose_layout,
    companions_of,
    config_file,
    model_config,
    refuse_foreign_codes,
)
from slimtorch.shrinking.planning import Item, Plan, plan_tensors, state_dict_source
from slimtorch.shrinking.report import ShrinkReport
from slimtorch.shrinking.writing import report_of, write
from slimtorch.sources import open_checkpoint
from slimtorch.sources.objects import model_objects, plain_objects

DEFAULT_SHARD_BYTES = 2_000_000_000


def shrink(
    source_path: str | os.PathLike[str],
    out: str | os.PathLike[str],
    /,
    options: ShrinkOptions | None = None,
    *,
    progress: Progress | None = None,
    **overrides: Any,
) -> ShrinkReport:
    """Write a slim copy of any checkpoint; returns what was stored and what it cost.

    Args:
        source_path: any checkpoint :func:`slimtorch.open` reads.
        out: a ``.safetensors`` file, or a folder (sharded by ``shard_bytes``, Hugging Face style).
        options: codecs and reading choices (:class:`~slimtorch.format.policy.ShrinkOptions`); the default
            is lossless and drops optimizer and training state. ``overrides`` replace single fields
            (``quantize="int8-weight"``, ``keep_optimizer=True``); an unknown one is an :class:`OptionError`.
        progress: told how many bytes were written (:mod:`slimtorch.format.progress`).

    The layout of a folder output (``layout``): ``"hf"`` (``from_pretrained`` reads it; quantized weights
    in the compressed-tensors format) or ``"slim"`` (smaller; ``from_pretrained`` refuses it); None:
    ``hf`` for a Hugging Face folder input, else ``slim`` (see :mod:`slimtorch.format.hf_layout`).
    Raises :class:`SlimtorchError` before writing anything when a ``skip`` pattern matches no tensor.

    Example:
        >>> report = slimtorch.shrink("ckpt.pt", "slim/", quantize="int8-weight")  # doctest: +SKIP
        >>> f"{report.ratio:.2f}"  # doctest: +SKIP
        '0.09'
    """
    options = resolve(ShrinkOptions, options, overrides, "shrink")
    started = time.perf_counter()
    with open_checkpoint(source_path, allow_globals=options.allow_globals) as source:
        before = inspect(source, scan=False)
        plan = plan_tensors(source, keep_training=options.keep_optimizer, keep_names=options.keep_names)
        if options.keep_objects:
            plan.objects = model_objects(source.tree, plan.dropped, keep_training=options.keep_optimizer)
        found = companions_of(source.path, Path(out))
        config = config_file(found.files.get("config.json"))
        refuse_foreign_codes(source, config)
        folder, policy = choose_layout(config, options.layout, Path(out), TensorPolicy.of(options))
        folder.notes.extend(f"not copied: {line}" for line in found.left_out)
        policy = _checked(plan, policy, options.quantize_all)
        provenance = {
            "tool": f"slimtorch {__version__}",
            "command": "shrink",
            # a Hub repo id as given (its snapshot folder is named by a commit hash), else the file's name
            "source": source.path.name if Path(source_path).exists() else str(source_path),
            "source_bytes": before.file_bytes,
            "source_format": source.format,
            "options": _described(options),
        }
        shard = _shard_bytes(options, out)
        results, files, written = write(
            plan, out, policy, shard, provenance, found.files, progress, folder=folder
        )
    return report_of(
        str(source_path), before.file_bytes, before.categories, plan, results, files, written, started, folder
    )


def save(
    state_dict: Mapping[str, torch.Tensor],
    path: str | os.PathLike[str],
    /,
    options: ShrinkOptions | None = None,
    *,
    metadata: Mapping[str, Any] | None = None,
    structure: StructuralDelta | None = None,
    extra_files: Mapping[str, Path] | None = None,
    coded: Mapping[str, Encoded] | None = None,
    objects: Mapping[str, Any] | None = None,
    progress: Progress | None = None,
    **overrides: Any,
) -> ShrinkReport:
    """Save a state dict in the slim format (a valid safetensors file), atomically, with checksums.

    Lossless by default (raw, sparse where smaller): :func:`slimtorch.load` gives back equal tensors (a
    -0.0 comes back as 0.0). ``dtype="fp16"``, ``quantize="int8-weight"`` or ``"int4-weight"`` (the
    schemes' names, as :func:`slimtorch.quantize` takes them) are lossy within the bounds documented in
    :mod:`slimtorch.format.codecs.lossy`. Tensors sharing memory (tied weights) are
    stored once and come back shared; equal tensors are stored once and come back as separate tensors.
    Options and ``overrides`` are :class:`~slimtorch.format.policy.ShrinkOptions`' codec choices
    (shrink's reading choices, such as ``keep_optimizer``, are refused: a state dict has nothing to drop).

    Data beside the options: ``coded`` adds tensors already encoded (a quantized layer's codes and
    scales), stored as they are; ``objects`` (plain JSON data: a config, an epoch) are stored beside the
    tensors and read back by :func:`slimtorch.load_objects`; ``metadata`` joins the file's provenance;
    ``structure`` is the structural delta a pruned model records. Quantizing stores the few weights whose
    error would dominate at float16, and recurrent layers' weights at a higher precision (see
    :mod:`slimtorch.format.sensitive`), unless ``quantize_all=True``. int4 groups hold 32 values.
    A folder given a ``config.json`` in ``extra_files`` is written in the ``hf`` layout unless
    ``layout="slim"`` (see :func:`shrink`).

    Example:
        >>> import torch, slimtorch
        >>> model = torch.nn.Linear(256, 256)
        >>> slimtorch.save(model.state_dict(), "linear.safetensors", quantize="int8-weight")  # doctest: +SKIP
        >>> slimtorch.load("linear.safetensors").tensors["weight"].shape  # doctest: +SKIP
        torch.Size([256, 256])
    """
    options = resolve_save_options(options, overrides, "save")
    extras = dict(extra_files or {})
    config = config_file(extras.get("config.json"))
    folder, policy = choose_layout(config, options.layout, Path(path), TensorPolicy.of(options))
    written = _Written(metadata, structure, extras, coded, objects)
    return _save(state_dict, path, options, policy, folder, written, progress)


def save_model(
    model: torch.nn.Module,
    path: str | os.PathLike[str],
    /,
    options: ShrinkOptions | None = None,
    *,
    extra_files: Mapping[str, Path] | None = None,
    metadata: Mapping[str, Any] | None = None,
    progress: Progress | None = None,
    carry: FileRest | None = None,
    **overrides: Any,
) -> ShrinkReport:
    """Save a model's weights and, if it was pruned or quantized, how its structure changed: no pickle.

    ``carry`` (a Hugging Face folder written back, ``hf`` layout): what of the file the model was loaded
    from it does not hold (:class:`~slimtorch.format.source.FileRest`): the model's tensors are written
    under the file's names (its prefix), and the file's other tensors as they are, so the output fits the
    class the file was made for (a body slimtorch built, and the custom heads around it) as well.

    Options and ``overrides`` are :func:`save`'s (``quantize="int8-weight"``, ``dtype="bf16"`` ...). Layers
    quantized by :func:`slimtorch.quantize` are stored as their codes, scales and zero points, untouched.
    Load it back with :func:`slimtorch.load_model` and the factory of the *original* model: the file tells
    how to reshape it and which layers to quantize.

    Example:
        >>> slimtorch.prune.channels(model, example, ratio=0.5)  # doctest: +SKIP
        >>> slimtorch.save_model(model, "pruned.safetensors")  # doctest: +SKIP
        >>> slimtorch.load_model("pruned.safetensors", build_model).model  # doctest: +SKIP
    """
    if not isinstance(model, torch.nn.Module):  # save_model(path, model): load_model's order
        given = type(model).__name__
        raise OptionError(
            f"save_model takes the model first, then the file (save_model(model, path)), not a {given}"
        )
    options = resolve_save_options(options, overrides, "save_model")
    extras = dict(extra_files or {})
    config = config_file(extras.get("config.json"))
    if config is None and options.layout == "hf" and Path(path).suffix != ".safetensors":
        config = model_config(model)
    meta = config_model(config) if config is not None and options.layout != "slim" else None
    folder, policy = choose_layout(config, options.layout, Path(path), TensorPolicy.of(options), meta)
    state, coded, structure = _model_tensors(model, folder, meta)
    if carry and folder.layout == "hf":
        state, coded = _carried(state, coded, carry, folder)
    written = _Written(metadata, structure, extras, coded, None)
    return _save(state, path, options, policy, folder, written, progress)


def _carried(
    state: dict[str, torch.Tensor], coded: dict[str, Encoded], carry: FileRest, folder: Folder
) -> tuple[dict[str, torch.Tensor], dict[str, Encoded]]:
    """The model's tensors under the file's prefix, and the file's tensors the model did not load, read
    from it as they are stored (lazily: each is read when it is written)."""
    prefix = carry.prefix
    state = {f"{prefix}{name}": tensor for name, tensor in state.items()}
    coded = {f"{prefix}{name}": encoded for name, encoded in coded.items()}
    folder.dynamic = frozenset(f"{prefix}{name}" for name in folder.dynamic)
    if carry.names and carry.path is not None:
        with open_checkpoint(carry.path) as source:
            present = set(source.names())
            kept = [
                name for name in carry.names if name in present and name not in state and name not in coded
            ]
            state.update({name: source.get(name).clone() for name in kept})  # the file closes next
        if kept:
            folder.notes.append(
                f"{len(kept)} tensor(s) of the source file that the model does not hold "
                f"({', '.join(kept[:3])}{' ...' if len(kept) > 3 else ''}), written as they are: the "
                "folder still fits the class it was made for"
            )
    return state, coded


def resolve_save_options(
    options: ShrinkOptions | None, overrides: Mapping[str, Any], verb: str
) -> ShrinkOptions:
    """The options a save verb runs with. Shrink's reading choices are refused by name: a save has no
    checkpoint to read."""
    resolved = resolve(ShrinkOptions, options, overrides, verb)
    reading = resolved.reading_given()
    if reading is not None:
        raise OptionError(
            f"{verb}: {reading} is a choice of shrink, which reads a checkpoint; {verb} stores the tensors "
            "it is given (drop or rename them before saving)"
        )
    return resolved


@dataclass(frozen=True)
class _Written:
    """What a save writes beside the tensors: provenance ``metadata``, the structural delta, files copied
    along, tensors already encoded, and plain objects."""

    metadata: Mapping[str, Any] | None
    structure: StructuralDelta | None
    extras: dict[str, Path]
    coded: Mapping[str, Encoded] | None
    objects: Mapping[str, Any] | None


def _save(
    state_dict: Mapping[str, torch.Tensor],
    path: str | os.PathLike[str],
    options: ShrinkOptions,
    policy: TensorPolicy,
    folder: Folder,
    given: _Written,
    progress: Progress | None,
) -> ShrinkReport:
    """:func:`save` with its options resolved and the folder's layout chosen: the planner reads the state
    dict as it reads a checkpoint, keeping every tensor under its own name."""
    started = time.perf_counter()
    coded_parts = [part for encoded in (given.coded or {}).values() for part in encoded.parts.values()]
    wait_for_checks([*state_dict.values(), *coded_parts])  # a loaded model's bytes: verified before saved
    plan = plan_tensors(state_dict_source(state_dict), keep_training=True, keep_names=True)
    for name, encoded in (given.coded or {}).items():
        stage = encoded.stages[0]
        before = math.prod(stage["shape"]) * parse_dtype(stage["dtype"]).itemsize
        plan.items.append(Item(name, "parameters", before, lambda: torch.empty(0), encoded))
    plan.objects = plain_objects(dict(given.objects or {}))
    if plan.objects.dropped:
        name, why = next(iter(plan.objects.dropped.items()))
        raise SlimtorchError(f"save: object {name!r} cannot be stored as JSON: {why}")
    policy = _checked(plan, policy, options.quantize_all)
    provenance = {
        "tool": f"slimtorch {__version__}",
        "options": _described(options, reading=False),
        **(given.metadata or {}),
    }
    delta = given.structure.to_dict() if given.structure else None
    shard = _shard_bytes(options, path)
    results, files, written = write(
        plan, path, policy, shard, provenance, given.extras, progress, delta, folder=folder
    )
    before = sum(item.before_bytes for item in plan.items)
    return report_of("<state_dict>", before, [], plan, results, files, written, started, folder)


def _model_tensors(
    model: torch.nn.Module, folder: Folder, meta: torch.nn.Module | None
) -> tuple[dict[str, torch.Tensor], dict[str, Encoded], StructuralDelta | None]:
    """A model's state dict, the coded parts of its quantized layers (stored as they are), and its
    structural delta. In the ``hf`` layout a quantized layer compressed-tensors cannot express is written
    as its dequantized weight, and its delta entry dropped: it loads as a float layer."""
    # here, not at the top: the quantized layers import torch's compiler (1.7 s), which a shrink of a file
    # never needs
    from slimtorch.quant.modules import QuantizedWeight

    state = model.state_dict()
    coded, structure = {}, delta_of(model)
    dynamic: set[str] = set()
    hf = folder.layout == "hf" and meta is not None
    writable = {bits: ct_weights(meta, bits) if hf else set() for bits in (4, 8)}  # type: ignore[arg-type]
    transposed = transposed_weights(meta) if meta is not None else set()
    for prefix, module in model.named_modules():
        if isinstance(module, QuantizedWeight):
            tensors = module.coded_tensors()
            for attr in module.SLIM_PARTS:
                state.pop(_joined(prefix, attr))
            names = {tensor: _joined(prefix, tensor) for tensor in tensors}
            bits = 4 if module.codec == "int4" else 8
            ct_ready = all(
                n in writable[bits] and ct_form(n, module.encoded(t)) is not None for t, n in names.items()
            )
            if folder.layout == "slim" or ct_ready:
                coded.update({n: module.encoded(t) for t, n in names.items()})
                row = SCHEME_ROWS.get(module.SCHEME)  # an embedding's class, shared, names its codec
                dynamic |= set(names.values()) if row is not None and row.dynamic else set()
                continue
            # compressed-tensors cannot express this layer: its dequantized weight, and a float layer
            for tensor, name in names.items():
                weight = module.dequantized(tensor=tensor)
                state[name] = weight.t().contiguous() if name in transposed else weight
            structure = _without_quantized(structure, prefix)
            folder.notes.append(_dense_note(prefix, module))
    folder.dynamic = frozenset(dynamic)
    return state, coded, structure


def _without_quantized(delta: StructuralDelta | None, layer: str) -> StructuralDelta | None:
    """``delta`` without the quantized layer ``layer`` (a copy: the model keeps its own)."""
    if delta is None:
        return None
    quantized = {k: v for k, v in delta.quantized.items() if k != layer}
    return replace(delta, quantized=quantized)


def _dense_note(layer: str, module: Any) -> str:
    return (
        f"{layer} ({module.kind}) written dense, dequantized: compressed-tensors has no form for it; it "
        "loads as a float layer holding the same values"
    )


def _joined(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _checked(plan: Plan, policy: TensorPolicy, quantize_all: bool) -> TensorPolicy:
    """Refuse ``skip`` patterns that match nothing; store the weights quantizing would hurt most at a higher
    precision (unless ``quantize_all``), noting them in the plan."""
    check_patterns(policy.skip, plan.names, plan.renamed_prefix)
    codec, asked = policy.codec, policy.quantize  # what the weights are stored with, what the user named
    if codec is None or asked is None or quantize_all:
        return policy
    errors = {}
    for item in plan.items:
        if item.encoded is None:
            value = convert(item.name, item.fetch().detach(), policy)
            if quantizable(item.name, value, item.category, policy) and not EMBEDDING.search(item.name):
                errors[item.name] = rounding_error(value, codec, policy.group_size)
    plan.stored_instead = higher_precision(errors, codec, asked)
    chosen = {c.name: c.stored for c in plan.stored_instead}
    return replace(policy, stored_as={**chosen, **policy.stored_as})


def _shard_bytes(options: ShrinkOptions, out: str | os.PathLike[str]) -> int | None:
    """Shards of a folder output hold at most 2 GB unless told otherwise; a ``.safetensors`` is one file."""
    if options.shard_bytes is None and Path(out).suffix != ".safetensors":
        return DEFAULT_SHARD_BYTES
    return options.shard_bytes


def _described(options: ShrinkOptions, reading: bool = True) -> dict[str, Any]:
    """The options as the file's provenance records them: the user's choices only (a recipe), without
    shrink's reading choices for a save (it has nothing to read)."""
    described = asdict(options)
    described["dtype"] = dtype_name(options.dtype) if options.dtype else None
    described["skip"] = list(options.skip)
    described["allow_globals"] = list(options.allow_globals)
    return described if reading else {k: v for k, v in described.items() if k not in READING}
