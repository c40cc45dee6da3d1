"""The error boundary around untrusted bytes: whatever a parser raises on a hostile or broken file becomes a
:class:`~slimtorch.errors.FormatError` naming the file (the CLI's exit 2 line), never a traceback.

JSON from a file is parsed by :func:`load_json`, with its size and integer lengths bounded.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from slimtorch.errors import FormatError, OptionError, SlimtorchError

MAX_JSON_BYTES = 100 * 2**20
"""The largest JSON document read from a file (a safetensors header, an index, a config): 100 MiB, the
limit the safetensors library sets on its own headers."""
MAX_INT_DIGITS = 40
"""2**128 has 39 digits: no size, offset or count in a checkpoint needs more (Python itself refuses over
4300 digits, with a ValueError)."""
PARSER_ERRORS = (ValueError, TypeError, KeyError, IndexError, OverflowError, RecursionError, UnicodeError)
"""What parsers (json, struct, torch, numpy) raise on bytes they cannot make sense of."""


@contextmanager
def untrusted(path: str | Path, what: str = "") -> Iterator[None]:
    """Turn a parser's exception inside the block into a :class:`FormatError` on ``path``.

    Example:
        >>> with untrusted("model.bin", "header"):  # doctest: +SKIP
        ...     int("x" * 5000)
        FormatError: model.bin: corrupt header: invalid literal for int() ...
    """
    try:
        yield
    except SlimtorchError:
        raise
    except MemoryError as exc:
        raise FormatError(path, f"{what or 'the file'} asks for more memory than this machine has") from exc
    except PARSER_ERRORS as exc:
        detail = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        raise FormatError(path, f"corrupt {what or 'file'}: {detail}") from exc


def load_json(path: str | Path, text: str | bytes, what: str = "JSON") -> Any:
    """``json.loads`` for bytes from a file: its size bounded before parsing, integers longer than any
    size or offset needs refused, NaN/Infinity refused, and deep nesting (json's C parser stops at the
    recursion limit) a :class:`FormatError`.

    Example:
        >>> load_json("x.json", '{"a": [1, 2]}')
        {'a': [1, 2]}
    """
    if len(text) > MAX_JSON_BYTES:
        raise FormatError(path, f"{what} is {len(text):,} bytes, more than the {MAX_JSON_BYTES:,} allowed")
    with untrusted(path, what):
        return json.loads(text, parse_int=_bounded_int, parse_constant=_no_constant)


def _bounded_int(digits: str) -> int:
    if len(digits) > MAX_INT_DIGITS:
        raise ValueError(f"an integer of {len(digits)} digits")
    return int(digits)


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not JSON")


MAX_EXPANSION = 64
"""Decoded bytes may be at most this many times the bytes stored in the file (plus :data:`EXPANSION_SLACK`)
unless the user raises it with the environment variable ``SLIMTORCH_MAX_EXPANSION``: int4 codes of
float32 weights decode to 8x, sparse ones of a 99% sparse float32 tensor to about 25x, entropy coding adds
a few x; a file that claims 20,000x is a memory bomb."""
EXPANSION_SLACK = 64 * 2**20


def max_expansion() -> float:
    """:data:`MAX_EXPANSION`, or the user's ``SLIMTORCH_MAX_EXPANSION`` (a positive number)."""
    value = os.environ.get("SLIMTORCH_MAX_EXPANSION", "")
    try:
        chosen = float(value) if value else MAX_EXPANSION
    except ValueError:
        chosen = -1.0
    if not chosen > 0 or chosen != chosen:
        raise OptionError(f"SLIMTORCH_MAX_EXPANSION must be a positive number, not {value!r}")
    return chosen


def check_expansion(path: str | Path, what: str, stored: int, decoded: int) -> None:
    """Refuse, before allocating, ``decoded`` bytes made from ``stored`` bytes of the file beyond the budget.

    Example:
        >>> check_expansion("m.safetensors", "w", stored=1000, decoded=8000)  # 8x: fine
    """
    limit = stored * max_expansion() + EXPANSION_SLACK
    if decoded > limit:
        raise FormatError(
            path,
            f"{what} would decode {decoded:,} bytes from {stored:,} stored, beyond the "
            f"{max_expansion():g}x budget (a memory bomb?); if you trust the file, raise it with "
            "SLIMTORCH_MAX_EXPANSION",
        )
