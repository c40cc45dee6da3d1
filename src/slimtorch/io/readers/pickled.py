"""Reading the pickle inside torch.save and TorchScript files without running code or touching tensor data.

Every pickle goes through torch's own ``weights_only`` unpickler: it refuses any global that is not on its
allow-list (``os.system`` included) before anything is called. Storages are handed to it as *meta* storages
of the claimed size, so unpickling allocates nothing for tensor data and tensors come back on the meta device
with their real dtype, shape and strides. Each meta storage is remembered by key, so the reader can map every
tensor back to the bytes in the file that hold it.
"""

from __future__ import annotations

import importlib
import io
import pickle
import pickletools
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch
from torch import _weights_only_unpickler as weights_only

from slimtorch.errors import CheckpointError, FormatError, SlimtorchError, UnsafeCheckpointError
from slimtorch.io.source import ObjectInfo, StorageLocation, TensorInfo, check_tensor_fits

_REFUSED_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")


@dataclass(frozen=True)
class StorageClaim:
    """A storage announced by a pickle's persistent id: its key, element dtype and size in bytes."""

    key: str
    dtype: torch.dtype
    nbytes: int


class MetaStorages:
    """Hands out meta storages for persistent ids and maps each back to its key afterwards."""

    def __init__(self, path: str | Path) -> None:
        self.path = path
        self.claims: dict[str, StorageClaim] = {}
        self._storages: dict[str, torch.storage.TypedStorage] = {}
        self._key_of: dict[int, str] = {}

    def storage(self, key: str, storage_type: Any, numel: int) -> torch.storage.TypedStorage:
        """The meta storage for ``key``; the same object for every reference, as torch.load does."""
        if key in self._storages:
            return self._storages[key]
        dtype = torch.uint8 if storage_type is torch.UntypedStorage else getattr(storage_type, "dtype", None)
        if not isinstance(dtype, torch.dtype) or not isinstance(numel, int) or numel < 0:
            raise FormatError(
                self.path, f"storage {key!r} has an invalid type or size ({storage_type}, {numel})"
            )
        nbytes = numel * dtype.itemsize
        untyped = torch.UntypedStorage(nbytes, device="meta")  # no memory, whatever size the file claims
        typed = torch.storage.TypedStorage(wrap_storage=untyped, dtype=dtype, _internal=True)
        self.claims[key] = StorageClaim(key, dtype, nbytes)
        self._storages[key] = typed
        self._key_of[untyped._cdata] = key
        return typed

    def key_of(self, tensor: torch.Tensor) -> str | None:
        return self._key_of.get(tensor.untyped_storage()._cdata)


def resolve_globals(names: Iterable[str]) -> list[tuple[Any, str]]:
    """Import the globals a user explicitly trusts (``--allow-global pkg.mod.Name``)."""
    resolved = []
    for name in names:
        module_name, _, attr = name.rpartition(".")
        try:
            obj = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError, ValueError) as exc:
            raise SlimtorchError(f"--allow-global {name}: cannot import it ({exc})") from None
        resolved.append((obj, name))
    return resolved


def unpickle(
    path: str | Path,
    stream: BinaryIO | bytes,
    persistent_load: Callable[[Any], Any] | None = None,
    *,
    trusted: Iterable[tuple[Any, str]] = (),
) -> Any:
    """Unpickle with torch's weights_only unpickler; map its refusals and failures to our errors.

    ``trusted`` adds (object, dotted name) pairs to the allow-list for this call only.
    """
    if isinstance(stream, bytes):
        stream = io.BytesIO(stream)
    unpickler = weights_only.Unpickler(stream, encoding="utf-8")
    if persistent_load is not None:
        unpickler.persistent_load = persistent_load
    try:
        with torch.serialization.safe_globals(list(trusted)):
            return unpickler.load()
    except CheckpointError:
        raise
    except pickle.UnpicklingError as exc:
        message = str(exc)
        refused = _REFUSED_GLOBAL.search(message)
        if refused and ("not an allowed global" in message or "is blocked" in message):
            raise UnsafeCheckpointError(path, refused.group(1)) from exc
        if "unrecognized function" in message or "Can only" in message:
            raise UnsafeCheckpointError(path, _first_line(message)) from exc
        raise FormatError(path, f"corrupt pickle: {_first_line(message)}") from exc
    except RecursionError as exc:
        raise FormatError(path, "corrupt pickle: nested too deeply") from exc
    except (
        EOFError,
        ValueError,
        TypeError,
        KeyError,
        IndexError,
        AttributeError,
        RuntimeError,
        UnicodeDecodeError,
        OverflowError,
        MemoryError,
    ) as exc:
        raise FormatError(
            path, f"corrupt or truncated pickle: {_first_line(str(exc)) or type(exc).__name__}"
        ) from exc


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else ""


def globals_in(data: bytes) -> set[str]:
    """Dotted names of every GLOBAL a protocol <= 3 pickle mentions, without unpickling it."""
    found = set()
    for opcode, arg, _ in pickletools.genops(data):
        if opcode.name == "GLOBAL":
            module, name = str(arg).split(" ", 1)
            found.add(f"{module}.{name}")
    return found


@dataclass(frozen=True)
class Flattened:
    tensors: list[tuple[str, torch.Tensor]]
    objects: list[ObjectInfo]


def flatten(obj: Any) -> Flattened:
    """Walk nested dicts, lists, tuples and objects; name every leaf by its dotted path.

    ``{"model": {"fc.weight": t}, "epoch": 3}`` gives the tensor ``model.fc.weight`` and the object ``epoch``.
    Iterative, so a deeply nested pickle cannot overflow the stack; a container seen twice is walked once.
    """
    tensors: list[tuple[str, torch.Tensor]] = []
    objects: list[ObjectInfo] = []
    seen: set[int] = set()
    stack: list[tuple[str, Any]] = [("", obj)]
    while stack:
        name, value = stack.pop()
        if isinstance(value, torch.Tensor):
            tensors.append((name, value))
            continue
        children = _children(value)
        if children == []:
            continue  # an empty container says nothing about the bytes (an empty optimizer state, say)
        if children is None:
            objects.append(ObjectInfo(name, type(value).__name__, _summary(value)))
            continue
        if id(value) in seen:
            continue
        seen.add(id(value))
        # Reversed, so the stack pops children in their original order.
        stack.extend((f"{name}.{key}" if name else str(key), child) for key, child in reversed(children))
    return Flattened(tensors, objects)


def _children(value: Any) -> list[tuple[Any, Any]] | None:
    if isinstance(value, dict):
        return list(value.items())
    if isinstance(value, (list, tuple)) and (not value or not _is_scalar_sequence(value)):
        return list(enumerate(value))
    state = getattr(value, "__dict__", None)
    if isinstance(value, ScriptObject) and isinstance(state, dict):
        return list(state.items())
    return None


def _is_scalar_sequence(value: list | tuple) -> bool:
    """A list of plain numbers or strings is one object (a shape, betas), not many."""
    return all(isinstance(item, (int, float, str, bool, type(None))) for item in value)


def _summary(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class ScriptObject:
    """Inert stand-in for a TorchScript class (``__torch__.*``): keeps its state, never runs its code."""

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, dict):
            self.__dict__.update(state)
        else:
            self.__dict__["state"] = state


def script_stand_ins(data: bytes) -> list[tuple[Any, str]]:
    """Allow-list entries that let the weights_only unpickler read a TorchScript ``data.pkl``.

    TorchScript classes become inert :class:`ScriptObject` subclasses, and ``torch.jit._pickle`` helpers
    become functions that return their data. Any other unknown global is still refused.
    """
    trusted: list[tuple[Any, str]] = []
    for name in sorted(globals_in(data)):
        module, _, attr = name.rpartition(".")
        if module == "__torch__" or module.startswith("__torch__."):
            trusted.append((type(attr, (ScriptObject,), {"__module__": module}), name))
        elif module == "torch.jit._pickle":
            trusted.append((_restore_type_tag if attr == "restore_type_tag" else _identity, name))
    return trusted


def _identity(data: Any) -> Any:
    return data


def _restore_type_tag(value: Any, type_str: str) -> Any:
    return value


def describe_tensors(
    path: str | Path,
    tensors: list[tuple[str, torch.Tensor]],
    storages: MetaStorages,
    locate: Callable[[StorageClaim], StorageLocation],
    *,
    storage_prefix: str = "",
) -> tuple[list[TensorInfo], dict[str, StorageLocation]]:
    """Turn unpickled meta tensors into TensorInfos and the StorageLocations that hold their bytes."""
    infos: list[TensorInfo] = []
    locations: dict[str, StorageLocation] = {}
    for name, tensor in tensors:
        if tensor.layout != torch.strided or tensor.is_quantized or tensor.is_nested:
            raise FormatError(
                path, f"tensor {name!r} is {tensor.layout} / quantized / nested, not supported yet"
            )
        key = storages.key_of(tensor)
        if key is None:
            raise FormatError(path, f"tensor {name!r} has no storage in the file (a meta tensor?)")
        claim = storages.claims[key]
        storage_id = storage_prefix + key
        if storage_id not in locations:
            locations[storage_id] = locate(claim)
        role = "parameter" if isinstance(tensor, torch.nn.Parameter) or tensor.requires_grad else None
        info = TensorInfo(
            name=name or "<root>",
            dtype=tensor.dtype,
            shape=tuple(tensor.shape),
            stride=tuple(tensor.stride()),
            storage=storage_id,
            storage_offset=tensor.storage_offset() * tensor.element_size(),
            storage_nbytes=claim.nbytes,
            role=role,
        )
        check_tensor_fits(path, info)
        infos.append(info)
    return infos, locations
