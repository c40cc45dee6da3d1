"""The work folder of a ``slimtorch slim`` run: one folder per stage (``01-baseline/``, ``02-prune/`` ...)
holding its output and, written last and atomically, its done marker (``done.json``: the stage's result).
A rerun with the same recipe finds the markers and skips those stages; a different recipe is refused."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from slimtorch.errors import SlimtorchError
from slimtorch.format.writer import write_atomic_text
from slimtorch.slimming.recipe import Recipe, read_recipe, write_recipe

MARKER = "done.json"
RECIPE = "recipe.toml"


class WorkFolder:
    """A run's folder: stage folders, their done markers, and the recipe that owns them.

    Example:
        >>> work = WorkFolder.claim("slim-work", recipe, restart=False)  # doctest: +SKIP
        >>> work.done("01-baseline")  # doctest: +SKIP
        {'metric': 99.56, ...}
    """

    def __init__(self, root: Path) -> None:
        self.root = root

    @classmethod
    def claim(cls, root: str | os.PathLike[str], recipe: Recipe, *, restart: bool) -> WorkFolder:
        """The work folder for ``recipe``: made if new, emptied with ``restart``; one that holds another
        recipe's stages is refused (its markers would be wrong for this one)."""
        folder = cls(Path(root).resolve())
        existing = folder.root / RECIPE
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

    def stage(self, name: str) -> Path:
        """The folder of stage ``name`` (``02-prune``), made if missing."""
        path = self.root / name
        path.mkdir(parents=True, exist_ok=True)
        return path

    def done(self, name: str) -> dict[str, Any] | None:
        """The result stage ``name`` recorded when it finished, or None if it did not."""
        marker = self.root / name / MARKER
        if not marker.exists():
            return None
        try:
            return json.loads(marker.read_text(encoding="utf-8"))
        except ValueError:
            raise SlimtorchError(f"{marker}: a damaged done marker; rerun with --restart") from None

    def finish(self, name: str, result: dict[str, Any]) -> None:
        """Record stage ``name`` as finished with ``result``: written to a temporary file, then renamed, so
        an interrupted write never leaves a marker behind."""
        write_atomic_text(self.stage(name) / MARKER, json.dumps(result, indent=1, sort_keys=True))

    def relative(self, path: Path | None) -> str | None:
        """``path`` relative to the work folder, as the report names outputs."""
        return None if path is None else Path(path).resolve().relative_to(self.root).as_posix()

    def _empty(self) -> None:
        for child in self.root.iterdir():
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child)
            else:
                child.unlink()
