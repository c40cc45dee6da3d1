"""Text for a causal language model: a plain text file cut into token sequences, scored by perplexity.

:func:`open_text` tokenizes a ``.txt`` file with the model's own tokenizer and cuts the token stream into
sequences of ``length`` tokens: the first ones are for calibration and training, the last
:data:`EVAL_SHARE` of them are held out (a contiguous tail, so no held-out sentence was seen). The
:class:`~slimtorch.recovery.data.TaskData` it returns has the metric ``"perplexity"``:
:func:`~slimtorch.recovery.data.evaluate` then gives ``exp`` of the mean negative log-likelihood of each
next token of the held-out sequences (lower is better), what language-model papers report.

The file is read within :data:`MAX_TEXT_BYTES`, and tokenized a paragraph block at a time until enough
tokens are there; a file with too few tokens for one calibration and one held-out sequence is one error.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from slimtorch.errors import OptionError, SlimtorchError

EVAL_SHARE = 0.2
"""the held-out share of the sequences (the file's tail)"""
LENGTH = 512
"""tokens per sequence unless told"""
MAX_SEQUENCES = 256
"""sequences taken from a file unless told: 2 MB of English text at most, enough for calibration (the
papers use 128 of 2048 tokens) and a held-out perplexity"""
MAX_TEXT_BYTES = 1 << 30
"""the largest text file read"""
CHUNK_CHARS = 1 << 16
"""characters tokenized at once (cut at a line end)"""


class Sequences:
    """Batches of ``(ids, ids)``: the model reads the ids and is scored on predicting each next one."""

    def __init__(self, ids: torch.Tensor, batch: int) -> None:
        self.ids, self.batch = ids, batch

    def __len__(self) -> int:
        return math.ceil(len(self.ids) / self.batch)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for start in range(0, len(self.ids), self.batch):
            chunk = self.ids[start : start + self.batch]
            yield chunk, chunk


def open_text(
    path: str | os.PathLike[str],
    tokenizer: Any,
    *,
    length: int = LENGTH,
    sequences: int = MAX_SEQUENCES,
    batch: int = 4,
) -> tuple[Sequences, Sequences, str]:
    """``(train, eval, note)`` from a text file: ``sequences`` sequences of ``length`` tokens at most,
    the last :data:`EVAL_SHARE` held out. ``tokenizer``: a ``tokenizers.Tokenizer``, a Hugging Face
    tokenizer, a path to a ``tokenizer.json`` or a model folder holding one, or any callable from a string
    to token ids."""
    if length < 2 or sequences < 2 or batch < 1:
        raise OptionError(
            f"text needs length >= 2, sequences >= 2 and batch >= 1, not {length}, {sequences}, {batch}"
        )
    file = Path(path)
    try:
        size = file.stat().st_size
    except OSError as exc:
        raise SlimtorchError(f"data {str(path)!r}: cannot read it ({exc.strerror})") from None
    if size > MAX_TEXT_BYTES:
        raise SlimtorchError(
            f"data {str(path)!r}: {size:,} bytes of text, more than the {MAX_TEXT_BYTES:,} read"
        )
    encode = _encoder(tokenizer, str(path))
    wanted = length * sequences
    ids: list[int] = []
    with file.open(encoding="utf-8", errors="replace") as handle:
        for chunk in _chunks(handle):
            ids += encode(chunk)
            if len(ids) >= wanted:
                break
    count = min(len(ids) // length, sequences)
    held = max(1, round(count * EVAL_SHARE))
    if count < 2:
        raise SlimtorchError(
            f"data {str(path)!r}: {len(ids):,} tokens, fewer than two sequences of {length} (one to "
            "calibrate on, one held out): give more text or a shorter --length"
        )
    table = torch.tensor(ids[: count * length], dtype=torch.long).reshape(count, length)
    note = (
        f"{count} sequences of {length} tokens from {file.name}: {count - held} to calibrate and train on, "
        f"the last {held} held out"
    )
    return Sequences(table[: count - held], batch), Sequences(table[count - held :], batch), note


def _chunks(handle: Any) -> Iterator[str]:
    """The file's text in pieces of about :data:`CHUNK_CHARS`, each ending at a line end."""
    pending = ""
    while True:
        block = handle.read(CHUNK_CHARS)
        if not block:
            if pending:
                yield pending
            return
        pending += block
        cut = pending.rfind("\n")
        if cut >= 0:
            yield pending[: cut + 1]
            pending = pending[cut + 1 :]


def _encoder(tokenizer: Any, spec: str) -> Callable[[str], Sequence[int]]:
    """A function from text to token ids, from what the caller gave as the tokenizer."""
    if isinstance(tokenizer, (str, os.PathLike)):
        found = Path(tokenizer)
        found = found / "tokenizer.json" if found.is_dir() else found
        if not found.is_file():
            raise SlimtorchError(
                f"data {spec!r}: no tokenizer at {str(tokenizer)!r} (a tokenizer.json or a folder with one)"
            )
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise SlimtorchError("text data needs the tokenizers package: pip install tokenizers") from None
        try:
            tokenizer = Tokenizer.from_file(str(found))
        except Exception as exc:  # the library's own error on a file it cannot read
            raise SlimtorchError(
                f"{found}: cannot read the tokenizer ({str(exc).splitlines()[0][:200]})"
            ) from None
    encode = getattr(tokenizer, "encode", None)
    if encode is None and callable(tokenizer):
        encode = tokenizer
    if encode is None:
        raise OptionError(
            "tokenizer must encode text (a tokenizers.Tokenizer, a transformers tokenizer, a path), not "
            f"{type(tokenizer).__name__}"
        )

    def ids(text: str) -> list[int]:
        try:  # a transformers tokenizer adds a beginning-of-text token to each call unless told not to
            found = encode(text, add_special_tokens=False)
        except TypeError:
            found = encode(text)
        found = getattr(found, "ids", found)  # a tokenizers Encoding
        found = found.get("input_ids", found) if isinstance(found, dict) else found
        return [int(i) for i in found]

    return ids


def perplexity(model: nn.Module, batches: Any) -> float:
    """``exp`` of the mean negative log-likelihood of each next token: the model's logits (its output, or
    the first tensor of a Hugging Face output) at each position against the id that follows. ``batches``
    yields ``(ids, ids)`` pairs or ids alone (``batch, sequence``)."""
    total, count = 0.0, 0
    for item in batches:
        ids = item[0] if isinstance(item, (tuple, list)) else item
        ids = ids.to(next((p.device for p in model.parameters()), torch.device("cpu")))
        logits = _logits(model(ids))
        if logits.dim() != 3 or logits.shape[:2] != ids.shape:
            raise SlimtorchError(
                f"perplexity needs a causal language model's logits (batch, sequence, vocabulary) for ids "
                f"{list(ids.shape)}, not {list(logits.shape)}"
            )
        total += float(
            nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1), reduction="sum"
            )
        )
        count += ids[:, 1:].numel()
    if count == 0:
        raise SlimtorchError("perplexity: the held-out data yielded no token to predict")
    return math.exp(total / count)


def _logits(output: Any) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise SlimtorchError(f"perplexity needs logits, and the model returns a {type(output).__name__}")
