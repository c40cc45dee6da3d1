"""Builders of hostile and broken files, written byte by byte the way an attacker or a bad disk would."""

from __future__ import annotations

import json
import pickle
import shlex
import struct
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


# -- safetensors headers ---------------------------------------------------------------------------------
def read_safetensors(path: Path) -> tuple[dict, bytes]:
    """(header as a dict, the data bytes after it) of a safetensors file."""
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + length]), raw[8 + length :]


def write_safetensors_raw(path: Path, header: dict, data: bytes) -> Path:
    """Write ``header`` (padded to 8 bytes, as safetensors does) and ``data`` as a safetensors file."""
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


def edit_slim_metadata(path: Path, edit) -> Path:
    """Rewrite the JSON in ``__metadata__["slimtorch"]`` in place via ``edit(body)``; data stays valid."""
    header, data = read_safetensors(path)
    body = json.loads(header["__metadata__"]["slimtorch"])
    edit(body)
    header["__metadata__"]["slimtorch"] = json.dumps(body)
    return write_safetensors_raw(path, header, data)


def data_range(path: Path, key: str) -> tuple[int, int]:
    """Absolute byte range ``[begin, end)`` of physical tensor ``key`` in a safetensors file."""
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    begin, end = json.loads(raw[8 : 8 + length])[key]["data_offsets"]
    return 8 + length + begin, 8 + length + end


def remove_safetensors_entry(path: Path, key: str) -> Path:
    """Drop physical tensor ``key``: its header entry and its bytes, moving later tensors' offsets down."""
    header, data = read_safetensors(path)
    begin, end = header.pop(key)["data_offsets"]
    for name, entry in header.items():
        if name != "__metadata__" and entry["data_offsets"][0] >= end:
            entry["data_offsets"] = [offset - (end - begin) for offset in entry["data_offsets"]]
    return write_safetensors_raw(path, header, data[:begin] + data[end:])


def add_safetensors_entry(path: Path, key: str, dtype: str, shape: list[int], payload: bytes) -> Path:
    """Append a physical tensor ``key`` holding ``payload`` after the existing data."""
    header, data = read_safetensors(path)
    header[key] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(payload)]}
    return write_safetensors_raw(path, header, data + payload)
