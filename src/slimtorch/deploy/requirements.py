"""What a bundle needs to run, pinned to what its check ran on, and the versions that made it.

Every requirement is ``name==version``: a bundle is verified to hold nothing else
(:func:`slimtorch.deploy.bundle.verify_bundle`), no pip option, URL or path.

An ONNX bundle needs onnxruntime and numpy, a ``.pt2`` torch and numpy, a text bundle ``tokenizers`` too.
A text ONNX bundle lists its whole runtime, every package pinned, for ``pip install --no-deps``.
"""

from __future__ import annotations

import contextlib
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


def versions(format: str) -> dict[str, str]:
    """The versions of what made the bundle (torch; onnx, onnxscript and onnxruntime for ONNX), for its
    manifest."""
    found = {"torch": torch.__version__}
    for package in ("onnx", "onnxscript", "onnxruntime") if format == "onnx" else ():
        with contextlib.suppress(PackageNotFoundError):
            found[package] = version(package)
    return found
