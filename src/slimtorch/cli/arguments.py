"""Pieces every command's parser shares: how a command is added, and the pickle trust option."""

from __future__ import annotations

import argparse


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


def add_allow_global(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--allow-global",
        action="append",
        default=[],
        metavar="NAME",
        help="trust one more pickle global, e.g. mypkg.Config (repeatable; only for files you trust)",
    )
