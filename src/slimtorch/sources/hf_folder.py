"""Hugging Face model folders: one weights file or shards listed by ``*.index.json``, safetensors or .bin.

Like transformers, we prefer safetensors when a folder holds both. The shards are read by the file readers and
merged into one source; the index is checked against them (every listed tensor must be where it says).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import cast

from slimtorch.errors import CheckpointError, CheckpointNotFoundError, FormatError
from slimtorch.format.hf_layout import inner_config
from slimtorch.format.source import ObjectInfo, TensorSource
from slimtorch.format.untrusted import load_json
from slimtorch.sources.slim import SlimSource
from slimtorch.sources.slim_shards import merge_shards

# In order of preference, as transformers loads them: its safetensors names (sharded by an index, or single)
# before its .bin names, whatever else the folder holds; within a format, an index before single files. Files
# not named the transformers way come last.
CANDIDATES = (
    ("index", "*.safetensors.index.json"),
    ("files", "model*.safetensors"),
    ("index", "*.bin.index.json"),
    ("files", "pytorch_model*.bin"),
    ("index", "*.pt.index.json"),
    ("files", "*.safetensors"),
    ("files", "*.bin"),
    ("files", "*.pt"),
    ("files", "*.pth"),
    ("files", "*.ckpt"),
)
SHARD_NAME = re.compile(r"-\d+-of-\d+\.[^.]+$")  # model-00001-of-00003.safetensors, as transformers writes
GENERIC = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.ckpt")
"""The patterns of :data:`CANDIDATES` that name no model file of a Hugging Face layout: any checkpoint."""
NOT_WEIGHTS = frozenset({"training_args.bin", "optimizer.pt", "scheduler.pt", "rng_state.pth", "scaler.pt"})
"""What a trainer's checkpoint folder holds beside its model: never weights of their own."""
CONFIG_KEYS = (
    "model_type",
    "architectures",
    "torch_dtype",
    "dtype",
    "hidden_size",
    "num_hidden_layers",
    "vocab_size",
    "tie_word_embeddings",
)


def weight_files(folder: Path) -> tuple[Path | None, list[Path]]:
    """The index file (if any) and the weight files a folder's model is made of.

    Several weight files without an index are one model only when named as shards
    (``model-00001-of-00003.safetensors``); otherwise they are separate checkpoints (facenet's
    ``pnet.pt``, ``rnet.pt`` and ``onet.pt``), and reading any one of them, or all as one, would be a guess.
    """
    for kind, pattern in CANDIDATES:
        found = sorted(p for p in folder.glob(pattern) if p.is_file())
        if found and kind == "index":
            return found[0], _shards_of(found[0], folder)
        if len(found) > 1 and not all(SHARD_NAME.search(p.name) for p in found):
            names = ", ".join(p.name for p in found[:6]) + (", ..." if len(found) > 6 else "")
            raise CheckpointError(
                folder,
                f"holds {len(found)} separate checkpoints ({names}), not one model; name one file, "
                f"e.g. {folder / found[0].name}",
            )
        if found and pattern in GENERIC:  # no model file by its Hugging Face name: any other is a rival
            rivals = sorted(
                p
                for other in GENERIC
                if other != pattern
                for p in folder.glob(other)
                if p.is_file() and p.name not in NOT_WEIGHTS
            )
            if rivals:
                every = sorted(found + rivals)
                names = ", ".join(p.name for p in every[:6]) + (", ..." if len(every) > 6 else "")
                raise CheckpointError(
                    folder,
                    f"holds {len(every)} separate checkpoints ({names}), not one model; name one file, "
                    f"e.g. {folder / every[0].name}",
                )
        if found:
            return None, found
    raise CheckpointNotFoundError(
        folder,
        "a folder without weights (looked for *.safetensors, *.index.json, pytorch_model*.bin, *.pt, *.pth)",
    )


def _shards_of(index: Path, folder: Path) -> list[Path]:
    weight_map = _weight_map(index)
    shards = []
    for shard in dict.fromkeys(weight_map.values()):
        # The index may only name files of this folder. Judge the name, not where it resolves to: in the
        # Hugging Face cache every file of a snapshot folder is a symlink into ../../blobs/.
        if shard in ("", ".", "..") or Path(shard).name != shard or "\\" in shard or "\0" in shard:
            raise FormatError(index, f"shard {shard!r} is outside the folder")
        if not (folder / shard).is_file():
            raise FormatError(index, f"shard {shard!r} listed in the index is missing")
        shards.append(folder / shard)
    return shards


def _weight_map(index: Path) -> dict[str, str]:
    if index.stat().st_size > 100_000_000:
        raise FormatError(index, "index file is implausibly large")
    try:
        body = load_json(index, index.read_bytes(), "shard index")
    except FormatError as exc:
        raise FormatError(index, f"not a valid shard index ({exc.problem})") from None
    weight_map = body.get("weight_map") if isinstance(body, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise FormatError(index, "weight_map must map tensor names to shard file names")
    return weight_map


def open_hf_folder(folder: Path, open_file: Callable[[Path], TensorSource]) -> TensorSource:
    """Read a model folder as one source whose files are its shards (plus index and config)."""
    index, files = weight_files(folder)
    parts = [open_file(f) for f in files]
    objects = _config_objects(folder / "config.json")
    extra = [p for p in (index, folder / "config.json") if p and p.is_file()]
    slim = [cast(SlimSource, p) for p in parts if p.coded]  # only slim files store through codecs
    if slim:
        if len(slim) < len(parts):
            raise FormatError(folder, "some shards are slim checkpoints and others are not")
        if index is not None:
            _check_slim_index(index, slim)
        return merge_shards(folder, slim, [*files, *extra], objects)
    infos, locations = [], {}
    for part in parts:
        prefix = f"{part.path.name}:" if len(parts) > 1 else ""
        for info in part.tensors:
            infos.append(replace(info, storage=prefix + info.storage))
        locations.update({prefix + key: loc for key, loc in part.locations.items()})
        objects += [replace(o, name=f"{prefix}{o.name}") for o in part.objects]
    merged = TensorSource(
        folder,
        f"hf-folder ({parts[0].format}{', sharded' if len(parts) > 1 else ''})",
        infos,
        locations,
        objects,
        files=[*files, *extra],
        structure_bytes=sum(p.structure_bytes for p in parts),
        tree=parts[0].tree if len(parts) == 1 else None,
    )
    if index is not None:
        for name, shard in _weight_map(index).items():
            if name not in merged:
                raise FormatError(
                    index, f"tensor {name!r} is listed in {shard} but that shard does not hold it"
                )
    return merged


def _check_slim_index(index: Path, shards: list[SlimSource]) -> None:
    """The index of a sharded slim checkpoint must list every part of every shard, where it is, and
    nothing else: a damaged or hand-edited index is refused, not half believed."""
    weight_map = _weight_map(index)
    listed = 0
    for shard in shards:
        for key in shard.physical:
            if weight_map.get(key) != shard.path.name:
                raise FormatError(
                    index, f"part {key!r} of {shard.path.name} is not listed there (a damaged index?)"
                )
        listed += len(shard.physical)
    if listed != len(weight_map):
        held = {key for shard in shards for key in shard.physical}
        ghost = next(key for key in weight_map if key not in held)
        raise FormatError(
            index, f"tensor {ghost!r} is listed in {weight_map[ghost]} but that shard does not hold it"
        )


def _config_objects(config: Path) -> list[ObjectInfo]:
    if not config.is_file() or config.stat().st_size > 10_000_000:
        return []
    try:
        values = load_json(config, config.read_bytes(), "config.json")
    except FormatError as exc:
        raise FormatError(config, f"config.json is not valid JSON ({exc.problem})") from None
    values = inner_config(values, config)  # a slim-layout folder's real config is inside the wrapper
    if not isinstance(values, dict):
        return []
    return [
        ObjectInfo(f"config.{k}", type(values[k]).__name__, str(values[k])[:80])
        for k in CONFIG_KEYS
        if k in values
    ]
