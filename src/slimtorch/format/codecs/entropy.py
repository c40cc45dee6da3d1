"""The optional entropy stage: zstandard over each stored part, kept only where it pays.

It runs last, on the parts the other stages produced (a bitmask, int8 codes, float values), and keeps a
part compressed only when that saves at least :data:`MIN_SAVING` of its bytes. Needs the ``zstandard``
package (``pip install 'slimtorch[zstd]'``).

A compressed part is stored as uint8; the stage records each one's original dtype and shape. Decoding
refuses a part that claims to expand more than :data:`MAX_RATIO` times, so a small hostile file cannot make
the loader allocate without bound.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from slimtorch.format.codecs.base import CodecError, parse_dtype, parse_shape, require
from slimtorch.format.source import dtype_name

MIN_SAVING = 0.05
MAX_RATIO = 256
LEVEL = 3


def _zstd():
    try:
        import zstandard
    except ImportError:
        raise CodecError(
            "the entropy stage needs the zstandard package: pip install 'slimtorch[zstd]'"
        ) from None
    return zstandard


def available() -> bool:
    try:
        _zstd()
    except CodecError:
        return False
    return True


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().data


def compress_parts(
    parts: Mapping[str, torch.Tensor], level: int = LEVEL
) -> tuple[dict[str, torch.Tensor], dict]:
    zstd = _zstd()
    compressor = zstd.ZstdCompressor(level=level, write_content_size=True)
    out, compressed = {}, {}
    for role, tensor in parts.items():
        nbytes = tensor.numel() * tensor.element_size()
        packed = compressor.compress(_bytes_of(tensor)) if nbytes else b""
        if nbytes and len(packed) <= nbytes * (1 - MIN_SAVING) and len(packed) * MAX_RATIO >= nbytes:
            out[role] = torch.frombuffer(bytearray(packed), dtype=torch.uint8)
            compressed[role] = {"dtype": dtype_name(tensor.dtype), "shape": list(tensor.shape)}
        else:
            out[role] = tensor
    return out, {"codec": "zstd", "parts": compressed}


def decompress_parts(parts: Mapping[str, torch.Tensor], stage: Mapping) -> dict[str, torch.Tensor]:
    listed = stage.get("parts")
    require(isinstance(listed, dict), "zstd stage lists no parts")
    out = dict(parts)
    if not listed:
        return out
    zstd = _zstd()
    decompressor = zstd.ZstdDecompressor()
    for role, spec in listed.items():
        require(role in parts and isinstance(spec, dict), f"compressed part {role!r} is missing")
        dtype, shape = parse_dtype(spec.get("dtype")), parse_shape(spec.get("shape"))
        expected = math.prod(shape) * dtype.itemsize
        blob = parts[role]
        require(blob.dtype == torch.uint8, f"compressed part {role!r} is not uint8")
        require(expected <= blob.numel() * MAX_RATIO, f"compressed part {role!r} claims an absurd size")
        # compress_parts never compresses an empty part, and max_output_size=0 would mean "no limit".
        require(expected > 0, f"compressed part {role!r} claims to be empty")
        try:
            # A frame may declare its own content size, and zstandard allocates that, whatever
            # max_output_size says: check it first (-1 = not declared, then max_output_size applies).
            declared = zstd.frame_content_size(_bytes_of(blob))
            require(declared in (-1, expected), f"compressed part {role!r} declares {declared} bytes")
            raw = decompressor.decompress(_bytes_of(blob), max_output_size=expected)
        except zstd.ZstdError as exc:
            raise CodecError(f"compressed part {role!r} is corrupt ({exc})") from exc
        require(len(raw) == expected, f"compressed part {role!r} decompresses to the wrong size")
        out[role] = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape)
    return out
