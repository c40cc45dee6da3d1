"""`slimtorch fit MODEL --budget 24GiB --world-size auto`: the least costly way to make a training step fit
a memory budget (checkpointing, bf16 autocast, or ranks under DDP / ZeRO-1 / FSDP2), predicted without
running it."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from slimtorch.cli.arguments import (
    MAX_RANKS,
    add_command,
    add_device,
    add_json,
    integer,
    print_json,
    real,
    size,
)
from slimtorch.cli.choices import FIT_MARGIN, OPTIMIZERS, PARALLEL
from slimtorch.cli.model_input import MODEL_HELP, add_input_shape, meta_model
from slimtorch.cli.untrusted_text import as_text, in_markup
from slimtorch.format.units import format_bytes, format_share

if TYPE_CHECKING:
    from slimtorch.memory import FitPlan

HELP = "choose checkpointing, bf16 autocast or the fewest ranks so a training step fits a memory budget"
DESCRIPTION = """\
Builds the model on the meta device (no memory, no weights read) and estimates its training step (the
steady state: the optimizer's state alive through forward and backward) with levers pulled in order:
activation checkpointing of the repeated blocks, one more at a time (exact, one more forward of each);
then bf16 autocast (the last bits change). With --world-size auto, when no plan fits one device, the
fewest ranks whose busiest rank fits, at that count the strategy with the least communication (ddp,
zero1, fsdp, fsdp-offload), there the fewest levers; the plan says how to launch them in one line.
The input's first dimension is the batch on each device (each rank's, with ranks).

examples:
  slimtorch fit ./llama-folder --input-shape 1,2048 --budget 80GiB --world-size auto
  slimtorch fit mypkg.models:resnet50 --input-shape 64,3,224,224 --budget 16GiB --device cuda
  slimtorch fit ./bert-folder --budget 8GiB --world-size 4 --strategies zero1 fsdp --json
"""


def register(commands: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    parser = add_command(commands, common, "fit", HELP, DESCRIPTION)
    parser.add_argument("model", metavar="MODEL", help=MODEL_HELP)
    add_input_shape(parser)
    parser.add_argument(
        "--budget", type=size, required=True, metavar="SIZE", help="memory per device, e.g. 24GB or 80GiB"
    )
    parser.add_argument("--optimizer", choices=tuple(OPTIMIZERS), default="adamw", help="default adamw")
    add_device(parser, "plan for this device")
    parser.add_argument(
        "--world-size",
        type=_world_size,
        metavar="N|auto",
        help="ranks: N exactly, or auto (one device when a plan fits there, else the fewest ranks); "
        "default one device",
    )
    parser.add_argument(
        "--strategies",
        nargs="+",
        choices=PARALLEL,
        metavar="S",
        help=f"wrappers ranks may use, in order of preference (default: {' '.join(PARALLEL)})",
    )
    parser.add_argument("--no-checkpointing", action="store_true", help="never checkpoint blocks")
    parser.add_argument("--no-precision", action="store_true", help="never use bf16 autocast")
    parser.add_argument("--no-offload", action="store_true", help="never offload activations (CUDA)")
    parser.add_argument(
        "--margin",
        type=real(0, 1, below=True),
        default=FIT_MARGIN,
        help=f"share of the budget kept free (default {FIT_MARGIN})",
    )
    add_json(parser)
    parser.set_defaults(run=run)


def _world_size(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return integer(1, MAX_RANKS)(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"must be a number of ranks from 1 to {MAX_RANKS:,}, or auto, not {text[:40]!r}"
        ) from None


def run(args: argparse.Namespace) -> int:
    from slimtorch.cli.progress import TerminalProgress
    from slimtorch.memory import FitOptions, fit

    loaded = meta_model(args)
    options = FitOptions(
        budget=args.budget,
        optimizer=args.optimizer,
        device=args.device,
        allow_precision=not args.no_precision,
        allow_checkpointing=not args.no_checkpointing,
        allow_offload=not args.no_offload,
        margin=args.margin,
        world_size=args.world_size,
        strategies=tuple(args.strategies or PARALLEL),
        apply=False,  # a meta model: the plan is the answer
    )
    with TerminalProgress() as bar:
        plan = fit(loaded.model, loaded.example, options, progress=bar)
    if args.json:
        print_json(plan.to_dict())
        return 0
    _render(args.model, plan)
    return 0


def _render(model: str, plan: FitPlan) -> None:
    from slimtorch.cli.views.inspect_view import output_console

    console = output_console()
    where = f"on {plan.world_size} ranks ({plan.strategy})" if plan.strategy else "on one device"
    verdict = "fits" if plan.fits else "may fit"  # an offloading plan: the estimate keeps the activations
    console.print(
        as_text(
            f"{model}: {verdict} {format_bytes(plan.budget_bytes)} per {plan.device} device {where}, "
            f"{plan.precision}"
        )
    )
    if plan.offload:
        console.print("  activations offloaded to pinned host memory (save_on_cpu)", highlight=False)
    at = f" at {in_markup(plan.per_rank.where)}" if plan.per_rank else ""
    console.print(
        f"  predicted peak{' per rank' if plan.strategy else ''}: {format_bytes(plan.predicted_peak_bytes)}"
        f"{at} (one device, nothing pulled: {format_bytes(plan.unmodified_peak_bytes)})",
        highlight=False,
    )
    if plan.checkpointed:
        console.print(
            as_text(
                f"  checkpointed: {len(plan.checkpointed)} blocks ({plan.checkpointed[0]} .. "
                f"{plan.checkpointed[-1]}), {format_share(plan.recompute_share, 1)} of the parameters run "
                "forward twice"
            )
        )
    if plan.launch:
        console.print(as_text(f"  launch: {plan.launch}"))
    for note in plan.notes:
        console.print(as_text(f"  note: {note}"))
