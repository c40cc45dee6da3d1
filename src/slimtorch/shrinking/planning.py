"""What shrink and save store, decided once: which tensors, under which names, in which category, and
which are ties (names on one tensor, loaded shared) or copies (equal values, loaded as separate tensors).

One planner reads a :class:`~slimtorch.format.source.TensorSource`. :func:`save` hands it a state dict
through :func:`state_dict_source`, so a state dict saved in memory and the same tensors shrunk from a
``torch.save`` file get the same ties, copies, categories and order.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from slimtorch.errors import FormatError, SlimtorchError
from slimtorch.format.codecs import Encoded
from slimtorch.format.names import training_wrapper
from slimtorch.format.scan import find_duplicates
from slimtorch.format.sensitive import StoredInstead
from slimtorch.format.source import StorageLocation, TensorInfo, TensorSource
from slimtorch.inspection.breakdown import classify
from slimtorch.sources.objects import PlainObjects

TRAINING_ONLY = ("optimizer_state", "training_state")


@dataclass(frozen=True)
class Item:
    """A tensor to store: its output name, category, input bytes, and how to fetch its value (or its parts,
    already encoded: a quantized layer's weight)."""

    name: str
    category: str
    before_bytes: int
    fetch: Callable[[], torch.Tensor]
    encoded: Encoded | None = None


@dataclass
class Plan:
    items: list[Item]
    ties: dict[str, str] = field(default_factory=dict)
    copies: dict[str, str] = field(default_factory=dict)
    dropped: list[str] = field(default_factory=list)
    folded: list[str] = field(default_factory=list)
    renamed_prefix: str | None = None
    objects: PlainObjects = field(default_factory=lambda: PlainObjects({}, {}))
    stored_instead: list[StoredInstead] = field(default_factory=list)

    @property
    def names(self) -> list[str]:
        """Every name the output will hold: stored tensors, ties and copies."""
        return [item.name for item in self.items] + list(self.ties) + list(self.copies)


def plan_tensors(source: TensorSource, *, keep_training: bool, keep_names: bool) -> Plan:
    """What to store of ``source``: optimizer and training state dropped (unless ``keep_training``),
    pruning masks folded into their weights, each tensor stored once, and a training wrapper prefix
    removed from the names (unless ``keep_names``)."""
    infos = source.infos()
    categories = classify(infos, source.objects)
    names = {info.name for info in infos}
    plan = Plan(items=[])
    duplicates = find_duplicates(source, list(dict.fromkeys(i.storage for i in infos)))
    # A slim source shows a copy on its original's storage, like a tie; its layout says which it is.
    slim_copies = source.copies()
    stored: dict[tuple, str] = {}
    for info in infos:
        category = categories[info.name]
        if category in TRAINING_ONLY and not keep_training:
            plan.dropped.append(info.name)
            continue
        if category == "pruning_leftovers":
            continue  # a *_mask: folded into its weight below
        name = info.name
        fetch: Callable[[], torch.Tensor] = functools.partial(source.get, info.name)
        before = info.nbytes if info.stored_nbytes is None else info.stored_nbytes
        if name.endswith("_orig") and name[: -len("_orig")] + "_mask" in names:
            name = name[: -len("_orig")]
            mask = source.info(name + "_mask")
            if mask.shape != info.shape:
                raise FormatError(source.path, _unfoldable(info.name, info.shape, mask.shape))
            fetch = functools.partial(_masked, source, info.name, mask.name)
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
        plan.items.append(Item(name, category, before, fetch))
    if not keep_names and not source.coded:  # a slim file's names are as chosen already
        _strip_wrapper_prefix(plan, _wrapper_prefix(plan, source))
    return plan


def _masked(source: TensorSource, name: str, mask: str) -> torch.Tensor:
    """``name * mask`` (torch.nn.utils.prune's ``weight_orig`` and ``weight_mask``): the weight it prunes."""
    return source.get(name) * source.get(mask)


def _view_key(info: TensorInfo, storage: str) -> tuple:
    return (storage, info.storage_offset, info.shape, info.stride, info.dtype, info.codec)


def _unfoldable(name: str, weight: Sequence[int], mask: Sequence[int]) -> str:
    """Why ``weight_orig * weight_mask`` is refused: torch.nn.utils.prune makes the mask in the weight's
    shape, and any other would broadcast (``[1, N] x [N, 1]`` is N**2 values from 2N)."""
    return (
        f"{name!r} {list(weight)} and its pruning mask {list(mask)[:8]} differ in shape: the mask must have "
        "the weight's shape"
    )


# -- training wrappers -------------------------------------------------------------------------------------
def _wrapper_prefix(plan: Plan, source: TensorSource) -> str:
    """The prefix that only wraps the model's tensors in the checkpoint, by the one rule
    (:func:`~slimtorch.format.names.training_wrapper`): ``model_state.`` (resemblyzer),
    ``model.state_dict.`` (chgnet), ``state_dict.`` (Lightning), DataParallel's ``module.``, or ``""``."""
    training = bool(plan.dropped) or _has_training_values(source)
    return training_wrapper(plan.names, source.tree, training)


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


def _strip_wrapper_prefix(plan: Plan, prefix: str) -> None:
    """``model.encoder...`` -> ``encoder...`` when a training checkpoint wrapped the model in ``prefix``."""
    if not prefix:
        return
    cut = len(prefix)
    plan.items = [replace(i, name=i.name[cut:]) for i in plan.items]
    plan.ties = {k[cut:]: v[cut:] for k, v in plan.ties.items()}
    plan.copies = {k[cut:]: v[cut:] for k, v in plan.copies.items()}
    plan.folded = [name[cut:] for name in plan.folded]
    plan.renamed_prefix = prefix


# -- a state dict as a source ------------------------------------------------------------------------------
STATE_DICT = Path("<state_dict>")


@dataclass
class _StateDictSource(TensorSource):
    """Tensors in memory, read the way a checkpoint's are: a storage is one tensor storage (views and
    tied weights share it), and its bytes are the storage's own (on the CPU, for comparing)."""

    held: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)
    storages: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)

    def get(self, name: str) -> torch.Tensor:
        self.info(name)
        return self.held[name]

    def storage_bytes(self, storage: str) -> torch.Tensor:
        tensor = self.storages[storage]
        whole = tensor.untyped_storage()
        raw = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(whole, 0, (whole.nbytes(),), (1,))
        return raw.cpu()


def state_dict_source(state_dict: Mapping[str, torch.Tensor]) -> TensorSource:
    """``state_dict`` as a source :func:`plan_tensors` reads; refuses what is not a dense tensor with data
    (a sparse, quantized, nested or meta tensor, or no tensor at all), saying what to do instead."""
    infos, locations = [], {}
    storages: dict[str, torch.Tensor] = {}
    for name, tensor in state_dict.items():
        _check_storable(name, tensor)
        whole = tensor.untyped_storage()
        # an empty storage has no address of its own: each empty tensor is its own storage
        storage = f"{tensor.device}:{whole.data_ptr()}" if whole.nbytes() else f"empty:{name}"
        infos.append(
            TensorInfo(
                name,
                tensor.dtype,
                tuple(tensor.shape),
                tuple(tensor.stride()),
                storage,
                int(tensor.storage_offset()) * tensor.element_size(),  # never symbolic here
                whole.nbytes(),
            )
        )
        locations[storage] = StorageLocation(STATE_DICT, 0, whole.nbytes())
        storages.setdefault(storage, tensor)
    return _StateDictSource(
        STATE_DICT, "state_dict", infos, locations, held=dict(state_dict), storages=storages
    )


def _check_storable(name: str, tensor: object) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise SlimtorchError(f"save: {name!r} is a {type(tensor).__name__}, not a tensor")
    if tensor.layout != torch.strided or tensor.is_quantized or tensor.is_nested or tensor.is_meta:
        kind = "meta" if tensor.is_meta else "quantized" if tensor.is_quantized else tensor.layout
        raise SlimtorchError(
            f"save: {name!r} is a {kind} tensor; save takes dense tensors with data (.to_dense() "
            "a sparse one, .dequantize() a quantized one)"
        )
