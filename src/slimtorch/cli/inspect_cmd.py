"""`slimtorch inspect PATH`: where a checkpoint's bytes go, and what could be saved."""

from __future__ import annotations

import argparse

from slimtorch.cli.arguments import add_allow_global, add_command, add_json, print_json
from slimtorch.cli.model_spec import PATH_HELP

HELP = "where a checkpoint's bytes go, and what could be saved"
DESCRIPTION = """\
Reads any checkpoint (torch.save .pt/.pth/.bin/.ckpt incl. legacy and nested training checkpoints,
.safetensors, TorchScript, Hugging Face folders, or a Hub repo id found in the local Hugging Face cache,
never downloaded) without running code from it, and shows:
bytes by category (parameters, buffers, optimizer state, pruning leftovers, duplicates, ...),
by dtype and by module, the largest tensors with their fraction of exact zeros, and an estimate
of the size after each shrinking action.

examples:
  slimtorch inspect checkpoint.pt
  slimtorch inspect ./my-hf-model --depth 2 --top 20
  slimtorch inspect sentence-transformers/all-MiniLM-L6-v2   (after hf download; HF_HUB_CACHE is read)
  slimtorch inspect model.safetensors --json > report.json
"""


def register(commands: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    parser = add_command(commands, common, "inspect", HELP, DESCRIPTION)
    parser.add_argument("path", metavar="PATH", help=PATH_HELP)
    parser.add_argument(
        "--depth", type=_positive, default=3, metavar="N", help="module tree depth (default 3)"
    )
    parser.add_argument(
        "--top", type=_positive, default=10, metavar="K", help="largest tensors to list (default 10)"
    )
    add_json(parser, "slimtorch.inspect/1")
    parser.add_argument(
        "--no-scan",
        dest="scan",
        action="store_false",
        help="do not read tensor data (no zero counts, no duplicate search): instant on any size",
    )
    add_allow_global(parser)
    parser.set_defaults(run=run)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


def run(args: argparse.Namespace) -> int:
    from slimtorch.cli.progress import TerminalProgress
    from slimtorch.cli.views.inspect_view import output_console, render_inspect
    from slimtorch.inspection.breakdown import inspect
    from slimtorch.inspection.options import InspectOptions
    from slimtorch.sources import open_checkpoint

    with (
        open_checkpoint(args.path, allow_globals=args.allow_global) as source,
        TerminalProgress(enabled=args.scan) as bar,
    ):
        report = inspect(source, InspectOptions(depth=args.depth, top=args.top, scan=args.scan), progress=bar)
    if args.json:
        print_json(report.to_dict())
    else:
        render_inspect(report, output_console())
    return 0
