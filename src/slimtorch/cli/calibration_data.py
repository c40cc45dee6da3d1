"""``--data`` and ``--length``: calibration inputs read from the user's data for the commands that choose
weights with their inputs in view (``prune --method wanda|sparsegpt``, ``quantize``), and the held-out
perplexity a causal language model is judged by."""

from __future__ import annotations

import argparse
import itertools
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slimtorch.cli.arguments import integer

if TYPE_CHECKING:
    from slimtorch.recovery import TaskData

MAX_LENGTH = 1 << 17
"""the longest --length: tokens per calibration sequence"""
LENGTH = 512
"""tokens per sequence unless told"""


def add_calibration_data(parser: argparse.ArgumentParser, what: str) -> None:
    """``--data DATA`` (``what`` reads it) and ``--length N``."""
    parser.add_argument(
        "--data",
        metavar="DATA",
        help=f"{what}: a .txt file (a language model's folder: read with its tokenizer), or recover's data",
    )
    parser.add_argument(
        "--length",
        type=integer(2, MAX_LENGTH),
        default=LENGTH,
        metavar="N",
        help=f"tokens per sequence of a .txt --data (default {LENGTH})",
    )


def open_calibration(args: argparse.Namespace) -> TaskData:
    """``--data`` as task data: a .txt file through the model folder's tokenizer (``--samples`` sequences
    of ``--length`` tokens to calibrate on, and a fifth of what is read held out), or anything recover
    reads."""
    from slimtorch.recovery import open_data
    from slimtorch.recovery.text import EVAL_SHARE

    folder = Path(args.model)
    tokenizer = folder if folder.is_dir() else None
    sequences = max(2, math.ceil(args.samples / (1 - EVAL_SHARE)))
    return open_data(args.data, batch=4, tokenizer=tokenizer, length=args.length, sequences=sequences)


def calibration_samples(args: argparse.Namespace, data: TaskData) -> list[Any]:
    """The calibration inputs: every training sequence of a text (``--samples`` of them), else the first
    ``--samples`` training batches."""
    if data.metric == "perplexity":
        return [inputs for inputs, _ in data.train]
    return [inputs for inputs, _ in itertools.islice(data.train, args.samples)]
