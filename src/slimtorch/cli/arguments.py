"""Pieces every command shares: how it is added, the pickle trust option, --group-size, --json output."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from slimtorch.errors import OptionError
from slimtorch.format.codecs.lossy import check_group_size


def add_command(
    commands: argparse._SubParsersAction,
    common: argparse.ArgumentParser,
    name: str,
    help: str,
    description: str,
) -> argparse.ArgumentParser:
    """A sub-command whose ``--help`` keeps the description's own line breaks (examples stay readable)."""
    return commands.add_parser(
        name,
        help=help,
        description=description,
        parents=[common],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def add_layout(parser: argparse.ArgumentParser) -> None:
    """``--format hf|slim``: the layout of a folder output, for every command that writes one."""
    parser.add_argument(
        "--format",
        choices=("hf", "slim"),
        dest="layout",
        help="folder layout: hf (from_pretrained reads it; int8/int4 in the compressed-tensors format), "
        "slim (smallest; from_pretrained refuses it); default hf from a Hugging Face folder, else slim",
    )


def add_group_size(parser: argparse.ArgumentParser, default: int) -> None:
    """``--group-size``, checked while parsing by the rule every verb checks it with: a bad one is a usage
    error naming the option (exit 2), before any model is read."""
    parser.add_argument(
        "--group-size",
        type=_group_size,
        default=default,
        metavar="G",
        help=f"int4 values per scale, even, 32 to 256 (default {default})",
    )


def _group_size(text: str) -> int:
    try:
        return check_group_size(int(text))
    except OptionError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None


def add_allow_global(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--allow-global",
        action="append",
        default=[],
        metavar="NAME",
        help="trust one more pickle global, e.g. mypkg.Config (repeatable; only for files you trust)",
    )


def print_json(data: dict[str, Any]) -> None:
    """A report's ``to_dict()`` on stdout, indented, with a final newline."""
    json.dump(data, sys.stdout, indent=2)
    sys.stdout.write("\n")


def add_runs(parser: argparse.ArgumentParser) -> None:
    """``--runs``: the rounds of the interleaved before/after latency comparison (prune, quantize)."""
    parser.add_argument(
        "--runs",
        type=int,
        default=10,
        help="interleaved latency rounds, about 2 s in all (default 10; 0: none)",
    )
