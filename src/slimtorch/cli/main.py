"""Entry point of the `slimtorch` command: parses, dispatches, and turns our errors into exit code 2."""

from __future__ import annotations

import argparse
import sys
import traceback
from collections.abc import Sequence

from slimtorch import __version__
from slimtorch.cli import (
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
    except (SlimtorchError, OSError) as exc:
        if args.debug:
            traceback.print_exc()
        print(f"slimtorch: error: {_one_line(exc)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("slimtorch: interrupted", file=sys.stderr)
        return 130


def _one_line(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.filename:
        return f"{exc.filename}: {exc.strerror or exc}"
    return " ".join(str(exc).split())


if __name__ == "__main__":
    sys.exit(main())
