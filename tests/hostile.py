"""Builders of hostile and broken files, written byte by byte the way an attacker or a bad disk would."""

from __future__ import annotations

import pickle
import shlex
import zipfile
from pathlib import Path

from slimtorch.io.readers.torch_legacy import MAGIC_NUMBER, PROTOCOL_VERSION


def os_system_pickle(command: str) -> bytes:
    """A protocol-2 pickle whose loading calls ``os.system(command)``."""
    arg = command.encode()
    return b"\x80\x02cos\nsystem\nX" + len(arg).to_bytes(4, "little") + arg + b"\x85R."


def touch_command(marker: Path) -> str:
    return f"touch {shlex.quote(str(marker))}"


def torch_zip_with_pickle(path: Path, data_pkl: bytes) -> Path:
    """A zip laid out like torch.save's, with the given data.pkl."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as archive:
        archive.writestr("archive/data.pkl", data_pkl)
        archive.writestr("archive/byteorder", "little")
        archive.writestr("archive/version", "3\n")
    return path


def legacy_with_pickle(path: Path, main_pickle: bytes) -> Path:
    """A legacy torch.save file whose main object pickle is ``main_pickle``."""
    header = b"".join(
        pickle.dumps(value, protocol=2)
        for value in (MAGIC_NUMBER, PROTOCOL_VERSION, {"protocol_version": 1001, "little_endian": True})
    )
    path.write_bytes(header + main_pickle + pickle.dumps([], protocol=2))
    return path


def rewrite_zip_entry(source: Path, target: Path, entry_name: str, transform) -> Path:
    """Copy a zip, passing its top-level-folder entry ``entry_name`` through ``transform(bytes) -> bytes``."""
    replaced = 0
    with zipfile.ZipFile(source) as old, zipfile.ZipFile(target, "w", zipfile.ZIP_STORED) as new:
        for info in old.infolist():
            data = old.read(info.filename)
            if info.filename.endswith(f"/{entry_name}") and info.filename.count("/") == 1:
                data = transform(data)
                replaced += 1
            new.writestr(info, data)
    assert replaced == 1, f"{source} has no single */{entry_name}"
    return target


class _StorageClaim:
    """Pickled as a persistent id claiming ``numel`` float32 elements for storage "0"."""

    def __init__(self, numel: int) -> None:
        self.numel = numel


class _TensorClaim:
    def __init__(self, storage: _StorageClaim, shape: tuple[int, ...], stride: tuple[int, ...]) -> None:
        self.args = (storage, 0, shape, stride, False, {})

    def __reduce__(self):
        import torch

        return (torch._utils._rebuild_tensor_v2, self.args)


def torch_zip_with_claims(path: Path, claimed_numel: int, shape: tuple[int, ...], stored_bytes: int) -> Path:
    """A torch zip whose pickle claims ``claimed_numel`` elements and ``shape``, holding ``stored_bytes``."""
    import io

    import torch

    class Pickler(pickle.Pickler):
        def persistent_id(self, obj):
            if isinstance(obj, _StorageClaim):
                return ("storage", torch.FloatStorage, "0", "cpu", obj.numel)
            return None

    stride = tuple(int(torch.tensor(shape[i + 1 :]).prod()) for i in range(len(shape)))
    buffer = io.BytesIO()
    Pickler(buffer, protocol=2).dump({"w": _TensorClaim(_StorageClaim(claimed_numel), shape, stride)})
    torch_zip_with_pickle(path, buffer.getvalue())
    with zipfile.ZipFile(path, "a", zipfile.ZIP_STORED) as archive:
        archive.writestr("archive/data/0", b"\x00" * stored_bytes)
    return path
