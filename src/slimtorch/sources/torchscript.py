"""TorchScript archives (torch.jit.save): the module's attributes and constants, without running its code.

A TorchScript archive is a torch zip whose ``data.pkl`` pickles the module tree as instances of TorchScript
classes (``__torch__.*``) and whose ``constants.pkl`` holds tensor constants. Those classes are replaced by
inert stand-ins, so nothing in the archive runs, ``__setstate__`` included. Which attributes are parameters
is read as text from each class's ``__parameters__`` declaration in ``code/``.
"""

from __future__ import annotations

import functools
import os
import re
import zipfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from slimtorch.format.source import TensorSource
from slimtorch.format.untrusted import check_expansion
from slimtorch.sources.pickled import (
    MetaStorages,
    ScriptObject,
    describe_tensors,
    flatten,
    key_name,
    script_stand_ins,
    unpickle,
)
from slimtorch.sources.zip_archive import locate_storage, persistent_load, read_entry

# TorchScript writes each module class to code/<module path>.py, opening with `__parameters__ = ["weight", ]`.
# The list is on one line: a `[` never closed cannot make each class scan the rest of the file.
_CLASS_PARAMETERS = re.compile(r"^class (\w+)\(Module\):\n\s+__parameters__ = \[([^\]\n]*)\]", re.MULTILINE)
_MAX_CODE_BYTES = 10_000_000


def open_script(
    path: Path, archive: zipfile.ZipFile, root: str, trusted: list[tuple[Any, str]]
) -> TensorSource:
    infos, locations, objects, structure = [], {}, [], 0
    # Attributes live in data.pkl (storages under data/); tensor constants in constants.pkl (constants/).
    for pickle_name, folder, prefix in (
        ("data.pkl", "data", ""),
        ("constants.pkl", "constants", "__constants__"),
    ):
        entry = f"{root}/{pickle_name}"
        if entry not in archive.namelist():
            continue
        data = read_entry(archive, entry, path)
        structure += len(data)
        storages = MetaStorages(path)
        obj = unpickle(
            path, data, persistent_load(path, storages), trusted=[*trusted, *script_stand_ins(data, path)]
        )
        flat = flatten(obj, path=path)
        declared = {} if prefix else _declared_parameters(path, archive, root, obj)
        named = [(f"{prefix}.{name}" if prefix else name, tensor) for name, tensor in flat.tensors]
        more, more_locations = describe_tensors(
            path,
            named,
            storages,
            functools.partial(locate_storage, path, archive, f"{root}/{folder}"),
            storage_prefix=f"{folder}/",
        )
        # Each module class declares its parameters in code/; where it cannot be found, a tensor that requires
        # grad is a parameter. Every other tensor attribute is a buffer.
        for info in more:
            is_parameter = declared.get(info.name, info.role == "parameter")
            infos.append(replace(info, role="parameter" if is_parameter else "buffer"))
        locations.update(more_locations)
        objects += [o for o in flat.objects if not o.name.endswith(("training", "_is_full_backward_hook"))]
    return TensorSource(path, "torchscript", infos, locations, objects, [path], structure_bytes=structure)


def _declared_parameters(path: Path, archive: zipfile.ZipFile, root: str, obj: Any) -> dict[str, bool]:
    """Whether each tensor attribute of each scripted module is a parameter, as its class declares it.

    ``requires_grad`` alone is not enough: a frozen parameter is saved with ``requires_grad=False``. The
    declarations are read as text from the class's source in ``code/`` (never run); a tensor whose class has
    none is left out.
    """
    classes: dict[str, dict[str, set[str]]] = {}  # module -> class name -> its parameter names
    declared: dict[str, bool] = {}
    stack: list[tuple[str, Any]] = [("", obj)]
    seen: set[int] = set()
    code_bytes = 0
    while stack:
        name, module = stack.pop()
        if not isinstance(module, ScriptObject) or id(module) in seen:
            continue
        seen.add(id(module))
        kind = type(module)
        if kind.__module__ not in classes:
            classes[kind.__module__], code_bytes = _class_parameters(
                path, archive, root, kind.__module__, code_bytes
            )
        parameters = classes[kind.__module__].get(kind.__name__)
        for attr, value in module.__dict__.items():
            child = f"{name}.{key_name(attr)}" if name else key_name(attr)
            if isinstance(value, ScriptObject):
                stack.append((child, value))
            elif parameters is not None and isinstance(value, torch.Tensor):
                declared[child] = attr in parameters
    return declared


def _class_parameters(
    path: Path, archive: zipfile.ZipFile, root: str, module: str, code_bytes: int
) -> tuple[dict[str, set[str]], int]:
    """The parameter names each class in ``module``'s code declares, and the code bytes read so far.

    All the code read is bounded by the archive's size (:func:`check_expansion`): many zip entries can
    point at the same deflated bytes, each decoding to megabytes.
    """
    entry = f"{root}/code/{module.replace('.', '/')}.py"
    try:
        info = archive.getinfo(entry)
    except KeyError:
        return {}, code_bytes
    if info.file_size > _MAX_CODE_BYTES:
        return {}, code_bytes
    code_bytes += info.file_size
    check_expansion(path, "TorchScript code", os.path.getsize(path), code_bytes)
    code = read_entry(archive, entry, path, limit=_MAX_CODE_BYTES, text=True).decode(
        "utf-8", errors="replace"
    )
    classes = {
        match[1]: set(re.findall(r'"([^"]*)"', match[2])) for match in _CLASS_PARAMETERS.finditer(code)
    }
    return classes, code_bytes
