"""One source over the shards of a sharded slim checkpoint, refused when a shard is missing, there twice
or from another save."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import replace
from pathlib import Path

from slimtorch.errors import FormatError
from slimtorch.format.layout import Layout
from slimtorch.format.source import ObjectInfo, StorageLocation, TensorInfo
from slimtorch.sources.slim import SlimSource, slim_source

SHARD_NAME = re.compile(r"model-\d+-of-(\d+)\.safetensors")


def merge_shards(
    folder: Path, shards: list[SlimSource], files: list[Path], objects: list[ObjectInfo]
) -> SlimSource:
    """One source over the shards of a sharded slim checkpoint, checked to come from one save."""
    first = shards[0].layout
    _check_complete(folder, shards)
    layout = Layout(
        provenance=first.provenance,
        delta=first.delta,
        checkpoint=first.checkpoint,
        objects=first.objects,
        shards=first.shards,
    )
    physical: dict[str, TensorInfo] = {}
    locations: dict[str, StorageLocation] = {}
    for shard in shards:
        for name, entry in shard.layout.tensors.items():
            if name in layout.tensors:
                raise FormatError(shard.path, f"tensor {name!r} is stored in two shards")
            layout.tensors[name] = entry
        layout.ties.update(shard.layout.ties)
        layout.copies.update(shard.layout.copies)
        prefix = f"{shard.path.name}:"
        physical.update({k: replace(i, storage=prefix + i.storage) for k, i in shard.physical.items()})
        locations.update({prefix + k: loc for k, loc in shard.locations.items()})
    return slim_source(
        folder,
        layout,
        physical,
        locations,
        objects=objects,
        files=files,
        structure_bytes=sum(s.structure_bytes for s in shards),
        format=f"slim ({len(shards)} shards)" if len(shards) > 1 else "slim",
    )


def _check_complete(folder: Path, shards: list[SlimSource]) -> None:
    """Refuse a sharded checkpoint with a shard missing, twice, or from another save.

    The index names every shard, but a folder without its index (or with a damaged one) is read from the
    ``model*.safetensors`` files alone: there, a missing shard would silently load as a checkpoint without
    its tensors. Every shard records its number, the save's shard count and the save's id; files from before
    the shard count are judged by the writer's file names (``model-00002-of-00005``).
    """
    ids = {shard.layout.checkpoint for shard in shards}
    if len(ids) > 1:
        odd = next(s for s in shards if s.layout.checkpoint != shards[0].layout.checkpoint)
        raise FormatError(odd.path, "this shard comes from a different save than the others")
    counts = {shard.layout.shards for shard in shards}
    if len(counts) > 1:
        raise FormatError(folder, f"the shards disagree on how many there are ({sorted(counts)})")
    numbers = Counter(shard.layout.shard for shard in shards)
    twice = [number for number, seen in numbers.items() if seen > 1]
    if twice:
        raise FormatError(folder, f"shard {twice[0]} is there twice (a copied file?)")
    totals = {int(m[1]) for s in shards if (m := SHARD_NAME.fullmatch(s.path.name))}
    recorded = counts.pop()
    total = recorded or max([len(shards), *numbers, *totals])
    missing = sorted(set(range(1, total + 1)) - set(numbers))
    if missing:
        raise FormatError(
            folder, f"shard {missing[0]} of {total} is missing (an interrupted copy or download?)"
        )
