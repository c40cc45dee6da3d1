"""What a model folder holds besides its weights, copied along when slimtorch writes a folder from it.

A Hugging Face folder is more than its weights: ``config.json``, the tokenizer's files, the generation
config. Every command that writes a folder from a folder (shrink, quantize, prune) copies them through
:func:`companion_files`, so that the output opens wherever the input did.
"""

from __future__ import annotations

from pathlib import Path

from slimtorch.io.readers import folder_file

# Small files a Hugging Face folder needs besides its weights.
COMPANION_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.txt",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "preprocessor_config.json",
)


def companion_files(folder: Path) -> dict[str, Path]:
    """The files of ``folder`` to copy into an output folder, by their name there (relative, ``/``-separated).

    Only the folder's own files: a link out of it (say ``tokenizer.json`` to ``~/.netrc``) is refused with a
    :class:`~slimtorch.errors.FormatError` rather than copied along.
    """
    return {name: folder_file(folder, folder / name) for name in COMPANION_FILES if (folder / name).is_file()}
