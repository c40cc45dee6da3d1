"""`slimtorch load PATH [--model package.module:factory] [--profile]`: load, verify, and show the time."""

from __future__ import annotations

import argparse

from slimtorch.cli.arguments import add_allow_global, add_command, print_json
from slimtorch.cli.model_spec import SPEC_HELP, resolve_factory
from slimtorch.errors import SlimtorchError
from slimtorch.io.loader import load_model_profiled, load_profiled
from slimtorch.report.inspect_view import output_console
from slimtorch.report.load_view import render_load

HELP = "load a checkpoint (into a model), verify every checksum, and show where the time went"
DESCRIPTION = """\
Loads every tensor of a checkpoint the way slimtorch.load / slimtorch.load_model do: stored tensors
memory-mapped from the file without a copy, coded ones (int8, int4, sparse, ...) decoded on a thread
pool, every CRC-32 of a slim file verified. With --model, the model is built on the meta device (no
RAM, no random init) and filled from the file, so shapes and names are checked against it.

--profile splits the time into phases: open (parse headers), construct (the factory), read (map and
verify), decode, copy (dtype, device) and assign. A corrupt file fails with the tensor's name, exit 2.

examples:
  slimtorch load model.safetensors --profile
  slimtorch load model-int8.safetensors --model mypkg.models:build_net --profile
  slimtorch load ./bert --model transformers:AutoModel ...   (a factory taking no arguments)
  slimtorch load ckpt.pt --model ./train.py:Net --device cuda --dtype bf16
"""
DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


def register(commands: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    parser = add_command(commands, common, "load", HELP, DESCRIPTION)
    parser.add_argument("path", metavar="PATH", help="checkpoint file or model folder")
    parser.add_argument("--model", metavar="FACTORY", help=SPEC_HELP)
    parser.add_argument("--device", help="where the tensors go: cpu, cuda, cuda:1 (default cpu)")
    parser.add_argument("--dtype", choices=tuple(DTYPES), help="convert floating-point tensors")
    parser.add_argument(
        "--non-strict",
        dest="strict",
        action="store_false",
        help="with --model: allow tensors the model lacks, and buffers the file lacks",
    )
    parser.add_argument("--no-verify", dest="verify", action="store_false", help="skip the CRC-32 checks")
    parser.add_argument(
        "--threads", type=int, metavar="N", help="decode threads (default: one per core, up to 4)"
    )
    parser.add_argument("--profile", action="store_true", help="show the time of each phase")
    parser.add_argument("--json", action="store_true", help="print the profile as JSON")
    add_allow_global(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import torch

    dtype = getattr(torch, DTYPES[args.dtype]) if args.dtype else None
    common = {
        "verify": args.verify,
        "threads": args.threads,
        "allow_globals": tuple(args.allow_global),
    }
    if args.model:
        factory = resolve_factory(args.model)
        _, profile = load_model_profiled(
            args.path, factory, device=args.device, dtype=dtype, strict=args.strict, **common
        )
    else:
        if args.device or dtype:
            raise SlimtorchError("--device and --dtype need --model (without it, tensors load as stored)")
        _, profile = load_profiled(args.path, **common)
    if args.json:
        print_json(profile.to_dict())
    else:
        render_load(profile, output_console(), show_phases=args.profile)
    return 0
