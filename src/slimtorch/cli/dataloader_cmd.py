"""`slimtorch dataloader mypkg.data:train_set --batch 64`: the DataLoader settings that load a dataset
fastest on this machine, measured."""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slimtorch.cli.arguments import MAX_BATCH, add_command, add_json, integer, print_json
from slimtorch.cli.choices import START_METHODS, TUNE_BUDGET_S
from slimtorch.cli.untrusted_text import as_text
from slimtorch.errors import SlimtorchError

if TYPE_CHECKING:
    from slimtorch.data import TuneReport

HELP = "measure DataLoader settings (num_workers, prefetch, persistent workers, pinning) for a dataset"
DESCRIPTION = """\
Imports DATASET (pkg.module:name or path/to/file.py:name, the current folder importable; a callable is
called with no arguments to make the dataset) and times torch's DataLoader over it: num_workers=0 first,
then 1, 2, 3, 4, 6, 8 ... workers while each count is faster than the best so far, then prefetch_factor=4,
persistent_workers and, with CUDA, pin_memory on the best, each kept only where it helps. Each candidate
is timed over a few passes after a warm-up; the table gives the median samples/s, how far the passes
disagree, and how long an epoch takes to start. The search stops at --budget-s seconds and says which
candidates it did not try. Prints the settings as DataLoader(...) keywords.

Workers are processes: under spawn or forkserver a dataset that cannot be pickled keeps num_workers=0.

examples:
  slimtorch dataloader mypkg.data:train_set --batch 64
  slimtorch dataloader ./data.py:make_dataset --batch 32 --budget-s 60 --max-workers 8
  slimtorch dataloader mypkg.data:train_set --batch 64 --json > loader.json
"""


def register(commands: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    parser = add_command(commands, common, "dataloader", HELP, DESCRIPTION)
    parser.add_argument("dataset", metavar="DATASET", help="pkg.module:name or file.py:name")
    batch = integer(1, MAX_BATCH)  # the bound of every --batch
    parser.add_argument("--batch", type=batch, metavar="N", help="samples per batch (required)")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=TUNE_BUDGET_S,
        metavar="S",
        help=f"seconds (default {TUNE_BUDGET_S:g})",
    )
    parser.add_argument("--max-workers", type=int, metavar="N", help="default: the CPU cores available")
    parser.add_argument("--start-method", choices=START_METHODS, help="default: this platform's")
    add_json(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from slimtorch.cli.progress import TerminalProgress
    from slimtorch.data import TuneOptions, tune

    if args.batch is None:  # not argparse's required: --batch is optional elsewhere (one shape everywhere)
        raise SlimtorchError("dataloader needs --batch N: the samples per batch to time")
    dataset = resolve_dataset(args.dataset)
    options = TuneOptions(
        batch_size=args.batch,
        budget_s=args.budget_s,
        max_workers=args.max_workers,
        start_method=args.start_method,
    )
    with TerminalProgress(enabled=not args.json) as progress:
        report = tune(dataset, options, progress=progress)
    if args.json:
        print_json(report.to_dict())
    else:
        _render(args.dataset, report)
    return 0


def resolve_dataset(spec: str) -> Any:
    """The object ``spec`` names, or what it returns when it is a callable (a class, a factory).

    A ``file.py`` is imported as a module of its folder, so workers started by spawn import it too."""
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name:
        raise SlimtorchError(f"dataset {spec!r}: expected pkg.module:name or file.py:name")
    if where.endswith(".py"):
        path = Path(where).resolve()
        if not path.is_file():
            raise SlimtorchError(f"dataset {spec!r}: no such file {where}")
        folder, where = str(path.parent), path.stem
    else:
        folder = str(Path.cwd())
    if folder not in sys.path:
        sys.path.insert(0, folder)
    try:
        module = importlib.import_module(where)
    except ModuleNotFoundError as exc:
        raise SlimtorchError(f"dataset {spec!r}: cannot import {where} ({exc})") from None
    if not hasattr(module, name):
        raise SlimtorchError(f"dataset {spec!r}: {where} has no attribute {name!r}")
    value = getattr(module, name)
    return value() if callable(value) else value


def _render(spec: str, report: TuneReport) -> None:
    from rich.table import Table

    from slimtorch.cli.views.inspect_view import output_console

    console = output_console()
    title = as_text(f"{spec}: batch {report.batch_size}, {report.batches} batches a pass")
    table = Table(title=title, title_justify="left", header_style="dim")
    for column in ("settings", "samples/s", "spread", "epoch start", "passes", ""):
        table.add_column(column, justify="left" if column in ("settings", "") else "right")
    for index, trial in enumerate(report.trials):
        chosen = index == report.chosen
        table.add_row(
            trial.candidate.label,
            "-" if trial.samples_per_s is None else f"{trial.samples_per_s:,.0f}",
            "-" if trial.spread is None else f"{trial.spread:.0%}",
            "-" if trial.start_s is None else f"{trial.start_s * 1000:,.0f} ms",
            str(trial.passes),
            "chosen" if chosen else as_text(trial.error or ""),
            style="bold" if chosen else None,
        )
    console.print(table)
    keywords = ", ".join(f"{key}={value!r}" for key, value in report.settings.items())
    console.print(as_text(f"DataLoader(dataset, {keywords})"))
    if report.speedup is not None:
        console.print(f"{report.speedup:.2f}x num_workers=0's samples/s", highlight=False)
    if report.step_samples_per_s is not None:
        console.print(f"the training step: {report.step_samples_per_s:,.0f} samples/s", highlight=False)
    console.print(as_text(f"stopped: {report.stopped}"))
    for note in report.notes:
        console.print(as_text(f"note: {note}"))
    if report.skipped:
        console.print(as_text(f"not tried: {', '.join(report.skipped)}"))
    console.print(f"searched for {report.seconds:.1f} s of a {report.budget_s:g} s budget", highlight=False)
