"""MODEL and its options, the same on every command that works on a model: one layer over
:func:`slimtorch.open_model`.

``prune``, ``quantize``, ``export`` and ``ops`` take MODEL (a factory spec, a Hugging Face folder or a
sentence-transformers folder, either also by its Hub repo id from the local cache), ``--weights``,
``--non-strict``, ``--prefix``, ``--rename``, ``--input-shape`` and ``--allow-global``; ``memory`` takes
MODEL and ``--input-shape`` (it builds on the meta device and loads nothing). The example input comes
from the model unless ``--input-shape`` is given, and it has been run through the model once: a model
that rejects it is one line, exit 2.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from slimtorch.cli.arguments import add_allow_global, machine_memory
from slimtorch.cli.choices import DEFAULT_SHAPE
from slimtorch.cli.model_spec import HUB_ID_HELP, SPEC_HELP
from slimtorch.cli.untrusted_text import printable
from slimtorch.errors import OptionError

if TYPE_CHECKING:
    from slimtorch.loading import ModelInput

MODEL_HELP = (
    SPEC_HELP + f", a Hugging Face model folder, a sentence-transformers folder, or either by {HUB_ID_HELP}"
)
NOTED_NAMES = 3
MAX_DIMS = 16
"""the most dimensions an input shape may have (images are 4, video 5; torch's own kernels stop near 25)"""
ELEMENT_BYTES = 8
"""the widest element an example input takes (int64 token ids): a shape's elements times this must fit
in this machine's memory, or the example could never be made"""

__all__ = ["DEFAULT_SHAPE", "add_model_arguments", "command_model", "meta_model", "shape"]


def add_model_arguments(parser: argparse.ArgumentParser, default_shape: str | None = None) -> None:
    """MODEL, ``--weights``, the name-matching options, ``--input-shape`` and ``--allow-global``."""
    parser.add_argument("model", metavar="MODEL", help=MODEL_HELP)
    parser.add_argument(
        "--weights",
        metavar="PATH",
        help="checkpoint to load into the model (any format, or a Hub repo id from the local cache); for a "
        "folder, instead of its own weights",
    )
    add_name_matching(parser)
    add_input_shape(parser, default_shape)
    add_allow_global(parser)


def add_input_shape(parser: argparse.ArgumentParser, default_shape: str | None = None) -> None:
    fallback = default_shape or ",".join(map(str, DEFAULT_SHAPE))
    parser.add_argument(
        "--input-shape",
        type=shape,
        metavar="N,...",
        help="shape of the example input; default from the model: N,LENGTH token ids and a mask for a text "
        f"model, an image for a vision one, else the model's example_input_shape or {fallback}",
    )


def add_name_matching(parser: argparse.ArgumentParser, *, non_strict: bool = True) -> None:
    """``--prefix`` and ``--rename`` (and ``--non-strict`` unless the command has its own)."""
    if non_strict:
        parser.add_argument(
            "--non-strict",
            dest="strict",
            action="store_false",
            help="load even if the file holds tensors the model lacks or lacks some of its buffers",
        )
    parser.add_argument(
        "--prefix",
        metavar="P",
        help="the model's tensors sit under P in the file (e.g. model_state.); default: found by matching",
    )
    parser.add_argument(
        "--rename",
        action="append",
        default=[],
        metavar="OLD=NEW",
        help="replace the name prefix OLD by NEW in the file's names (repeatable), e.g. lstm.=rnn.",
    )


def name_matching(args: argparse.Namespace) -> dict:
    """``prefix`` and ``rename`` for :func:`slimtorch.load_model`, only those given."""
    given: dict = {}
    if getattr(args, "prefix", None) is not None:
        given["prefix"] = args.prefix
    if getattr(args, "rename", None):
        given["rename"] = [_rename(text) for text in args.rename]
    return given


def command_model(args: argparse.Namespace, *, check_example: bool = True) -> ModelInput:
    """The model MODEL names, its weights loaded, and an example input it accepts (not run through the
    model with ``check_example=False``: the command has an input of its own)."""
    from slimtorch.loading import open_model

    loaded = open_model(
        args.model,
        args.weights,
        strict=args.strict,
        input_shape=args.input_shape,
        allow_globals=tuple(args.allow_global),
        check_example=check_example,
        **name_matching(args),
    )
    _note_left_out(loaded)
    args.input_shape = loaded.shape  # the reports print the shape that was used
    return loaded


def meta_model(args: argparse.Namespace) -> ModelInput:
    """The model built on the meta device (no memory, no weights read), and an example input it accepts."""
    from slimtorch.loading import open_meta_model

    loaded = open_meta_model(args.model, input_shape=args.input_shape)
    args.input_shape = loaded.shape
    return loaded


def shape(text: str) -> tuple[int, ...]:
    """``--input-shape``: positive sizes, at most :data:`MAX_DIMS` of them, whose elements (at
    :data:`ELEMENT_BYTES` each) fit in this machine's memory.

    Example:
        >>> shape("1,3,224,224")
        (1, 3, 224, 224)
    """
    shown = text if len(text) <= 60 else text[:57] + "..."
    try:
        sizes = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated shape: {shown!r}") from None
    if not sizes or any(size < 1 for size in sizes):
        raise argparse.ArgumentTypeError(f"sizes must be positive: {shown!r}")
    if len(sizes) > MAX_DIMS:
        raise argparse.ArgumentTypeError(f"at most {MAX_DIMS} dimensions, not {len(sizes)}")
    elements, most = math.prod(sizes), machine_memory() // ELEMENT_BYTES
    if elements > most:
        raise argparse.ArgumentTypeError(
            f"{shown} is {elements:,} elements; this machine's memory holds at most {most:,} "
            f"({ELEMENT_BYTES} bytes each)"
        )
    return sizes


def _rename(text: str) -> tuple[str, str]:
    old, sep, new = text.partition("=")
    if not sep or not old:
        raise OptionError(f"--rename {text!r}: expected OLD=NEW, e.g. --rename lstm.=rnn.")
    return old, new


def output_companions(folder: Path | None) -> dict:
    """The input folder's files besides its weights, for a folder output (:func:`find_companions`); what
    stays behind (a stale ``onnx/`` export ...) is said on stderr, one line each, never dropped silently."""
    from slimtorch.sources.companions import find_companions

    if folder is None:
        return {}
    found = find_companions(folder)
    for line in found.left_out:
        print(f"slimtorch: note: not copied: {printable(line)}", file=sys.stderr)
    return found.files


def _note_left_out(loaded: ModelInput) -> None:
    """Nothing is left out silently: what the load skipped goes to stderr (stdout may be --json)."""
    if not loaded.ignored:
        return
    by_reason: dict[str, list[str]] = {}
    for line in loaded.ignored:  # "name (reason)": one reason said once, for all the names it covers
        name, _, reason = line.partition(" (")
        by_reason.setdefault(f" ({reason}" if reason else "", []).append(name)
    parts = []
    for reason, names in by_reason.items():
        more = f" and {len(names) - NOTED_NAMES} more" if len(names) > NOTED_NAMES else ""
        parts.append(", ".join(names[:NOTED_NAMES]) + more + reason)
    print(f"slimtorch: note: the load left out {printable('; '.join(parts))}", file=sys.stderr)
