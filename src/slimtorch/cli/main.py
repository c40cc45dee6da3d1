"""Entry point of the `slimtorch` command: parses, dispatches, and turns our errors into exit code 2.

The one error boundary: readers turn what a parser raises on hostile bytes into a
:class:`~slimtorch.errors.FormatError` naming the file, so what reaches here is a
:class:`~slimtorch.errors.SlimtorchError`, an ``OSError`` (a missing or unreadable file), or a bug, which
keeps its traceback. Two exceptions are never a traceback though: ``MemoryError`` and ``RecursionError``
mean input too big or too deep for this machine (a reader missed a budget), and a user cannot act on
the stack; ``--debug`` shows it. A closed stdout (``slimtorch inspect m.pt | head``) ends quietly.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import traceback
from collections.abc import Sequence

from slimtorch._version import __version__
from slimtorch.cli import (
    dataloader_cmd,
    export_cmd,
    footprint_cmd,
    inspect_cmd,
    load_cmd,
    memory_cmd,
    ops_cmd,
    prune_cmd,
    quantize_cmd,
    shrink_cmd,
)
from slimtorch.errors import SlimtorchError

COMMANDS = (
    inspect_cmd,
    shrink_cmd,
    load_cmd,
    prune_cmd,
    quantize_cmd,
    memory_cmd,
    dataloader_cmd,
    export_cmd,
    footprint_cmd,
    ops_cmd,
)
EXIT_BAD_INPUT = 2


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", help="show the full traceback on errors")
    parser = argparse.ArgumentParser(
        prog="slimtorch",
        description="Make PyTorch models physically smaller, faster to load and lighter on memory.",
        parents=[common],
    )
    parser.add_argument("--version", action="version", version=f"slimtorch {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for command in COMMANDS:
        command.register(commands, common)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args) or 0
    except BrokenPipeError:
        return _stdout_closed()
    except (SlimtorchError, OSError, MemoryError, RecursionError) as exc:
        if args.debug:
            traceback.print_exc()
        print(f"slimtorch: error: {_one_line(exc, args)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("slimtorch: interrupted", file=sys.stderr)
        return 130


def _one_line(exc: BaseException, args: argparse.Namespace) -> str:
    if isinstance(exc, OSError) and exc.filename:
        return f"{exc.filename}: {exc.strerror or exc}"
    if isinstance(exc, (MemoryError, RecursionError)):
        what = "more memory than this machine has" if isinstance(exc, MemoryError) else "nesting too deep"
        return f"{_input_of(args)}: reading it needs {what} ({type(exc).__name__}); --debug shows where"
    return " ".join(str(exc).split())


def _input_of(args: argparse.Namespace) -> str:
    """The file or model the command was reading, for an error that does not name it."""
    for name in ("source", "path", "model", "bundle"):
        if getattr(args, name, None):
            return str(getattr(args, name))
    return "the input"


def _stdout_closed() -> int:
    """Whoever read stdout has gone (``| head``): nothing left to say, and Python's own flush at exit must
    not fail again, so stdout goes to /dev/null (the recipe of Python's signal docs; exit 1, as rich does)."""
    with contextlib.suppress(OSError, ValueError):
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 1


if __name__ == "__main__":
    sys.exit(main())
