"""torch.save zip files (.pt .pth .bin .ckpt, PyTorch >= 1.6), nested training checkpoints included.

We unpickle only ``data.pkl`` (tensors come back as meta tensors) and locate each storage's bytes in the zip.
"""

from __future__ import annotations

import zipfile
from pathlib import Path
from typing import Any

from slimtorch.format.source import TensorSource
from slimtorch.sources.pickled import MetaStorages, describe_tensors, flatten, unpickle
from slimtorch.sources.zip_archive import locate_storage, persistent_load, read_entry


def open_torch_zip(
    path: Path, archive: zipfile.ZipFile, root: str, trusted: list[tuple[Any, str]]
) -> TensorSource:
    """Read an open torch.save archive lazily."""
    data = read_entry(archive, f"{root}/data.pkl", path)
    storages = MetaStorages(path)
    obj = unpickle(path, data, persistent_load(path, storages), trusted=trusted)
    flat = flatten(obj, path=path)
    infos, locations = describe_tensors(
        path, flat.tensors, storages, lambda claim: locate_storage(path, archive, f"{root}/data", claim)
    )
    return TensorSource(
        path, "torch-zip", infos, locations, flat.objects, [path], structure_bytes=len(data), tree=obj
    )
