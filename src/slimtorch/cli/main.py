"""Entry point of the `slimtorch` command: parses, dispatches, and turns our errors into exit code 2.

The one error boundary: readers turn what a parser raises on hostile bytes into a
:class:`~slimtorch.errors.FormatError` naming the file, so what reaches here is a
:class:`~slimtorch.errors.SlimtorchError`, an ``OSError`` (a missing or unreadable file), or a bug, which
keeps its traceback. Two exceptions are never a traceback though: ``MemoryError`` and ``RecursionError``
mean input too big or too deep for this machine (a reader missed a budget), and a user cannot act on
the stack; ``--debug`` shows it. The line quotes paths and names from files, so its control characters are
shown as escapes (:mod:`slimtorch.cli.untrusted_text`): it stays one line and the terminal obeys none of
them. A closed stdout (``slimtorch inspect m.pt | head``) ends quietly with exit 0, as ``git log | head``
does; Ctrl-C is one line and exit 130 (128 + SIGINT, as a shell reports it).

Nothing here or in a command's module imports torch: a command imports its work when it runs, so
``--help``, ``--version``, completion and a mistyped option answer in a tenth of a second.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import traceback
import warnings
from collections.abc import Iterator, Sequence

from slimtorch._version import __version__
from slimtorch.cli import (
    arguments,
    completion_cmd,
    dataloader_cmd,
    export_cmd,
    fit_cmd,
    footprint_cmd,
    inspect_cmd,
    load_cmd,
    memory_cmd,
    ops_cmd,
    prune_cmd,
    quantize_cmd,
    recover_cmd,
    shrink_cmd,
    slim_cmd,
)
from slimtorch.cli.untrusted_text import printable
from slimtorch.errors import PlaceholderWarning, SlimtorchError

COMMANDS = (
    inspect_cmd,
    shrink_cmd,
    load_cmd,
    prune_cmd,
    quantize_cmd,
    recover_cmd,
    slim_cmd,
    memory_cmd,
    fit_cmd,
    dataloader_cmd,
    export_cmd,
    footprint_cmd,
    ops_cmd,
    completion_cmd,
)
EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130
DEBUG_HELP = "show the full traceback on errors"


def build_parser() -> argparse.ArgumentParser:
    """Every command's parser; ``--debug`` works before the command and after it. A mistyped command or
    option is answered with the closest spellings, and ``--help`` ends with the documentation's address
    (:class:`~slimtorch.cli.arguments.Parser`)."""
    parser = arguments.Parser(
        prog="slimtorch",
        description="Make PyTorch models physically smaller, faster to load and lighter on memory.",
        epilog=f"Documentation: {arguments.DOCS_URL}",
    )
    parser.add_argument("--debug", action="store_true", help=DEBUG_HELP)
    parser.add_argument("--version", action="version", version=f"slimtorch {__version__}")
    # A sub-parser's default would overwrite the top level's True: it sets debug only when given.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=DEBUG_HELP)
    # each command's parser makes a bad option value one line (arguments.CommandParser)
    commands = parser.add_subparsers(
        dest="command", metavar="COMMAND", required=True, parser_class=arguments.CommandParser
    )
    for command in COMMANDS:
        command.register(commands, common)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    if "_ARGCOMPLETE" in os.environ:  # a shell asking for completions (slimtorch completion SHELL)
        completion_cmd.complete(parser)
    args = parser.parse_args(argv)
    try:
        with _notes():
            code = args.run(args) or 0
        sys.stdout.flush()  # a reader gone while the last lines sat in the buffer is caught here too
        return code
    except BrokenPipeError:
        return _stdout_closed()
    except (SlimtorchError, OSError, MemoryError, RecursionError) as exc:
        if args.debug:
            traceback.print_exc()
        print(f"slimtorch: error: {printable(_one_line(exc, args))}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        if args.debug:
            traceback.print_exc()
        print("slimtorch: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


@contextlib.contextmanager
def _notes() -> Iterator[None]:
    """A :class:`PlaceholderWarning` is one ``slimtorch: note:`` line on stderr, each said once (a command
    may open one file twice); every other warning goes where it went."""
    said: set[str] = set()
    shown = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if not issubclass(category, PlaceholderWarning):
            return shown(message, category, filename, lineno, file, line)
        if str(message) not in said:
            said.add(str(message))
            print(f"slimtorch: note: {printable(str(message))}", file=sys.stderr)
        return None

    with warnings.catch_warnings():
        warnings.simplefilter("always", PlaceholderWarning)
        warnings.showwarning = show
        yield


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
    not fail again, so stdout goes to /dev/null (the recipe of Python's signal docs). Exit 0: the reader
    asked for no more, which is not a failure of ours (``git log | head`` does the same)."""
    with contextlib.suppress(OSError, ValueError):
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


if __name__ == "__main__":
    sys.exit(main())
