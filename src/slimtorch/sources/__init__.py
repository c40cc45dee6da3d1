"""Format detection: one entry point, :func:`open_checkpoint`, that picks the reader by content, not name.

A folder's weight files may be symbolic links, but only to files inside the folder, or, in the Hugging Face
cache layout (``snapshots/<revision>/<file>`` linking to ``../../blobs/<hash>``), to that repository's
``blobs``. A link anywhere else is refused, not followed: a downloaded folder must not make slimtorch read
(and ``shrink`` copy into its output) a file the user never named. For the same reason an error shows the
first bytes only of a file the user named.
"""

from __future__ import annotations

import os
import stat
import tarfile
import warnings
import zipfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from slimtorch.errors import CheckpointNotFoundError, FormatError
from slimtorch.format.source import TensorSource
from slimtorch.sources.dcp import looks_like_dcp, open_dcp
from slimtorch.sources.hf_folder import open_hf_folder
from slimtorch.sources.hub_cache import resolve_model_path
from slimtorch.sources.objects import plain_objects, restore_values
from slimtorch.sources.pickled import resolve_globals, unpickle
from slimtorch.sources.safetensors_file import looks_like_safetensors, open_safetensors
from slimtorch.sources.torch_legacy import SIGNATURE as LEGACY_SIGNATURE
from slimtorch.sources.torch_legacy import open_torch_legacy
from slimtorch.sources.torch_zip import open_torch_zip
from slimtorch.sources.torchscript import open_script
from slimtorch.sources.zip_archive import is_torchscript, open_archive

# Formats we recognise but do not read, so the error can say what the file is.
_OTHER_SIGNATURES = {b"GGUF": "a GGUF file (llama.cpp)", b"\x93NUMPY": "a NumPy .npy file"}


def open_checkpoint(path: str | os.PathLike[str], *, allow_globals: Iterable[str] = ()) -> TensorSource:
    """Open any supported checkpoint lazily, by its path or by a Hugging Face Hub repo id found in the local
    cache (``org/name[@revision]``, never downloaded); see :func:`slimtorch.open`."""
    path = resolve_model_path(path)
    trusted = resolve_globals(allow_globals)
    if not path.exists():
        raise CheckpointNotFoundError(path, "no such file or folder")
    try:
        if path.is_dir():
            if looks_like_dcp(path):
                return open_dcp(path, trusted)
            return open_hf_folder(path, lambda f: _open_file(folder_file(path, f), trusted, named=False))
        return _open_file(path, trusted)
    except PermissionError as exc:
        raise CheckpointNotFoundError(exc.filename or path, "permission denied") from exc
    except IsADirectoryError as exc:
        raise FormatError(exc.filename or path, "expected a file, found a folder") from exc


def folder_file(folder: Path, member: Path) -> Path:
    """``member``, a file of ``folder``, once it is known to resolve inside the folder (or, in the Hugging
    Face cache layout, into its repository's ``blobs``); a link leaving them is a :class:`FormatError`.

    Example:
        >>> folder_file(Path("bert"), Path("bert/model.safetensors"))  # doctest: +SKIP
        PosixPath('bert/model.safetensors')
    """
    root, target = folder.resolve(), member.resolve()
    # A snapshot's sub-folder (``0_Transformer/`` of an old sentence-transformers repo) links into the same
    # repository's blobs as the snapshot itself.
    snapshot = next((p for p in (root, *root.parents) if p.parent.name == "snapshots"), None)
    blobs = snapshot.parent.parent / "blobs" if snapshot is not None else None
    if target.is_relative_to(root) or (blobs is not None and target.parent == blobs):
        return member
    raise FormatError(
        member,
        "a symbolic link to a file outside the folder, which slimtorch does not follow (copy the file into "
        "the folder, or name it directly, if you trust it)",
    )


def _open_file(path: Path, trusted: list, named: bool = True) -> TensorSource:
    """Open one file by its first bytes; ``named``: the user gave this path (not a file of a folder)."""
    status = path.stat()
    if not stat.S_ISREG(status.st_mode):  # a pipe would block the read below forever; a device may never end
        raise FormatError(path, "not a regular file (a pipe, socket or device)")
    size = status.st_size
    if size == 0:
        raise FormatError(path, "the file is empty")
    with open(path, "rb") as stream:
        head = stream.read(64)
    if head.startswith(b"PK\x03\x04") or head.startswith(b"PK\x05\x06"):
        return _open_zip(path, trusted)
    if head.startswith(LEGACY_SIGNATURE):
        return open_torch_legacy(path, trusted)
    if looks_like_safetensors(head):
        return open_safetensors(path)
    if head.startswith(b"\x80"):
        # Some other pickle: run it through the safe unpickler so a hostile one is named and refused.
        with open(path, "rb") as stream:
            unpickle(path, stream)
        raise FormatError(path, "a plain Python pickle, not a torch.save file; slimtorch does not read it")
    for signature, what in _OTHER_SIGNATURES.items():
        if head.startswith(signature):
            raise FormatError(path, f"{what}, not a PyTorch checkpoint")
    if _is_tar(path):
        raise FormatError(path, "a tar archive (torch.save from PyTorch < 0.4?), which is not supported")
    if zipfile.is_zipfile(path):
        return _open_zip(path, trusted)
    if head.startswith(b"version https://git-lfs"):
        raise FormatError(path, "a Git LFS pointer, not the weights themselves (run git lfs pull)")
    starts = f"; it starts with {head[:8]!r}" if named else ""
    raise FormatError(
        path,
        "not a recognised checkpoint (expected a torch.save file, safetensors, a TorchScript archive or a "
        f"Hugging Face folder){starts}",
    )


def _open_zip(path: Path, trusted: list) -> TensorSource:
    with open_archive(path) as (archive, root):
        if is_torchscript(archive.namelist(), root):
            return open_script(path, archive, root, trusted)
        return open_torch_zip(path, archive, root, trusted)


def _is_tar(path: Path) -> bool:
    try:
        return tarfile.is_tarfile(path)
    except (OSError, tarfile.TarError):
        return False


def load_objects(path: str | os.PathLike[str], *, allow_globals: Iterable[str] = ()) -> dict[str, Any]:
    """The non-tensor values of a checkpoint, nested as saved: what ``slimtorch shrink`` kept in a slim
    file, or the plain data of a torch.save file (what :func:`plain_objects` keeps). numpy arrays, scalars
    and dtypes come back as numpy's; an object whose class was kept as a placeholder comes back as
    ``{"__placeholder__": "module.Class", "state": {...}}``. Formats without such values (safetensors,
    TorchScript) give ``{}``. A value that is not plain data (an object of a class ``allow_globals``
    built, a set, bytes) is left out with a warning naming it; ``slimtorch.open(path).tree`` holds it.

    Example:
        >>> import slimtorch
        >>> slimtorch.shrink("chgnet.pth.tar", "chgnet.safetensors")  # doctest: +SKIP
        >>> slimtorch.load_objects("chgnet.safetensors")["model"]["model_args"]["n_conv"]  # doctest: +SKIP
        4
    """
    with open_checkpoint(path, allow_globals=allow_globals) as source:
        tree = source.tree
    plain = plain_objects(tree)
    if plain.dropped:  # an object built from an allowed class, a set, bytes: never a quiet gap
        left = ", ".join(f"{key} ({why})" for key, why in list(plain.dropped.items())[:8])
        more = f" and {len(plain.dropped) - 8} more" if len(plain.dropped) > 8 else ""
        warnings.warn(
            f"{os.fspath(path)}: load_objects keeps plain data only; left out: {left}{more} "
            "(slimtorch.open(path).tree holds every value as loaded)",
            stacklevel=2,
        )
    return restore_values(plain.values)
