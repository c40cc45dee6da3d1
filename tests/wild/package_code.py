"""The wild packages' own code, without the dependencies they were installed without.

The packages were installed with ``--no-deps`` (tests/wild/requirements.txt): their files are all there,
but many of their ``__init__`` modules import librosa, torchaudio, torchvision, pymatgen or webrtcvad at
the top for features these tests never use. Two ways in, both running the package's own source, nothing
re-typed:

- :func:`module`: import ``package.sub.module`` with the packages above it registered bare (their
  ``__init__`` not run), for a module whose own imports are all installed.
- :func:`definitions`: execute only the named top-level definitions (classes, functions, constants) of a
  module file whose module-level imports are not installed, in a namespace the caller provides.
"""

from __future__ import annotations

import ast
import importlib
import importlib.machinery
import importlib.util
import sys
import types
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

SOURCE_PREFIX = "wild_source."
"""Definitions executed from a package's source live in modules named like this one's ``wild_source.``
plus the file's own module name."""


def package_dir(package: str) -> Path:
    """The folder of an installed top-level package, found without importing it.

    Example:
        >>> package_dir("torchcrepe").name
        'torchcrepe'
    """
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"package {package!r} is not installed (make installs it)")
    return Path(next(iter(spec.submodule_search_locations)))


def package_file(package: str, relative: str) -> Path:
    """A data file a package ships, e.g. ``package_file("pesto", "weights/mir-1k.ckpt")``."""
    path = package_dir(package) / relative
    if not path.exists():
        raise FileNotFoundError(f"{package} ships no {relative} (is the version in requirements.txt?)")
    return path


def module(dotted: str) -> types.ModuleType:
    """Import ``dotted``; a parent package whose ``__init__`` cannot import is registered bare instead.

    A bare package is a module object with the package's ``__path__`` and nothing else, so its submodules
    (and their absolute imports of one another) resolve to the real files.

    Example:
        >>> module("pesto.model").Resnet1d.__name__
        'Resnet1d'
    """
    parts = dotted.split(".")
    for depth in range(1, len(parts)):
        name = ".".join(parts[:depth])
        if name in sys.modules:
            continue
        try:
            importlib.import_module(name)
        except ImportError:
            _register_bare(name)
    return importlib.import_module(dotted)


def _register_bare(name: str) -> None:
    parent, _, leaf = name.rpartition(".")
    location = package_dir(name) if not parent else Path(sys.modules[parent].__path__[0]) / leaf
    bare = types.ModuleType(name)
    bare.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
    bare.__spec__.submodule_search_locations = [str(location)]
    bare.__path__ = [str(location)]
    bare.__package__ = name
    sys.modules[name] = bare
    if parent:
        setattr(sys.modules[parent], leaf, bare)


def definitions(
    package: str, relative: str, names: Iterable[str], namespace: Mapping[str, Any]
) -> dict[str, Any]:
    """Execute the named top-level definitions of ``package/relative`` in a copy of ``namespace``.

    For a module whose imports at the top are not installed: the classes and functions themselves only
    need what the caller puts in ``namespace`` (torch, nn, the package's own helpers). Definitions run in
    file order, so a class may use a function defined before it.

    Example:
        >>> import torch, functools
        >>> from torch import nn
        >>> crepe = definitions("torchcrepe", "model.py", ["Crepe"],
        ...     {"torch": torch, "functools": functools, "F": torch.nn.functional})["Crepe"]
        >>> crepe.__module__
        'wild_source.torchcrepe.model'
    """
    path = package_dir(package) / relative
    tree = ast.parse(path.read_text(), filename=str(path))
    wanted = set(names)
    body = [node for node in tree.body if _defined(node) & wanted]
    found = set().union(*(_defined(node) for node in body)) if body else set()
    # `from __future__ import annotations` keeps annotations unevaluated: names only a type checker imports
    body = [n for n in tree.body if isinstance(n, ast.ImportFrom) and n.module == "__future__"] + body
    if missing := wanted - found:
        raise AttributeError(f"{path} defines no {sorted(missing)}")
    # A module of its own (dataclasses look their module up in sys.modules), under a name no import uses.
    name = f"{SOURCE_PREFIX}{package}.{relative.removesuffix('.py').replace('/', '.')}"
    scope = types.ModuleType(name)
    scope.__dict__.update(namespace)
    sys.modules[name] = scope
    exec(compile(ast.Module(body=body, type_ignores=[]), str(path), "exec"), scope.__dict__)
    return {n: scope.__dict__[n] for n in wanted}


def _defined(node: ast.stmt) -> set[str]:
    if isinstance(node, ast.ClassDef | ast.FunctionDef):
        return {node.name}
    if isinstance(node, ast.Assign):
        return {t.id for t in node.targets if isinstance(t, ast.Name)}
    return set()
