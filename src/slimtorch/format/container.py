"""The safetensors container every slim file is: an 8-byte header length, a JSON header, then the tensors'
bytes back to back. Its dtype names and its header, read within a budget, are what both the writer and the
readers need.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import torch

from slimtorch.errors import FormatError
from slimtorch.format.untrusted import load_json

# The safetensors reference implementation refuses headers above 100 MB; so do we.
MAX_HEADER_BYTES = 100_000_000

DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "U16": torch.uint16,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I32": torch.int32,
    "U32": torch.uint32,
    "F32": torch.float32,
    "I64": torch.int64,
    "U64": torch.uint64,
    "F64": torch.float64,
    "C64": torch.complex64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu,
}


def read_metadata(path: Path) -> dict:
    """The ``__metadata__`` of a safetensors file ({} when it has none)."""
    header, _, _ = read_header(path)
    metadata = header.get("__metadata__") or {}
    return metadata if isinstance(metadata, dict) else {}


def read_header(path: Path) -> tuple[dict, int, int]:
    """The header of a safetensors file, its length checked against the file before it is read; returns
    (header, where the data starts, the file's size)."""
    size = os.path.getsize(path)
    with open(path, "rb") as stream:
        prefix = stream.read(8)
        if len(prefix) != 8:
            raise FormatError(path, "too short to be a safetensors file")
        (length,) = struct.unpack("<Q", prefix)
        if length > MAX_HEADER_BYTES:
            raise FormatError(path, f"header claims {length} bytes, over the {MAX_HEADER_BYTES} byte limit")
        if length > size - 8:
            raise FormatError(path, f"header claims {length} bytes but the file has {size} (truncated file)")
        raw = stream.read(length)
    header = load_json(path, raw, "header (not valid JSON)")
    if not isinstance(header, dict):
        raise FormatError(path, "the header is not a JSON object")
    return header, 8 + length, size
