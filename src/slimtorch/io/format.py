"""The slim checkpoint layout (version 1): what ``__metadata__["slimtorch"]`` says about a safetensors file.

Every slim file is a valid safetensors file. Its physical tensors are the *parts* of logical tensors: a
tensor stored as is keeps its own name (so any safetensors reader sees it), a coded one is stored as
``name::role`` parts (``name::q``, ``name::scale``, ``name::mask``, ``name::values`` ...). The JSON in
``__metadata__["slimtorch"]`` says how to rebuild each logical tensor::

    {
      "format": "slimtorch", "version": 1, "checkpoint": "<uuid>", "shard": 1,
      "tensors": {
        "fc.weight": {"dtype": "float32", "shape": [512, 256],
                      "stages": [{"codec": "int8", "dtype": "float32", "shape": [512, 256]}],
                      "parts": {"q": "fc.weight::q", "scale": "fc.weight::scale"},
                      "crc32": {"q": [2766042353], "scale": [410823049]}}
      },
      "ties": {"lm_head.weight": "embed.weight"},     # same tensor on load
      "copies": {"decoder.bias": "encoder.bias"},     # equal bytes, stored once, loaded as separate tensors
      "provenance": {"tool": "slimtorch 0.1.0", "source": "ckpt.pt", ...},
      "delta": null,                                  # structural changes of a pruned model
      "objects": {"model": {"model_args": {"n_conv": 4}}, "epoch": 29}
    }

``objects`` (optional; absent in files without any) holds the checkpoint's non-tensor values that are plain
JSON data, nested as in the original (see :mod:`slimtorch.io.objects`); :func:`slimtorch.load_objects`
reads them. Files written before it existed read as having none.

``crc32`` holds one CRC-32 per :data:`CHECKSUM_CHUNK` bytes of each part as stored, so a flipped bit is
found before decoding and chunks can be checked in parallel. A sharded checkpoint repeats ``ties``,
``copies``, ``provenance`` and ``objects`` in every shard, lists only its own tensors, and has a Hugging
Face style ``model.safetensors.index.json`` (``weight_map`` over physical parts) beside the shards.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from slimtorch.errors import FormatError
from slimtorch.io.codecs.chain import CodecError, chain_label, parse_dtype, parse_shape
from slimtorch.io.source import dtype_name

FORMAT = "slimtorch"
VERSION = 1
METADATA_KEY = "slimtorch"
CHECKSUM_CHUNK = 64 << 20
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


def part_key(name: str, role: str) -> str:
    """Physical name of a part: the tensor's own name for its dense data, ``name::role`` otherwise."""
    return name if role == "" else f"{name}::{role}"


def crc32_chunks(tensor: torch.Tensor) -> list[int]:
    """CRC-32 of each :data:`CHECKSUM_CHUNK` bytes of a contiguous tensor's bytes (zlib releases the GIL)."""
    data = memoryview(tensor.reshape(-1).view(torch.uint8).numpy()) if tensor.numel() else memoryview(b"")
    return [zlib.crc32(data[i : i + CHECKSUM_CHUNK]) for i in range(0, max(len(data), 1), CHECKSUM_CHUNK)]


@dataclass(frozen=True)
class Entry:
    """How one logical tensor is stored."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    stages: list[dict[str, Any]]
    parts: dict[str, str]
    """role -> physical key"""
    crc32: dict[str, list[int]]

    @property
    def chain(self) -> str:
        return chain_label(self.stages)

    def to_json(self) -> dict[str, Any]:
        return {
            "dtype": dtype_name(self.dtype),
            "shape": list(self.shape),
            "stages": self.stages,
            "parts": self.parts,
            "crc32": self.crc32,
        }

    @classmethod
    def from_json(cls, path: Path, name: str, value: object) -> Entry:
        def bad(problem: str) -> FormatError:
            return FormatError(path, f"tensor {name!r}: {problem} in the slimtorch metadata")

        if not isinstance(value, dict):
            raise bad("entry is not an object")
        try:
            dtype, shape = parse_dtype(value.get("dtype")), parse_shape(value.get("shape"))
        except CodecError as exc:
            raise bad(str(exc)) from None
        stages, parts, crc = value.get("stages"), value.get("parts"), value.get("crc32")
        if not isinstance(stages, list) or not all(isinstance(s, dict) for s in stages):
            raise bad("stages is not a list of objects")
        if not _str_map(parts) or not parts:
            raise bad("parts is not a map of roles to names")
        if (
            not isinstance(crc, dict)
            or set(crc) != set(parts)
            or not all(isinstance(v, list) and v and all(isinstance(c, int) for c in v) for v in crc.values())
        ):
            raise bad("crc32 does not list a checksum for every part")
        return cls(name, dtype, shape, stages, parts, crc)


@dataclass
class Layout:
    """The slimtorch metadata of one file (or, merged, of a sharded checkpoint)."""

    tensors: dict[str, Entry] = field(default_factory=dict)
    ties: dict[str, str] = field(default_factory=dict)
    copies: dict[str, str] = field(default_factory=dict)
    provenance: dict[str, Any] = field(default_factory=dict)
    delta: Any = None
    checkpoint: str = ""
    shard: int = 1
    objects: dict[str, Any] = field(default_factory=dict)

    def to_metadata(self) -> dict[str, str]:
        """The safetensors ``__metadata__`` (string to string)."""
        body = {
            "format": FORMAT,
            "version": VERSION,
            "checkpoint": self.checkpoint,
            "shard": self.shard,
            "tensors": {name: entry.to_json() for name, entry in self.tensors.items()},
            "ties": self.ties,
            "copies": self.copies,
            "provenance": self.provenance,
            "delta": self.delta,
            **({"objects": self.objects} if self.objects else {}),
        }
        return {METADATA_KEY: json.dumps(body, separators=(",", ":")), "format": "pt"}

    @classmethod
    def from_metadata(cls, path: Path, metadata: Mapping[str, str]) -> Layout:
        try:
            body = json.loads(metadata[METADATA_KEY])
        except (TypeError, json.JSONDecodeError) as exc:
            raise FormatError(path, f"the slimtorch metadata is not valid JSON ({exc})") from None
        if not isinstance(body, dict) or body.get("format") != FORMAT:
            raise FormatError(path, "the slimtorch metadata does not name its format")
        version = body.get("version")
        if version != VERSION:
            raise FormatError(
                path, f"slim format version {version!r}; this slimtorch reads version {VERSION} (upgrade it?)"
            )
        tensors = body.get("tensors")
        if not isinstance(tensors, dict):
            raise FormatError(path, "the slimtorch metadata has no tensor table")
        ties, copies = body.get("ties", {}), body.get("copies", {})
        if not _str_map(ties) or not _str_map(copies):
            raise FormatError(path, "ties and copies must map tensor names to tensor names")
        shard = body.get("shard", 1)
        if not isinstance(shard, int) or isinstance(shard, bool) or shard < 1:
            raise FormatError(path, "the shard number is not a positive integer")
        objects = body.get("objects", {})
        if not isinstance(objects, dict):
            raise FormatError(path, "the stored objects are not a JSON object")
        return cls(
            tensors={name: Entry.from_json(path, name, value) for name, value in tensors.items()},
            ties=ties,
            copies=copies,
            provenance=body.get("provenance") if isinstance(body.get("provenance"), dict) else {},
            delta=body.get("delta"),
            checkpoint=str(body.get("checkpoint", "")),
            shard=shard,
            objects=objects,
        )


def is_slim(metadata: object) -> bool:
    return isinstance(metadata, dict) and METADATA_KEY in metadata


def _str_map(value: object) -> bool:
    return isinstance(value, dict) and all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    )
