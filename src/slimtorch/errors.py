"""Exceptions raised by slimtorch.

Every error a user can cause (a missing file, a corrupt checkpoint, a pickle that wants to run code) is a
:class:`SlimtorchError`. The CLI turns any of them into one line on stderr and exit code 2, in one place
(``slimtorch.cli.main``); anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

from pathlib import Path


class SlimtorchError(Exception):
    """Base class for every error slimtorch raises on purpose."""


class OptionError(SlimtorchError, ValueError):
    """An option the caller gave is not one slimtorch takes (a group size, a scheme, a ratio, a layout).

    It is a :class:`ValueError` too, Python's type for a bad argument, so ``except ValueError`` and
    ``except SlimtorchError`` both catch it, whichever verb raised it; the CLI prints it as one line, exit 2.

    Example:
        >>> from slimtorch.format.codecs.lossy import check_group_size
        >>> check_group_size(33)
        Traceback (most recent call last):
        ...
        slimtorch.errors.OptionError: int4 group size must be even, 32 to 256, not 33
    """


class CheckpointError(SlimtorchError):
    """A problem with one file or folder; the message always starts with its path."""

    def __init__(self, path: str | Path, problem: str) -> None:
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")


class CheckpointNotFoundError(CheckpointError):
    """The path does not exist, or a folder holds no weights."""


class FormatError(CheckpointError):
    """The file is not a checkpoint slimtorch reads, or it is truncated, corrupt or self-contradictory."""


class PlaceholderWarning(UserWarning):
    """A pickle named classes slimtorch kept as inert placeholders instead of building them (the CLI shows
    it as one ``note:`` line)."""


class UnsafeCheckpointError(CheckpointError):
    """Reading the file would need a Python global that is not on the safe list.

    ``global_name`` is the dotted name the pickle asked for (for example ``os.system``). ``allowable`` says
    whether ``--allow-global`` may trust it: never for what runs code or touches files (``builtins.eval``,
    ``os.system``, ``subprocess.Popen``) nor for a name no installed module has, so the message suggests the
    flag only where the reader checked it can help.
    """

    def __init__(
        self, path: str | Path, global_name: str, detail: str = "", *, allowable: bool = False
    ) -> None:
        self.global_name = global_name
        problem = (
            f"refused: the pickle needs the global `{global_name}`, which is not on the safe list, and "
            "slimtorch never runs code from a file"
        )
        if detail:
            problem += f" ({detail})"
        if allowable:
            problem += f". If you trust this file and that global, allow it with --allow-global {global_name}"
        super().__init__(path, problem)
