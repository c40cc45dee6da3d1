"""Codec chains: how one logical tensor becomes a few physical parts, and back.

A chain is a list of stages applied in order. Each stage takes the tensor the previous one handed on (the
"primary"), returns a new primary plus side parts (a scale, a bitmask), and records what it needs to undo
itself: the dtype and shape it received and its own parameters. The last primary is stored too. Decoding
walks the stages backwards. An entropy stage, if present, comes last and compresses the stored parts
themselves.

Example: ``["int8", "sparse"]`` quantizes a weight per output channel (parts: ``scale``), then stores the
int8 codes as a bitmask plus the non-zero codes (parts: ``mask``, ``values``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import torch

from slimtorch.errors import FormatError
from slimtorch.format import untrusted
from slimtorch.format.codecs import entropy
from slimtorch.format.codecs.base import CodecError, parse_dtype, parse_shape
from slimtorch.format.source import dtype_name


class Codec(Protocol):
    name: str
    primary: str
    """Role of the part this stage hands on; ``""`` means a dense tensor of the logical shape (stored under
    the tensor's own name, so plain safetensors readers see it as the tensor)."""
    lossless: bool

    # each codec takes its own keyword options: `*args: Any, **options: Any` lets any signature after x match
    def encode(
        self, x: torch.Tensor, *args: Any, **options: Any
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict]:
        """-> (primary, side parts by role, parameters for decode)."""
        ...

    def decode(self, primary: torch.Tensor, parts: Mapping[str, torch.Tensor], stage: dict) -> torch.Tensor:
        """Undo the stage; ``stage`` holds the recorded ``dtype`` and ``shape`` of its input."""
        ...


REGISTRY: dict[str, Codec] = {}
ENTROPY = "zstd"
C = TypeVar("C", bound=Codec)


def register(codec: C) -> C:
    REGISTRY[codec.name] = codec
    return codec


@dataclass(frozen=True)
class Encoded:
    """The physical parts of one logical tensor (role -> contiguous tensor) and the stages that made them."""

    parts: dict[str, torch.Tensor]
    stages: list[dict[str, Any]]

    @property
    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parts.values())

    @property
    def chain(self) -> str:
        return chain_label(self.stages)


def chain_label(stages: Sequence[Mapping[str, Any]]) -> str:
    """``[{"codec": "int8"}, {"codec": "sparse"}]`` -> ``"int8+sparse"``; no stage -> ``"raw"``."""
    return "+".join(str(s.get("codec"))[:40] for s in stages) or "raw"


def _spec(item: str | tuple[str, Mapping[str, Any]]) -> tuple[str, dict[str, Any]]:
    if isinstance(item, str):
        return item, {}
    return item[0], dict(item[1])


def encode(x: torch.Tensor, chain: Sequence[str | tuple[str, Mapping[str, Any]]] = ()) -> Encoded:
    """Encode ``x`` through ``chain`` (names, or ``(name, options)`` pairs).

    Example:
        >>> w = torch.randn(64, 256)
        >>> enc = encode(w, [("int4", {"group_size": 64})])
        >>> sorted(enc.parts), enc.chain
        (['q4', 'scale', 'zero'], 'int4')
    """
    encoded = Encoded({"": dense(x.detach())}, [])
    for item in chain:
        encoded = extend(encoded, item)
    return encoded


def primary_role(stages: Sequence[Mapping[str, Any]]) -> str:
    """Role of the part the last stage handed on (the one a further stage would transform)."""
    return _codec(stages[-1]).primary if stages else ""


def extend(encoded: Encoded, item: str | tuple[str, Mapping[str, Any]]) -> Encoded:
    """Apply one more stage to an encoding's primary part (``encode`` is a fold of this)."""
    name, options = _spec(item)
    if encoded.stages and encoded.stages[-1].get("codec") == ENTROPY:
        raise CodecError("the entropy stage must come last")
    if name == ENTROPY:
        compressed, stage = entropy.compress_parts(encoded.parts, **options)
        if not within_budget(compressed, [*encoded.stages, stage]):
            # A file must load with the default budget: keep the parts as they are rather than write one
            # that decompresses beyond it (all-zero masks compress 256x).
            compressed, stage = dict(encoded.parts), {"codec": ENTROPY, "parts": {}}
        return Encoded(compressed, [*encoded.stages, stage])
    codec = REGISTRY.get(name)
    if codec is None:
        raise CodecError(f"unknown codec {name!r} (known: {', '.join(sorted([*REGISTRY, ENTROPY]))})")
    parts = dict(encoded.parts)
    primary = parts.pop(primary_role(encoded.stages))
    stage = {"codec": name, "dtype": dtype_name(primary.dtype), "shape": list(primary.shape)}
    primary, sides, params = codec.encode(primary, **options)
    for side in [*sides, codec.primary]:
        if side in parts:
            raise CodecError(f"chain {chain_label([*encoded.stages, stage])} uses the part {side!r} twice")
    parts.update(sides)
    parts[codec.primary] = primary
    return Encoded({k: dense(v) for k, v in parts.items()}, [*encoded.stages, {**stage, **params}])


def dense(t: torch.Tensor) -> torch.Tensor:
    """``t`` contiguous, its last stride 1. torch calls a tensor contiguous whatever the strides of its empty
    or size-1 dims (``torch.arange(3.0)[1::2]`` keeps stride 2), then refuses to view it as another dtype."""
    t = t.contiguous()
    if t.numel() <= 1 or t.stride(-1) != 1:
        return t.new_empty(t.shape).copy_(t)
    return t


def decode(
    parts: Mapping[str, torch.Tensor],
    stages: Sequence[Mapping[str, Any]],
    dtype: torch.dtype,
    shape: Sequence[int],
) -> torch.Tensor:
    """Rebuild the logical tensor from its parts; raises :class:`CodecError` on any inconsistency."""
    primary = undo(parts, stages, keep=0)[""]
    if primary.dtype != dtype or tuple(primary.shape) != tuple(shape):
        raise CodecError(
            f"parts decode to {dtype_name(primary.dtype)} {list(primary.shape)}, "
            f"the metadata says {dtype_name(dtype)} {list(shape)}"
        )
    return primary


def undo(
    parts: Mapping[str, torch.Tensor], stages: Sequence[Mapping[str, Any]], keep: int
) -> dict[str, torch.Tensor]:
    """The parts as the first ``keep`` stages left them: every later stage undone, last first.

    ``keep=0`` gives the logical tensor under the role ``""``; ``keep=1`` on ``int8+sparse`` gives the
    int8 codes and their scales (what a quantized layer holds), without dequantizing anything.
    """
    parts = dict(parts)
    stages = list(stages)
    check_budget(parts, stages, keep)
    if len(stages) > keep and stages[-1].get("codec") == ENTROPY:
        parts = entropy.decompress_parts(parts, stages.pop())
    role = primary_role(stages)
    if role not in parts:
        raise CodecError(f"part {role or '(data)'!r} is missing")
    primary = parts.pop(role)
    for stage in reversed(stages[keep:]):
        codec = _codec(stage)
        want_dtype, want_shape = _declared(stage)
        try:
            primary = codec.decode(primary, parts, dict(stage))
        except (KeyError, TypeError, IndexError, OverflowError) as exc:  # a parameter of the wrong type
            raise CodecError(f"stage {codec.name} has bad parameters ({type(exc).__name__}: {exc})") from None
        if primary.dtype != want_dtype or tuple(primary.shape) != want_shape:
            raise CodecError(
                f"stage {codec.name} decoded to {dtype_name(primary.dtype)} {list(primary.shape)}, "
                f"expected {dtype_name(want_dtype)} {list(want_shape)}"
            )
    parts[primary_role(stages[:keep])] = primary
    return parts


def check_budget(
    parts: Mapping[str, torch.Tensor], stages: Sequence[Mapping[str, Any]], keep: int = 0
) -> None:
    """Refuse, before decoding anything, a chain that would make more bytes than the expansion budget of
    :func:`slimtorch.format.untrusted.max_expansion` allows from the parts stored: a few KB of zstd-compressed
    bitmask can claim gigabytes of float64 zeros."""
    stored, decoded = stored_bytes(parts), decoded_bytes(stages, keep)
    try:
        untrusted.check_expansion("", "the codec chain", stored, decoded)
    except FormatError as exc:
        raise CodecError(exc.problem) from None


def within_budget(parts: Mapping[str, torch.Tensor], stages: Sequence[Mapping[str, Any]]) -> bool:
    """Whether decoding ``parts`` stays within the default expansion budget (or the user's, if lower): the
    writer's side of :func:`check_budget`, so that every file it writes loads without raising it."""
    budget = min(untrusted.MAX_EXPANSION, untrusted.max_expansion())
    return decoded_bytes(stages) <= stored_bytes(parts) * budget + untrusted.EXPANSION_SLACK


def stored_bytes(parts: Mapping[str, torch.Tensor]) -> int:
    return sum(p.numel() * p.element_size() for p in parts.values())


def decoded_bytes(stages: Sequence[Mapping[str, Any]], keep: int = 0) -> int:
    """Bytes that undoing the stages after the first ``keep`` allocates, from their declared dtypes and
    shapes (checked, never trusted for a product): the parts the entropy stage decompresses, plus the
    largest tensor a stage decodes to (one stage's output is the next one's input)."""
    stages = list(stages)
    total = 0
    if len(stages) > keep and stages[-1].get("codec") == ENTROPY:
        listed = stages.pop().get("parts")
        if not isinstance(listed, dict):
            raise CodecError("zstd stage lists no parts")
        for spec in listed.values():
            if not isinstance(spec, dict):
                raise CodecError("zstd stage lists a part that is not an object")
            total += _nbytes(spec)
    return total + max((_nbytes(stage) for stage in stages[keep:]), default=0)


def _nbytes(spec: Mapping[str, Any]) -> int:
    dtype, shape = parse_dtype(spec.get("dtype")), parse_shape(spec.get("shape"))
    return math.prod(shape) * dtype.itemsize


def _codec(stage: Mapping[str, Any]) -> Codec:
    name = stage.get("codec")
    codec = REGISTRY.get(name) if isinstance(name, str) else None
    if codec is None:
        raise CodecError(f"unknown codec {str(name)[:40]!r} in the metadata")
    return codec


def _declared(stage: Mapping[str, Any]) -> tuple[torch.dtype, tuple[int, ...]]:
    return parse_dtype(stage.get("dtype")), parse_shape(stage.get("shape"))


def part(parts: Mapping[str, torch.Tensor], role: str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Side part ``role``, checked to exist and (optionally) to have ``dtype``."""
    tensor = parts.get(role)
    if tensor is None:
        raise CodecError(f"part {role!r} is missing")
    if dtype is not None and tensor.dtype != dtype:  # not require(): its message would be built every call
        raise CodecError(f"part {role!r} is {dtype_name(tensor.dtype)}")
    return tensor
