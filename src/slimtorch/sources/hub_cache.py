"""Hugging Face Hub repo ids as model paths: ``org/name`` or ``org/name@revision``, read from the local cache.

Wherever slimtorch takes a checkpoint or a model folder it also takes a repo id, found in the cache that
``hf download`` and ``from_pretrained`` fill (``HF_HUB_CACHE``, or ``HF_HOME/hub``). Nothing is ever
downloaded, whatever ``HF_HUB_OFFLINE`` says: ``huggingface_hub`` is asked with ``local_files_only=True``,
which makes no network call. An existing local path always wins over an id with the same spelling.

A snapshot an interrupted download left behind is refused, not half read: an unfinished blob
(``blobs/*.incomplete``), a file whose blob is gone, or a shard the index lists but the snapshot lacks.

Example:
    >>> resolve_model_path("sentence-transformers/all-MiniLM-L6-v2")  # doctest: +SKIP
    PosixPath('/home/me/.cache/huggingface/hub/models--sentence-transformers--all-MiniLM-L6-v2/snapshots/c9745ed1...')
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from slimtorch.errors import CheckpointError, CheckpointNotFoundError, FormatError, SlimtorchError

# What huggingface_hub's validate_repo_id accepts, with the namespace: ASCII letters, digits, "-", "_", "."
# (not first or last), at most 96 each. "./x", "/x", "~/x" and "a/b/c" are paths, never ids.
_PART = r"[A-Za-z0-9_](?:[\w.-]{0,94}[A-Za-z0-9_])?"
_REPO_ID = re.compile(rf"(?:{_PART}/)?{_PART}", re.ASCII)
_REVISION = re.compile(r"[\w./-]+", re.ASCII)  # refs/pr/1, v1.0, main, a commit hash
# A missing "runs/model.pt" is a mistyped file, not a repo: it keeps the plain "no such file" error.
_FILE_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt", ".safetensors", ".pt2", ".onnx", ".json", ".py", ".gguf")


@dataclass(frozen=True)
class HubId:
    """A repo id on the Hub and, optionally, a revision: a branch, a tag or a commit hash."""

    repo_id: str
    revision: str | None = None

    def __str__(self) -> str:
        return self.repo_id + (f"@{self.revision}" if self.revision else "")

    @property
    def download_command(self) -> str:
        """The command that puts this revision in the cache."""
        return f"hf download {self.repo_id}" + (f" --revision {self.revision}" if self.revision else "")


def parse_hub_id(text: str) -> HubId | None:
    """``text`` as a repo id (``org/name`` or ``name``, then ``@revision`` optionally), or None when it
    cannot be one: a path such as ``./model``, ``/abs/model`` or ``a/b/c``, or a factory spec (``pkg:f``).

    Example:
        >>> parse_hub_id("BAAI/bge-small-en-v1.5@main")
        HubId(repo_id='BAAI/bge-small-en-v1.5', revision='main')
        >>> parse_hub_id("./runs/best") is None
        True
    """
    repo_id, at, revision = text.partition("@")
    if not _REPO_ID.fullmatch(repo_id) or "--" in repo_id or ".." in repo_id:
        return None
    if at and not _is_revision(revision):
        return None
    return HubId(repo_id, revision or None)


def hub_cache_dir() -> Path:
    """The cache folder huggingface_hub uses, read from the environment now, in its order:
    ``HF_HUB_CACHE``, ``HUGGINGFACE_HUB_CACHE``, ``HF_HOME/hub``, ``XDG_CACHE_HOME/huggingface/hub``,
    ``~/.cache/huggingface/hub``.
    (``huggingface_hub.constants`` reads them once, at import: a variable set later would be missed.)

    Example:
        >>> os.environ["HF_HUB_CACHE"] = "/data/hf"; hub_cache_dir()  # doctest: +SKIP
        PosixPath('/data/hf')
    """
    home = os.getenv("HF_HOME", os.path.join(os.getenv("XDG_CACHE_HOME", "~/.cache"), "huggingface"))
    legacy = os.getenv("HUGGINGFACE_HUB_CACHE", os.path.join(os.path.expanduser(home), "hub"))
    return Path(os.path.expandvars(os.path.expanduser(os.getenv("HF_HUB_CACHE", legacy))))


def resolve_model_path(path_or_id: str | os.PathLike[str]) -> Path:
    """Where ``path_or_id`` is on disk: an existing path as it is; a repo id as its snapshot folder in the
    local Hugging Face cache; anything else as given (the caller says it is missing). A ``Path`` object is
    always a path.

    Raises :class:`CheckpointNotFoundError` for a repo id the cache lacks, and :class:`FormatError` for a
    snapshot an interrupted download left incomplete. Never downloads.

    Example:
        >>> resolve_model_path("torch.nn:Identity")  # not an id: unchanged
        PosixPath('torch.nn:Identity')
        >>> resolve_model_path("BAAI/bge-small-en-v1.5").name  # doctest: +SKIP
        '5c38ec7c405ec4b44b94cc5a9bb96e735b38267a'
    """
    path = Path(path_or_id)
    if not isinstance(path_or_id, str) or path.exists():
        return path
    hub_id = parse_hub_id(path_or_id)
    if hub_id is None:
        return path
    snapshot = cached_snapshot(
        hub_id, missing_ok=path_or_id.endswith(_FILE_SUFFIXES) or "/" not in path_or_id
    )
    return path if snapshot is None else snapshot


def cached_snapshot(hub_id: HubId, *, missing_ok: bool = False) -> Path | None:
    """The snapshot folder of ``hub_id`` in the local cache, checked to be complete; None for an id the
    cache lacks with ``missing_ok`` (else a :class:`CheckpointNotFoundError` saying how to download it).

    Example:
        >>> cached_snapshot(HubId("BAAI/bge-small-en-v1.5", "main"))  # doctest: +SKIP
        PosixPath('.../models--BAAI--bge-small-en-v1.5/snapshots/5c38ec7c...')
    """
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError
    except ImportError:
        if missing_ok:
            return None
        raise SlimtorchError(
            f"{hub_id}: no such file or folder; to read it as a Hugging Face Hub id from the local cache, "
            "install huggingface_hub (pip install 'slimtorch[hf]')"
        ) from None
    cache = hub_cache_dir()
    try:
        found = snapshot_download(
            hub_id.repo_id, revision=hub_id.revision, cache_dir=cache, local_files_only=True
        )
    except LocalEntryNotFoundError as exc:
        # huggingface_hub >= 2.4 refuses a snapshot that lacks any file of its cached listing, even those
        # the user left out on purpose (hf download --include): judge it by what slimtorch reads instead.
        refused = getattr(exc, "snapshot_path", None)
        if refused is None:
            if missing_ok:
                return None
            raise CheckpointNotFoundError(str(hub_id), _not_cached(hub_id, cache)) from None
        found = refused
    snapshot = Path(found)
    _check_complete(hub_id, snapshot)
    return snapshot


def _not_cached(hub_id: HubId, cache: Path) -> str:
    refs = cache / f"models--{hub_id.repo_id.replace('/', '--')}" / "refs"
    cached = sorted(p.relative_to(refs).as_posix() for p in refs.rglob("*") if p.is_file())
    held = f" (it holds {', '.join(cached[:5])})" if hub_id.revision and cached else ""
    return (
        f"not a file or folder here, and not in the local Hugging Face cache (HF_HUB_CACHE={cache}){held}; "
        f"download it with `{hub_id.download_command}` or give a path"
    )


def _check_complete(hub_id: HubId, snapshot: Path) -> None:
    """Refuse a snapshot an interrupted download left behind; a snapshot without weights passes (a config
    is all a memory estimate needs), and the reader says so when weights are wanted."""
    from slimtorch.sources.hf_folder import weight_files  # the readers import this module

    again = f"finish the download with `{hub_id.download_command}`"
    unfinished = sorted((snapshot.parent.parent / "blobs").glob("*.incomplete"))
    if unfinished:
        raise FormatError(str(hub_id), f"a download into the cache is unfinished ({unfinished[0]}); {again}")
    for member in sorted(snapshot.rglob("*")):
        if member.is_symlink() and not member.exists():
            relative = member.relative_to(snapshot)
            raise FormatError(str(hub_id), f"{relative} in the cache links to a blob that is gone; {again}")
    try:
        weight_files(snapshot)
    except FormatError as exc:
        raise FormatError(
            str(hub_id), f"the cached snapshot is incomplete or damaged ({exc}); {again}"
        ) from None
    except CheckpointError:  # no weights, or several checkpoints: the reader says so if it reads them
        pass


def _is_revision(text: str) -> bool:
    """A branch, tag or commit hash that stays inside the cache's ``refs/`` (huggingface_hub opens
    ``refs/<revision>``): no part empty or starting with a dot."""
    return bool(_REVISION.fullmatch(text)) and all(p and not p.startswith(".") for p in text.split("/"))
