"""Pieces every command shares: how it is added, the pickle trust option, and its --json output."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


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
