"""A checkpoint's non-tensor values (a config, an epoch, a model's constructor arguments) as plain JSON data.

Training checkpoints keep more than tensors: chgnet needs ``model.model_args`` to rebuild its model,
torchfcpe keeps its ``config_dict``, Lightning its ``hyper_parameters``. :func:`plain_objects` keeps what JSON
holds exactly (None, bool, int, float, str, and lists, tuples and string-keyed dicts of them; tuples come
back as lists) and names everything it leaves out and why; the slim format stores the kept values in its
metadata (``objects``) and :func:`slimtorch.load_objects` gives them back, nested as in the original.
"""

from __future__ import annotations

import itertools
import json
import re
import sys
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Any

import torch

MAX_JSON_BYTES = 1 << 20
"""Most JSON the values of one checkpoint may take; the largest subtrees beyond it are left out."""
MAX_DEPTH = 32
MAX_VALUES = 500_000  # per top-level entry (1 MiB of JSON holds fewer): bounds walks over shared lists
MAX_TOTAL_VALUES = 4 * MAX_VALUES
"""Values one walk visits over all entries, a string counting a value per 16 characters: entries that
share one big list (memo references in a pickle) would otherwise be walked, and then written as JSON, once
per reference."""
_SHOWN_ITEMS = 8  # items of a container that short_repr shows
MAX_LISTED = 100  # names of left-out values listed; the rest are counted
# Top-level entries that only training needs (what shrink drops with the optimizer): optimizer and scheduler
# states, gradient scalers (``scaler``, ``grad_scaler``: not a ``data_scaler``, which a model's outputs are
# scaled back with), random generator states, Lightning's loops and callbacks.
TRAINING_KEY = re.compile(
    r"optim|sched|^(grad_|amp_)?scaler$|(^|_)rng($|_)|random_state|^loops$|^callbacks$|(^|_)amp(_|$)",
    re.IGNORECASE,
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


_Name = tuple  # (parent _Name or None, key): a dotted name built only if it is listed


class _Walk:
    """One pass over an unpickled tree; collects what it leaves out by dotted name (as ``inspect`` names).

    Linear in the tree, shared lists included: every value visited is charged to a budget of
    :data:`MAX_VALUES` per top-level entry and :data:`MAX_TOTAL_VALUES` in all, and names are built only
    for the values it lists.
    """

    def __init__(self) -> None:
        self.dropped: dict[str, str] = {}
        self._open: set[int] = set()
        self._only_tensors: dict[int, bool] = {}
        self._budget = 0
        self._left = MAX_TOTAL_VALUES
        self.unlisted = 0

    def entry(self, key: Any, value: Any) -> Any:
        self._budget = start = min(MAX_VALUES, max(self._left, 0))
        try:
            if not isinstance(key, str):
                return self._drop((None, key), value, f"key {short_repr(key)} is not a string")
            return self.value((None, key), value, 1)
        finally:
            self._left -= start - self._budget

    def value(self, name: _Name, value: Any, depth: int) -> Any:
        self._budget -= 1
        if isinstance(value, torch.Tensor):
            return _MISSING
        if isinstance(value, int) and value.bit_length() > 10_000:
            return self._drop(name, value, "an integer too long for JSON")  # Python refuses to print it
        cost = _json_cost(value)
        if cost > self._budget:
            return self._drop(
                name, value, f"too large ({MAX_VALUES:,} values per entry, {MAX_TOTAL_VALUES:,} in all)"
            )
        self._budget -= cost
        if value is None or isinstance(value, (bool, str)):
            return value if type(value) in (type(None), bool, str) else _builtin(value)
        numpy = _numpy_value(value)  # first: numpy's float64 and bool_ pass for float and int
        if numpy is not None:
            return self._numpy(name, value, numpy)
        if isinstance(value, (int, float)):
            return _builtin(value)
        if _is_placeholder(value):  # its class was never built: its name, and its state where it is plain
            state = self.value(name, dict(value.__dict__), depth + 1) if value.__dict__ else {}
            return {PLACEHOLDER: type(value).source, "state": {} if state is _MISSING else state}
        if not isinstance(value, (dict, list, tuple)):
            kind = type(value)
            module = "" if kind.__module__ == "builtins" else f"{kind.__module__}."
            return self._drop(name, value, f"{module}{kind.__qualname__}")
        if len(value) > self._budget:
            return self._drop(
                name, value, f"too many values ({MAX_VALUES:,} per entry, {MAX_TOTAL_VALUES:,} in all)"
            )
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

    def _numpy(self, name: _Name, value: Any, kind: str) -> Any:
        """A numpy array, scalar or dtype as a tagged dict (:data:`NUMPY_ARRAY`), read back by
        :func:`restore_values`; numbers only (an array of objects or text is left out, named)."""
        if kind == "dtype":
            return {NUMPY_DTYPE: value.str}
        if value.dtype.kind not in "biuf":
            return self._drop(name, value, f"a numpy {kind} of {value.dtype} (only numbers are kept)")
        if kind == "scalar":
            return {NUMPY_SCALAR: value.dtype.str, "value": value.item()}
        if value.size > self._budget:
            return self._drop(
                name, value, f"too large ({MAX_VALUES:,} values per entry, {MAX_TOTAL_VALUES:,} in all)"
            )
        self._budget -= value.size
        return {NUMPY_ARRAY: value.dtype.str, "shape": list(value.shape), "values": value.ravel().tolist()}

    def _dict(self, name: _Name, value: dict, depth: int) -> Any:
        out = {}
        for key, child in value.items():
            child_name = (name, key)
            kept = self.value(child_name, child, depth + 1)
            if kept is _MISSING:
                continue
            if not isinstance(key, str):
                self._note(child_name, f"key {short_repr(key)} is not a string")
                continue
            out[key] = kept
        return _MISSING if value and not out else out  # a dict of tensors only is not a value

    def _list(self, name: _Name, value: list | tuple, depth: int) -> Any:
        noted = len(self.dropped)
        items = [self.value((name, i), child, depth + 1) for i, child in enumerate(value)]
        missing = sum(item is _MISSING for item in items)
        if missing == 0:
            return items
        if missing < len(items):
            # Leaving out some items would shift the others' positions: leave out the whole list.
            for key in list(self.dropped)[noted:]:
                del self.dropped[key]
            self._note(name, "a list mixing values with tensors or with what is not plain data")
        return _MISSING  # a list of tensors (or of state dicts) only is not a value

    def _drop(self, name: _Name, value: Any, why: str) -> Any:
        if id(value) not in self._only_tensors:
            self._only_tensors[id(value)] = _holds_only_tensors(value)
        if not self._only_tensors[id(value)]:
            self._note(name, why)
        return _MISSING

    def _note(self, name: _Name, why: str) -> None:
        if len(self.dropped) < MAX_LISTED:
            self.dropped[_dotted(name)] = why
        else:
            self.unlisted += 1


NUMPY_ARRAY = "__numpy_array__"
"""The key of a numpy array kept as plain data: ``{NUMPY_ARRAY: dtype, "shape": [...], "values": [...]}``
(dtype as numpy spells it with its byte order, ``"<f4"``; values flat, in C order)."""
NUMPY_SCALAR = "__numpy_scalar__"
"""``{NUMPY_SCALAR: dtype, "value": number}``: a numpy scalar (``np.float32(0.5)``) kept as plain data."""
NUMPY_DTYPE = "__numpy_dtype__"
"""``{NUMPY_DTYPE: dtype}``: a numpy dtype kept as plain data."""
PLACEHOLDER = "__placeholder__"
"""``{PLACEHOLDER: "module.Class", "state": {...}}``: an object slimtorch did not build (a class off the
unpickler's allow-list, kept as an inert placeholder), with what of its state is plain data."""


def _numpy_value(value: Any) -> str | None:
    """``"array"``, ``"scalar"`` or ``"dtype"`` for a numpy value; None for anything else (numpy is asked
    only where it is imported: without it, no value can be one of its)."""
    np = sys.modules.get("numpy")
    if np is None:
        return None
    if isinstance(value, np.ndarray):
        return "array"
    if isinstance(value, np.generic):
        return "scalar"
    if isinstance(value, np.dtype):
        return "dtype"
    return None


def _is_placeholder(value: Any) -> bool:
    placeholder = getattr(sys.modules.get("slimtorch.sources.pickled"), "Placeholder", None)
    return placeholder is not None and isinstance(value, placeholder)


def restore_values(values: Any) -> Any:
    """The values :func:`plain_objects` kept, with numpy's arrays, scalars and dtypes made numpy's again
    (placeholders stay dicts: their classes were never built). A new tree; ``values`` is unchanged.

    Example:
        >>> restore_values({"mean": {NUMPY_ARRAY: "<f4", "shape": [2], "values": [0.5, 1.0]}})
        {'mean': array([0.5, 1. ], dtype=float32)}
    """
    if isinstance(values, list):
        return [restore_values(item) for item in values]
    if not isinstance(values, dict):
        return values
    keys = set(values)
    if keys in ({NUMPY_ARRAY, "shape", "values"}, {NUMPY_SCALAR, "value"}, {NUMPY_DTYPE}):
        import numpy as np

        try:
            dtype = np.dtype(values[(keys & {NUMPY_ARRAY, NUMPY_SCALAR, NUMPY_DTYPE}).pop()])
            if keys == {NUMPY_DTYPE}:
                return dtype
            if dtype.kind in "biuf":  # numbers only, as they were written: no void of a gigabyte a value
                if NUMPY_SCALAR in keys:
                    return dtype.type(values["value"])
                return np.array(values["values"], dtype=dtype).reshape(values["shape"])
        except (TypeError, ValueError, OverflowError):
            pass
        return values  # not one of ours after all: a user's dict with such keys stays as it is
    return {key: restore_values(child) for key, child in values.items()}


def _json_cost(value: Any) -> int:
    """Values' worth of JSON a long string or integer makes, charged each time it is met (it may be shared
    by every entry of the checkpoint)."""
    if isinstance(value, str):
        return len(value) // 16
    if isinstance(value, int):
        return value.bit_length() // 64
    return 0


def _dotted(name: _Name) -> str:
    """``(((None, "a"), "b"), 0)`` -> ``"a.b.0"``; keys cut to 200 characters (a listing, not a lookup)."""
    keys = []
    while name is not None:
        name, key = name
        keys.append(key[:200] if isinstance(key, str) else short_repr(key, 200))
    return ".".join(reversed(keys))


def short_repr(value: Any, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters, in time and memory bounded by ``limit`` whatever the
    value: a 400 MB bytearray or a list of a million items is never printed whole, nor an integer Python
    refuses to print, nor more than three levels of nesting.

    Example:
        >>> short_repr(list(range(10**6)), 40)
        '[0, 1, 2, 3, 4, 5, 6, 7, ...]'
    """
    text = _bounded_repr(value, limit, 3)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _bounded_repr(value: Any, limit: int, depth: int) -> str:
    if isinstance(value, (str, bytes, bytearray)):
        return repr(value[:limit]) + ("..." if len(value) > limit else "")
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 256:
        return f"<an integer of {value.bit_length():,} bits>"
    if isinstance(value, (list, tuple, set, frozenset, dict)):
        return _container_repr(value, limit, depth)
    if _numpy_value(value) == "array":  # numpy's own repr spans lines
        shape = "x".join(map(str, value.shape)) or "scalar"
        first = _container_repr(value.ravel()[: _SHOWN_ITEMS + 1].tolist(), limit, 1)
        return f"array({value.dtype} {shape}: {first})"
    state = getattr(value, "__dict__", None)
    if isinstance(state, dict):  # an instance's own __repr__ may print all of it (argparse.Namespace does)
        if depth <= 0:
            return f"<{type(value).__name__}>"
        fields = [f"{k}={_bounded_repr(v, limit, depth - 1)}" for k, v in itertools.islice(state.items(), 4)]
        return f"{type(value).__name__}({', '.join(fields)}{', ...' if len(state) > 4 else ''})"[:limit]
    return repr(value)


def _container_repr(value: Any, limit: int, depth: int) -> str:
    if depth <= 0:
        return f"<{type(value).__name__} of {len(value):,} items>"
    shown = itertools.islice(value.items() if isinstance(value, dict) else value, _SHOWN_ITEMS)
    if isinstance(value, dict):
        parts = [
            f"{_bounded_repr(k, limit, depth - 1)}: {_bounded_repr(v, limit, depth - 1)}" for k, v in shown
        ]
    else:
        parts = [_bounded_repr(item, limit, depth - 1) for item in shown]
    body = ", ".join([part[:limit] for part in parts] + (["..."] if len(value) > _SHOWN_ITEMS else []))
    kind = type(value)
    if kind is list:
        return f"[{body}]"
    if kind is tuple:
        return f"({body}{',' if len(value) == 1 else ''})"
    if kind in (dict, set):
        return f"{{{body}}}" if value or kind is dict else "set()"
    brackets = "[]" if isinstance(value, (list, tuple)) else "{}"
    return f"{kind.__name__}({brackets[0]}{body}{brackets[1]})"


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
