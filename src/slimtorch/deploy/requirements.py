"""What a bundle needs to run, pinned to what its check ran on, and the versions that made it.

Every requirement is ``name==version``: a bundle is verified to hold nothing else
(:func:`slimtorch.deploy.bundle.verify_bundle`), no pip option, URL or path, and to name no package its
runtime does not need (:func:`runtime_names`): a pinned name is still whatever the index serves under it.

An ONNX bundle needs onnxruntime and numpy, a ``.pt2`` torch and numpy, a text bundle ``tokenizers`` too.
A text ONNX bundle lists its whole runtime, every package pinned, for ``pip install --no-deps``.
"""

from __future__ import annotations

import contextlib
import re
from importlib.metadata import PackageNotFoundError, requires, version

import torch


def requirements(format: str, text: bool = False) -> list[str]:
    """The runtime, pinned to the versions the check ran on; ``tokenizers`` for a text bundle.

    A text bundle lists its whole runtime, every dependency pinned, to be installed with ``--no-deps``
    (:data:`NO_DEPS`): ``tokenizers`` declares ``huggingface_hub``, which the runner never imports and which
    would bring about 21 MiB (hf-xet, httpx, PyYAML ...) into every deployment.
    """
    if format == "onnx" and text:
        return [f"{name}=={version(name)}" for name in closure(("onnxruntime", "numpy", "tokenizers"))]
    tokenizers = [f"tokenizers=={version('tokenizers')}"] if text else []
    numpy = f"numpy=={version('numpy')}"
    if format == "onnx":
        return [f"onnxruntime=={version('onnxruntime')}", numpy, *tokenizers]
    return [f"torch=={torch.__version__.split('+')[0]}", numpy, *tokenizers]


# Declared dependencies a bundle's runner never imports: left out of a text bundle's pinned runtime.
UNUSED_DEPENDENCIES = {"tokenizers": {"huggingface-hub"}}
NO_DEPS = ["--no-deps"]


def closure(roots: tuple[str, ...]) -> list[str]:
    """``roots`` and every package they need here (markers evaluated for this interpreter), less
    :data:`UNUSED_DEPENDENCIES`; sorted, by distribution name."""
    from packaging.requirements import Requirement  # packaging: not a dependency of slimtorch itself
    from packaging.utils import canonicalize_name

    found: set[str] = set()
    todo = [canonicalize_name(r) for r in roots]
    while todo:
        name = todo.pop()
        if name in found:
            continue
        found.add(name)
        skip = UNUSED_DEPENDENCIES.get(name, set())
        for line in requires(name) or []:
            needed = Requirement(line)
            if needed.marker is not None and not needed.marker.evaluate({"extra": ""}):
                continue
            if canonicalize_name(needed.name) not in skip:
                todo.append(canonicalize_name(needed.name))
    return sorted(found)


RUNTIME_ROOTS = {"onnx": ("onnxruntime", "numpy"), "pt2": ("torch", "numpy")}
"""What each kind of bundle runs on; a text bundle adds ``tokenizers``."""
KNOWN_RUNTIME = frozenset(
    {
        *("onnxruntime", "numpy", "tokenizers", "torch"),
        *("coloredlogs", "flatbuffers", "humanfriendly", "mpmath", "packaging", "protobuf", "sympy"),
        *("filelock", "fsspec", "jinja2", "markupsafe", "networkx", "setuptools", "typing-extensions"),
    }
)
"""The runtimes and every package they have needed (onnxruntime 1.17-1.23, torch 2.x, tokenizers 0.2x):
what a bundle's requirements may name where the runtime is not installed beside slimtorch to ask."""


def runtime_names(format: str, text: bool = False) -> frozenset[str]:
    """The package names (:func:`canonical`) a bundle of ``format`` may pin: :data:`KNOWN_RUNTIME`, and
    the dependencies of its runtime as installed here (a newer onnxruntime's new one among them).

    Example:
        >>> "numpy" in runtime_names("onnx")
        True
    """
    roots = (*RUNTIME_ROOTS.get(format, ()), *(("tokenizers",) if text else ()))
    installed = []
    for root in roots:
        with contextlib.suppress(PackageNotFoundError):
            version(root)
            installed.append(root)
    found = set(KNOWN_RUNTIME)
    with contextlib.suppress(ImportError, PackageNotFoundError):  # packaging reads the metadata
        found.update(closure(tuple(installed)))
    return frozenset(canonical(name) for name in found)


def canonical(name: str) -> str:
    """A distribution's name as PEP 503 compares them: lower case, runs of ``-_.`` one ``-``."""
    return re.sub(r"[-_.]+", "-", name).lower()


def versions(format: str) -> dict[str, str]:
    """The versions of what made the bundle (torch; onnx, onnxscript and onnxruntime for ONNX), for its
    manifest."""
    found: dict[str, str] = {"torch": torch.__version__}
    for package in ("onnx", "onnxscript", "onnxruntime") if format == "onnx" else ():
        with contextlib.suppress(PackageNotFoundError):
            found[package] = version(package)
    return found
