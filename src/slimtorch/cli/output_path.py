"""``-o OUT``, checked before any work: never an input, never through a symbolic link.

The writers replace OUT atomically (a rename, or an exchange for a folder), which makes two mistakes
silent and costly. OUT being an input (the same file by another path or a hard link, a folder holding an
input, or a file of an input folder) replaces what the command reads. OUT being a symbolic link replaces
the link itself, and the folder it pointed at is left behind under a temporary name. Both are refused
here with one line.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from slimtorch.errors import SlimtorchError


def check_output(output: str | os.PathLike[str], inputs: Iterable[str | os.PathLike[str] | None]) -> Path:
    """``output`` as a path, once it is known to be neither a symbolic link nor one of ``inputs`` (a file,
    or a folder holding an input). ``inputs`` that do not exist (a ``package.module:factory``) are skipped.

    Example:
        >>> check_output("small.safetensors", ["model.pt"])
        PosixPath('small.safetensors')
        >>> check_output("model.pt", ["./model.pt"])  # doctest: +SKIP
        SlimtorchError: model.pt: -o is the input (model.pt); write elsewhere, then move it
    """
    out = Path(output)
    if out.is_symlink():
        raise SlimtorchError(
            f"{out}: -o is a symbolic link; slimtorch replaces what is at that path, so it would replace the "
            f"link, not write where it points: give the real path ({os.path.realpath(out)})"
        )
    if not out.exists():
        return out
    for given in _existing(inputs):
        if os.path.samefile(out, given):
            raise SlimtorchError(f"{out}: -o is the input ({given}); write elsewhere, then move it")
        if out.is_dir() and given.resolve().is_relative_to(out.resolve()):
            raise SlimtorchError(
                f"{out}: -o is the folder holding the input ({given}), which replacing it would delete; "
                "write elsewhere, then move it"
            )
        if given.is_dir() and out.resolve().is_relative_to(given.resolve()):
            raise SlimtorchError(
                f"{out}: -o is a file of the input folder ({given}), which replacing it would change; "
                "write elsewhere, then move it"
            )
    return out


def model_inputs(model: str, weights: str | None = None) -> list[str]:
    """What MODEL and ``--weights`` read from disk: a folder or checkpoint, or the file of a
    ``path/to/file.py:factory`` spec (so ``-o train.py`` cannot overwrite the model's code)."""
    found = [model, model.rpartition(":")[0]]
    return [*found, weights] if weights else found


def _existing(inputs: Iterable[str | os.PathLike[str] | None]) -> list[Path]:
    return [Path(given) for given in inputs if given and Path(given).exists()]
