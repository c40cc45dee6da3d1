"""A checkpoint's non-tensor values (a config, an epoch, a model's constructor arguments) as plain JSON data.

Training checkpoints keep more than tensors: chgnet needs ``model.model_args`` to rebuild its model,
torchfcpe keeps its ``config_dict``, Lightning its ``hyper_parameters``. :func:`plain_objects` keeps what JSON
holds exactly (None, bool, int, float, str, and lists, tuples and string-keyed dicts of them; tuples come
back as lists) and names everything it leaves out and why; the slim format stores the kept values in its
metadata (``objects``) and :func:`load_objects` gives them back, nested as in the original.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Any

import torch

MAX_JSON_BYTES = 1 << 20
"""Most JSON the values of one checkpoint may take; the largest subtrees beyond it are left out."""
MAX_DEPTH = 32
MAX_VALUES = 500_000  # per top-level entry (1 MiB of JSON holds fewer): bounds walks over shared lists
MAX_LISTED = 100  # names of left-out values listed; the rest are counted
# Top-level entries that only training needs (what shrink drops with the optimizer): optimizer and scheduler
# states, gradient scalers, random generator states, Lightning's loops and callbacks.
TRAINING_KEY = re.compile(
    r"optim|sched|scaler|(^|_)rng($|_)|random_state|^loops$|^callbacks$|(^|_)amp(_|$)", re.IGNORECASE
)
_MISSING = object()


@dataclass(frozen=True)
class PlainObjects:
    """The plain-data values of a checkpoint and the dotted names of those left out, with the reason."""

    values: dict[str, Any]
    dropped: dict[str, str]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def plain_objects(
    tree: Any,
    *,
    leave_out: Callable[[str], bool] = lambda key: False,
    max_bytes: int = MAX_JSON_BYTES,
) -> PlainObjects:
    """The non-tensor values of an unpickled checkpoint that JSON keeps exactly; tensors are left out.

    ``leave_out(key)`` drops a top-level entry without listing it (training state the caller drops with its
    tensors). Anything else left out is listed in ``dropped``: class instances, bytes, sets, dict keys that
    are not strings, self references, nesting deeper than :data:`MAX_DEPTH`, a list mixing tensors and
    values, and, beyond ``max_bytes`` of JSON, the largest entries.

    Example:
        >>> plain_objects({"model": {"fc.weight": torch.ones(2)}, "epoch": 3, "ids": {1, 2}})
        PlainObjects(values={'epoch': 3}, dropped={'ids': 'set'})
    """
    walk = _Walk()
    values: dict[str, Any] = {}
    if isinstance(tree, dict):
        for key, child in tree.items():
            if isinstance(key, str) and leave_out(key):
                continue
            value = walk.entry(key, child)
            if value is not _MISSING:
                values[key] = value
    elif tree is not None and walk.entry("<root>", tree) is not _MISSING:
        walk.dropped["<root>"] = f"the checkpoint is a {type(tree).__name__}, so its values have no names"
    if walk.unlisted:
        walk.dropped["..."] = f"{walk.unlisted:,} more values left out"
    _fit(values, max_bytes, walk.dropped)
    return PlainObjects(values, walk.dropped)


def load_objects(path: str | os.PathLike[str], *, allow_globals: Iterable[str] = ()) -> dict[str, Any]:
    """The non-tensor values of a checkpoint, nested as saved: what ``slimtorch shrink`` kept in a slim
    file, or the plain data of a torch.save file (what :func:`plain_objects` keeps). Formats without
    such values (safetensors, TorchScript) give ``{}``.

    Example:
        >>> import slimtorch
        >>> slimtorch.shrink("chgnet.pth.tar", "chgnet.safetensors")  # doctest: +SKIP
        >>> slimtorch.load_objects("chgnet.safetensors")["model"]["model_args"]["n_conv"]  # doctest: +SKIP
        4
    """
    from slimtorch.io.readers import open_checkpoint  # the readers import this module's neighbours

    with open_checkpoint(path, allow_globals=allow_globals) as source:
        tree = source.tree
    return plain_objects(tree).values


class _Walk:
    """One pass over an unpickled tree; collects what it leaves out by dotted name (as ``inspect`` names)."""

    def __init__(self) -> None:
        self.dropped: dict[str, str] = {}
        self._open: set[int] = set()
        self._budget = 0
        self.unlisted = 0

    def entry(self, key: Any, value: Any) -> Any:
        self._budget = MAX_VALUES
        name = str(key)
        if not isinstance(key, str):
            return self._drop(name, value, f"key {key!r} is not a string")
        return self.value(name, value, 1)

    def value(self, name: str, value: Any, depth: int) -> Any:
        self._budget -= 1
        if isinstance(value, torch.Tensor):
            return _MISSING
        if value is None or isinstance(value, (bool, str)):
            return value if type(value) in (type(None), bool, str) else _builtin(value)
        if isinstance(value, int) and value.bit_length() > 10_000:
            return self._drop(name, value, "an integer too long for JSON")  # Python refuses to print it
        if isinstance(value, (int, float)):
            return _builtin(value)
        if not isinstance(value, (dict, list, tuple)):
            kind = type(value)
            module = "" if kind.__module__ == "builtins" else f"{kind.__module__}."
            return self._drop(name, value, f"{module}{kind.__qualname__}")
        if len(value) > self._budget:
            return self._drop(name, value, f"more than {MAX_VALUES:,} values")
        if id(value) in self._open:
            return self._drop(name, value, "refers to itself")
        if depth > MAX_DEPTH:
            return self._drop(name, value, f"nested deeper than {MAX_DEPTH} levels")
        self._open.add(id(value))
        try:
            return (
                self._dict(name, value, depth) if isinstance(value, dict) else self._list(name, value, depth)
            )
        finally:
            self._open.discard(id(value))

    def _dict(self, name: str, value: dict, depth: int) -> Any:
        out = {}
        for key, child in value.items():
            child_name = f"{name}.{key}"
            kept = self.value(child_name, child, depth + 1)
            if kept is _MISSING:
                continue
            if not isinstance(key, str):
                self._note(child_name, f"key {key!r} is not a string")
                continue
            out[key] = kept
        return _MISSING if value and not out else out  # a dict of tensors only is not a value

    def _list(self, name: str, value: list | tuple, depth: int) -> Any:
        noted = len(self.dropped)
        items = [self.value(f"{name}.{i}", child, depth + 1) for i, child in enumerate(value)]
        missing = sum(item is _MISSING for item in items)
        if missing == 0:
            return items
        if missing < len(items):
            # Leaving out some items would shift the others' positions: leave out the whole list.
            for key in list(self.dropped)[noted:]:
                del self.dropped[key]
            self._note(name, "a list mixing values with tensors or with what is not plain data")
        return _MISSING  # a list of tensors (or of state dicts) only is not a value

    def _drop(self, name: str, value: Any, why: str) -> Any:
        if not _holds_only_tensors(value):
            self._note(name, why)
        return _MISSING

    def _note(self, name: str, why: str) -> None:
        if len(self.dropped) < MAX_LISTED:
            self.dropped[name] = why
        else:
            self.unlisted += 1


def _holds_only_tensors(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, dict):
        return bool(value) and all(isinstance(v, torch.Tensor) for v in value.values())
    return False


def _builtin(value: Any) -> Any:
    """An int, float, str or bool subclass (an IntEnum, numpy's float64) as the builtin JSON writes."""
    for kind in (bool, int, float, str):
        if isinstance(value, kind):
            return kind(value)
    return value


def _json_size(value: Any) -> int:
    return len(json.dumps(value, separators=(",", ":")))


def _fit(values: dict[str, Any], max_bytes: int, dropped: dict[str, str]) -> None:
    """Leave out the largest entries until the values fit in ``max_bytes`` of JSON.

    The search follows the largest entry down while one of its own entries alone is larger than the excess,
    so a long training history goes, not the whole dict around it.
    """
    while (excess := _json_size(values) - max_bytes) > 0:
        node, name = values, ""
        while True:
            sizes = {key: _json_size(child) for key, child in node.items()}
            key = max(sizes, key=sizes.__getitem__)
            child = node[key]
            if not (isinstance(child, dict) and child and max(map(_json_size, child.values())) > excess):
                break
            node, name = child, f"{name}.{key}" if name else key
        for key in sorted(sizes, key=sizes.__getitem__, reverse=True):
            dropped[f"{name}.{key}" if name else key] = (
                f"too large: {sizes[key]:,} bytes of JSON, and all values together may take {max_bytes:,}"
            )
            del node[key]
            excess -= sizes[key]
            if excess <= 0:
                break


def model_objects(tree: Any, dropped_tensors: Iterable[str], *, keep_training: bool = False) -> PlainObjects:
    """What shrink keeps beside a model's tensors: the plain data of every top-level entry except training
    state (entries whose tensors it dropped as optimizer or training state, or named like
    :data:`TRAINING_KEY`), unless ``keep_training``.

    Example:
        >>> model_objects({"model_args": {"depth": 4}, "lr_scheduler": {"last_epoch": 9}}, []).values
        {'model_args': {'depth': 4}}
    """
    if keep_training:
        return plain_objects(tree)
    roots = {name.split(".", 1)[0] for name in dropped_tensors}
    return plain_objects(tree, leave_out=lambda key: key in roots or bool(TRAINING_KEY.search(key)))
