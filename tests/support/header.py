"""Small slim checkpoints of each kind and single-bit flips of them (``tests/test_header_integrity.py``,
``benchmarks.bitflips``)."""

from __future__ import annotations

import random
import struct
from dataclasses import dataclass, field
from pathlib import Path

import torch

import slimtorch

KINDS = ("lossless", "int8", "int4", "sharded")
SCHEMES = {"int8": "int8-weight", "int4": "int4-weight"}
"""The writers' ``quantize`` of each quantized kind."""


# -- templates and flips (benchmarks.bitflips runs the same with more flips) --------------------------------
def small_state() -> dict[str, torch.Tensor]:
    """Every storage form in tens of KB: codes (int8 or int4), codes stored sparsely, as is, an integer."""
    generator = torch.Generator().manual_seed(0)
    pruned = torch.randn(128, 128, generator=generator)  # sparse pays from 4 KiB saved: int8 codes save 12
    pruned[torch.rand(128, 128, generator=generator) < 0.9] = 0
    return {
        "fc.weight": torch.randn(64, 64, generator=generator),
        "pruned.weight": pruned,
        "norm.weight": torch.randn(64, generator=generator),
        "steps": torch.tensor(3),
    }


def slim_template(folder: Path, kind: str) -> Path:
    """A small slim checkpoint of ``kind`` (one of :data:`KINDS`) in ``folder``."""
    if kind == "sharded":
        state = {
            f"layer{i}.weight": torch.randn(64, 64, generator=torch.Generator().manual_seed(i))
            for i in range(3)
        }
        path = folder / "sharded"
        slimtorch.save(state, path, quantize="int8-weight", shard_bytes=3000)
        return path
    path = folder / f"{kind}.safetensors"
    slimtorch.save(small_state(), path, quantize=SCHEMES.get(kind))
    return path


@dataclass
class FlipCounts:
    """What single-bit flips did: found (a FormatError), harmless (the same tensors), silent (a change)."""

    detected: int = 0
    harmless: int = 0
    silent: list[str] = field(default_factory=list)


def flip_bits(path: Path, flips: int, rng: random.Random) -> FlipCounts:
    """Flip one random bit at a time in the checkpoint at ``path`` and load it; the file is restored after
    each. Every other flip lands in a header (or the index), where the parts' checksums cannot see it."""
    reference = slimtorch.load(path).tensors
    files = [path] if path.is_file() else sorted(path.iterdir())
    originals = {file: file.read_bytes() for file in files}
    headers = {file: _header_end(file, data) for file, data in originals.items()}
    counts = FlipCounts()
    for i in range(flips):
        file, offset = _pick(originals if i % 2 else headers, rng)
        bit = rng.randrange(8)
        damaged = bytearray(originals[file])
        damaged[offset] ^= 1 << bit
        file.write_bytes(damaged)
        try:
            loaded = slimtorch.load(path).tensors
        except slimtorch.FormatError:
            counts.detected += 1
        else:
            if _same(loaded, reference):
                counts.harmless += 1
            else:
                counts.silent.append(f"{file.name} byte {offset} bit {bit}")
        finally:
            file.write_bytes(originals[file])
    return counts


def _header_end(file: Path, data: bytes) -> bytes:
    """The header bytes (length and JSON) of a safetensors file; all of an index."""
    if file.suffix != ".safetensors":
        return data
    return data[: 8 + struct.unpack("<Q", data[:8])[0]]


def _pick(regions: dict[Path, bytes], rng: random.Random) -> tuple[Path, int]:
    """A file and a byte offset, uniform over the bytes of ``regions`` together."""
    spot = rng.randrange(sum(len(data) for data in regions.values()))
    for file, data in regions.items():
        if spot < len(data):
            return file, spot
        spot -= len(data)
    raise AssertionError("unreachable")


def _same(loaded: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> bool:
    return list(loaded) == list(reference) and all(
        loaded[name].dtype == tensor.dtype
        and loaded[name].shape == tensor.shape
        and torch.equal(loaded[name], tensor)
        for name, tensor in reference.items()
    )
