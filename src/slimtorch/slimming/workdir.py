"""The work folder of a ``slimtorch slim`` run: one folder per stage (``01-baseline/``, ``02-prune/`` ...)
holding its output and, written last and atomically, its done marker (``done.json``: the stage's result,
its files' hashes and what it was made from, :mod:`slimtorch.slimming.markers`). A rerun with the same
recipe resumes the stages whose markers check out and redoes the others; a different recipe is refused."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from slimtorch.errors import CheckpointError, SlimtorchError
from slimtorch.format.writer import write_atomic_text
from slimtorch.slimming.markers import MARKER, Inputs, make_marker, read_marker, seal, stage_files, verify
from slimtorch.slimming.recipe import Recipe, read_recipe, write_recipe
from slimtorch.slimming.schema import Invalid

RECIPE = "recipe.toml"


class WorkFolder:
    """A run's folder: stage folders, their done markers, and the recipe that owns them.

    Example:
        >>> work = WorkFolder.claim("slim-work", recipe, restart=False)  # doctest: +SKIP
        >>> marker, why = work.verified("01-baseline", "baseline", inputs, after="")  # doctest: +SKIP
        >>> marker["result"]["metric"], why  # doctest: +SKIP
        (99.56, '')
    """

    def __init__(self, root: Path) -> None:
        self.root = root

    @classmethod
    def claim(cls, root: str | os.PathLike[str], recipe: Recipe, *, restart: bool) -> WorkFolder:
        """The work folder for ``recipe``: made if new, emptied with ``restart``; one that holds another
        recipe's stages is refused (its markers would be wrong for this one)."""
        folder = cls(Path(root).resolve())
        existing = folder.root / RECIPE
        if os.path.lexists(folder.root) and not folder.root.is_dir():
            raise SlimtorchError(f"work folder {folder.root} is not a folder: give another --work")
        if restart and folder.root.exists():
            folder._empty()
        elif existing.exists():
            theirs = read_recipe(existing).identity()
            differs = sorted(
                k for k in {*theirs, *recipe.identity()} if theirs.get(k) != recipe.identity().get(k)
            )
            if differs:
                raise SlimtorchError(
                    f"work folder {folder.root} holds a run with another recipe ({differs[0]} differs): "
                    "give another --work, or --restart to start it over"
                )
        elif folder.root.exists() and any(folder.root.iterdir()):
            raise SlimtorchError(
                f"work folder {folder.root} is not empty and holds no {RECIPE}: give another --work"
            )
        folder.root.mkdir(parents=True, exist_ok=True)
        if not existing.exists():
            write_recipe(recipe, existing)
        return folder

    def verified(
        self, folder: str, name: str, inputs: Inputs, after: str
    ) -> tuple[dict[str, Any] | None, str]:
        """Stage ``folder``'s marker when it finished and checks out against ``inputs`` (its schema, its
        files' hashes: :func:`~slimtorch.slimming.markers.verify`), with ""; else None and why what the
        folder holds is not trusted ("" when the stage never finished: nothing to say)."""
        path = self.root / folder
        if not os.path.lexists(path):
            return None, ""
        if path.is_symlink() or not path.is_dir():
            return None, "it is not a folder"
        if not os.path.lexists(path / MARKER):
            return None, ""
        try:
            marker = read_marker(path / MARKER)
            verify(path, marker, name, inputs, after)
        except Invalid as problem:
            return None, str(problem)
        except OSError as error:
            return None, f"cannot read it ({error.strerror or error})"
        return marker, ""

    def redo(self, folder: str) -> Path:
        """The folder of stage ``folder``, emptied (what was there removed; a link unlinked, never
        followed) and made again: a stage run never records a file an earlier try left."""
        path = self.root / folder
        try:
            if path.is_symlink() or (os.path.lexists(path) and not path.is_dir()):
                path.unlink()
            elif path.exists():
                shutil.rmtree(path)
            path.mkdir(parents=True)
        except OSError as error:
            raise CheckpointError(path, f"cannot redo the stage there ({error.strerror or error})") from None
        return path

    def finish(self, folder: str, name: str, inputs: Inputs, result: dict[str, Any]) -> str:
        """Record stage ``folder`` as finished: its result, its inputs and every file it wrote with its
        sha256, written to a temporary file and renamed (an interrupted write leaves no marker). Returns the
        stage's seal, which the stages made from it record."""
        path = self.root / folder
        marker = make_marker(name, inputs, stage_files(path), result)
        text = json.dumps(marker, indent=1, sort_keys=True)
        write_atomic_text(path / MARKER, text)
        return seal(json.loads(text))  # as a resume reads it back

    def relative(self, path: Path | None) -> str | None:
        """``path`` relative to the work folder, as the report names outputs."""
        return None if path is None else Path(path).resolve().relative_to(self.root).as_posix()

    def _empty(self) -> None:
        for child in self.root.iterdir():
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child)
            else:
                child.unlink()
