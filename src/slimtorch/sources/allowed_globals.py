"""Which pickle globals ``--allow-global`` may trust, and importing them from installed packages only.

torch's weights_only unpickler refuses every global off its list; the user may add one they trust. Some
can never be trusted, whatever the user says: what runs code, starts processes or touches files from
arguments the pickle chooses (``builtins.eval``, ``os.system``, ``functools.partial``). A refusal suggests
the flag only for a name that could help (:func:`can_be_allowed`), and :func:`resolve_globals` never
imports a module planted in the current directory.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import os
import re
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from slimtorch.errors import SlimtorchError

NEVER_ALLOWED_MODULES = frozenset(
    {
        *("builtins", "__builtin__", "os", "posix", "nt", "posixpath", "ntpath", "sys", "subprocess"),
        *("_posixsubprocess", "shutil", "importlib", "pkgutil", "zipimport", "runpy", "functools"),
        *("operator", "pickle", "_pickle", "pickletools", "copyreg", "copy_reg", "marshal", "types", "code"),
        *("codeop", "ctypes", "_ctypes", "pty", "io", "_io", "socket", "signal", "multiprocessing"),
        *("threading", "_thread", "asyncio", "webbrowser", "tempfile", "pdb", "timeit", "trace", "cProfile"),
        *("profile", "inspect", "site", "gc", "codecs", "_codecs", "antigravity", "this"),
    }
)
"""Top-level modules ``--allow-global`` never trusts, nor suggests: each can run code, start processes or
touch files from arguments a pickle chooses (``builtins.eval``, ``os.system``, ``functools.partial``,
``operator.attrgetter``, ``io.open``), or runs code when imported (``antigravity``)."""
NEVER_ALLOWED_PREFIXES = (
    *("torch.load", "torch.serialization", "torch.hub", "torch.jit", "torch.package", "torch.ops"),
    *("torch._C", "torch.utils.cpp_extension", "torch._dynamo", "torch._inductor", "torch.compile"),
)
"""torch's own ways to load a pickle, compile or run code (``torch.hub.load``, ``torch.jit.load``)."""
SAFE_BUILTINS = frozenset(
    f"builtins.{name}" for name in ("slice", "range", "frozenset", "tuple", "list", "dict", "int", "float")
)
"""Builtins a checkpoint may need (pickled configs call them) that cannot run code or allocate beyond
what the pickle itself holds."""
_DOTTED_NAME = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+")


def never_allowed(name: str) -> bool:
    """Whether ``--allow-global name`` is refused whatever the user says (see :data:`NEVER_ALLOWED_MODULES`).

    Example:
        >>> never_allowed("builtins.eval"), never_allowed("pathlib.PosixPath")
        (True, False)
    """
    if name in SAFE_BUILTINS:
        return False
    top = name.split(".", 1)[0]
    return top in NEVER_ALLOWED_MODULES or any(
        name == prefix or name.startswith(f"{prefix}.") for prefix in NEVER_ALLOWED_PREFIXES
    )


def can_be_allowed(name: str) -> bool:
    """Whether suggesting ``--allow-global name`` could help: a dotted name, not refused outright, whose
    top-level module is installed (found without importing it, and never in the current directory).

    Example:
        >>> can_be_allowed("pathlib.PosixPath"), can_be_allowed("__builtin__.eval")
        (True, False)
    """
    if not _DOTTED_NAME.fullmatch(name) or never_allowed(name):
        return False
    top = name.split(".", 1)[0]
    if top in sys.modules or top in sys.builtin_module_names:
        return True
    return importlib.machinery.PathFinder.find_spec(top, _installed_path()) is not None


def importable_global(name: str) -> bool:
    """Whether ``--allow-global name`` would find it: its module's file is installed (found level by level
    without importing anything; never in the current directory) and, where the module is imported
    already, it has that attribute. A class the pickle names under a module since renamed or removed is
    not suggested.

    Example:
        >>> importable_global("pathlib.PosixPath"), importable_global("pathlib.NoSuchPath")
        (True, False)
    """
    if not can_be_allowed(name):
        return False
    module_name, _, attr = name.rpartition(".")
    module = sys.modules.get(module_name)
    if module is not None:
        return hasattr(module, attr)
    search: list[str] | None = _installed_path()
    parts = module_name.split(".")
    for depth, part in enumerate(parts):
        loaded = sys.modules.get(".".join(parts[: depth + 1]))
        if loaded is not None:
            search = list(getattr(loaded, "__path__", []) or [])
            if depth + 1 < len(parts) and not search:
                return False
            continue
        spec = importlib.machinery.PathFinder.find_spec(part, search)
        if spec is None:
            return False
        search = list(spec.submodule_search_locations or [])
        if depth + 1 < len(parts) and not search:
            return False
    return True


def resolve_globals(names: Iterable[str]) -> list[tuple[Any, str]]:
    """Import the globals a user explicitly trusts (``--allow-global pkg.mod.Name``), from installed
    packages only: a module file in the current directory is never imported, whatever ``sys.path`` says.

    Example:
        >>> resolve_globals(["pathlib.PosixPath"])  # doctest: +ELLIPSIS
        [(<class 'pathlib.PosixPath'>, 'pathlib.PosixPath')]
    """
    resolved = []
    for name in names:
        if never_allowed(name):
            raise SlimtorchError(
                f"refused to trust the global `{name}` (given to --allow-global): it can run code or touch "
                "files, so no file may use it"
            )
        module_name, _, attr = name.rpartition(".")
        try:
            with _installed_imports_only():
                obj = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError, ValueError) as exc:
            raise SlimtorchError(f"--allow-global {name}: cannot import it ({exc})") from None
        resolved.append((obj, name))
    return resolved


def _installed_path() -> list[str]:
    """``sys.path`` without the current directory and the running script's folder (``''`` or its path
    first on ``sys.path``), where anyone who can write a file could plant a module."""
    here = {os.path.realpath(os.getcwd())}
    if sys.argv and sys.argv[0]:
        here.add(os.path.realpath(os.path.dirname(sys.argv[0]) or os.getcwd()))
    return [entry for entry in sys.path if entry and os.path.realpath(entry) not in here]


@contextmanager
def _installed_imports_only() -> Iterator[None]:
    """Import with :func:`_installed_path` as ``sys.path`` (and put it back after)."""
    saved = list(sys.path)
    sys.path[:] = _installed_path()
    try:
        yield
    finally:
        sys.path[:] = saved
