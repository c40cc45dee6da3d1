"""`slimtorch load PATH [--model package.module:factory] [--profile]`: load, verify, and show the time."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from slimtorch.cli.arguments import (
    add_allow_global,
    add_command,
    add_device,
    add_json,
    machine_device,
    print_json,
)
from slimtorch.cli.choices import VERIFY_MODES
from slimtorch.cli.model_spec import PATH_HELP, SPEC_HELP
from slimtorch.errors import SlimtorchError

if TYPE_CHECKING:
    from slimtorch.loading.options import LoadOptions, LoadReport

HELP = "load a checkpoint (into a model), verify every checksum, and show where the time went"
DESCRIPTION = """\
Loads every tensor of a checkpoint the way slimtorch.load / slimtorch.load_model do: stored tensors
memory-mapped from the file without a copy, coded ones (int8, int4, sparse, ...) decoded on a thread
pool, every CRC-32 of a slim file verified. With --model, the model is built on the meta device (no
RAM, no random init) and filled from the file, so shapes and names are checked against it.

--profile splits the time into phases: open (parse headers), construct (the factory), read (map, and
verify what is decoded), decode, copy (dtype, device) and assign, and says how long the checksums of the
mapped tensors took and whether they ran before the load returned (--verify eager, the default) or
after it (--verify before-use). A corrupt file fails with the tensor's name, exit 2.

examples:
  slimtorch load model.safetensors --profile
  slimtorch load model-int8.safetensors --model mypkg.models:build_net --profile
  slimtorch load ./bert --model transformers:AutoModel ...   (a factory taking no arguments)
  slimtorch load google-bert/bert-base-uncased@main --profile   (a Hub repo id, from the local cache only)
  slimtorch load ckpt.pt --model ./train.py:Net --device cuda --dtype bf16
  slimtorch load pretrained.pt --model ./voice.py:Encoder --prefix model_state. --rename lstm.=rnn.
  slimtorch load big.safetensors --model ./net.py:Net --max-memory cpu=4GB --offload disk

Names: the wrapper a training script put around the model's names (model_state., state_dict., module.)
is found by matching; --prefix names it, --rename OLD=NEW maps names once it is off. Names the model
does without (buffers it computes, Hugging Face's _keys_to_ignore_on_load_*) are left out and listed.
"""
DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


def register(commands: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    parser = add_command(commands, common, "load", HELP, DESCRIPTION)
    parser.add_argument("path", metavar="PATH", help=PATH_HELP)
    parser.add_argument("--model", metavar="FACTORY", help=SPEC_HELP)
    add_device(parser, "where the tensors go")
    parser.add_argument("--dtype", choices=tuple(DTYPES), help="convert floating-point tensors")
    parser.add_argument(
        "--non-strict",
        dest="strict",
        action="store_false",
        help="with --model: allow tensors the model lacks, and buffers the file lacks",
    )
    checks = parser.add_mutually_exclusive_group()
    checks.add_argument(
        "--verify",
        choices=VERIFY_MODES,
        help="when the CRC-32 checks run: before the load returns (eager, the default), or beside the work "
        "after it, each module's forward waiting for its own (before-use); the command waits for "
        "all of them either way, and --profile shows how long they took and whether they overlapped",
    )
    checks.add_argument("--no-verify", action="store_true", help="skip the checks")
    parser.add_argument(
        "--threads", type=int, metavar="N", help="decode threads (default: one per core, up to 4)"
    )
    parser.add_argument(
        "--prefix",
        metavar="P",
        help="with --model: the model's names sit under P. in the file (default: found)",
    )
    parser.add_argument(
        "--rename",
        action="append",
        default=[],
        metavar="OLD=NEW",
        help="with --model: file names starting OLD (after the prefix) start NEW instead; repeatable",
    )
    parser.add_argument(
        "--max-memory",
        action="append",
        default=[],
        metavar="cpu=SIZE",
        help="with --model: the most the model may hold in memory (cpu=4GB); blocks past it need --offload",
    )
    parser.add_argument(
        "--offload",
        choices=("none", "disk"),
        default="none",
        help="with --max-memory: blocks past the budget stay mapped from the file, brought in by each "
        "forward and released after it (inference only)",
    )
    parser.add_argument("--profile", action="store_true", help="show the time of each phase")
    add_json(parser)
    add_allow_global(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from slimtorch.cli.progress import TerminalProgress
    from slimtorch.cli.untrusted_text import printable
    from slimtorch.cli.views.inspect_view import output_console
    from slimtorch.cli.views.load_view import render_load
    from slimtorch.loading.loader import load, load_model
    from slimtorch.models.spec import resolve_factory

    options = _options(args)
    with TerminalProgress() as bar:
        if args.model:
            report = load_model(args.path, resolve_factory(args.model), options, progress=bar)
        else:
            report = load(args.path, options, progress=bar)
        report.wait()  # the command's result is a verified load (or exit 2 naming the tensor)
    if args.json:
        print_json(report.to_dict())
    else:
        console = output_console()
        render_load(report, console, show_phases=args.profile)
        if report.model_class is not None:
            for line in name_lines(report, every=args.profile):
                console.print(printable(line), highlight=False, markup=False)
    return 0


def _options(args: argparse.Namespace) -> LoadOptions:
    """The command line as :class:`LoadOptions`; name matching needs a model to match against."""
    import torch

    from slimtorch.loading.options import LoadOptions

    if not args.model and (not args.strict or args.prefix is not None or args.rename):
        raise SlimtorchError(
            "--non-strict, --prefix and --rename match the file's names to a model's: they need --model"
        )
    if not args.model and (args.max_memory or args.offload != "none"):
        raise SlimtorchError("--max-memory and --offload budget a model's memory: they need --model")
    return LoadOptions(
        device=args.device or machine_device(),
        dtype=getattr(torch, DTYPES[args.dtype]) if args.dtype else None,
        strict=args.strict,
        verify=False if args.no_verify else args.verify or "eager",
        threads=args.threads,
        allow_globals=tuple(args.allow_global),
        prefix=args.prefix,
        rename=tuple(args.rename),
        max_memory=tuple(args.max_memory),
        offload=args.offload,
    )


def name_lines(report: LoadReport, *, every: bool) -> list[str]:
    """One line per kind of name a load left out (every kind with ``every``, else those that happened)."""
    from slimtorch.format.names import file_groups

    lines = []
    if every or report.prefix or report.model_prefix:
        where = f"under {report.prefix!r}" if report.prefix else "as they are"
        if report.model_prefix:
            where = f"as the model's names after {report.model_prefix!r}"
        outside = report.outside_prefix
        rest = f"; {len(outside)} other tensors: {file_groups(outside)}" if outside else ""
        lines.append(f"names: read {where}{rest}")
    kinds = (
        ("ignored", [f"{s.name} ({s.reason})" for s in report.ignored]),
        ("unmatched", report.unmatched),
        ("missing", report.missing),
    )
    for label, names in kinds:
        if names or every:
            shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
            lines.append(f"{label}: {len(names)}" + (f" ({shown})" if names else ""))
    lines += [f"note: {note}" for note in report.notes]
    return lines
