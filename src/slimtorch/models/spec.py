"""``package.module:factory`` or ``path/to/file.py:factory``: a model named by the code that builds it.

This imports the user's own code, which they name themselves; it never runs code from a checkpoint or
from a model folder.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

from torch import nn

from slimtorch.errors import SlimtorchError


def resolve_factory(spec: str, *, what: str = "model") -> Callable[[], nn.Module]:
    """The callable that ``spec`` names; the current folder is importable, like ``python -m``. ``what``
    names the spec in errors (``"data"`` for a data factory).

    Example:
        >>> factory = resolve_factory("torch.nn:Identity")
        >>> type(factory()).__name__
        'Identity'
    """
    where, sep, attr = spec.rpartition(":")
    if not sep or not where or not attr:
        if Path(spec).is_file():
            raise SlimtorchError(
                f"model {spec!r} is a file, not a model: name the code that builds the model "
                f"(package.module:factory or file.py:factory) and give the file with --weights"
            )
        raise SlimtorchError(f"{what} {spec!r}: expected package.module:factory or file.py:factory")
    module = _import(where, f"{what} {spec!r}")
    try:
        factory = getattr(module, attr)
    except AttributeError:
        raise SlimtorchError(f"{what} {spec!r}: {where} has no attribute {attr!r}") from None
    if not callable(factory):
        raise SlimtorchError(f"{what} {spec!r}: {attr} is a {type(factory).__name__}, not callable")
    return factory


def _import(where: str, named: str) -> ModuleType:
    if where.endswith(".py"):
        path = Path(where)
        if not path.is_file():
            raise SlimtorchError(f"{named}: no such file {where}")
        loaded = importlib.util.spec_from_file_location(path.stem, path)
        assert loaded is not None and loaded.loader is not None
        module = importlib.util.module_from_spec(loaded)
        # Registered while it runs, as an import would be: dataclasses and pickling look the module up.
        sys.modules[loaded.name] = module
        try:
            loaded.loader.exec_module(module)
        except BaseException:
            del sys.modules[loaded.name]
            raise
        return module
    if "" not in sys.path and str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))
    try:
        return importlib.import_module(where)
    except ModuleNotFoundError as exc:
        raise SlimtorchError(f"{named}: cannot import {where} ({exc})") from None
