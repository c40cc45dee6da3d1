"""The slim checkpoint layout (version 1): what ``__metadata__["slimtorch"]`` says about a safetensors file.

Every slim file is a valid safetensors file. Its physical tensors are the *parts* of logical tensors: a
tensor stored as is keeps its own name (so any safetensors reader sees it), a coded one is stored as
``name::role`` parts (``name::q``, ``name::scale``, ``name::mask``, ``name::values`` ...). The JSON in
``__metadata__["slimtorch"]`` says how to rebuild each logical tensor::

    {
      "format": "slimtorch", "version": 1, "minor": 1, "checkpoint": "<uuid>", "shard": 1, "shards": 3,
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
JSON data, nested as in the original (see :mod:`slimtorch.sources.objects`); :func:`slimtorch.load_objects`
reads them. Files written before it existed read as having none.

``__metadata__["slimtorch.crc"]`` (since minor version 1) seals the header: the CRC-32 of a canonical
serialisation of every other ``__metadata__`` value and of every entry's name, dtype, shape and offsets
(:func:`header_checksum`), so no flipped bit in the header renames, relabels or moves a part unnoticed. Old
readers ignore it and the ``minor`` field. Files written before it (no ``minor``) load with the checks they
have; a file whose JSON says ``minor`` >= 1 must carry the seal, so a damaged key cannot turn checks off.

``checkpoint`` is a random id per save and ``shards`` the number of shards it wrote (both in every shard),
so a missing shard, or one from another save, is found with or without the index.

``crc32`` holds one CRC-32 per :data:`CHECKSUM_CHUNK` bytes of each part as stored, so a flipped bit is
found before decoding and chunks can be checked in parallel. A sharded checkpoint repeats ``ties``,
``copies``, ``provenance`` and ``objects`` in every shard, lists only its own tensors, and has a Hugging
Face style ``model.safetensors.index.json`` (``weight_map`` over physical parts) beside the shards.
"""

from __future__ import annotations

import ctypes
import functools
import json
import mmap
import re
import zlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeGuard

import torch

from slimtorch.errors import FormatError
from slimtorch.format.codecs.chain import CodecError, chain_label, parse_dtype, parse_shape
from slimtorch.format.source import StoredChunk, dtype_name
from slimtorch.format.untrusted import load_json, untrusted

FORMAT = "slimtorch"
VERSION = 1
MINOR = 1
"""1: the header seal (``slimtorch.crc``) and the shard count; readers of version 1 ignore both."""
METADATA_KEY = "slimtorch"
CRC_KEY = "slimtorch.crc"
SLIM_JSON = re.compile(rf'\s*\{{\s*"format"\s*:\s*"{FORMAT}"')
"""How the slimtorch JSON starts, under whatever key: a damaged key must not hide it."""
HeaderParts = Mapping[str, tuple[torch.dtype, Any, int, int]]
"""Physical key -> (dtype, shape, begin, end) as the safetensors header gives them."""
RESERVED_NAMES = frozenset({"__metadata__"})
"""Keys of a safetensors header that are not tensors: a tensor of that name would overwrite the metadata."""
CHECKSUM_CHUNK = 64 << 20
READ_AHEAD_MIN = 1 << 20
"""Ranges shorter than this get no read-ahead hint (:func:`read_ahead`): the kernel's own fault read-ahead
covers them, and the hint's two ``mincore`` calls cost 6 us a range (BERT-base has 200 small tensors)."""
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


def part_key(name: str, role: str) -> str:
    """Physical name of a part: the tensor's own name for its dense data, ``name::role`` otherwise."""
    return name if role == "" else f"{name}::{role}"


def _crc32() -> Callable[[Any], int]:
    """zlib's CRC-32, from Intel's ISA-L where installed (``pip install slimtorch[fast]``): the same
    polynomial and the same values, about 3x zlib's speed with the CPU's carry-less multiply (10 GB/s
    against 3.1 here); both release the GIL."""
    try:
        from isal.isal_zlib import crc32
    except ImportError:
        return zlib.crc32
    return crc32


crc32 = _crc32()
"""``crc32(data) -> int``, zlib's checksum, as fast as this machine has it"""


_CRC_POLY = 0xEDB88320  # zlib's CRC-32 polynomial, bit-reversed: bit 31 is x^0, bit 0 is x^31


def _times_mod_p(a: int, b: int) -> int:
    """``a * b mod P`` over GF(2), both in the bit-reversed order the CRC keeps its register in."""
    product, bit = 0, 1 << 31
    while a:
        if a & bit:
            product ^= b
            a ^= bit
        bit >>= 1
        b = (b >> 1) ^ _CRC_POLY if b & 1 else b >> 1
    return product


@functools.lru_cache(maxsize=256)  # pieces of one shard mostly share a few lengths
def _x_to_8n(n: int) -> int:
    """``x^(8n) mod P``: appending n bytes multiplies a CRC by it (square-and-multiply over n's bits)."""
    result, square = 1 << 31, 1 << 30  # x^0, and x^1 squared below to x^8 = x^(8 * 1)
    for _ in range(3):
        square = _times_mod_p(square, square)
    while n:
        if n & 1:
            result = _times_mod_p(square, result)
        square = _times_mod_p(square, square)
        n >>= 1
    return result


def _crc32_combine() -> Callable[[int, int, int], int]:
    """ISA-L's ``crc32_combine`` where installed (C); else the same arithmetic in Python (~0.1 ms each)."""
    try:
        from isal.isal_zlib import crc32_combine as fast
    except ImportError:
        return lambda crc_a, crc_b, length_b: _times_mod_p(_x_to_8n(length_b), crc_a) ^ crc_b
    return fast


crc32_combine = _crc32_combine()
"""``crc32_combine(crc(A), crc(B), len(B)) -> crc(A + B)``: ranks that each hash their own piece of a stored
chunk check the chunk's CRC together, none reading the others' bytes.

Example:
    >>> crc32_combine(zlib.crc32(b"sl"), zlib.crc32(b"im"), 2) == zlib.crc32(b"slim")
    True
"""


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A contiguous tensor's bytes, without a copy."""
    if not tensor.numel():
        return memoryview(b"")
    if tensor.dtype in _NUMPY_DTYPES and tensor.is_contiguous():
        return tensor.numpy().data.cast("B")  # 1 us; the uint8 view below: 3 (a load makes 300)
    return tensor.reshape(-1).view(torch.uint8).numpy().data


_NUMPY_DTYPES = frozenset(
    (torch.float64, torch.float32, torch.float16, torch.int64, torch.int32, torch.int16, torch.int8)
) | {torch.uint8}


def crc32_chunks(tensor: torch.Tensor) -> list[int]:
    """CRC-32 of each :data:`CHECKSUM_CHUNK` bytes of a contiguous tensor's bytes."""
    data = tensor_bytes(tensor)
    return [crc32(data[i : i + CHECKSUM_CHUNK]) for i in range(0, max(len(data), 1), CHECKSUM_CHUNK)]


@dataclass(slots=True)  # not frozen: a frozen dataclass takes 2 us to build, this one 0.4 (one per tensor)
class ChunkCheck:
    """One stored chunk of a part and the CRC-32 the file records for it. Calling it reads the bytes
    (paging them in) and returns how many, or raises :class:`FormatError` naming the tensor. Checks are
    independent: any thread may run any of them, in any order, so a load verifies a part on every core.

    Example:
        >>> data = memoryview(b"slim")
        >>> ChunkCheck(Path("f"), "w", "w", 0, data, zlib.crc32(data))()
        4
    """

    path: Path
    tensor: str
    part: str
    """The part's physical key (``w::q``; a tensor stored as is: its own name)."""
    start: int
    """Where the chunk starts in the part, in bytes."""
    data: memoryview = field(repr=False)
    expected: int
    address: int = 0
    """Where ``data`` is mapped (0: unknown), to ask the kernel to read it ahead."""

    def __call__(self) -> int:
        if self.address:
            read_ahead(self.address, len(self.data))
        if crc32(self.data) != self.expected:
            raise FormatError(
                self.path,
                f"tensor {self.tensor!r}: checksum mismatch in part {self.part!r} (bytes {self.start}..): "
                "the file is corrupt",
            )
        return len(self.data)


def recorded_crcs(path: Path, entry: Entry, role: str, part_bytes: int, chunk: int) -> list[int]:
    """The CRC-32 the file records for each ``chunk`` bytes of part ``role`` (``part_bytes`` long), refused
    when there are not as many as the part has chunks."""
    expected = entry.crc32[role]
    if len(expected) != max(1, -(-part_bytes // chunk)):
        raise FormatError(path, f"tensor {entry.name!r}: checksum list does not fit part {role!r}")
    return expected


def chunk_checks(
    path: Path,
    entry: Entry,
    role: str,
    tensor: torch.Tensor,
    within: tuple[int, int] | None = None,
    chunk: int = CHECKSUM_CHUNK,
) -> list[ChunkCheck]:
    """The checks of part ``role`` of ``entry`` as mapped in ``tensor``: every chunk's, or only those
    overlapping the byte range ``within``. A checksum list that does not fit the part is refused here."""
    data = tensor_bytes(tensor)
    expected = recorded_crcs(path, entry, role, len(data), chunk)
    chunks = len(expected)
    key, address = entry.parts[role], tensor.data_ptr() if tensor.device.type == "cpu" else 0
    if chunks == 1:  # most tensors: one check, built without the general case's ranges
        return [ChunkCheck(path, entry.name, key, 0, data, expected[0], address)]
    first, last = (0, chunks) if within is None else (within[0] // chunk, -(-within[1] // chunk))
    return [
        ChunkCheck(
            path,
            entry.name,
            key,
            i * chunk,
            data[i * chunk : (i + 1) * chunk],
            expected[i],
            address and address + i * chunk,
        )
        for i in range(first, max(first + 1, last))
    ]


class ChecksumMismatches(FormatError):
    """A :class:`SpanCheck` found corrupt chunks: ``errors`` has each corrupt tensor's own error (the one
    its :class:`ChunkCheck` raises), by tensor name; the message is the first one's."""

    def __init__(self, errors: dict[str, FormatError]) -> None:
        first = next(iter(errors.values()))
        super().__init__(first.path, first.problem)
        self.errors = errors


class SpanCheck:
    """Stored chunks lying back to back in one file, checked with one CRC-32 over all their bytes against
    the value their recorded CRCs combine to (:data:`crc32_combine`). A file-wide check runs a few of
    these instead of one check per tensor (BERT-base: 2 spans of 256 MiB, not 276 chunks, each a
    Python call on the verifying thread that waits for the interpreter lock while a model is built).
    On a mismatch each chunk is checked alone, and :class:`ChecksumMismatches` names the corrupt ones.

    Example:
        >>> data = memoryview(b"slimtorch")
        >>> chunks = [StoredChunk(Path("f"), 0, 4, zlib.crc32(b"slim"), "a", "a", 0),
        ...           StoredChunk(Path("f"), 4, 5, zlib.crc32(b"torch"), "b", "b", 0)]
        >>> SpanCheck(Path("f"), chunks, data)()
        9
    """

    __slots__ = ("chunks", "data", "expected", "path")

    def __init__(self, path: Path, chunks: list[StoredChunk], data: memoryview) -> None:
        self.path, self.chunks, self.data = path, chunks, data
        # Combined here, on the thread that builds the check: ISA-L's combine releases the interpreter
        # lock, and a verifying thread taking it back while a model is built waits up to 5 ms each time.
        self.expected = 0
        for chunk in chunks:
            self.expected = crc32_combine(self.expected, chunk.expected, chunk.length)

    def __call__(self) -> int:
        if crc32(self.data) == self.expected:
            return len(self.data)
        errors: dict[str, FormatError] = {}
        at = 0
        for chunk in self.chunks:
            view, at = self.data[at : at + chunk.length], at + chunk.length
            try:
                ChunkCheck(self.path, chunk.tensor, chunk.part, chunk.start, view, chunk.expected)()
            except FormatError as exc:
                errors.setdefault(chunk.tensor, exc)
        if not errors:  # every chunk matched alone: the recorded CRCs do not fit the bytes they cover
            first = self.chunks[0]
            errors[first.tensor] = FormatError(
                self.path, f"tensor {first.tensor!r}: checksums do not combine (the file is corrupt)"
            )
        raise ChecksumMismatches(errors)


def spans(chunks: list[StoredChunk], span_bytes: int) -> list[list[StoredChunk]]:
    """``chunks`` (sorted by file and offset) cut into runs back to back in one file, each of at most
    ``span_bytes`` unless a single chunk is longer.

    Example:
        >>> chunk = lambda at, n: StoredChunk(Path("f"), at, n, 0, "t", "t", 0)
        >>> [len(run) for run in spans([chunk(0, 4), chunk(4, 4), chunk(8, 4), chunk(20, 4)], 8)]
        [2, 1, 1]
    """
    runs: list[list[StoredChunk]] = []
    size = 0
    for chunk in chunks:
        last = runs[-1][-1] if runs else None
        joins = last is not None and last.file == chunk.file and last.offset + last.length == chunk.offset
        if not joins or size + chunk.length > span_bytes:
            runs.append([])
            size = 0
        runs[-1].append(chunk)
        size += chunk.length
    return runs


def _libc_call(name: str, *argtypes: Any) -> Callable[..., int] | None:
    """A libc function with its argument types set, or None where the platform lacks it."""
    try:
        call = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None
    call.argtypes = list(argtypes)
    return call


_MADVISE = _libc_call("madvise", ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_MINCORE = _libc_call("mincore", ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p)
_WILLNEED = getattr(mmap, "MADV_WILLNEED", None)


def resident(address: int) -> bool:
    """Whether the mapped page holding ``address`` is in memory (False where it cannot be told)."""
    flag = ctypes.create_string_buffer(1)
    page = address - address % mmap.PAGESIZE
    return _MINCORE is not None and _MINCORE(page, mmap.PAGESIZE, flag) == 0 and flag.raw[0] & 1 == 1


def read_ahead(address: int, length: int) -> None:
    """Ask the kernel to read mapped bytes ahead of their use (``MADV_WILLNEED``): on a cold page cache a
    chunk then comes in large sequential reads, not a page fault at a time. Skipped where the range's
    first and last pages are in memory already: on a warm cache the hint only walks the cached pages, and
    beside a forward that walk cost 0.15 s per 2 GiB (measured: a before-use load went from 0.96x to 1.8x
    the unchecked one). Skipped for ranges under :data:`READ_AHEAD_MIN` too. A hint only: refused (an
    unaligned or unmapped range) it changes nothing."""
    if _MADVISE is None or _WILLNEED is None or length < READ_AHEAD_MIN:
        return
    start = address - address % mmap.PAGESIZE
    if resident(start) and resident(address + length - 1):
        return
    _MADVISE(start, length + address - start, _WILLNEED)


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

    @functools.cached_property
    def chain(self) -> str:  # asked several times per tensor by a load: 0.5 us each, built once here
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
    shards: int = 0
    """How many shards the save wrote; 0 in files from before minor version 1 (and while writing)."""
    metadata: dict[str, Any] | None = None
    """The file's raw ``__metadata__``, to check its seal against the header; None for a merged layout."""

    def to_metadata(self) -> dict[str, str]:
        """The safetensors ``__metadata__`` (string to string), before :func:`seal` adds its checksum."""
        body = {
            "format": FORMAT,
            "version": VERSION,
            "minor": MINOR,
            "checkpoint": self.checkpoint,
            "shard": self.shard,
            "shards": self.shards,
            "tensors": {name: entry.to_json() for name, entry in self.tensors.items()},
            "ties": self.ties,
            "copies": self.copies,
            "provenance": self.provenance,
            "delta": self.delta,
            **({"objects": self.objects} if self.objects else {}),
        }
        return {METADATA_KEY: json.dumps(body, separators=(",", ":")), "format": "pt"}

    @classmethod
    def from_metadata(cls, path: Path, metadata: Mapping[str, Any]) -> Layout:
        """Parse and check the slimtorch JSON (the seal is checked against the header by the reader)."""
        body = _body(path, metadata)
        tensors = body.get("tensors")
        if not isinstance(tensors, dict):
            raise FormatError(path, "the slimtorch metadata has no tensor table")
        ties, copies = body.get("ties", {}), body.get("copies", {})
        if not _str_map(ties) or not _str_map(copies):
            raise FormatError(path, "ties and copies must map tensor names to tensor names")
        shard, shards = _shard_numbers(path, body)
        objects = body.get("objects", {})
        if not isinstance(objects, dict):
            raise FormatError(path, "the stored objects are not a JSON object")
        provenance = body.get("provenance")
        return cls(
            tensors={name: Entry.from_json(path, name, value) for name, value in tensors.items()},
            ties=ties,
            copies=copies,
            provenance=provenance if isinstance(provenance, dict) else {},
            delta=body.get("delta"),
            checkpoint=str(body.get("checkpoint", "")),
            shard=shard,
            objects=objects,
            shards=shards,
            metadata=dict(metadata),
        )


def _body(path: Path, metadata: Mapping[str, Any]) -> dict[str, Any]:
    """The slimtorch JSON, its format and version checked; a sealed one (minor >= 1) must carry its seal."""
    text = metadata.get(METADATA_KEY)
    if not isinstance(text, str):
        raise FormatError(
            path,
            f"the slimtorch metadata is missing or damaged (no {METADATA_KEY!r} text beside the parts and "
            "checksums that need it): the file is corrupt",
        )
    try:
        body = load_json(path, text, "slimtorch metadata")
    except FormatError as exc:
        raise FormatError(path, f"the slimtorch metadata is not valid JSON ({exc.problem})") from None
    if not isinstance(body, dict) or body.get("format") != FORMAT:
        raise FormatError(path, "the slimtorch metadata does not name its format")
    version = body.get("version")
    if version != VERSION:
        raise FormatError(
            path,
            f"slim format version {_short(version)}; this slimtorch reads version {VERSION} (upgrade it?)",
        )
    minor = body.get("minor", 0)
    if not _count(minor, 0):
        raise FormatError(path, f"the slim format minor version {_short(minor)} is not a number")
    if minor >= 1 and CRC_KEY not in metadata:
        raise FormatError(path, f"the header checksum ({CRC_KEY!r}) is missing or its key damaged")
    return body


def _shard_numbers(path: Path, body: dict[str, Any]) -> tuple[int, int]:
    """(this shard's number, the save's shard count or 0 where the file predates it)."""
    shard, shards = body.get("shard", 1), body.get("shards", 0 if body.get("minor", 0) < 1 else None)
    if not _count(shard, 1):
        raise FormatError(path, "the shard number is not a positive integer")
    if not _count(shards, 0) or (body.get("minor", 0) >= 1 and not 1 <= shard <= shards):
        raise FormatError(path, f"shard number {shard} of {_short(shards)} shards does not make sense")
    return shard, shards


def header_checksum(metadata: Mapping[str, Any], parts: HeaderParts) -> str:
    """CRC-32 (8 hex digits) of every ``__metadata__`` value but the seal itself and of every part's dtype,
    shape and ``[begin, end)`` offsets, serialised canonically (sorted keys, no spaces), so writer and reader
    compute it the same way from what each has in hand.

    Example:
        >>> header_checksum({"slimtorch": "{}"}, {"w": (torch.float32, [2], 0, 8)})
        'cc7a75ee'
    """
    canonical = {
        "metadata": {key: value for key, value in metadata.items() if key != CRC_KEY},
        "parts": {
            key: [dtype_name(dtype), list(shape), begin, end]
            for key, (dtype, shape, begin, end) in parts.items()
        },
    }
    text = json.dumps(canonical, sort_keys=True, separators=(",", ":"))
    return f"{zlib.crc32(text.encode()):08x}"


def seal(metadata: Mapping[str, str], parts: HeaderParts) -> dict[str, str]:
    """``metadata`` with its :data:`CRC_KEY` set for a header holding ``parts`` (:func:`header_checksum`)."""
    return {**{k: v for k, v in metadata.items() if k != CRC_KEY}, CRC_KEY: header_checksum(metadata, parts)}


def check_seal(path: Path, layout: Layout, parts: HeaderParts) -> None:
    """Refuse a header whose seal does not match it; files from before the seal have none to check."""
    metadata = layout.metadata or {}
    if CRC_KEY not in metadata:
        return
    with untrusted(path, "header"):  # hostile metadata values may nest too deep to serialise
        expected = header_checksum(metadata, parts)
    if metadata[CRC_KEY] != expected:
        raise FormatError(
            path,
            "header checksum mismatch: a tensor name, dtype, shape, offset or the slimtorch metadata was "
            "changed after writing (the file is corrupt)",
        )


def is_slim(metadata: object, names: Iterable[str] = ()) -> bool:
    """Whether a safetensors file is a slim checkpoint, damaged or not: it has the slimtorch metadata, or
    the seal, or slimtorch JSON under a damaged key, or ``name::role`` parts (``names``, the header's
    tensor names). One flipped bit never makes a slim file read as plain safetensors, unchecked."""
    if isinstance(metadata, dict) and (
        METADATA_KEY in metadata
        or CRC_KEY in metadata
        or any(isinstance(v, str) and SLIM_JSON.match(v) for v in metadata.values())
    ):
        return True
    return any("::" in name for name in names)


def _short(value: object) -> str:
    """A value from the file for a one-line message: its repr, cut short."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _count(value: object, least: int) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def _str_map(value: object) -> TypeGuard[dict[str, str]]:
    return isinstance(value, dict) and all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    )
