"""Reading the pickle inside torch.save and TorchScript files without running code or touching tensor data.

Every pickle goes through torch's own ``weights_only`` unpickler: it refuses any global that is not on its
allow-list (``os.system`` included) before anything is called. Storages are handed to it as *meta* storages
of the claimed size, so unpickling allocates nothing for tensor data and tensors come back on the meta device
with their real dtype, shape and strides. Each meta storage is remembered by key, so the reader can map every
tensor back to the bytes in the file that hold it.
"""

from __future__ import annotations

import io
import pickle
import pickletools
import re
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch
from torch import _weights_only_unpickler as weights_only

from slimtorch.errors import CheckpointError, FormatError, PlaceholderWarning, UnsafeCheckpointError
from slimtorch.format.source import ObjectInfo, StorageLocation, TensorInfo, check_tensor_fits
from slimtorch.format.untrusted import untrusted
from slimtorch.sources.allowed_globals import can_be_allowed, importable_global, never_allowed
from slimtorch.sources.allowed_globals import resolve_globals as resolve_globals  # where readers get it
from slimtorch.sources.objects import short_repr
from slimtorch.sources.pickle_budget import (
    MAX_NESTING,
    MAX_OPCODES,
    MAX_PICKLE_BYTES,
    check_pickle,
    global_name,
)

ROOT = "<root>"
"""The name of the tensor a file holds when ``torch.save`` was given one tensor, not a dict."""
_REFUSED_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")
_DOTTED = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+")


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

    def storage(self, key: Any, storage_type: Any, numel: Any) -> torch.storage.TypedStorage:
        """The meta storage for ``key``; the same object for every reference, as torch.load does."""
        if not isinstance(key, str) or len(key) > 256:
            # torch.save names storages "0", "1", ...; any other key is a hostile or corrupt file
            raise FormatError(self.path, f"a storage key that is not a short string: {short_repr(key)}")
        if key in self._storages:
            return self._storages[key]
        dtype = torch.uint8 if storage_type is torch.UntypedStorage else getattr(storage_type, "dtype", None)
        if not isinstance(dtype, torch.dtype) or type(numel) is not int or numel < 0:
            raise FormatError(
                self.path,
                f"storage {key!r} has an invalid type or size "
                f"({short_repr(storage_type)}, {short_repr(numel)})",
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


def unpickle(
    path: str | Path,
    stream: BinaryIO | bytes,
    persistent_load: Callable[[Any], Any] | None = None,
    *,
    trusted: Iterable[tuple[Any, str]] = (),
    placeholders: bool = True,
) -> Any:
    """Unpickle with torch's weights_only unpickler; map its refusals and failures to our errors.

    ``trusted`` adds (object, dotted name) pairs to the allow-list for this call only. With
    ``placeholders``, numpy's arrays, scalars and dtypes are read as numpy builds them, and any other class
    or function the pickle names that torch's list lacks becomes an inert :class:`Placeholder` (see
    :func:`stand_ins`): the tensors always open. What can run code (:func:`never_allowed`) still refuses.
    """
    trusted = list(trusted)
    if isinstance(stream, bytes):
        stream = io.BytesIO(stream)
    if placeholders:
        trusted += stand_ins(path, stream, {name for _, name in trusted})
    check_pickle(path, stream, {name for _, name in trusted}, can_be_allowed)
    unpickler = weights_only.Unpickler(stream, encoding="utf-8")
    if persistent_load is not None:
        # pickle's documented hook, set per instance over the class's default method
        unpickler.persistent_load = persistent_load  # type: ignore[method-assign]
    try:
        # a copy: torch annotates the argument as a list of its own (invariant) element type
        with torch.serialization.safe_globals(list(trusted)), warnings.catch_warnings():
            # torch warns of any protocol but 2 on stderr; the opcodes were checked above, and a warning
            # would make the CLI's one line two
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            result = unpickler.load()
    except CheckpointError:
        raise
    except pickle.UnpicklingError as exc:
        message = str(exc)
        refused = _REFUSED_GLOBAL.search(message)
        if refused and ("not an allowed global" in message or "is blocked" in message):
            name = refused.group(1)
            raise UnsafeCheckpointError(path, name, allowable=can_be_allowed(name)) from exc
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
    if any(isinstance(obj, type) and issubclass(obj, Placeholder) for obj, _ in trusted):
        _say_placeholders(path, placeholders_in(result))
    return result


def _say_placeholders(path: str | Path, found: dict[str, int]) -> None:
    """One warning naming the classes kept as placeholders, and how to build one where that is possible."""
    if not found:
        return
    names = sorted(found, key=lambda name: (-found[name], name))
    shown = ", ".join(f"{name} ({found[name]})" if found[name] > 1 else name for name in names[:4])
    more = f" and {len(names) - 4} more" if len(names) > 4 else ""
    # torch's own classes (a whole pickled nn.Module) need no building: their tensors are read as they are
    importable = [name for name in names if not name.startswith("torch.") and importable_global(name)]
    how = (
        f"; to build them instead (only for a file you trust): --allow-global {importable[0]}"
        if importable
        else ""
        if all(name.startswith("torch.") for name in names)
        else "; none of their classes is installed here, so they cannot be built"
    )
    warnings.warn(
        PlaceholderWarning(
            f"{path}: {sum(found.values()):,} pickled object(s) kept as inert placeholders, never built: "
            f"{shown}{more}{how}"
        ),
        stacklevel=3,
    )


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else ""


def globals_in(data: bytes | BinaryIO, path: str | Path = "<pickle>") -> set[str]:
    """Dotted names of every GLOBAL a protocol <= 3 pickle mentions, as torch's unpickler names them
    (Python 2 names mapped), without unpickling it. A stream is read from its position and put back;
    the scan stops past the pickle budget (:func:`check_pickle` refuses such a pickle)."""
    stream = io.BytesIO(data) if isinstance(data, bytes) else data
    start, found = stream.tell(), set()
    try:
        with untrusted(path, "pickle"):
            for count, (opcode, arg, position) in enumerate(pickletools.genops(stream)):
                assert position is not None  # genops gives each opcode's position in a stream (tell())
                if count > MAX_OPCODES or position - start > MAX_PICKLE_BYTES:
                    break
                if opcode.name == "GLOBAL":
                    module, _, name = str(arg).partition(" ")
                    found.add(global_name(module, name))
    finally:
        stream.seek(start)
    return found


@dataclass(frozen=True)
class Flattened:
    tensors: list[tuple[str, torch.Tensor]]
    objects: list[ObjectInfo]


MAX_NAME_CHARS = 64 * 2**20
"""Characters of all the dotted names one walk builds (every tensor, value and container on the way): a
100,000-tensor checkpoint with 200-character names takes 20 million. Bounds a walk whose names grow with
the nesting (a chain 100 deep of keys as long as the file)."""


MAX_PATHS = 10_000_000
"""Names the unpickled object would give its tensors and values with every path to them counted, as
torch.load's object has them: a dict holding one dict twice, 40 levels deep, names one tensor 2**40 times
(a "billion laughs"). :func:`flatten` names each leaf once, on its first path; beyond this count the file
is refused rather than read as something smaller than it claims to be."""


def flatten(obj: Any, *, path: str | Path = "<pickle>") -> Flattened:
    """Walk nested dicts, lists, tuples and objects; name every leaf by its dotted path.

    ``{"model": {"fc.weight": t}, "epoch": 3}`` gives the tensor ``model.fc.weight`` and the object ``epoch``.
    Iterative and linear: a container seen twice is walked once, a value seen twice summarized once, names
    are bounded by :data:`MAX_NAME_CHARS` and the nesting by :data:`MAX_NESTING` (a :class:`FormatError`
    on ``path`` beyond them).
    """
    if _count_paths(obj, MAX_PATHS) > MAX_PATHS:
        raise FormatError(
            path, f"shared containers give its values more than {MAX_PATHS:,} names (a billion-laughs bomb?)"
        )
    tensors: list[tuple[str, torch.Tensor]] = []
    objects: list[ObjectInfo] = []
    seen: set[int] = set()
    summaries: dict[int, tuple[str, str]] = {}
    budget = MAX_NAME_CHARS
    stack: list[tuple[str, Any, int]] = [("", obj, 0)]
    while stack:
        name, value, depth = stack.pop()
        if isinstance(value, torch.Tensor):
            tensors.append((name if depth else ROOT, value))  # a key "" stays "", refused when described
            continue
        if id(value) in seen:
            continue
        if id(value) not in summaries:
            children = _children(value)
            if children == []:
                continue  # an empty container says nothing about the bytes (an empty optimizer state, say)
            if children is not None:
                seen.add(id(value))
                if depth >= MAX_NESTING:
                    raise FormatError(path, f"{name[:80]!r} nests values more than {MAX_NESTING} deep")
                named = []
                for key, child in children:
                    named.append((f"{name}.{key_name(key)}" if name else key_name(key), child))
                    budget -= len(named[-1][0])
                    if budget < 0:
                        raise FormatError(path, f"its names take more than {MAX_NAME_CHARS:,} characters")
                # Reversed, so the stack pops children in their original order.
                stack.extend((child_name, child, depth + 1) for child_name, child in reversed(named))
                continue
            kind = f"{value.source} (placeholder)" if isinstance(value, Placeholder) else type(value).__name__
            summaries[id(value)] = (kind, short_repr(value))
        objects.append(ObjectInfo(name, *summaries[id(value)]))
    return Flattened(tensors, objects)


def _count_paths(obj: Any, limit: int) -> int:
    """How many root-to-leaf paths ``obj`` has (up to ``limit + 1``): a container shared by two parents
    counts once for each. Iterative and linear, each container counted once; a cycle adds nothing."""
    counts: dict[int, int] = {}
    stack: list[tuple[Any, list | None]] = [(obj, None)]
    while stack:
        value, children = stack.pop()
        if children is not None:  # its children are counted: add them up
            counts[id(value)] = min(limit + 1, sum(counts[id(child)] for _, child in children))
            continue
        if id(value) in counts:
            continue
        children = None if isinstance(value, torch.Tensor) else _children(value)
        counts[id(value)] = 0 if children == [] else 1  # a leaf, or 0 while in progress (a cycle)
        if children:
            counts[id(value)] = 0
            stack.append((value, children))
            stack.extend((child, None) for _, child in children)
    return counts[id(obj)]


def key_name(key: Any) -> str:
    """A dict key or attribute as it appears in a dotted name: a string as is, anything else as a short
    repr (``str()`` of a hostile key could be megabytes, or an integer Python refuses to print)."""
    return key if isinstance(key, str) else short_repr(key, 200)


def _children(value: Any) -> list[tuple[Any, Any]] | None:
    if isinstance(value, dict):
        return list(value.items())
    if isinstance(value, (list, tuple)) and (not value or not _is_scalar_sequence(value)):
        return list(enumerate(value))
    state = getattr(value, "__dict__", None)
    if isinstance(value, ScriptObject) and isinstance(state, dict):
        if isinstance(value, Placeholder):
            if _module_state(state):
                # a whole pickled nn.Module: its tensors by the names its state_dict would give them
                parts = [state.get(part) for part in ("_parameters", "_buffers", "_modules")]
                return [
                    (k, v)
                    for part in parts
                    if isinstance(part, dict)
                    for k, v in part.items()
                    if v is not None
                ]
            if not _holds_tensor(state):
                return None  # one value, shown as its class and state: a Namespace, a path, a config
        return list(state.items())
    return None


def _holds_tensor(tree: Any, limit: int = 10_000) -> bool:
    """Whether ``tree`` holds a tensor within its first ``limit`` values (past them, it is assumed to)."""
    stack, seen = [tree], set()
    while stack:
        value = stack.pop()
        if isinstance(value, torch.Tensor):
            return True
        limit -= 1
        if limit < 0:
            return True
        if id(value) in seen:
            continue
        seen.add(id(value))
        if isinstance(value, dict):
            stack.extend(value.values())
        elif isinstance(value, (list, tuple)):
            stack.extend(value)
        elif isinstance(getattr(value, "__dict__", None), dict) and isinstance(value, ScriptObject):
            stack.extend(value.__dict__.values())
    return False


def _module_state(state: dict) -> bool:
    return isinstance(state.get("_parameters"), dict) and isinstance(state.get("_modules"), dict)


def _is_scalar_sequence(value: list | tuple) -> bool:
    """A list of plain numbers or strings is one object (a shape, betas), not many."""
    return all(isinstance(item, (int, float, str, bool, type(None))) for item in value)


class ScriptObject:
    """Inert stand-in for a TorchScript class (``__torch__.*``): keeps its state, never runs its code."""

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, dict):
            self.__dict__.update(state)
        else:
            self.__dict__["state"] = state


class Placeholder(ScriptObject):
    """An object a pickle describes but slimtorch did not build: a class or function off torch's allow-list
    and not trusted with ``--allow-global``. Each such global becomes a subclass named as it is (its
    ``__module__`` and ``__qualname__``), :attr:`source` the dotted name; calling or creating one keeps the
    arguments as ``args``, and its state lands in ``__dict__`` as plain data. No code of the file's classes
    runs, nor is their module imported: the pickle's tensors open, and its values can be inspected."""

    source = ""

    def __new__(cls, *args: Any, **kwargs: Any) -> Placeholder:
        made = object.__new__(cls)
        if args:
            made.__dict__["args"] = args
        return made

    def __init__(self, *args: Any, **kwargs: Any) -> None:  # a call (REDUCE) passes the arguments here too
        pass

    def __repr__(self) -> str:
        return f"<placeholder {self.source}>"


def placeholders_in(tree: Any, limit: int = 100_000) -> dict[str, int]:
    """Dotted name -> how many :class:`Placeholder` objects of it ``tree`` holds (a bounded walk)."""
    found: dict[str, int] = {}
    stack, seen = [tree], set()
    while stack and limit > 0:
        value = stack.pop()
        limit -= 1
        if id(value) in seen or isinstance(value, (torch.Tensor, str, bytes, int, float)):
            continue
        seen.add(id(value))
        if isinstance(value, Placeholder):
            found[value.source] = found.get(value.source, 0) + 1
            stack.extend(value.__dict__.values())  # what it holds, whether or not flatten walks it
            continue
        children = _children(value)
        if children:
            stack.extend(child for _, child in children)
    return found


def _numpy_globals() -> dict[str, Any]:
    """numpy's own names for what it pickles (arrays, scalars, dtypes), under numpy 1's module names and 2's:
    data, allowed by default. An array is made empty, then given the pickle's bytes by its state (numpy
    checks their length against its shape), so it holds no more memory than the pickle itself."""
    import numpy as np
    from numpy._core.multiarray import scalar

    def reconstruct(subtype: Any, shape: Any, dtype: Any) -> Any:
        if subtype is not np.ndarray or tuple(shape) != (0,):
            raise ValueError(f"numpy array pickled as {short_repr(subtype)} of shape {short_repr(shape)}")
        return np.ndarray.__new__(np.ndarray, (0,), dtype)

    found: dict[str, Any] = {"numpy.ndarray": np.ndarray, "numpy.dtype": np.dtype}
    # a dtype is built as np.dtype(...) and then given its state, as an instance of its own class
    found.update(
        {f"numpy.dtypes.{name}": kind for name, kind in vars(np.dtypes).items() if name.endswith("DType")}
    )
    for module in ("numpy.core.multiarray", "numpy._core.multiarray"):
        found[f"{module}._reconstruct"] = reconstruct
        found[f"{module}.scalar"] = scalar
    return found


def stand_ins(path: str | Path, stream: BinaryIO, trusted: set[str]) -> list[tuple[Any, str]]:
    """Allow-list entries for a pickle's globals torch's list lacks: numpy's own (:func:`_numpy_globals`),
    and a :class:`Placeholder` subclass for every other one that cannot run code (what can, like
    ``os.system``, stays refused, with its name). ``stream`` is read from its position and put back."""
    try:
        names = globals_in(stream, path)
    except CheckpointError:
        names = set()  # a corrupt pickle: the budget check or the unpickler says what is wrong with it
    allowed = set(weights_only._get_allowed_globals()) | set(weights_only._get_user_allowed_globals())
    wanted = sorted(names - allowed - trusted)
    every_numpy = _numpy_globals() if wanted else {}
    numpy = {name: obj for name, obj in every_numpy.items() if name in wanted}
    if numpy:  # the dtype classes the pickle never names but builds: a dtype's state is given to one
        numpy.update({name: obj for name, obj in every_numpy.items() if name.startswith("numpy.dtypes.")})
    foreign = [name for name in wanted if name not in numpy and not _refused(name)]
    if len(foreign) > MAX_SCRIPT_CLASSES:
        raise FormatError(
            path, f"refused pickle: more than {MAX_SCRIPT_CLASSES:,} classes it does not say how to build"
        )
    made: list[tuple[Any, str]] = [(obj, name) for name, obj in numpy.items()]
    for name in foreign:
        module, _, attr = name.rpartition(".")
        namespace = {"__module__": module, "__qualname__": attr, "source": name}
        made.append((type(attr, (Placeholder,), namespace), name))
    return made


def _refused(name: str) -> bool:
    """Globals that stay refused: what can run code, and what torch's unpickler blocks by module."""
    if len(name) > 200 or not _DOTTED.fullmatch(name):  # a placeholder's name is printed: short, plain
        return True
    return never_allowed(name) or name.split(".", 1)[0] in weights_only._blocklisted_modules


MAX_SCRIPT_CLASSES = 10_000
"""Distinct classes a TorchScript pickle may name (silero_vad's names 40): each becomes a stand-in class on
the unpickler's allow-list, which torch searches for every object built."""


def script_stand_ins(data: bytes, path: str | Path = "<pickle>") -> list[tuple[Any, str]]:
    """Allow-list entries that let the weights_only unpickler read a TorchScript ``data.pkl``.

    TorchScript classes become inert :class:`ScriptObject` subclasses, and ``torch.jit._pickle`` helpers
    become functions that return their data. Any other unknown global is still refused.
    """
    names = globals_in(data, path)
    if len(names) > MAX_SCRIPT_CLASSES:
        raise FormatError(path, f"refused pickle: more than {MAX_SCRIPT_CLASSES:,} TorchScript classes")
    trusted: list[tuple[Any, str]] = []
    for name in sorted(names):
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
    """Turn unpickled meta tensors into TensorInfos and the StorageLocations that hold their bytes.

    Whatever the unpickled tensors do wrong (state that shadows a tensor method, a dtype torch cannot
    size) is a :class:`FormatError` on ``path``.
    """
    infos: list[TensorInfo] = []
    locations: dict[str, StorageLocation] = {}
    for name, tensor in tensors:
        if not name:  # no reader could name it (torch.save of one tensor is named ROOT by flatten)
            raise FormatError(path, "a tensor is stored under the empty key '', which no model has")
        with untrusted(path, f"tensor {name[:80]!r}"):
            info, claim = _describe(path, name, tensor, storages, storage_prefix)
            if info.storage not in locations:
                locations[info.storage] = locate(claim)
            check_tensor_fits(path, info)
        infos.append(info)
    return infos, locations


def _describe(
    path: str | Path, name: str, tensor: torch.Tensor, storages: MetaStorages, storage_prefix: str
) -> tuple[TensorInfo, StorageClaim]:
    # A pickled Parameter's state (``_rebuild_parameter_with_state``) becomes its attributes: one named like
    # a tensor method (``stride = 3``) would break every reader of the tensor.
    shadowing = sorted(str(attr) for attr in vars(tensor) if hasattr(torch.Tensor, str(attr)))
    if shadowing:
        raise FormatError(
            path, f"tensor {name[:80]!r} has state {shadowing[0]!r} that shadows a tensor method"
        )
    if tensor.layout != torch.strided or tensor.is_quantized or tensor.is_nested:
        raise FormatError(
            path, f"tensor {name[:80]!r} is {tensor.layout} / quantized / nested, not supported yet"
        )
    key = storages.key_of(tensor)
    if key is None:
        raise FormatError(path, f"tensor {name[:80]!r} has no storage in the file (a meta tensor?)")
    claim = storages.claims[key]
    role = "parameter" if isinstance(tensor, torch.nn.Parameter) or tensor.requires_grad else None
    info = TensorInfo(
        name=name,
        dtype=tensor.dtype,
        shape=tuple(tensor.shape),
        stride=tuple(tensor.stride()),
        storage=storage_prefix + key,
        storage_offset=int(tensor.storage_offset()) * tensor.element_size(),  # never symbolic here
        storage_nbytes=claim.nbytes,
        role=role,
    )
    return info, claim
