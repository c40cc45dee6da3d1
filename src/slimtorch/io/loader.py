"""load: every tensor of a checkpoint as a dict, decoded and verified.

Tensors stored as is come memory-mapped from the file (copy-on-write: writing into them never changes the
file); coded tensors are decoded in a small thread pool (torch and NumPy release the GIL in their kernels).
Tied tensors come back as one tensor under several names; copies as separate tensors.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import torch

from slimtorch.io.readers import open_checkpoint
from slimtorch.io.readers.slim import SlimSource

DECODE_THREADS = min(4, os.cpu_count() or 1)


def load(
    path: str | os.PathLike[str], *, verify: bool = True, allow_globals: tuple[str, ...] = ()
) -> dict[str, torch.Tensor]:
    """Load every tensor of a checkpoint (slim or any format :func:`slimtorch.open` reads).

    A slim file's parts are checked against their CRC-32 first (``verify=False`` skips that); a mismatch
    raises :class:`slimtorch.FormatError` naming the tensor.

    Example:
        >>> import slimtorch
        >>> state = slimtorch.load("model.safetensors")  # doctest: +SKIP
        >>> model.load_state_dict(state)  # doctest: +SKIP
    """
    source = open_checkpoint(path, allow_globals=allow_globals)
    if not isinstance(source, SlimSource):
        return {name: source.get(name) for name in source.names()}
    source.verify = verify
    layout = source.layout
    stored = list(layout.tensors)
    with ThreadPoolExecutor(DECODE_THREADS) as pool:
        decoded = dict(zip(stored, pool.map(source.get, stored), strict=True))
    for name, target in layout.ties.items():
        decoded[name] = decoded[target]
    for name, target in layout.copies.items():
        decoded[name] = decoded[target].clone()
    return {name: decoded[name] for name in source.names()}
