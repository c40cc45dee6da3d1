"""inspect: where a checkpoint's bytes go, and what could be saved.

Every byte of the file is put in exactly one category: the tensors' storages (parameters, buffers, optimizer
state, training state, pruning leftovers, duplicates, storage no tensor uses), the serialized non-tensor
structure, and the format's own overhead. Tensors that share a storage (tied weights, views) are counted
once, by the first tensor that uses the bytes.
"""

from __future__ import annotations

import os
import re
from bisect import bisect_left, bisect_right
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

from slimtorch.errors import OptionError
from slimtorch.format.progress import Progress, task
from slimtorch.format.scan import count_masked_zeros, count_zeros, find_duplicates
from slimtorch.format.source import ObjectInfo, TensorInfo, TensorSource, dtype_name
from slimtorch.format.verbs import Report, resolve
from slimtorch.inspection.estimates import Saving, TensorCost, estimate_savings
from slimtorch.inspection.options import InspectOptions
from slimtorch.sources import open_checkpoint

SCHEMA = "slimtorch.inspect/1"
CATEGORIES = (
    "parameters",
    "buffers",
    "optimizer_state",
    "training_state",
    "pruning_leftovers",
    "duplicates",
    "unreferenced_storage",
    "non_tensor",
    "format_overhead",
)
# Names that are buffers when the file does not say (a plain state_dict loses the distinction).
BUFFER_NAMES = {
    "running_mean",
    "running_var",
    "num_batches_tracked",
    "position_ids",
    "token_type_ids",
    "inv_freq",
    "masked_bias",
}
_OPTIMIZER_KEY = re.compile(r"optim", re.IGNORECASE)
# a gradient scaler's state (``scaler``, ``grad_scaler``), not a ``data_scaler`` a model's outputs need
_TRAINING_KEY = re.compile(r"sched|^(grad_|amp_)?scaler$|rng|random|loops|amp", re.IGNORECASE)

Advance = Callable[[int], None]


@dataclass(frozen=True)
class TensorStat:
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    stored_bytes: int
    category: str
    sparsity: float | None
    shares_with: str | None
    codec: str = "raw"

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "shape": list(self.shape)}


@dataclass(frozen=True)
class Bucket:
    name: str
    tensors: int
    bytes: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class PrefixNode:
    prefix: str
    depth: int
    tensors: int
    bytes: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


_COUNTS = {
    "type": "object",
    "properties": {"tensors": {"type": "integer"}, "bytes": {"type": "integer"}},
    "required": ["bytes", "tensors"],
}
BUCKETS_SCHEMA = {"type": "object", "additionalProperties": _COUNTS}
"""JSON Schema of :func:`by_name`'s output."""


def by_name(buckets: list[Bucket]) -> dict[str, dict[str, int]]:
    """Buckets as the JSON gives them: bucket name -> its tensors and bytes (inspect's and shrink's)."""
    return {b.name: {"tensors": b.tensors, "bytes": b.bytes} for b in buckets}


@dataclass(frozen=True)
class InspectReport(Report):
    """The result of :func:`inspect`; ``to_dict()`` is the stable ``--json`` schema (docs/inspect-json.md)."""

    SCHEMA: ClassVar[str] = SCHEMA

    path: str
    format: str
    file_bytes: int
    tensor_bytes: int
    stored_bytes: int
    categories: list[Bucket]
    tied: Bucket
    by_dtype: list[Bucket]
    tree: list[PrefixNode]
    largest: list[TensorStat]
    tensors: list[TensorStat]
    objects: list[ObjectInfo]
    savings: list[Saving]
    scanned: bool
    notes: list[str] = field(default_factory=list)

    def category(self, name: str) -> int:
        """Bytes in one category (0 when absent)."""
        return next((b.bytes for b in self.categories if b.name == name), 0)

    def to_dict(self) -> dict[str, Any]:
        """The fields, with buckets by name and the savings under ``actions`` (the JSON's shape since 1)."""
        values = super().to_dict()
        for name in ("categories", "by_dtype"):
            values[name] = by_name(getattr(self, name))
        values["tied"] = {"tensors": self.tied.tensors, "bytes": self.tied.bytes}
        values["savings"] = {"estimates": False, "actions": values["savings"]}
        return values

    @classmethod
    def json_schema(cls) -> dict[str, Any]:
        schema = super().json_schema()
        actions = schema["properties"]["savings"]
        schema["properties"].update(
            categories=BUCKETS_SCHEMA,
            by_dtype=BUCKETS_SCHEMA,
            tied=_COUNTS,
            savings={
                "type": "object",
                "properties": {"estimates": {"type": "boolean"}, "actions": actions},
            },
        )
        return schema


def inspect(
    path_or_source: str | os.PathLike[str] | TensorSource,
    /,
    options: InspectOptions | None = None,
    *,
    progress: Progress | None = None,
    **overrides: Any,
) -> InspectReport:
    """Where a checkpoint's bytes go, and what each shrinking action would save.

    Args:
        path_or_source: a checkpoint path (any format :func:`slimtorch.open` reads) or an open source.
        options: what to show and read (:class:`~slimtorch.inspection.options.InspectOptions`: ``depth``,
            ``top``, ``scan``, ``allow_globals``); ``overrides`` replace single fields.
        progress: told how many bytes the scan got through (:mod:`slimtorch.format.progress`).

    Example:
        >>> import slimtorch
        >>> report = slimtorch.inspect("checkpoint.pt", depth=2)  # doctest: +SKIP
        >>> report.category("optimizer_state") / report.file_bytes  # doctest: +SKIP
        0.66
    """
    options = resolve(InspectOptions, options, overrides, "inspect")
    if isinstance(path_or_source, TensorSource):
        if options.allow_globals:
            raise OptionError(
                "inspect: allow_globals applies when inspect opens a path; this source is open already "
                "(give it to slimtorch.open)"
            )
        return _build(path_or_source, options, progress)
    with open_checkpoint(path_or_source, allow_globals=options.allow_globals) as source:
        return _build(source, options, progress)


def classify(infos: list[TensorInfo], objects: list[ObjectInfo]) -> dict[str, str]:
    """Category of each tensor: what it is for, as far as the file and the names tell."""
    shapes = {info.name: info.shape for info in infos}
    names = shapes.keys()
    optimizer_roots: dict = {}  # a trie of name parts; a root ends where it holds the key None
    for name in [*names, *(o.name for o in objects)]:
        parts = name.split(".")
        if "param_groups" in parts:
            node = optimizer_roots
            for part in parts[: parts.index("param_groups")]:
                node = node.setdefault(part, {})
            node[None] = True
    categories = {}
    for info in infos:
        parts = info.name.split(".")
        leaf = parts[-1]
        top = parts[0] if len(parts) > 1 else ""
        if _OPTIMIZER_KEY.search(top) or _under_optimizer_state(parts, optimizer_roots):
            categories[info.name] = "optimizer_state"
        elif _TRAINING_KEY.search(top) or (len(parts) == 1 and _TRAINING_KEY.search(leaf)):
            categories[info.name] = "training_state"
        elif leaf.endswith("_mask") and shapes.get(info.name[: -len("_mask")] + "_orig") == info.shape:
            categories[info.name] = "pruning_leftovers"
        elif info.role == "buffer" or (
            info.role is None
            and (leaf in BUFFER_NAMES or not (info.dtype.is_floating_point or info.dtype.is_complex))
        ):
            categories[info.name] = "buffers"
        else:
            categories[info.name] = "parameters"
    return categories


def _under_optimizer_state(parts: list[str], roots: dict) -> bool:
    """Whether the name continues some optimizer's root with ``state``: one walk down the trie of roots,
    so a file with thousands of optimizers (or names) is not compared name by root."""
    node = roots
    for part in parts:
        if part == "state" and None in node:
            return True
        node = node.get(part, {})
        if not node:
            return False
    return False


def _build(source: TensorSource, options: InspectOptions, progress: Progress | None) -> InspectReport:
    depth, top, scan = options.depth, options.top, options.scan
    infos = source.infos()
    categories = classify(infos, source.objects)
    stored, shares_with, unreferenced = _attribute_bytes(infos)
    zeros: dict[str, int] = {}
    duplicates: dict[str, str] = {}
    if scan:
        with task(progress, "scanning", sum(info.nbytes for info in infos)) as advance:
            zeros = _scan_zeros(source, infos, advance)
            duplicates = find_duplicates(source, list(dict.fromkeys(i.storage for i in infos)), advance)
    first_user: dict[str, str] = {}  # storage -> the first tensor that uses it
    for info in infos:
        first_user.setdefault(info.storage, info.name)
    for info in infos:
        if info.storage in duplicates and stored[info.name]:
            categories[info.name] = "duplicates"
            shares_with[info.name] = first_user[duplicates[info.storage]]

    stats = [
        TensorStat(
            name=info.name,
            dtype=dtype_name(info.dtype),
            shape=info.shape,
            nbytes=info.nbytes,
            stored_bytes=stored[info.name],
            category=categories[info.name],
            sparsity=(zeros[info.name] / info.numel) if info.name in zeros and info.numel else None,
            shares_with=shares_with.get(info.name),
            codec=info.codec,
        )
        for info in infos
    ]
    stored_bytes = sum(s.stored_bytes for s in stats) + unreferenced
    other = {
        "unreferenced_storage": unreferenced,
        "non_tensor": source.structure_bytes,
        "format_overhead": max(0, source.file_bytes - stored_bytes - source.structure_bytes),
    }
    costs = [
        TensorCost(s.category, i.dtype, i.shape, s.stored_bytes, zeros.get(i.name))
        for s, i in zip(stats, infos, strict=True)
    ]
    if unreferenced:
        costs.append(TensorCost("unreferenced_storage", infos[0].dtype, (0,), unreferenced, None))
    tied = [s for s in stats if s.shares_with and s.category != "duplicates"]
    return InspectReport(
        path=str(source.path),
        format=source.format,
        file_bytes=source.file_bytes,
        tensor_bytes=sum(s.nbytes for s in stats),
        stored_bytes=stored_bytes,
        categories=_categories(stats, other, len(source.objects)),
        tied=Bucket("tied", len(tied), sum(s.nbytes - s.stored_bytes for s in tied)),
        by_dtype=_buckets(stats, lambda s: s.dtype),
        tree=prefix_tree(stats, depth),
        largest=sorted(stats, key=lambda s: s.nbytes, reverse=True)[:top],
        tensors=stats,
        objects=source.objects,
        savings=estimate_savings(costs, source.file_bytes),
        scanned=scan,
        notes=_notes(stats, unreferenced, scan),
    )


def _attribute_bytes(infos: list[TensorInfo]) -> tuple[dict[str, int], dict[str, str], int]:
    """Bytes each tensor adds to the file (0 for a tie), whom it shares with, and unused storage bytes.

    Each storage keeps the bytes already attributed as sorted intervals, so 20,000 names on one tensor
    cost 20,000 binary searches, not 20,000**2 / 2 span comparisons."""
    coverage: dict[str, _Coverage] = defaultdict(_Coverage)
    stored: dict[str, int] = {}
    shares_with: dict[str, str] = {}
    sizes: dict[str, int] = {}
    for info in infos:
        start, end = info.span
        stored[info.name], owner = coverage[info.storage].add(start, end, info.name)
        if owner is not None:
            shares_with[info.name] = owner
        sizes[info.storage] = info.storage_nbytes
    unreferenced = sum(size - coverage[storage].covered(0, size) for storage, size in sizes.items())
    return stored, shares_with, unreferenced


class _Coverage:
    """The bytes of one storage that tensors already use: their union as disjoint sorted intervals, and
    the same bytes cut into segments labelled with the tensor that used them first. Every tensor adds at
    most a few intervals and merges away the ones it bridges, so all the work stays near linear."""

    def __init__(self) -> None:
        self.starts: list[int] = []  # the union, merged
        self.ends: list[int] = []
        self.segment_starts: list[int] = []  # the same bytes, by first owner
        self.segment_ends: list[int] = []
        self.owners: list[str] = []

    def add(self, start: int, end: int, name: str) -> tuple[int, str | None]:
        """Use ``[start, end)`` for ``name``: (bytes not used before, owner of the first shared byte)."""
        owner = self._first_owner(start, end)
        if end <= start:
            return 0, owner
        lo, hi = bisect_left(self.ends, start), bisect_right(self.starts, end)
        new, cursor = 0, start
        for s, e in zip(self.starts[lo:hi], self.ends[lo:hi], strict=True):
            if s > cursor:
                self._label(cursor, s, name)
                new += s - cursor
            cursor = max(cursor, e)
        if cursor < end:
            self._label(cursor, end, name)
            new += end - cursor
        merged = (min([start, *self.starts[lo:hi]]), max([end, *self.ends[lo:hi]]))
        self.starts[lo:hi], self.ends[lo:hi] = [merged[0]], [merged[1]]
        return new, owner

    def covered(self, start: int, end: int) -> int:
        """Bytes of ``[start, end)`` some tensor uses."""
        lo, hi = bisect_right(self.ends, start), bisect_left(self.starts, end)
        spans = zip(self.starts[lo:hi], self.ends[lo:hi], strict=True)
        return sum(max(0, min(e, end) - max(s, start)) for s, e in spans)

    def _first_owner(self, start: int, end: int) -> str | None:
        i = bisect_right(self.segment_ends, start)
        if i < len(self.owners) and self.segment_starts[i] < end:
            return self.owners[i]
        return None

    def _label(self, start: int, end: int, name: str) -> None:
        i = bisect_left(self.segment_starts, start)
        self.segment_starts.insert(i, start)
        self.segment_ends.insert(i, end)
        self.owners.insert(i, name)


def _scan_zeros(source: TensorSource, infos: list[TensorInfo], advance: Advance) -> dict[str, int]:
    """Zeros per tensor; names that view the same bytes the same way (ties, 20,000 aliases of one tensor
    in a hostile file) are counted once."""
    names = {info.name for info in infos}
    zeros: dict[str, int] = {}
    seen: dict[tuple, Any] = {}
    for info in infos:
        mask = info.name[: -len("_orig")] + "_mask" if info.name.endswith("_orig") else None
        if mask in names:
            # The zeros of the weight prune would give (orig * mask), and the mask's own, in one pass.
            key = (_view(info), _view(source.info(mask)))
            if key not in seen:
                seen[key] = count_masked_zeros(source.get(info.name), source.get(mask))
            zeros[info.name], zeros[mask] = seen[key]
        elif info.name not in zeros:  # a mask is counted with its weight_orig
            if _view(info) not in seen:
                seen[_view(info)] = count_zeros(source.get(info.name))
            zeros[info.name] = seen[_view(info)]
        advance(info.nbytes)
    return zeros


def _view(info: TensorInfo) -> tuple:
    """What makes two names the same values: the same bytes seen with the same shape, strides and codec."""
    return (info.storage, info.storage_offset, info.shape, info.stride, info.dtype, info.codec)


def _buckets(stats: list[TensorStat], key: Callable[[TensorStat], str]) -> list[Bucket]:
    counts: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for s in stats:
        counts[key(s)][0] += 1
        counts[key(s)][1] += s.stored_bytes
    return sorted((Bucket(k, n, b) for k, (n, b) in counts.items()), key=lambda b: b.bytes, reverse=True)


def _categories(stats: list[TensorStat], other: dict[str, int], objects: int) -> list[Bucket]:
    by_name = {b.name: b for b in _buckets(stats, lambda s: s.category)}
    counts = {"non_tensor": objects}
    for name, nbytes in other.items():
        by_name[name] = Bucket(name, counts.get(name, 0), nbytes)
    return [by_name[name] for name in CATEGORIES if name in by_name and by_name[name].bytes]


def prefix_tree(stats: list[TensorStat], depth: int, max_children: int = 12) -> list[PrefixNode]:
    """Bytes per dotted name prefix, to ``depth`` levels, largest first; small siblings are summed up."""
    totals: dict[tuple[str, ...], list[int]] = defaultdict(lambda: [0, 0])
    for s in stats:
        parts = tuple(s.name.split("."))
        for level in range(1, min(depth, len(parts)) + 1):
            totals[parts[:level]][0] += 1
            totals[parts[:level]][1] += s.stored_bytes
    children: dict[tuple[str, ...], list[tuple[str, ...]]] = defaultdict(list)
    for key in totals:
        children[key[:-1]].append(key)
    nodes: list[PrefixNode] = []

    def walk(parent: tuple[str, ...]) -> None:
        kids = sorted(children[parent], key=lambda k: totals[k][1], reverse=True)
        for key in kids[:max_children]:
            nodes.append(PrefixNode(".".join(key), len(key), *totals[key]))
            walk(key)
        if len(kids) > max_children:
            rest = kids[max_children:]
            label = ".".join((*parent, f"({len(rest)} more)"))
            nodes.append(
                PrefixNode(
                    label, len(parent) + 1, sum(totals[k][0] for k in rest), sum(totals[k][1] for k in rest)
                )
            )

    walk(())
    return nodes


def _notes(stats: list[TensorStat], unreferenced: int, scanned: bool) -> list[str]:
    notes = []
    masks = [s for s in stats if s.category == "pruning_leftovers"]
    if masks:
        notes.append(
            f"{len(masks)} pruning mask(s) from torch.nn.utils.prune: the file stores each pruned weight "
            "twice (weight_orig and weight_mask); finalizing keeps one"
        )
    if unreferenced:
        notes.append(
            f"{unreferenced} bytes of storage are not used by any tensor: a saved view keeps its whole base "
            "tensor (save tensor.clone() instead)"
        )
    if not scanned:
        notes.append("data not scanned: no sparsity or duplicate figures (run without --no-scan)")
    notes.append(
        "savings are the bytes `slimtorch shrink` writes for each action (its codecs' sizes; values that "
        "round to zero in fp16/int8 make the real file slightly smaller)"
    )
    return notes
