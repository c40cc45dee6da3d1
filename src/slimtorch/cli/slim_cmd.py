"""`slimtorch slim MODEL --data DATA --goal G`: from a model and a goal to a smaller, verified deliverable,
with a before/after report (HTML, charts, JSON) in a resumable work folder."""

from __future__ import annotations

import argparse
import shlex
import sys
from typing import TYPE_CHECKING, Any

from slimtorch.cli.arguments import add_command, add_json, print_json
from slimtorch.cli.model_input import MODEL_HELP
from slimtorch.cli.recover_cmd import DEFAULT_LR, EPOCHS, LEARNING_RATE, add_data_arguments
from slimtorch.cli.untrusted_text import as_text, printable
from slimtorch.errors import SlimtorchError

if TYPE_CHECKING:
    from slimtorch.slimming import SlimReport

EXIT_GOAL_NOT_MET = 1
HELP = "from a model and a goal (size, latency, params) to a smaller, verified model, with a report"
DESCRIPTION = """\
Measures MODEL on --data (accuracy, or for data without class ids the output cosine to the original),
plans how to reach --goal from measured facts (each prune / quantize combination applied to a copy and its
file, parameters or latency measured), then runs the plan: prune channels -> zero weights -> recover
(distilled from the original) -> quantize (sensitive layers kept float) -> save, loaded back and scored
from the file -> export (--export). An attempt that loses more than --max-drop is followed by the next
plan; the best result within the drop is always kept.

Goals: size=50MB or size=0.05x (the saved file), latency=2x (one sample, one thread), params=0.5 or
params=2M. --max-drop is in the metric's unit: points of accuracy, or of cosine (0..1).

Everything goes to the work folder (--work, default slim-work): one folder per stage with its model and
a done marker, recipe.toml (every choice, the plan's included), report.html, report.json and charts/. A
rerun with the same inputs resumes the finished stages whose done markers check out (the sha256 of their
files, what they were made from) and redoes the others, one line each saying why; other inputs in the
same folder are refused (--restart starts over). --recipe runs a recipe.toml again, its plan included.

Exit code 0 when the goal was met, 1 when it was not (the best result within the drop is kept and named,
with the reason in one line), 2 for bad input.

examples:
  slimtorch slim examples/digits.py:DigitsCNN --weights dense.safetensors --data digits --goal size=0.05x
  slimtorch slim examples/bert_base.py:bert_base --data examples/bert_base.py:tokens --goal size=0.3x \\
      --max-drop 0.01 --work bert-work
  slimtorch slim --recipe slim-work/recipe.toml --work again
  slimtorch slim mypkg.models:net --weights w.pt --data ./arrays --goal latency=2x --export --json
"""


def register(commands: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    parser = add_command(commands, common, "slim", HELP, DESCRIPTION)
    parser.add_argument("model", metavar="MODEL", nargs="?", help=MODEL_HELP + " (default: the recipe's)")
    parser.add_argument("--weights", metavar="PATH", help="checkpoint to load into the model (any format)")
    add_data_arguments(parser)
    parser.add_argument(
        "--goal", metavar="G", help="size=50MB, size=0.05x, latency=2x, params=0.5 or params=2M"
    )
    parser.add_argument(
        "--max-drop",
        type=float,
        metavar="D",
        help="the largest metric loss allowed: points of accuracy, or of cosine (default 1)",
    )
    parser.add_argument(
        "--work", metavar="DIR", default="slim-work", help="the work folder (default slim-work)"
    )
    parser.add_argument(
        "--recipe", metavar="TOML", help="run a recipe.toml again (its inputs, options and plan)"
    )
    parser.add_argument(
        "--restart", action="store_true", help="empty the work folder first instead of resuming"
    )
    parser.add_argument(
        "--epochs", type=EPOCHS, metavar="N", help="recovery epochs after pruning (default 10)"
    )
    parser.add_argument(
        "--lr",
        type=LEARNING_RATE,
        default=DEFAULT_LR,
        help=f"recovery's learning rate (default {DEFAULT_LR:g})",
    )
    parser.add_argument(
        "--export", action="store_true", help="also export an ONNX bundle and measure its footprint"
    )
    parser.add_argument(
        "--no-timings",
        action="store_true",
        help="skip latency, load-time and memory measurements (their report sections say not measured)",
    )
    add_json(parser, "slimtorch.slim/1")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from slimtorch.cli.progress import TerminalProgress
    from slimtorch.slimming import slim

    model, weights, data, options, plan = _inputs(args)
    with TerminalProgress(enabled=not args.json) as progress:
        report = slim(
            model,
            data,
            options,
            work=args.work,
            weights=weights,
            plan=plan,
            restart=args.restart,
            command=_command(args, model, weights, data, options),
            progress=progress,
        )
    for note in report.notes:
        print(f"slimtorch: note: {printable(note)}", file=sys.stderr)
    if args.json:
        print_json(report.to_dict())
    else:
        _render(report)
    if not report.met:
        print(f"slimtorch: goal not met: {printable(report.reason)}", file=sys.stderr)
        return EXIT_GOAL_NOT_MET
    return 0


def _inputs(args: argparse.Namespace) -> tuple[str, str | None, str, Any, dict | None]:
    """MODEL, --weights, --data, the options and the plan: from the arguments, or from --recipe."""
    from slimtorch.slimming import SlimOptions, read_recipe

    given = {
        "goal": args.goal,
        "max_drop": args.max_drop,
        "recover_epochs": args.epochs,
        "lr": args.lr,
        "seed": args.seed,
        "batch": args.batch,
        "export": args.export or None,
        "timings": False if args.no_timings else None,
    }
    if args.recipe:
        recipe = read_recipe(args.recipe)
        extra = [
            f"--{k.replace('_', '-')}" for k in ("goal", "max_drop", "epochs", "batch") if getattr(args, k)
        ]
        extra += ["--seed"] if args.seed != 0 else []
        extra += ["--lr"] if args.lr != DEFAULT_LR else []
        extra += ["--export"] if args.export else []
        extra += ["--no-timings"] if args.no_timings else []
        if extra:
            raise SlimtorchError(f"--recipe gives the options: {extra[0]} cannot go with it")
        model = args.model or recipe.inputs.get("model")
        if not model:
            raise SlimtorchError(f"recipe {args.recipe} was run on a module from Python: give MODEL")
        weights = args.weights or recipe.inputs.get("weights") or None
        data = args.data or recipe.inputs.get("data")
        if not data:
            raise SlimtorchError(f"recipe {args.recipe} names no data ([inputs] data): give --data DATA")
        return model, weights, data, recipe.options, recipe.plan
    for name, what in (("model", "MODEL"), ("data", "--data DATA"), ("goal", "--goal G")):
        if not getattr(args, name):
            raise SlimtorchError(f"slim needs {what} (or --recipe recipe.toml)")
    return (
        args.model,
        args.weights,
        args.data,
        SlimOptions(**{k: v for k, v in given.items() if v is not None}),
        None,
    )


def _command(args: argparse.Namespace, model: str, weights: str | None, data: str, options: Any) -> str:
    """The command line that reproduces this run, for the report."""
    if args.recipe:
        return f"slimtorch slim --recipe {shlex.quote(args.recipe)} --work {shlex.quote(args.work)}"
    words = ["slimtorch", "slim", model, *(["--weights", weights] if weights else []), "--data", data]
    words += ["--goal", options.goal, "--max-drop", f"{options.max_drop:g}", "--work", args.work]
    words += ["--export"] if options.export else []
    return " ".join(shlex.quote(w) for w in words)


def _render(report: SlimReport) -> None:
    """The stages, the before/after table, the verdict and where the report is."""
    from rich.table import Table

    from slimtorch.cli.views.inspect_view import output_console
    from slimtorch.format.units import format_bytes

    console = output_console()
    stages = Table(title=as_text(f"slimtorch slim {report.model}, {report.goal['text']}"))
    for column in ("stage", "status", report.metric, "file", "seconds", "why"):
        stages.add_column(column, justify="left" if column in ("stage", "status", "why") else "right")
    for stage in report.stages:
        stages.add_row(
            as_text(stage["name"]),
            as_text(stage["status"]),
            "" if stage["metric"] is None else f"{stage['metric']:.4g}",
            "" if stage["file_bytes"] is None else format_bytes(stage["file_bytes"]),
            f"{stage['seconds']:.1f}",
            as_text(stage["reason"]),
        )
    console.print(stages)
    console.print(_before_after(report))
    console.print(as_text(("met: " if report.met else "not met: ") + report.reason))
    console.print(as_text(f"result: {report.work}/{report.outputs['model']}"))
    console.print(as_text(f"report: {report.work}/{report.outputs['report_html']}"))


def _before_after(report: SlimReport) -> Any:
    from rich.table import Table

    from slimtorch.format.units import format_bytes

    first = report.stages[0]
    last = next(
        (s for s in report.stages if s["output"] == report.outputs["model"]),
        first,
    )
    table = Table()
    for column in ("", "before", "after", "after / before"):
        table.add_column(column, justify="right" if column else "left")
    rows = [
        (report.metric, first["metric"], last["metric"], lambda v: f"{v:.4g}"),
        ("file", first["file_bytes"], last["file_bytes"], format_bytes),
        ("parameters", first["params"], last["params"], lambda v: f"{v:,}"),
    ]
    if report.latency is not None:
        before, after = report.latency["before"]["median_ms"], report.latency["after"]["median_ms"]
        rows.append(("latency, 1 sample", before, after, lambda v: f"{v:.3g} ms"))
    if report.load is not None:
        rows.append(
            (
                "load",
                report.load["before"]["median_s"],
                report.load["after"]["median_s"],
                lambda v: f"{v * 1e3:.3g} ms",
            )
        )
    for name, before, after, show in rows:
        ratio = f"{after / before:.3f}x" if before else ""
        table.add_row(name, show(before), show(after), ratio)
    return table
