"""Passes over tensor data: exact zeros per tensor, and storages whose bytes are identical.

Both stream tensor by tensor (and chunk by chunk inside a tensor) from the memory-mapped file, so a
checkpoint of any size is scanned with a few MiB of anonymous memory.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from collections.abc import Callable, Iterator

import torch

from slimtorch.format.source import TensorSource

CHUNK_ELEMENTS = 1 << 22  # 4 Mi elements: big enough to run at memory speed, small enough for the cache
DUPLICATE_MIN_BYTES = 4096  # smaller storages are not worth naming as duplicates
_FINGERPRINT_BYTES = 4096
_SIGNED_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _chunks(tensor: torch.Tensor) -> Iterator[torch.Tensor]:
    if tensor.is_contiguous():
        yield from tensor.reshape(-1).split(CHUNK_ELEMENTS)
    elif tensor.dim() > 0 and tensor.shape[0] > 1:
        for part in tensor.unbind(0):
            yield from _chunks(part)
    else:
        yield tensor


def _nonzero(chunk: torch.Tensor) -> int:
    try:
        return int(torch.count_nonzero(chunk))
    except (RuntimeError, NotImplementedError):
        pass
    # Some dtypes (float8, unsigned ints) have no count_nonzero kernel: compare their bits instead,
    # ignoring the sign bit of floats so that -0.0 counts as zero.
    if chunk.dtype == torch.float8_e8m0fnu:
        return chunk.numel()  # this format has no zero
    bits = chunk.contiguous().view(_SIGNED_INT[chunk.element_size()])
    if chunk.dtype.is_floating_point:
        bits = bits & torch.iinfo(bits.dtype).max
    return int(torch.count_nonzero(bits))


def count_zeros(tensor: torch.Tensor) -> int:
    """Number of elements exactly equal to zero, in bounded memory."""
    return tensor.numel() - sum(_nonzero(chunk) for chunk in _chunks(tensor))


def count_masked_zeros(values: torch.Tensor, mask: torch.Tensor) -> tuple[int, int]:
    """Zeros of ``values * mask`` (a pruned weight) and zeros of ``mask``, in one pass over both.

    The product is never built: a chunk of each is compared with zero at a time.
    """
    if values.shape != mask.shape:
        return count_zeros(values), count_zeros(mask)
    kept = mask_kept = 0
    for part, keep in zip(_chunks(values.contiguous()), _chunks(mask.contiguous()), strict=True):
        keeps = keep != 0
        mask_kept += int(torch.count_nonzero(keeps))
        kept += int(torch.count_nonzero((part != 0) & keeps))
    return values.numel() - kept, mask.numel() - mask_kept


def find_duplicates(
    source: TensorSource, storages: list[str], progress: Callable[[int], None] | None = None
) -> dict[str, str]:
    """Map each storage whose bytes equal an earlier one's to that earlier storage.

    Storages are compared only within groups of equal size; a fingerprint of a few KiB rules out almost all
    pairs, and only the survivors are hashed in full.
    """
    by_size: dict[int, list[str]] = defaultdict(list)
    for storage in storages:
        nbytes = source.locations[storage].nbytes
        if nbytes >= DUPLICATE_MIN_BYTES:
            by_size[nbytes].append(storage)
    duplicates: dict[str, str] = {}
    for group in by_size.values():
        if len(group) < 2:
            continue
        by_fingerprint: dict[bytes, list[str]] = defaultdict(list)
        for storage in group:
            by_fingerprint[_fingerprint(source.storage_bytes(storage))].append(storage)
        for candidates in by_fingerprint.values():
            first_with_digest: dict[bytes, str] = {}
            for storage in candidates if len(candidates) > 1 else ():
                data = source.storage_bytes(storage)
                digest = hashlib.blake2b(data.numpy().data, digest_size=32).digest()
                if progress:
                    progress(data.numel())
                if digest in first_with_digest:
                    duplicates[storage] = first_with_digest[digest]
                else:
                    first_with_digest[digest] = storage
    return duplicates


def _fingerprint(data: torch.Tensor) -> bytes:
    size = data.numel()
    middle = max(0, size // 2 - _FINGERPRINT_BYTES // 2)
    digest = hashlib.blake2b(digest_size=16)
    for start in (0, middle, max(0, size - _FINGERPRINT_BYTES)):
        digest.update(data[start : start + _FINGERPRINT_BYTES].numpy().data)
    return digest.digest()
