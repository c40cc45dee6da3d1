"""shrink and save: write tensors to the slim format, keeping only what carries information.

:func:`shrink` reads any checkpoint and writes a slim one: it drops optimizer and training state, folds
``torch.nn.utils.prune`` re-parametrizations (``weight = weight_orig * weight_mask``), stores tied and
duplicated tensors once, keeps the checkpoint's other plain-data values as JSON
(:mod:`slimtorch.sources.objects`) and encodes each tensor by the rules of :mod:`slimtorch.format.policy`,
storing at a higher precision the few weights quantizing would hurt most (:mod:`slimtorch.format.sensitive`).
:func:`save` does the same for an in-memory state dict.
"""

from __future__ import annotations

import math
import os
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from slimtorch._version import __version__
from slimtorch.errors import FormatError, SlimtorchError
from slimtorch.format.codecs import REGISTRY, Encoded, decode
from slimtorch.format.codecs.chain import parse_dtype
from slimtorch.format.delta import StructuralDelta, delta_of
from slimtorch.format.hf_layout import (
    CtScheme,
    base_prefix,
    ct_form,
    ct_weights,
    folder_config,
    inner_config,
    quantization_config,
    resolve_layout,
    transposed_weights,
    weight_names,
    write_config,
)
from slimtorch.format.names import training_wrapper
from slimtorch.format.policy import (
    EMBEDDING,
    SHRINK_INT4_GROUP_SIZE,
    ShrinkOptions,
    check_patterns,
    convert,
    encode_tensor,
    finish_coded,
    quantizable,
)
from slimtorch.format.progress import Progress, task
from slimtorch.format.scan import find_duplicates
from slimtorch.format.sensitive import StoredInstead, higher_precision, rounding_error
from slimtorch.format.source import TensorInfo, TensorSource, dtype_name
from slimtorch.format.untrusted import load_json
from slimtorch.format.writer import SlimWriter
from slimtorch.inspection.breakdown import Bucket, classify, inspect
from slimtorch.models.hub import config_model
from slimtorch.quant.modules import QuantizedWeight
from slimtorch.sources import open_checkpoint
from slimtorch.sources.companions import Companions, find_companions, model_card
from slimtorch.sources.hf_folder import weight_files
from slimtorch.sources.objects import PlainObjects, model_objects, plain_objects

TRAINING_ONLY = ("optimizer_state", "training_state")
DEFAULT_SHARD_BYTES = 2_000_000_000


@dataclass(frozen=True)
class TensorResult:
    """One stored tensor: its codec chain, bytes before and after, and the error of lossy codecs."""

    name: str
    category: str
    chain: str
    dtype: str
    before_bytes: int
    after_bytes: int
    max_abs: float | None = None
    rel_l2: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class ShrinkReport:
    """What :func:`shrink` did; ``to_dict()`` is the ``--json`` output."""

    source: str
    files: list[str]
    before_bytes: int
    after_bytes: int
    before: list[Bucket]
    after: list[Bucket]
    tensors: list[TensorResult]
    dropped: list[str]
    folded: list[str]
    ties: dict[str, str]
    copies: dict[str, str]
    renamed_prefix: str | None
    seconds: float
    notes: list[str] = field(default_factory=list)
    objects: list[str] = field(default_factory=list)
    """Top-level names of the non-tensor values kept (read them with :func:`slimtorch.load_objects`)."""
    dropped_objects: dict[str, str] = field(default_factory=dict)
    """Non-tensor values left out because they are not plain data, with the reason."""
    stored_instead: list[StoredInstead] = field(default_factory=list)
    """Weights stored at a higher precision than asked (float16 or int8), and why; none with
    ``quantize_all``."""

    @property
    def ratio(self) -> float:
        return self.after_bytes / self.before_bytes if self.before_bytes else 1.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": "slimtorch.shrink/1",
            **{k: v for k, v in asdict(self).items() if k not in ("before", "after", "tensors")},
            "ratio": self.ratio,
            "before": {b.name: {"tensors": b.tensors, "bytes": b.bytes} for b in self.before},
            "after": {b.name: {"tensors": b.tensors, "bytes": b.bytes} for b in self.after},
            "tensors": [t.to_dict() for t in self.tensors],
        }


@dataclass(frozen=True)
class _Item:
    """A tensor to store: its output name, category, input bytes, and how to fetch its value (or its parts,
    already encoded: a quantized layer's weight)."""

    name: str
    category: str
    before_bytes: int
    fetch: Callable[[], torch.Tensor]
    encoded: Encoded | None = None


@dataclass
class _Plan:
    items: list[_Item]
    ties: dict[str, str] = field(default_factory=dict)
    copies: dict[str, str] = field(default_factory=dict)
    dropped: list[str] = field(default_factory=list)
    folded: list[str] = field(default_factory=list)
    renamed_prefix: str | None = None
    objects: PlainObjects = field(default_factory=lambda: PlainObjects({}, {}))
    stored_instead: list[StoredInstead] = field(default_factory=list)


@dataclass
class _Folder:
    """What a folder output holds besides its weights: its layout (:mod:`slimtorch.format.hf_layout`), the
    model's config (None: no ``config.json`` to write), and for ``hf`` the model's base prefix and the
    coded tensors whose layers quantize their inputs (``int8-dynamic``)."""

    layout: str = "slim"
    config: dict[str, Any] | None = None
    base_prefix: str = ""
    dynamic: frozenset[str] = frozenset()
    notes: list[str] = field(default_factory=list)


def shrink(
    source_path: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    options: ShrinkOptions | None = None,
    keep_optimizer: bool = False,
    keep_names: bool = False,
    keep_objects: bool = True,
    shard_bytes: int | None = None,
    allow_globals: Sequence[str] = (),
    progress: Progress | None = None,
    layout: str | None = None,
) -> ShrinkReport:
    """Write a slim copy of any checkpoint; returns what was stored and what it cost.

    Args:
        source_path: any checkpoint :func:`slimtorch.open` reads.
        out: a ``.safetensors`` file, or a folder (sharded by ``shard_bytes``, Hugging Face style).
        options: codecs (see :class:`slimtorch.format.policy.ShrinkOptions`); the default is lossless.
        keep_optimizer: keep optimizer and training state (dropped by default).
        keep_names: do not strip a wrapper prefix such as ``model.`` from a training checkpoint.
        keep_objects: keep non-tensor values that are plain data (a config, an epoch) as JSON; those
            that are not are listed in ``dropped_objects``.
        layout: a folder output's layout: ``"hf"`` (``from_pretrained`` reads it; quantized weights in the
            compressed-tensors format) or ``"slim"`` (smaller; ``from_pretrained`` refuses it); None:
            ``hf`` for a Hugging Face folder input, else ``slim`` (see :mod:`slimtorch.format.hf_layout`).

    Raises :class:`SlimtorchError` before writing anything when a ``skip`` pattern matches no tensor.

    Example:
        >>> from slimtorch.format.policy import ShrinkOptions
        >>> report = shrink("ckpt.pt", "slim/", options=ShrinkOptions(quantize="int8"))  # doctest: +SKIP
        >>> f"{report.ratio:.2f}"  # doctest: +SKIP
        '0.09'
    """
    options = options or ShrinkOptions()
    started = time.perf_counter()
    with open_checkpoint(source_path, allow_globals=allow_globals) as source:
        before = inspect(source, scan=False)
        plan = _plan_source(source, keep_optimizer, keep_names)
        if keep_objects:
            plan.objects = model_objects(source.tree, plan.dropped, keep_training=keep_optimizer)
        found = _companions(source.path, Path(out))
        companions = found.files
        config = _config_file(companions.get("config.json"))
        _refuse_foreign_codes(source, config)
        folder, options = _folder(config, layout, Path(out), options)
        folder.notes.extend(f"not copied: {line}" for line in found.left_out)
        options = _checked(plan, options)
        if shard_bytes is None and Path(out).suffix != ".safetensors":
            shard_bytes = DEFAULT_SHARD_BYTES
        provenance = {
            "tool": f"slimtorch {__version__}",
            "command": "shrink",
            # a Hub repo id as given (its snapshot folder is named by a commit hash), else the file's name
            "source": source.path.name if Path(source_path).exists() else str(source_path),
            "source_bytes": before.file_bytes,
            "source_format": source.format,
            "options": _describe_options(options),
        }
        results, files, written = _write(
            plan, out, options, shard_bytes, provenance, companions, progress, folder=folder
        )
    return _report(
        str(source_path), before.file_bytes, before.categories, plan, results, files, written, started, folder
    )


def save(
    state_dict: Mapping[str, torch.Tensor],
    path: str | os.PathLike[str],
    *,
    dtype: str | torch.dtype | None = None,
    quantize: str | None = None,
    group_size: int = SHRINK_INT4_GROUP_SIZE,
    sparse: str = "auto",
    entropy: bool = False,
    quantize_embeddings: bool = True,
    skip: Sequence[str] = (),
    shard_size: int | None = None,
    metadata: Mapping[str, Any] | None = None,
    structure: StructuralDelta | None = None,
    extra_files: Mapping[str, Path] | None = None,
    coded: Mapping[str, Encoded] | None = None,
    objects: Mapping[str, Any] | None = None,
    quantize_all: bool = False,
    layout: str | None = None,
) -> ShrinkReport:
    """Save a state dict in the slim format (a valid safetensors file), atomically, with checksums.

    Lossless by default (raw, sparse where smaller): :func:`slimtorch.load` gives back equal tensors (a
    -0.0 comes back as 0.0). ``dtype="fp16"``, ``quantize="int8"`` or ``"int4"`` are lossy within the
    bounds documented in :mod:`slimtorch.format.codecs.lossy`. Tensors sharing memory (tied weights) are
    stored once and come back shared. ``coded`` adds tensors already encoded (a quantized layer's codes and
    scales), stored as they are. ``objects`` (plain JSON data: a config, an epoch) are stored beside the
    tensors and read back by :func:`slimtorch.load_objects`. Quantizing stores the few weights whose
    error would dominate at float16, and recurrent layers' weights at a higher precision (see
    :mod:`slimtorch.format.sensitive`), unless ``quantize_all=True``. int4 groups hold 32 values.
    A folder given a ``config.json`` in ``extra_files`` is written in the ``hf`` layout unless
    ``layout="slim"`` (see :func:`shrink`).

    Example:
        >>> import torch, slimtorch
        >>> model = torch.nn.Linear(256, 256)
        >>> slimtorch.save(model.state_dict(), "linear.safetensors", quantize="int8")  # doctest: +SKIP
        >>> slimtorch.load("linear.safetensors")["weight"].shape  # doctest: +SKIP
        torch.Size([256, 256])
    """
    options = ShrinkOptions(
        dtype=dtype,  # type: ignore[arg-type]  (ShrinkOptions takes 'fp16' / 'bf16' too)
        quantize=quantize,
        group_size=group_size,
        sparse=sparse,
        entropy=entropy,
        quantize_embeddings=quantize_embeddings,
        skip=skip,
        quantize_all=quantize_all,
    )
    extras = dict(extra_files or {})
    config = _config_file(extras.get("config.json"))
    folder, options = _folder(config, layout, Path(path), options)
    return _save(state_dict, path, options, shard_size, metadata, structure, extras, coded, objects, folder)


def _save(
    state_dict: Mapping[str, torch.Tensor],
    path: str | os.PathLike[str],
    options: ShrinkOptions,
    shard_size: int | None,
    metadata: Mapping[str, Any] | None,
    structure: StructuralDelta | None,
    extras: dict[str, Path],
    coded: Mapping[str, Encoded] | None,
    objects: Mapping[str, Any] | None,
    folder: _Folder,
) -> ShrinkReport:
    """:func:`save` with its options resolved and the folder's layout chosen."""
    started = time.perf_counter()
    plan = _plan_state_dict(state_dict)
    for name, encoded in (coded or {}).items():
        stage = encoded.stages[0]
        before = math.prod(stage["shape"]) * parse_dtype(stage["dtype"]).itemsize
        plan.items.append(_Item(name, "parameters", before, lambda: torch.empty(0), encoded))
    plan.objects = plain_objects(dict(objects or {}))
    if plan.objects.dropped:
        name, why = next(iter(plan.objects.dropped.items()))
        raise SlimtorchError(f"save: object {name!r} cannot be stored as JSON: {why}")
    options = _checked(plan, options)
    provenance = {
        "tool": f"slimtorch {__version__}",
        "options": _describe_options(options),
        **(metadata or {}),
    }
    delta = structure.to_dict() if structure else None
    results, files, written = _write(
        plan, path, options, shard_size, provenance, extras, None, delta, folder=folder
    )
    before = sum(item.before_bytes for item in plan.items)
    return _report("<state_dict>", before, [], plan, results, files, written, started, folder)


def save_model(model: torch.nn.Module, path: str | os.PathLike[str], **options: Any) -> ShrinkReport:
    """Save a model's weights and, if it was pruned or quantized, how its structure changed: no pickle.

    ``options`` are :func:`save`'s (``quantize="int8"``, ``dtype="bf16"`` ...). Layers quantized by
    :func:`slimtorch.quantize` are stored as their codes, scales and zero points, untouched. Load it back
    with :func:`slimtorch.load_model` and the factory of the *original* model: the file tells how to
    reshape it and which layers to quantize.

    Example:
        >>> slimtorch.prune.channels(model, example, ratio=0.5)  # doctest: +SKIP
        >>> slimtorch.save_model(model, "pruned.safetensors")  # doctest: +SKIP
        >>> slimtorch.load_model("pruned.safetensors", build_model)  # doctest: +SKIP
    """
    layout = options.pop("layout", None)
    extras = dict(options.pop("extra_files", None) or {})
    config = _config_file(extras.get("config.json"))
    if config is None and layout == "hf" and Path(path).suffix != ".safetensors":
        config = _model_config(model)
    meta = config_model(config) if config is not None and layout != "slim" else None
    folder, shrink_options = _folder(config, layout, Path(path), _save_options(options), meta)
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
            bits = 4 if module.stage_of(tensors[0])["codec"] == "int4" else 8
            ct_ready = all(
                n in writable[bits] and ct_form(n, module.encoded(t)) is not None for t, n in names.items()
            )
            if folder.layout == "slim" or ct_ready:
                coded.update({n: module.encoded(t) for t, n in names.items()})
                dynamic |= set(names.values()) if module.SCHEME == "int8-dynamic" else set()
                continue
            # compressed-tensors cannot express this layer: its dequantized weight, and a float layer
            for tensor, name in names.items():
                weight = module.dequantized(tensor=tensor)
                state[name] = weight.t().contiguous() if name in transposed else weight
            structure = _without_quantized(structure, prefix)
            folder.notes.append(_dense_note(prefix, module))
    folder.dynamic = frozenset(dynamic)
    shard, metadata, objects = (options.get(k) for k in ("shard_size", "metadata", "objects"))
    return _save(state, path, shrink_options, shard, metadata, structure, extras, coded, objects, folder)


def _save_options(options: Mapping[str, Any]) -> ShrinkOptions:
    """The codec options among :func:`save_model`'s keyword arguments, as :func:`save` reads them."""
    known = (
        "dtype",
        "quantize",
        "group_size",
        "sparse",
        "entropy",
        "quantize_embeddings",
        "skip",
        "quantize_all",
    )
    unknown = [k for k in options if k not in (*known, "shard_size", "metadata", "objects")]
    if unknown:
        raise TypeError(f"save_model() got an unexpected keyword argument {unknown[0]!r}")
    chosen = {k: v for k, v in options.items() if k in known}
    chosen.setdefault("group_size", SHRINK_INT4_GROUP_SIZE)
    return ShrinkOptions(**chosen)


def _without_quantized(delta: StructuralDelta | None, layer: str) -> StructuralDelta | None:
    """``delta`` without the quantized layer ``layer`` (a copy: the model keeps its own)."""
    if delta is None:
        return None
    quantized = {k: v for k, v in delta.quantized.items() if k != layer}
    return replace(delta, quantized=quantized)


def _dense_note(layer: str, module: QuantizedWeight) -> str:
    return (
        f"{layer} ({module.kind}) written dense, dequantized: compressed-tensors has no form for it; it "
        "loads as a float layer holding the same values"
    )


def _model_config(model: torch.nn.Module) -> dict[str, Any] | None:
    """A transformers model's config as ``config.json`` holds it, naming the model's class as
    ``save_pretrained`` does (None for other models)."""
    config = getattr(model, "config", None)
    to_dict = getattr(config, "to_dict", None)
    if not callable(to_dict):
        return None
    values = to_dict()
    values["architectures"] = values.get("architectures") or [type(model).__name__]
    return values


def _joined(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _checked(plan: _Plan, options: ShrinkOptions) -> ShrinkOptions:
    """Refuse ``skip`` patterns that match nothing; store the weights quantizing would hurt most at a higher
    precision (unless ``quantize_all``), noting them in the plan."""
    names = [item.name for item in plan.items] + list(plan.ties) + list(plan.copies)
    check_patterns(options.skip, names, plan.renamed_prefix)
    if options.quantize is None or options.quantize_all:
        return options
    errors = {}
    for item in plan.items:
        if item.encoded is None:
            value = convert(item.name, item.fetch().detach(), options)
            if quantizable(item.name, value, item.category, options) and not EMBEDDING.search(item.name):
                errors[item.name] = rounding_error(value, options.quantize, options.group_size)
    plan.stored_instead = higher_precision(errors, options.quantize)
    chosen = {c.name: c.stored for c in plan.stored_instead}
    return replace(options, stored_as={**chosen, **options.stored_as})


def _folder(
    config: dict[str, Any] | None,
    asked: str | None,
    out: Path,
    options: ShrinkOptions,
    model: torch.nn.Module | None = None,
) -> tuple[_Folder, ShrinkOptions]:
    """The layout of the output and the options that write it: ``hf`` quantizes only what
    compressed-tensors expresses, which the model ``config`` describes tells (``model``: built already)."""
    if out.suffix == ".safetensors":
        config = None  # one file: no config.json goes with it
    layout = resolve_layout(asked, config is not None, out)
    folder = _Folder(layout, config)
    if layout == "slim":
        return folder, options
    if options.entropy:
        raise SlimtorchError(
            f"{out}: --entropy stores parts transformers cannot read; use it with --format slim"
        )
    if options.quantize and model is None:
        model = config_model(config)  # type: ignore[arg-type]
    if options.quantize and model is None:
        if asked == "hf":
            raise SlimtorchError(
                f"{out}: transformers cannot build the model config.json describes, so which weights "
                "compressed-tensors can hold is unknown; use --format slim"
            )
        folder.layout = "slim"
        folder.notes.append("written in the slim layout: transformers cannot build this config's model")
        return folder, options
    folder.base_prefix = base_prefix(model) if model is not None else ""
    weights = ct_weights(model) if model is not None else set()
    if options.quantize == "int4":
        # compressed-tensors' int4 is for Linear layers: embeddings go int8, which it holds, not float
        int4 = ct_weights(model, 4) if model is not None else set()
        options = replace(options, stored_as={**dict.fromkeys(weights - int4, "int8"), **options.stored_as})
    return folder, replace(options, layout="hf", hf_weights=weights)


def _config_file(found: Path | bytes | None) -> dict[str, Any] | None:
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


# -- planning ----------------------------------------------------------------------------------------------
def _plan_source(source: TensorSource, keep_optimizer: bool, keep_names: bool) -> _Plan:
    infos = source.infos()
    categories = classify(infos, source.objects)
    names = {info.name for info in infos}
    plan = _Plan(items=[])
    duplicates = find_duplicates(source, list(dict.fromkeys(i.storage for i in infos)))
    # A slim source shows a copy on its original's storage, like a tie; its layout says which it is.
    slim_copies = source.copies()
    stored: dict[tuple, str] = {}
    for info in infos:
        category = categories[info.name]
        if category in TRAINING_ONLY and not keep_optimizer:
            plan.dropped.append(info.name)
            continue
        if category == "pruning_leftovers":
            continue  # a *_mask: folded into its weight below
        name = info.name
        fetch: Callable[[], torch.Tensor] = lambda info=info: source.get(info.name)  # noqa: E731
        before = info.nbytes if info.stored_nbytes is None else info.stored_nbytes
        if name.endswith("_orig") and name[: -len("_orig")] + "_mask" in names:
            name = name[: -len("_orig")]
            mask = source.info(name + "_mask")
            if mask.shape != info.shape:
                raise FormatError(source.path, _unfoldable(info.name, info.shape, mask.shape))
            fetch = lambda info=info, mask=mask: source.get(info.name) * source.get(mask.name)  # noqa: E731
            before += mask.nbytes
            plan.folded.append(name)
            category = "parameters"
        else:
            key = _view_key(info, duplicates.get(info.storage, info.storage))
            if key in stored:
                shares = duplicates.get(info.storage) is None and name not in slim_copies
                (plan.ties if shares else plan.copies)[name] = stored[key]
                continue
            stored[key] = name
        plan.items.append(_Item(name, category, before, fetch))
    if not keep_names and not source.coded:  # a slim file's names are as chosen already
        _strip_wrapper_prefix(plan, _wrapper_prefix(plan, source))
    return plan


def _wrapper_prefix(plan: _Plan, source: TensorSource) -> str:
    """The prefix that only wraps the model's tensors in the checkpoint, by the one rule
    (:func:`~slimtorch.format.names.training_wrapper`): ``model_state.`` (resemblyzer),
    ``model.state_dict.`` (chgnet), ``state_dict.`` (Lightning), DataParallel's ``module.``, or ``""``."""
    names = [item.name for item in plan.items] + list(plan.ties) + list(plan.copies)
    training = bool(plan.dropped) or _has_training_values(source)
    return training_wrapper(names, source.tree, training)


def _has_training_values(source: TensorSource) -> bool:
    """Whether the checkpoint holds non-tensor values that a training loop saves (an epoch, a step).

    A model folder's config.json entries and a safetensors file's ``__metadata__`` strings do not count:
    every Hugging Face folder has them, and one whose weights all start with ``model.`` (a
    ``LlamaForCausalLM`` with tied embeddings saves no ``lm_head.weight``) must keep its names to load
    back into its model.
    """
    return any(
        "__metadata__." not in obj.name and not (source.path.is_dir() and obj.name.startswith("config."))
        for obj in source.objects
    )


def _view_key(info: TensorInfo, storage: str) -> tuple:
    return (storage, info.storage_offset, info.shape, info.stride, info.dtype, info.codec)


def _strip_wrapper_prefix(plan: _Plan, prefix: str) -> None:
    """``model.encoder...`` -> ``encoder...`` when a training checkpoint wrapped the model in ``prefix``."""
    if not prefix:
        return
    cut = len(prefix)
    plan.items = [replace(i, name=i.name[cut:]) for i in plan.items]
    plan.ties = {k[cut:]: v[cut:] for k, v in plan.ties.items()}
    plan.copies = {k[cut:]: v[cut:] for k, v in plan.copies.items()}
    plan.folded = [name[cut:] for name in plan.folded]
    plan.renamed_prefix = prefix


def _plan_state_dict(state_dict: Mapping[str, torch.Tensor]) -> _Plan:
    plan = _Plan(items=[])
    stored: dict[tuple, str] = {}
    names = set(state_dict)
    for name, tensor in state_dict.items():
        if not isinstance(tensor, torch.Tensor):
            raise SlimtorchError(f"save: {name!r} is a {type(tensor).__name__}, not a tensor")
        if tensor.layout != torch.strided or tensor.is_quantized or tensor.is_nested or tensor.is_meta:
            kind = "meta" if tensor.is_meta else "quantized" if tensor.is_quantized else tensor.layout
            raise SlimtorchError(
                f"save: {name!r} is a {kind} tensor; save takes dense tensors with data (.to_dense() "
                "a sparse one, .dequantize() a quantized one)"
            )
        if name.endswith("_mask") and name[: -len("_mask")] + "_orig" in names:
            continue
        category = "buffers" if not tensor.dtype.is_floating_point else "parameters"
        fetch = lambda tensor=tensor: tensor  # noqa: E731
        if name.endswith("_orig") and name[: -len("_orig")] + "_mask" in names:
            mask = state_dict[name[: -len("_orig")] + "_mask"]
            if not isinstance(mask, torch.Tensor) or mask.shape != tensor.shape:
                raise SlimtorchError("save: " + _unfoldable(name, tensor.shape, getattr(mask, "shape", ())))
            name = name[: -len("_orig")]
            fetch = lambda tensor=tensor, mask=mask: tensor * mask  # noqa: E731
            plan.folded.append(name)
        elif tensor.numel():
            key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), *_layout(tensor))
            if key in stored:
                plan.ties[name] = stored[key]
                continue
            stored[key] = name
        plan.items.append(_Item(name, category, tensor.numel() * tensor.element_size(), fetch))
    return plan


def _unfoldable(name: str, weight: Sequence[int], mask: Sequence[int]) -> str:
    """Why ``weight_orig * weight_mask`` is refused: torch.nn.utils.prune makes the mask in the weight's
    shape, and any other would broadcast (``[1, N] x [N, 1]`` is N**2 values from 2N)."""
    return (
        f"{name!r} {list(weight)} and its pruning mask {list(mask)[:8]} differ in shape: the mask must have "
        "the weight's shape"
    )


def _layout(tensor: torch.Tensor) -> tuple:
    return (tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype, tensor.device)


# -- writing -----------------------------------------------------------------------------------------------
def _write(
    plan: _Plan,
    out: str | os.PathLike[str],
    options: ShrinkOptions,
    shard_bytes: int | None,
    provenance: dict[str, Any],
    companions: dict[str, Path],
    progress: Progress | None,
    delta: dict[str, Any] | None = None,
    *,
    folder: _Folder | None = None,
) -> tuple[list[TensorResult], list[Path], int]:
    """Write the plan's tensors and the folder's files; a folder with a ``config.json`` gets one written
    for its layout (``hf``: with the ``quantization_config`` of what was written quantized)."""
    folder = folder or _Folder()
    hf = folder.layout == "hf"
    if hf:
        _every_name_stored(plan)
    with tempfile.TemporaryDirectory() as staging:
        if folder.config is not None:  # written once the quantized layers are known; named from the start
            companions = {**companions, "config.json": Path(staging) / "config.json"}
        writer = SlimWriter(
            out,
            shard_bytes=shard_bytes,
            ties=plan.ties,
            copies=plan.copies,
            provenance=provenance,
            delta=delta,
            extra_files=companions,
            objects=plan.objects.values,
            card=lambda card, written: model_card(card, provenance, delta, written),
        )
        try:
            with task(progress, "shrinking", sum(item.before_bytes for item in plan.items)) as advance:
                results, schemes = _add_all(writer, plan, options, advance, folder)
            if folder.config is not None:
                quantization = quantization_config(schemes, folder.base_prefix) if hf else None
                write_config(
                    Path(staging), folder_config(folder.config, folder.layout, quantization, options.dtype)
                )
            files = writer.commit()
        except BaseException:
            writer.abort()
            raise
    return results, files, sum(f.stat().st_size for f in files if f.suffix == ".safetensors")


def _add_all(
    writer: SlimWriter, plan: _Plan, options: ShrinkOptions, advance: Callable[[int], None], folder: _Folder
) -> tuple[list[TensorResult], dict[str, CtScheme]]:
    """Queue every tensor of the plan; returns what was stored and, in the ``hf`` layout, the
    compressed-tensors scheme of each weight written in that form."""
    hf = folder.layout == "hf"
    results: list[TensorResult] = []
    schemes: dict[str, CtScheme] = {}
    bits = _ct_bits(plan, options) if hf else None
    for item in (i for i in plan.items if i.encoded is not None):
        encoded = finish_coded(item.encoded, options)  # type: ignore[arg-type]
        stage = encoded.stages[0]
        dtype, shape = parse_dtype(stage["dtype"]), tuple(stage["shape"])
        entry = _add(writer, item.name, encoded, dtype, shape, bits, schemes, folder.dynamic)
        results.append(
            TensorResult(
                item.name, item.category, entry.chain, stage["dtype"], item.before_bytes, encoded.nbytes
            )
        )
    floated = []
    for item, original in _fetched([i for i in plan.items if i.encoded is None]):
        value = convert(item.name, original.detach().cpu(), options)
        encoded = encode_tensor(item.name, value, item.category, options)
        _add(writer, item.name, encoded, value.dtype, tuple(value.shape), bits, schemes, frozenset())
        if hf and options.quantize and _float_in_hf(item, value, encoded, options):
            floated.append(item.name)
        results.append(_result(item, original, value, encoded))
        advance(item.before_bytes)
    if floated:
        folder.notes.append(_floated_note(floated))
    return results, schemes


def _add(
    writer: SlimWriter,
    name: str,
    encoded: Encoded,
    dtype: torch.dtype,
    shape: tuple[int, ...],
    bits: int | None,
    schemes: dict[str, CtScheme],
    dynamic: frozenset[str],
) -> Any:
    """Queue one tensor: in the ``hf`` layout (``bits``: the folder's one compressed-tensors width) a
    quantized one goes in the compressed-tensors form (its scheme noted for ``quantization_config``), and
    anything else transformers cannot read dense."""
    hf = bits is not None
    quantized = bool(encoded.stages) and encoded.stages[0].get("codec") in ("int8", "int4")
    if hf and quantized:
        found = ct_form(name, encoded)
        if found is not None and found[2].bits == bits:
            coded, keys, scheme = found
            schemes[name] = replace(scheme, activations=name in dynamic)
            return writer.add(name, coded, dtype, shape, keys)
    if hf and encoded.stages and encoded.stages[0].get("codec") != "cast":
        # sparse, zstd, a code form compressed-tensors lacks: the values the slim loader would give
        encoded = Encoded({"": decode(encoded.parts, encoded.stages, dtype, shape)}, [])
    return writer.add(name, encoded, dtype, shape)


def _refuse_foreign_codes(source: TensorSource, config: Mapping[str, Any] | None) -> None:
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


def _ct_bits(plan: _Plan, options: ShrinkOptions) -> int:
    """The one width a folder's compressed-tensors weights have: transformers decodes a folder mixing
    int4 (``pack-quantized``) and int8 groups with the wrong decoder, so int4 when anything is int4."""
    coded = (
        i.encoded.stages[0].get("codec") for i in plan.items if i.encoded is not None and i.encoded.stages
    )
    return 4 if options.quantize == "int4" or "int4" in set(coded) else 8


def _every_name_stored(plan: _Plan) -> None:
    """Turn ties and copies into tensors of their own (transformers knows neither): each name stored."""
    by_name = {item.name: item for item in plan.items}
    for name, target in {**plan.ties, **plan.copies}.items():
        original = by_name[target]
        plan.items.append(replace(original, name=name, before_bytes=0))
    plan.ties, plan.copies = {}, {}


def _float_in_hf(item: _Item, value: torch.Tensor, encoded: Encoded, options: ShrinkOptions) -> bool:
    """Whether a weight the slim layout would quantize stays float because compressed-tensors cannot
    hold it (a convolution, GPT-2's Conv1D, int4 groups that do not fit its rows)."""
    slim = replace(options, layout="slim")
    return not encoded.stages and quantizable(item.name, value, item.category, slim)


def _floated_note(names: list[str]) -> str:
    return (
        f"{len(names)} weight(s) kept at their precision in the hf layout "
        f"({', '.join(weight_names(names))}): compressed-tensors quantizes nn.Linear and nn.Embedding "
        "weights only, int4 in whole groups per row; --format slim quantizes them"
    )


def _result(item: _Item, original: torch.Tensor, value: torch.Tensor, encoded: Encoded) -> TensorResult:
    converted = value.dtype != original.dtype
    lossy = converted or any(
        not REGISTRY[s["codec"]].lossless for s in encoded.stages if s["codec"] in REGISTRY
    )
    error = _error(original, encoded, value) if lossy else None
    return TensorResult(
        item.name,
        item.category,
        f"{dtype_name(value.dtype)} {encoded.chain}" if converted else encoded.chain,
        dtype_name(value.dtype),
        item.before_bytes,
        encoded.nbytes,
        *(error or (None, None)),
    )


def _fetched(items: list[_Item]) -> Iterator[tuple[_Item, torch.Tensor]]:
    for item in items:
        yield item, item.fetch()


def _error(original: torch.Tensor, encoded: Any, value: torch.Tensor) -> tuple[float, float] | None:
    """Max abs and relative L2 error of the stored tensor against the original (floats only)."""
    if not original.dtype.is_floating_point or original.numel() == 0:
        return None
    decoded = decode(encoded.parts, encoded.stages, value.dtype, tuple(value.shape))
    reference = original.to(torch.float32)
    diff = decoded.to(torch.float32, copy=True).sub_(reference)
    norm = float(torch.linalg.vector_norm(reference))
    return float(diff.abs().max()), float(torch.linalg.vector_norm(diff)) / norm if norm else 0.0


def _companions(source: Path, out: Path) -> Companions:
    if not source.is_dir() or out.suffix == ".safetensors":
        return Companions({})
    weight_files(source)  # the folder was read as a model folder
    return find_companions(source)


def _describe_options(options: ShrinkOptions) -> dict[str, Any]:
    described = asdict(options)
    described["dtype"] = dtype_name(options.dtype) if options.dtype else None
    described["skip"] = list(options.skip)
    described["unquantized"] = sorted(options.unquantized)
    del described["hf_weights"]  # the model's layers, not a choice
    return described


def _report(
    source: str,
    before_bytes: int,
    before: list[Bucket],
    plan: _Plan,
    results: list[TensorResult],
    files: list[Path],
    written: int,
    started: float,
    folder: _Folder | None = None,
) -> ShrinkReport:
    after: dict[str, list[int]] = {}
    for result in results:
        bucket = after.setdefault(result.category, [0, 0])
        bucket[0] += 1
        bucket[1] += result.after_bytes
    overhead = written - sum(r.after_bytes for r in results)
    buckets = [Bucket(name, n, b) for name, (n, b) in after.items()]
    buckets.append(Bucket("format_overhead", 0, overhead))
    notes = []
    if plan.renamed_prefix:
        notes.append(
            f"names lost the training wrapper prefix {plan.renamed_prefix!r} (keep it with --keep-names)"
        )
    notes += folder.notes if folder else []
    return ShrinkReport(
        source=source,
        files=[str(f) for f in files],
        before_bytes=before_bytes,
        after_bytes=written,
        before=before,
        after=buckets,
        tensors=results,
        dropped=plan.dropped,
        folded=plan.folded,
        ties=plan.ties,
        copies=plan.copies,
        renamed_prefix=plan.renamed_prefix,
        seconds=time.perf_counter() - started,
        notes=notes,
        objects=list(plan.objects.values),
        dropped_objects=plan.objects.dropped,
        stored_instead=plan.stored_instead,
    )
