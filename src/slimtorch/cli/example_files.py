"""``export --example``: the example input from files the user gives, read within a budget and checked to
be numbers before torch sees them, so that a hostile or mistaken file is one line naming it.

- ``.npy`` files (one per input, in the forward's order) and one ``.npz`` (inputs by name) are read by
  :mod:`slimtorch.format.numpy_files`: headers and sizes checked before anything is allocated;
- one ``.json`` file, at most :data:`MAX_JSON_BYTES`: an object ``{"input_ids": [[101, 2023]]}``, or a
  list (the only input, or one entry per input). Every value is a number or a (rectangular) list of
  them: a string, a boolean, an object or null is refused, naming the input.

Arrays must hold numbers (booleans, integers, floats); they come back in this machine's byte order.

Example:
    >>> read_example(["batch.npz"], ["x"])["x"].shape  # doctest: +SKIP
    (8, 6)
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from slimtorch.errors import FormatError, SlimtorchError
from slimtorch.format.numpy_files import read_npy, read_npz
from slimtorch.format.untrusted import load_json

MAX_JSON_BYTES = 16 * 2**20
"""the largest JSON example: parsed, every number is a Python object (about 30 bytes for 3 of text), so
16 MiB of JSON is some 200 MiB in memory; larger inputs belong in an .npy or .npz"""
NUMBER_KINDS = "biuf"
"""numpy kinds an input may hold: booleans, signed and unsigned integers, floats"""
INT64 = (-(2**63), 2**63 - 1)


def read_example(files: Sequence[str], names: Sequence[str]) -> dict[str, np.ndarray]:
    """The example's arrays by input name: one ``.npz`` or ``.json`` (by name, or a JSON list in order),
    else one ``.npy`` per input in the order of ``names`` (the forward's arguments)."""
    if len(files) == 1 and files[0].endswith(".npz"):
        arrays = read_npz(files[0])
    elif len(files) == 1 and files[0].endswith(".json"):
        arrays = _json_example(Path(files[0]), names)
    else:
        if len(files) > len(names):
            raise SlimtorchError(
                f"{files[len(names)]}: the model takes {len(names)} input(s) ({', '.join(names)}); "
                f"got {len(files)} files"
            )
        arrays = {name: read_npy(path) for name, path in zip(names, files, strict=False)}
    where = {name: files[0] if len(files) == 1 else files[i] for i, name in enumerate(arrays)}
    return {name: _numbers(Path(where[name]), name, array) for name, array in arrays.items()}


def _numbers(path: Path, name: str, array: np.ndarray) -> np.ndarray:
    """``array`` if it holds numbers, in native byte order (what torch.from_numpy takes)."""
    if array.dtype.kind not in NUMBER_KINDS:
        raise FormatError(path, f"example {name!r} holds {array.dtype}, not numbers")
    return array.astype(array.dtype.newbyteorder("="), copy=False)


def _json_example(path: Path, names: Sequence[str]) -> dict[str, np.ndarray]:
    if path.stat().st_size > MAX_JSON_BYTES:
        raise FormatError(
            path,
            f"a JSON example of {path.stat().st_size:,} bytes, more than the {MAX_JSON_BYTES:,} read; "
            "give a larger input as .npy or .npz",
        )
    with open(path, "rb") as stream:
        document = load_json(path, stream.read(MAX_JSON_BYTES + 1), "JSON example")
    if isinstance(document, dict):
        values = document
    elif isinstance(document, list):
        values = {names[0]: document} if len(names) == 1 else dict(zip(names, document, strict=False))
    else:
        raise FormatError(
            path, f'expected an object of inputs ({{"{names[0]}": [...]}}) or a list, not {_kind(document)}'
        )
    return {str(name): _json_array(path, str(name), value) for name, value in values.items()}


def _json_array(path: Path, name: str, value: Any) -> np.ndarray:
    """A JSON value as an array: numbers, or lists of them to any depth (walked without recursion)."""
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, list):
            pending.extend(reversed(item))  # first in document order, for the message
        elif isinstance(item, bool) or not isinstance(item, (int, float)):
            raise FormatError(
                path, f"example {name!r} holds {_kind(item)}; an input is a number or lists of numbers"
            )
        elif isinstance(item, int) and not INT64[0] <= item <= INT64[1]:
            raise FormatError(path, f"example {name!r} holds {item}, beyond a 64-bit integer")
    try:
        array = np.asarray(value)
    except ValueError as exc:  # ragged lists
        raise FormatError(path, f"example {name!r} is not rectangular ({str(exc)[:160]})") from None
    if array.dtype.kind not in NUMBER_KINDS:  # lists of differing depth make an object array
        raise FormatError(path, f"example {name!r} is not rectangular (lists of differing depth)")
    return array


def _kind(value: Any) -> str:
    """What a JSON value is, for a message: a string (shown short), a boolean, an object, null."""
    if isinstance(value, str):
        return f"a string ({value[:20]!r})" if len(value) <= 20 else f"a string ({value[:20]!r}...)"
    if isinstance(value, bool):
        return f"a boolean ({str(value).lower()})"
    if isinstance(value, dict):
        return "an object"
    if value is None:
        return "null"
    return f"a {type(value).__name__}"
