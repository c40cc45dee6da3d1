"""Text bundles: a model that reads token ids, exported with its tokenizer so that its bundle takes raw text.

A Hugging Face text model's inputs come from its tokenizer: ``input_ids``, ``attention_mask`` and, where
the model has token types, ``token_type_ids``, each ``(batch, sequence)``. A text bundle exports exactly
those its forward takes, with both axes dynamic up to the model's longest input; it carries the folder's
``tokenizer.json`` (with its config and special tokens) and records in the manifest how ``predict.py``
turns text into inputs: the ``tokenizers`` package encodes, truncates at the model's max length and pads
each batch on the right, to its longest text, with the pad token and a zero mask.

The export check runs on sample sentences tokenized that very way (the runner's own code), on the
example, and on random tokens at other lengths and batch sizes, up to the longest.

A sentence-transformers folder is a :class:`~slimtorch.models.sentence.SentenceEmbedder`, whose pooling
and normalisation are part of its forward: they are exported in the graph, where the check against eager
covers them, rather than re-written in numpy in the runner, where nothing would.

Example:
    >>> text = text_inputs("bert-folder", model, example)  # doctest: +SKIP
    >>> text.inputs, text.max_length, text.pad_id  # doctest: +SKIP
    (('input_ids', 'attention_mask', 'token_type_ids'), 512, 0)
"""

from __future__ import annotations

import inspect
import os
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from slimtorch.deploy import runner
from slimtorch.errors import FormatError, SlimtorchError
from slimtorch.format.untrusted import MAX_JSON_BYTES
from slimtorch.models import hub
from slimtorch.models.sentence import SentenceEmbedder
from slimtorch.sources.companions import companion_files

TOKEN_INPUTS = runner.TOKEN_FIELDS
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
TOKENIZER = "tokenizer.json"
SEQUENCE = "sequence"
SAMPLE_TEXTS = (
    "Hello world.",
    "A bundle carries its tokenizer, so it takes raw text and pads each batch with its attention mask.",
)
UNSET_LENGTH = 10**6
"""a ``model_max_length`` at or above this is transformers' "no limit" placeholder (1e30), not a limit"""


@dataclass(frozen=True)
class TextInputs:
    """How a text bundle turns text into the model's inputs, and the example to export with."""

    folder: Path
    """where the tokenizer's files come from"""
    inputs: tuple[str, ...]
    """the model's token inputs, in its forward's order"""
    example: dict[str, torch.Tensor]
    """the caller's example with every input in :attr:`inputs` (a missing mask is all ones)"""
    max_length: int
    """tokens kept per text: the sentence-transformers or tokenizer limit, within the model's positions"""
    pad_id: int
    pad_token: str | None
    files: dict[str, Path]
    """the tokenizer files copied into the bundle, by their name there"""
    sentence: bool
    """a sentence-transformers model: its one output is the pooled, normalised embedding"""

    def manifest(self) -> dict[str, Any]:
        """The manifest's ``text`` section: what :func:`runner.encode_texts` reads."""
        return {
            "tokenizer": TOKENIZER,
            "files": sorted(self.files),
            "inputs": {name: TOKEN_INPUTS[name] for name in self.inputs},
            "max_length": self.max_length,
            "truncation": "right",
            "padding": "right, to the longest text of the batch",
            "pad_id": self.pad_id,
            "pad_token": self.pad_token,
            "sample_texts": list(SAMPLE_TEXTS),
        }

    def note(self) -> str:
        """One line for the export report."""
        return (
            f"text bundle: the tokenizer of {self.folder}, at most {self.max_length} tokens a text, padded "
            'per batch with the attention mask; python predict.py --text "a sentence"'
        )

    def copy_files(self, path: Callable[[str], Path]) -> None:
        """Copy the tokenizer files to ``path(name)`` (the bundle's staging folder)."""
        for name, source in self.files.items():
            shutil.copyfile(source, path(name))


def text_inputs(folder: str | os.PathLike[str], model: nn.Module, example: Any) -> TextInputs:
    """The text set-up of ``model`` with the tokenizer of ``folder``; a clear refusal where the bundle
    could not turn text into what the model takes.

    Example:
        >>> text_inputs("bert-folder", model, {"input_ids": ids}).inputs  # doctest: +SKIP
        ('input_ids', 'attention_mask', 'token_type_ids')
    """
    folder = Path(folder)
    files = {  # files of the folder (only README.md and modules.json come as bytes to write)
        name: path
        for name, path in companion_files(folder).items()
        if name in TOKENIZER_FILES and isinstance(path, Path)
    }
    if TOKENIZER not in files:
        raise SlimtorchError(
            f"{folder}: no tokenizer.json, which a text bundle carries (the tokenizers package reads only "
            "that file); save the tokenizer with transformers' save_pretrained, or export token ids"
        )
    tokenizer = _tokenizer(files[TOKENIZER])
    config = getattr(model, "config", None)
    names = token_inputs(model)
    limit = max_length(folder, config)
    pad_id, pad_token = _pad(tokenizer, folder, config)
    given = _example(example, names, folder)
    length = given["input_ids"].shape[-1]
    if length > limit:
        raise SlimtorchError(f"the example has {length} tokens, more than the {limit} the model takes")
    sentence = isinstance(model, SentenceEmbedder)
    return TextInputs(folder, names, given, limit, pad_id, pad_token, files, sentence)


def token_inputs(model: nn.Module) -> tuple[str, ...]:
    """The inputs of :data:`TOKEN_INPUTS` the model's forward takes (token types only where its config
    has them), in the forward's order."""
    try:
        parameters = list(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        parameters = []
    if "input_ids" not in parameters:
        raise SlimtorchError(f"{type(model).__name__} takes no input_ids: it is not a text model")
    config = getattr(model, "config", None)
    types = getattr(config, "type_vocab_size", 1) if config is not None else 1
    return tuple(name for name in parameters if name in TOKEN_INPUTS and (name != "token_type_ids" or types))


def max_length(folder: Path, config: Any) -> int:
    """The most tokens a text keeps: ``max_seq_length`` of ``sentence_bert_config.json`` (what
    sentence-transformers truncates to), else the tokenizer's ``model_max_length``, never more than the
    model's position embeddings."""
    positions = _positive(
        getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    )
    sentence = _setting(folder / "sentence_bert_config.json", "max_seq_length")
    tokenizer = _setting(folder / "tokenizer_config.json", "model_max_length")
    wanted = sentence or (tokenizer if tokenizer and tokenizer < UNSET_LENGTH else None) or positions
    if wanted is None:
        raise SlimtorchError(
            f"{folder}: cannot tell the longest input the model takes (no max_seq_length, model_max_length "
            "or max_position_embeddings)"
        )
    return min(wanted, positions) if positions else wanted


def verification_inputs(text: TextInputs, count: int, seed: int = 0) -> list[tuple[torch.Tensor, ...]]:
    """What the export is checked on: the sample texts tokenized as the runner tokenizes, the example,
    then random tokens at other lengths: a batch of 3 short rows, one row as long as the model takes, ..."""
    encoded = encode(text, list(SAMPLE_TEXTS))
    inputs = [encoded, tuple(text.example[name] for name in text.inputs)]
    generator = torch.Generator().manual_seed(seed)
    shapes = [(3, min(5, text.max_length)), (1, text.max_length)]
    while len(shapes) < count - 1:
        shapes.append((2, int(torch.randint(1, text.max_length + 1, (), generator=generator))))
    return inputs + [_tokens(text, batch, length, generator) for batch, length in shapes[: count - 1]]


def trace_inputs(text: TextInputs) -> tuple[torch.Tensor, ...]:
    """The input export traces: the example when its batch and length are over 1 (export fixes a size of
    1), else random tokens of 2 x 8."""
    batch, length = text.example["input_ids"].shape
    if batch > 1 and length > 1:
        return tuple(text.example[name] for name in text.inputs)
    return _tokens(text, 2, min(8, text.max_length), torch.Generator().manual_seed(0))


def encode(text: TextInputs, texts: list[str]) -> tuple[torch.Tensor, ...]:
    """``texts`` as the bundle's runner tokenizes them (its own function), as tensors in input order."""
    arrays = runner.encode_texts(text.files[TOKENIZER], text.manifest(), texts)
    return tuple(torch.from_numpy(arrays[name]).to(text.example[name].dtype) for name in text.inputs)


def dynamic_shape(shapes: list[tuple[int, ...]]) -> list[int | str]:
    """An output's shape over the samples: ``"batch"`` and ``"sequence"`` where it varied, else its size."""
    first = shapes[0]
    varied = [len({s[i] for s in shapes}) > 1 for i in range(len(first))]
    return [(("batch" if i == 0 else SEQUENCE) if varied[i] else size) for i, size in enumerate(first)]


def _tokens(
    text: TextInputs, batch: int, length: int, generator: torch.Generator
) -> tuple[torch.Tensor, ...]:
    """Random ids from the example's range, each row shorter than the last by a quarter, padded as the
    runner pads (pad id, zero mask and token types)."""
    ids = text.example["input_ids"]
    mask = text.example["attention_mask"].bool() if "attention_mask" in text.example else None
    used = ids[mask] if mask is not None and mask.any() else ids.flatten()
    drawn = torch.randint(int(used.min()), int(used.max()) + 1, (batch, length), generator=generator)
    keep = torch.zeros(batch, length, dtype=torch.long)
    for row in range(batch):
        keep[row, : max(1, length - row * (length // 4))] = 1
    if "attention_mask" not in text.inputs:
        keep.fill_(1)  # no mask to say what is padding: every row full
    values = {
        "input_ids": torch.where(keep.bool(), drawn, text.pad_id).to(ids.dtype),
        "attention_mask": keep,
        "token_type_ids": torch.zeros_like(keep),
    }
    return tuple(values[name].to(text.example[name].dtype) for name in text.inputs)


def _example(example: Any, names: tuple[str, ...], folder: Path) -> dict[str, torch.Tensor]:
    """The example by input name, with an all-ones mask and zero token types where it has none."""
    if not isinstance(example, Mapping):
        values = example if isinstance(example, (tuple, list)) else (example,)
        example = dict(zip(names, values, strict=False))
    unknown = [name for name in example if name not in names]
    if unknown or "input_ids" not in example:
        raise SlimtorchError(
            f"a text bundle's inputs come from the tokenizer of {folder} ({', '.join(names)}); the example "
            f"gives {', '.join(map(repr, unknown)) or 'no input_ids'}"
        )
    ids = example["input_ids"]
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.is_floating_point():
        raise SlimtorchError(
            "a text model's example input_ids are integer token ids of shape (batch, length)"
        )
    filled = {"attention_mask": torch.ones_like(ids), "token_type_ids": torch.zeros_like(ids)}
    return {name: example[name] if name in example else filled[name] for name in names}


def _tokenizer(path: Path) -> Any:
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise SlimtorchError("a text bundle needs the tokenizers package: pip install tokenizers") from None
    if not path.is_file() or path.stat().st_size > MAX_JSON_BYTES:  # read whole by the Rust library
        raise FormatError(path, f"not a regular file of at most {MAX_JSON_BYTES >> 20} MiB")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # the Rust library raises a bare Exception on a file it cannot read
        raise FormatError(path, f"not a tokenizer the tokenizers package reads ({exc})") from None


def _pad(tokenizer: Any, folder: Path, config: Any) -> tuple[int, str | None]:
    """The pad token: as tokenizer.json pads, else the folder's ``pad_token``, else the config's id, else 0
    (masked out wherever it is used)."""
    if tokenizer.padding:
        return int(tokenizer.padding["pad_id"]), tokenizer.padding["pad_token"]
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        token = _setting(folder / name, "pad_token", kind=(str, dict))
        token = token.get("content") if isinstance(token, dict) else token
        if isinstance(token, str) and tokenizer.token_to_id(token) is not None:
            return int(tokenizer.token_to_id(token)), token
    pad_id = getattr(config, "pad_token_id", None)
    return (pad_id, None) if isinstance(pad_id, int) and pad_id >= 0 else (0, None)


def _setting(path: Path, key: str, kind: type | tuple[type, ...] = int) -> Any:
    if not path.is_file():
        return None
    document = hub.read_json(path)
    value = document.get(key) if isinstance(document, dict) else None
    if kind is int:
        return _positive(value)
    return value if isinstance(value, kind) else None


def _positive(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None
