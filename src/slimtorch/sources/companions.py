"""What a model folder holds besides its weights, copied along when slimtorch writes a folder from it.

A Hugging Face folder is more than its weights: ``config.json``, the tokenizer's files, the generation
config, a model card; a sentence-transformers folder adds ``modules.json``, ``1_Pooling/config.json`` and
the other modules' folders. Every command that writes a folder from a folder (shrink, quantize, prune)
copies them through :func:`companion_files`, so that the output opens wherever the input did.

Two kinds of files stay behind, each with a line saying why (:attr:`Companions.left_out`): the weights
slimtorch rewrites, and exports of the original weights (``onnx/``, ``*.gguf`` ...), which would no longer
match the new weights and would load as the old model without a word. The model card (``README.md``) is
copied with a short section saying what slimtorch did (:func:`model_card`), or written when there is none.
"""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from slimtorch.errors import CheckpointError, FormatError, SlimtorchError
from slimtorch.format.untrusted import load_json
from slimtorch.format.writer import CARD_NAME
from slimtorch.schemes import BY_NAME as SCHEME_ROWS
from slimtorch.sources import folder_file

MODULES_NAME = "modules.json"
TRANSFORMER = "sentence_transformers.models.Transformer"
POOLING = "sentence_transformers.models.Pooling"
NORMALIZE = "sentence_transformers.models.Normalize"
# modules.json names each module by its class's import path, which sentence-transformers 5.4 moved:
# folders it saves name the new paths, older folders the old ones.
MODULE_TYPES = {
    TRANSFORMER: TRANSFORMER,
    "sentence_transformers.base.modules.transformer.Transformer": TRANSFORMER,
    "sentence_transformers.base.modules.Transformer": TRANSFORMER,
    POOLING: POOLING,
    "sentence_transformers.sentence_transformer.modules.pooling.Pooling": POOLING,
    "sentence_transformers.sentence_transformer.modules.Pooling": POOLING,
    NORMALIZE: NORMALIZE,
    "sentence_transformers.base.modules.normalize.Normalize": NORMALIZE,
    "sentence_transformers.base.modules.Normalize": NORMALIZE,
}
MAX_FILES = 1000
MAX_BYTES = 1 << 30
"""Budgets for what a folder holds besides its weights: a tokenizer is at most tens of MiB."""
MAX_DEPTH = 8

# Weights of the model's own folder, which the writer replaces (names as transformers and slimtorch read
# them), and pickled training state beside them, which belongs to the old weights.
_REWRITTEN = re.compile(r".*\.safetensors|.*\.index\.json|.*\.(pt|pth|ckpt|bin)|model\.ckpt.*")
# Exports of the original weights, anywhere in the folder: copied, they would run the old model.
_STALE_FOLDERS = frozenset({"onnx", "openvino", "coreml", "tflite", "gguf", "tensorrt"})
_STALE_SUFFIXES = frozenset(
    {".onnx", ".onnx_data", ".gguf", ".ggml", ".tflite", ".mlmodel", ".mlpackage", ".h5", ".msgpack", ".ot"}
    | {".engine", ".plan", ".pte", ".pt2"}
)


@dataclass(frozen=True)
class Companions:
    """The files to copy into the output folder (by their name there) and what was left out, and why."""

    files: dict[str, Path | bytes]
    """relative, ``/``-separated name in the output -> the input's file, or the bytes to write there;
    always a ``README.md`` (empty bytes where the input has no card), which the writer turns into the
    output's card (:func:`model_card`)"""
    left_out: tuple[str, ...] = ()
    """one ``name: why`` line per file left behind"""

    def to_dict(self) -> dict[str, Any]:
        return {"files": sorted(self.files), "left_out": list(self.left_out)}


def find_companions(folder: Path) -> Companions:
    """Every file of ``folder`` besides the weights slimtorch rewrites and stale exports of them.

    ``folder`` may also be the Transformer sub-folder of a sentence-transformers folder (``0_Transformer``,
    what :func:`slimtorch.open_model` reports as the model's folder): the whole sentence-transformers
    folder comes along, the Transformer's files at the top (where the new weights go) and ``modules.json``
    pointing there. Only the folder's own files are read: a link leaving it is a
    :class:`~slimtorch.errors.FormatError`, a pipe or device file too, and more than :data:`MAX_FILES`
    files or :data:`MAX_BYTES` bytes is refused in one line.

    Example:
        >>> found = find_companions(Path("all-MiniLM-L6-v2"))  # doctest: +SKIP
        >>> sorted(found.files)[:3], found.left_out  # doctest: +SKIP
        (['1_Pooling/config.json', 'README.md', 'config.json'], ('onnx/model.onnx: an export of ...',))
    """
    root, inner = _sentence_root(folder)
    files: dict[str, Path | bytes] = {}
    left_out: list[str] = []
    for shown, path in _walk(root, left_out):  # the top's files first, then the sub-folders'
        name = shown.removeprefix(f"{inner}/") if inner else shown  # the Transformer's files go to the top
        why = _left_behind(name, path)
        if why:
            left_out.append(f"{shown}: {why}")
        elif name in files and name == CARD_NAME:
            left_out.append(f"{shown}: the folder's own {CARD_NAME} is the card")
        else:
            if name in files:  # the top is the Transformer's folder now: its config.json, not an old one
                left_out.append(f"{name}: {shown} takes its place")
            files[name] = path
    if inner is not None and MODULES_NAME in files:
        files[MODULES_NAME] = _flattened_modules(root / MODULES_NAME)
    files.setdefault(CARD_NAME, b"")  # no card: the writer writes a new one
    _check_budget(root, files)
    return Companions(files, tuple(left_out))


def companion_files(folder: Path) -> dict[str, Path | bytes]:
    """The files of ``folder`` to copy into an output folder, by their name there (relative, ``/``-separated):
    :attr:`Companions.files` of :func:`find_companions`.

    Example:
        >>> companion_files(Path("bert"))  # doctest: +SKIP
        {'config.json': PosixPath('bert/config.json'), 'vocab.txt': PosixPath('bert/vocab.txt')}
    """
    return find_companions(folder).files


def source_provenance(command: str, folder: Path | None) -> dict[str, Any]:
    """What the model card says about the input: the command, the input folder's name and its weights'
    size. Writers pass it as provenance (``save_model(..., metadata=source_provenance("quantize int8-weight",
    folder))``); :func:`model_card` reads it.

    Example:
        >>> source_provenance("quantize int8-dynamic", None)
        {'command': 'quantize int8-dynamic'}
    """
    if folder is None:
        return {"command": command}
    from slimtorch.sources.hf_folder import weight_files

    root, inner = _sentence_root(folder)
    try:
        _, weights = weight_files(root / inner if inner else root)
    except CheckpointError:
        return {"command": command, "source": root.name}
    return {"command": command, "source": root.name, "source_bytes": sum(p.stat().st_size for p in weights)}


def model_card(
    source: Path | bytes | None, provenance: Mapping[str, Any], delta: Mapping[str, Any] | None, after: int
) -> bytes:
    """The output's ``README.md``: the input's card (``source``) with a section appended saying what
    slimtorch did, to which input, and the weights' size before and after; a minimal card without one.

    Example:
        >>> print(model_card(None, {"tool": "slimtorch 0.1.0", "command": "shrink"}, None, 2048).decode())
        ... # doctest: +ELLIPSIS
        # Model compressed with slimtorch
        ...
    """
    raw = source.read_bytes() if isinstance(source, Path) else source or b""
    text = raw.decode("utf-8", "replace") if raw.strip() else "# Model compressed with slimtorch\n"
    return (text.rstrip("\n") + "\n\n" + _provenance_section(provenance, delta or {}, after)).encode()


def _provenance_section(provenance: Mapping[str, Any], delta: Mapping[str, Any], after: int) -> str:
    from slimtorch.format.units import format_bytes

    tool = str(provenance.get("tool", "slimtorch"))
    command = provenance.get("command")
    source = provenance.get("source")
    what = f"`{tool}`" + (f" (`{command}`)" if command else "")
    lines = ["## slimtorch", "", f"Written by {what}" + (f" from `{source}`." if source else "."), ""]
    before = provenance.get("source_bytes")
    size = f"- weights: {format_bytes(after)}"
    if isinstance(before, int) and before > 0:
        size += f", from {format_bytes(before)} ({after / before:.2f}x)"
    lines.append(size)
    options = provenance.get("options")
    if isinstance(options, Mapping):
        shown = [
            f"{k}={_short(options[k])}"
            for k, default in _CARD_OPTIONS.items()
            if options.get(k, default) != default
        ]
        if _grouped(options.get("quantize")):
            shown.append(f"group_size={options.get('group_size')}")
        if shown:
            lines.append(f"- options: `{' '.join(shown)}`")
    quantized = delta.get("quantized") or {}
    if quantized:
        schemes = sorted(
            {str(v.get("scheme", "?")) if isinstance(v, Mapping) else "?" for v in quantized.values()}
        )
        lines.append(f"- {len(quantized)} layers quantized ({', '.join(schemes)})")
    if delta.get("shapes"):
        lines.append(f"- {len(delta['shapes'])} tensors resized by pruning")
    return "\n".join(lines) + "\n"


# The options a card shows, with the defaults it leaves out (ShrinkOptions' own; the rest is bookkeeping).
_CARD_OPTIONS: dict[str, Any] = {
    "quantize": None,
    "dtype": None,
    "sparse": "auto",
    "entropy": False,
    "skip": [],
    "quantize_embeddings": True,
    "quantize_all": False,
}


def _grouped(quantize: Any) -> bool:
    """Whether the writers' ``quantize`` (a scheme's name) stores weights in groups, whose size the card
    then shows: a name of any other kind (provenance may come from a user) is none."""
    row = SCHEME_ROWS.get(quantize) if isinstance(quantize, str) else None
    return row is not None and row.grouped


def _short(value: Any) -> str:
    text = ",".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _sentence_root(folder: Path) -> tuple[Path, str | None]:
    """(the folder to copy, the sub-folder holding the Transformer when it is not the top): for
    ``x/0_Transformer`` whose parent's ``modules.json`` names it, ``(x, "0_Transformer")``."""
    inner = _transformer_path(folder)
    if inner:
        return folder, inner
    outer = _transformer_path(folder.parent)
    if outer and (folder.parent / outer).resolve() == folder.resolve():
        return folder.parent, outer
    return folder, None


def _transformer_path(root: Path) -> str | None:
    """The Transformer module's path in ``root/modules.json`` (``""``: the top); None: no such module,
    or a path that is not one plain sub-folder."""
    modules_file = root / MODULES_NAME
    if not modules_file.is_file():
        return None
    try:
        modules = load_json(modules_file, modules_file.read_bytes(), "modules.json")
    except (OSError, FormatError):
        return None
    if not isinstance(modules, list):
        return None
    paths = [m.get("path", "") for m in modules if _is_transformer(m)]
    if len(paths) != 1 or not isinstance(paths[0], str):
        return None
    path = paths[0].strip("/")
    plain = re.fullmatch(r"[\w.-]+", path) is not None and path not in (".", "..")
    return path if path == "" or plain else None


def _flattened_modules(path: Path) -> bytes:
    """``modules.json`` with the Transformer at the top, where the output's weights are."""
    modules = load_json(path, path.read_bytes(), "modules.json")
    for module in modules:
        if _is_transformer(module):
            module["path"] = ""
    return (json.dumps(modules, indent=2) + "\n").encode()


def _is_transformer(module: Any) -> bool:
    return isinstance(module, dict) and MODULE_TYPES.get(str(module.get("type"))) == TRANSFORMER


def _walk(root: Path, left_out: list[str]) -> list[tuple[str, Path]]:
    """(relative name, path) of every plain file under ``root``, links checked to stay inside; within
    :data:`MAX_DEPTH` folders and :data:`MAX_FILES` files."""
    found: list[tuple[str, Path]] = []
    pending = [(root, 0)]
    while pending:
        here, depth = pending.pop()
        for entry in sorted(os.scandir(here), key=lambda e: e.name):
            path = Path(entry.path)
            name = path.relative_to(root).as_posix()
            if entry.name.startswith("."):  # .git, .gitattributes, .cache: the repository's, not the model's
                continue
            if entry.is_dir(follow_symlinks=False):
                if depth + 1 >= MAX_DEPTH:
                    raise FormatError(path, f"folders nested deeper than {MAX_DEPTH}; not a model folder")
                pending.append((path, depth + 1))
                continue
            try:
                mode = entry.stat().st_mode  # a link: what it points to
            except OSError:
                raise FormatError(path, "a symbolic link to nothing; remove it or copy the file in") from None
            if stat.S_ISDIR(mode):
                folder_file(root, path)  # a link to a folder: refused if it leaves, not followed otherwise
                left_out.append(f"{name}: a link to a folder, not followed")
                continue
            if not stat.S_ISREG(mode):
                raise FormatError(path, "not a regular file (a pipe, socket or device); remove it or copy")
            found.append((name, folder_file(root, path)))
            if len(found) > MAX_FILES:
                raise SlimtorchError(
                    f"{root}: holds more than {MAX_FILES} files besides its weights; slimtorch copies at "
                    "most that many along (write to a .safetensors file, or trim the folder)"
                )
    return found


def _left_behind(name: str, path: Path) -> str | None:
    """Why ``name`` is not copied; None: it is."""
    parts = PurePosixPath(name).parts
    if any(part in _STALE_FOLDERS for part in parts[:-1]) or path.suffix.lower() in _STALE_SUFFIXES:
        return "an export of the original weights: it would not match the new ones (export again)"
    if len(parts) == 1 and _REWRITTEN.fullmatch(name):
        return "the weights (or training state) this output rewrites"
    return None


def _check_budget(root: Path, files: Mapping[str, Path | bytes]) -> None:
    total = 0
    for name, source in files.items():
        total += len(source) if isinstance(source, bytes) else source.stat().st_size
        if total > MAX_BYTES:
            raise SlimtorchError(
                f"{root}: holds more than {MAX_BYTES >> 20} MiB besides its weights (up to {name}); "
                "slimtorch copies at most that much along (write to a .safetensors file, or trim the folder)"
            )
