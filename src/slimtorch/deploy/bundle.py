"""The deployment bundle: a folder that runs an exported model with nothing but its runtime.

    model.onnx (or model.pt2)   the exported model
    requirements.txt            the runtime only: onnxruntime and numpy (torch for .pt2)
    predict.py                  the runner (slimtorch/deploy/runner.py): .npy / .npz / .json in, outputs out
    sample_inputs.npz           a sample input ...
    expected_outputs.npz        ... and what eager PyTorch computed from it
    manifest.json               inputs, outputs, tolerance, verification, versions, sha256 of every file

The folder is written beside its destination and renamed into place when complete, so an interrupted
export never leaves half a bundle, nor destroys the previous one.

A bundle comes back from elsewhere (a download, a shared folder): :func:`verify_bundle` is what stands
between it and anything that runs or installs what it holds.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from slimtorch._version import __version__
from slimtorch.deploy import runner
from slimtorch.deploy.requirements import canonical, runtime_names
from slimtorch.errors import FormatError, SlimtorchError
from slimtorch.format.untrusted import load_json
from slimtorch.format.writer import TEMP_PREFIX, replace_folder

FORMAT, VERSION, RUNNER = runner.FORMAT, runner.VERSION, runner.RUNNER
SAMPLE_INPUTS, EXPECTED_OUTPUTS = "sample_inputs.npz", "expected_outputs.npz"


class BundleWriter:
    """A bundle being written in a staging folder; :meth:`commit` moves it into place."""

    def __init__(self, out: str | os.PathLike[str]) -> None:
        self.out = Path(out)
        check_replaceable(self.out)
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.staging = self.out.with_name(f"{TEMP_PREFIX}{self.out.name}-{uuid.uuid4().hex[:8]}")
        self.staging.mkdir()

    def path(self, name: str) -> Path:
        return self.staging / name

    def commit(self, manifest: dict[str, Any], requirements: list[str], sample: dict, expected: dict) -> Path:
        """Write the runner, requirements, sample and manifest (with every file's checksum), then swap the
        folder into place."""
        np.savez(self.path(SAMPLE_INPUTS), **sample)
        np.savez(self.path(EXPECTED_OUTPUTS), **expected)
        self.path(RUNNER).write_bytes(shipped_runner())
        header = "# the runtime this bundle needs, nothing else (pip and setuptools aside)\n"
        if manifest.get("pip_options"):
            options = " ".join(manifest["pip_options"])
            header += f"# every package pinned: install with pip install {options} -r requirements.txt\n"
        self.path("requirements.txt").write_text(header + "\n".join(requirements) + "\n")
        files = {
            p.name: {"bytes": p.stat().st_size, "sha256": runner.sha256(p)}
            for p in sorted(self.staging.iterdir())
            if p.is_file()
        }
        document = {
            "format": FORMAT,
            "version": VERSION,
            **manifest,
            "sample": {"inputs": SAMPLE_INPUTS, "outputs": EXPECTED_OUTPUTS},
            "requirements": requirements,
            "created_by": {"slimtorch": __version__, **manifest.get("created_by", {})},
            "files": files,
        }
        self.path(runner.MANIFEST).write_text(json.dumps(document, indent=2) + "\n")
        for p in self.staging.iterdir():
            with open(p, "rb") as stream:
                os.fsync(stream.fileno())
        check_replaceable(self.out)
        replace_folder(self.staging, self.out)
        return self.out

    def abort(self) -> None:
        shutil.rmtree(self.staging, ignore_errors=True)

    def __enter__(self) -> BundleWriter:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is not None:
            self.abort()


def check_replaceable(out: Path) -> None:
    """An existing folder is replaced only if it is empty or a bundle: anything else may be the user's."""
    if not out.exists():
        return
    if not out.is_dir():
        raise SlimtorchError(f"{out}: exists and is not a folder; pick another -o")
    if any(out.iterdir()) and read_manifest(out, strict=False) is None:
        raise SlimtorchError(
            f"{out}: exists and is not a slimtorch bundle; refusing to replace it (pick another -o)"
        )


def read_manifest(folder: Path, *, strict: bool = True) -> dict[str, Any] | None:
    """The bundle's manifest, checked for our format (None when it is not a bundle and not ``strict``)."""
    path = Path(folder) / runner.MANIFEST
    try:
        document = load_json(path, path.read_bytes(), "manifest")
        if not isinstance(document, dict) or document.get("format") != FORMAT:
            raise ValueError(f"not a {FORMAT} manifest")
    except (OSError, ValueError, SlimtorchError) as exc:
        if strict:
            raise SlimtorchError(f"{path}: not a slimtorch bundle ({exc})") from None
        return None
    return document


def shipped_runner() -> bytes:
    """The runner this slimtorch writes into every bundle as ``predict.py``."""
    return Path(runner.__file__).read_bytes()


def verify_bundle(folder: str | os.PathLike[str], allow: tuple[str, ...] = ()) -> dict[str, Any]:
    """The manifest of the bundle in ``folder``, once nothing in it can run but what this slimtorch wrote.

    Checked before anything in the bundle is installed or run (``footprint``): the manifest's shape
    (:func:`runner.check_manifest`: types, required keys, bounds, plain file names); ``predict.py``
    byte for byte the runner this slimtorch ships (:func:`shipped_runner`: the manifest's hashes are
    the bundle's own word, this is ours); every file a regular file of its listed size and sha256, and
    nothing unlisted that Python could import; ``requirements.txt`` nothing but ``name==version`` lines,
    each a package the bundle's runtime needs (:func:`~slimtorch.deploy.requirements.runtime_names`) or
    one named in ``allow``; the sample files' array headers within the input budget. Anything else is
    a :class:`FormatError` naming the file.

    Example:
        >>> verify_bundle("resnet-bundle")["model"]["file"]  # doctest: +SKIP
        'model.onnx'
    """
    folder = Path(folder)
    try:
        manifest = runner.read_manifest(folder)
        path, shipped = folder / RUNNER, shipped_runner()
        if path.is_symlink() or path.stat().st_size != len(shipped) or path.read_bytes() != shipped:
            made = str(manifest.get("created_by", {}).get("slimtorch", "an unknown version"))[:40]
            raise FormatError(
                path,
                f"is not the runner slimtorch {__version__} writes into bundles (the manifest says it was "
                f"made by slimtorch {made!r}); refusing to run it: export the bundle again",
            )
        runner.verify_files(folder, manifest)
    except runner.InvalidBundle as exc:
        raise FormatError(exc.path, exc.problem) from None
    known = runtime_names(manifest["model"]["format"], "text" in manifest) | {canonical(a) for a in allow}
    for line in manifest["requirements"]:
        name = line.partition("==")[0]
        if canonical(name) not in known:
            raise FormatError(
                folder / runner.REQUIREMENTS,
                f"names {name!r}, a package no slimtorch bundle's runtime needs; refusing to install it "
                f"(--allow-package {name} if you trust it)",
            )
    return manifest
