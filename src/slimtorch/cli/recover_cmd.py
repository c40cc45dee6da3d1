"""`slimtorch recover MODEL --weights pruned.safetensors --data digits -o OUT`: fine-tune or distil a pruned
model back, measured before and after on held-out data."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slimtorch.cli.arguments import (
    MAX_BATCH,
    MAX_STEPS,
    add_command,
    add_json,
    add_output,
    integer,
    print_json,
    real,
)
from slimtorch.cli.model_input import add_model_arguments, command_model
from slimtorch.cli.output_path import check_output, model_inputs
from slimtorch.cli.untrusted_text import as_text, printable
from slimtorch.errors import SlimtorchError
from slimtorch.format.units import format_bytes

if TYPE_CHECKING:
    from torch import nn

    from slimtorch.recovery import RecoverReport, TaskData

DEFAULT_EPOCHS = 3
DEFAULT_LR = 1e-3  # RecoverOptions.lr
MAX_EPOCHS = 1000
"""the most --epochs (recover's, and slim's recovery): a recovery is a few passes, 1000 is days on digits
(the bound of a slim recipe's recover_epochs)"""
MAX_SEED = 2**63 - 1
"""what torch's generators take"""
EPOCHS = integer(0, MAX_EPOCHS)
"""--epochs of recover and slim, one type (slim's 0 skips recovery; recover refuses 0 when it runs)"""
LEARNING_RATE = real(0, 1, above=True)
"""--lr of recover and slim: AdamW moves each weight by about lr a step, so beyond 1 is no fine-tune"""
DATA_HELP = (
    "the task's data: digits (scikit-learn's), a folder (train.npz + eval.npz, or x.npy + y.npy) or an .npz "
    "file with arrays x and y, or pkg.module:factory / file.py:factory returning DataLoaders"
)
HELP = "fine-tune or distil a pruned model back on your data, measured before and after, and save it"
DESCRIPTION = f"""\
Loads MODEL with --weights (a file slimtorch prune wrote loads as it was saved: the pruned shapes come
from the file), scores it on the held-out part of --data, trains it on the rest, scores it again and
saves it with its structure: load it back with slimtorch.load_model(OUT, factory).

With --teacher (the original model's weights, for the same MODEL) it distils: Hinton's loss between the
two models' softened outputs, mixed with the task loss; for data scored by output cosine (targets that
are not class ids) the student is trained towards the teacher's outputs, and --teacher is required.
BatchNorm statistics are re-estimated on the training data first, and zeros left by unstructured pruning
stay zero. Training stops early once the metric reaches --target.

The metric: accuracy (percent of held-out samples whose argmax is the target) when the targets are class
ids, else the mean cosine of the outputs to the teacher's; a factory's module or dict may name it
(metric = "cosine").

examples:
  slimtorch recover ./digits.py:DigitsCNN --weights pruned.safetensors --data digits -o recovered.safetensors
  slimtorch recover ./digits.py:DigitsCNN --weights pruned.safetensors --teacher dense.safetensors \\
      --data digits -o distilled.safetensors --epochs 10 --target 99
  slimtorch recover mypkg.models:net --weights sparse.safetensors --data ./arrays -o n.safetensors --steps 500
  slimtorch recover mypkg.models:net --weights w.safetensors --data mypkg.data:loaders -o o.safetensors --json

default: {DEFAULT_EPOCHS} epochs, learning rate {DEFAULT_LR:g} (AdamW).
"""


def register(commands: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    parser = add_command(commands, common, "recover", HELP, DESCRIPTION)
    add_model_arguments(parser)
    add_output(parser, "output .safetensors file")
    add_data_arguments(parser)
    parser.add_argument(
        "--teacher", metavar="PATH", help="the original (unpruned) weights for MODEL: distil from them"
    )
    add_training_arguments(parser)
    parser.add_argument(
        "--target",
        type=real(),
        metavar="METRIC",
        help="stop once the metric reaches this (e.g. 99 or 0.995)",
    )
    add_json(parser, "slimtorch.recover/1")
    parser.set_defaults(run=run)


def add_data_arguments(parser: argparse.ArgumentParser) -> None:
    """``--data``, ``--batch`` and ``--seed``: the task data, as :func:`slimtorch.recovery.open_data` takes
    it (``--data`` is checked when the command runs: a recipe may give it)."""
    parser.add_argument("--data", metavar="DATA", help=DATA_HELP)
    parser.add_argument(
        "--batch", type=integer(1, MAX_BATCH), metavar="N", help="samples per batch (default 64)"
    )
    parser.add_argument(
        "--seed",
        type=integer(0, MAX_SEED),
        default=0,
        metavar="N",
        help="training order, split of one set of arrays, and torch's seed (default 0)",
    )


def add_training_arguments(parser: argparse.ArgumentParser) -> None:
    """``--epochs`` or ``--steps``, and ``--lr``: how long and how fast recovery trains."""
    length = parser.add_mutually_exclusive_group()
    length.add_argument(
        "--epochs",
        type=EPOCHS,
        metavar="N",
        help=f"passes over the data (default {DEFAULT_EPOCHS})",
    )
    length.add_argument(
        "--steps", type=integer(1, MAX_STEPS), metavar="N", help="optimizer steps, instead of --epochs"
    )
    parser.add_argument(
        "--lr", type=LEARNING_RATE, default=DEFAULT_LR, help=f"learning rate (default {DEFAULT_LR:g})"
    )


def run(args: argparse.Namespace) -> int:
    import torch

    from slimtorch.cli.progress import TerminalProgress
    from slimtorch.format.progress import announcer
    from slimtorch.recovery import RecoverOptions, evaluate, open_data
    from slimtorch.recovery.data import BATCH
    from slimtorch.shrinking.saving import save_model

    _check(args)
    check_output(args.output, [*model_inputs(args.model, args.weights), args.teacher])
    options = RecoverOptions(  # a bad option fails before anything loads
        steps=args.steps,
        epochs=None if args.steps is not None else (args.epochs or DEFAULT_EPOCHS),
        lr=args.lr,
        target=args.target,
    )
    data = open_data(args.data, batch=args.batch or BATCH, seed=args.seed)
    for note in data.notes:
        print(f"slimtorch: note: {printable(note)}", file=sys.stderr)
    progress = TerminalProgress(enabled=not args.json)
    stage = announcer(progress)
    with progress:
        stage("loading the model")
        student = command_model(args, check_example=False).model
        teacher = _teacher(args, data) if args.teacher or data.metric == "cosine" else None
        stage(f"scoring on the held-out {args.data} data")
        before = evaluate(student, data, reference=teacher)
        torch.manual_seed(args.seed)
        score = lambda model: evaluate(model, data, reference=teacher)  # noqa: E731
        report = _train(student, data, teacher, options, score, progress)
        after = evaluate(student, data, reference=teacher)
        stage(f"saving {args.output}")
        files = save_model(student, args.output).files
    size = sum(Path(f).stat().st_size for f in files if f.endswith(".safetensors"))
    summary = _summary(args, data, before, after, report, files, size)
    if args.json:
        print_json(summary)
    else:
        _render(args, summary)
    return 0


def _check(args: argparse.Namespace) -> None:
    """What argparse cannot say (its types bound the numbers): one line each, before anything loads."""
    if not args.data:
        raise SlimtorchError("recover needs --data DATA: the data to train on and score with")
    if args.input_shape is not None:
        raise SlimtorchError("recover takes its inputs from --data; --input-shape does not apply")
    if args.epochs is not None and args.epochs < 1:  # slim's --epochs 0 skips recovery: not here
        raise SlimtorchError(f"--epochs must be at least 1, not {args.epochs}")


def _teacher(args: argparse.Namespace, data: TaskData) -> nn.Module:
    """MODEL with the original weights (``--teacher``): what the student learns from and is compared to."""
    if not args.teacher:
        raise SlimtorchError(
            f"data {data.spec!r} is scored by the output cosine to the original model: give its weights "
            "with --teacher"
        )
    original = argparse.Namespace(**{**vars(args), "weights": args.teacher})
    return command_model(original, check_example=False).model.eval()


def _train(student, data, teacher, options, score, progress) -> RecoverReport:
    """:func:`slimtorch.recover` on the training batches; for a cosine task, towards the teacher's outputs."""
    from slimtorch.recovery import recover

    if data.metric == "cosine":
        targets = _TeacherOutputs(data.train, teacher)
        return recover(student, targets, options, eval_fn=score, loss_fn=_cosine_loss, progress=progress)
    return recover(student, data.train, options, teacher=teacher, eval_fn=score, progress=progress)


class _TeacherOutputs:
    """The training batches with the teacher's outputs as targets (re-iterable, with the data's length)."""

    def __init__(self, batches: Any, teacher: nn.Module) -> None:
        self.batches, self.teacher = batches, teacher

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self):
        import torch

        from slimtorch.recovery.data import output_tensor

        for inputs, _ in self.batches:
            with torch.no_grad():  # closed before the yield: grad mode is global, the step needs it on
                expected = output_tensor(self.teacher(inputs))
            yield inputs, expected


def _cosine_loss(output: Any, expected: Any) -> Any:
    """1 - the mean cosine of each output vector to the teacher's (the metric the task is scored by)."""
    import torch.nn.functional as F

    from slimtorch.recovery.data import output_tensor

    got = output_tensor(output)
    return 1 - F.cosine_similarity(got.reshape(-1, got.shape[-1]), expected.reshape(-1, got.shape[-1])).mean()


def _summary(args, data, before: float, after: float, report, files: list[str], size: int) -> dict:
    """The ``--json`` report: the training's report, the metric around it, what was written."""
    return {
        **report.to_dict(),
        "data": args.data,
        "metric": data.metric,
        "before": before,
        "after": after,
        "teacher": args.teacher,
        "notes": list(data.notes),
        "file_bytes": size,
        "files": files,
    }


def _render(args: argparse.Namespace, summary: dict) -> None:
    from rich.table import Table

    from slimtorch.cli.views.inspect_view import output_console

    console = output_console()
    how = f"distilled from {args.teacher}" if args.teacher else "fine-tuned"
    title = f"{args.model} on {args.data}, {how}, {summary['steps']:,} steps"
    table = Table(title=as_text(title), title_justify="left", header_style="dim")
    for column in ("", "before", "after", "change"):
        table.add_column(column, justify="left" if not column else "right")
    accuracy = summary["metric"] == "accuracy"
    shown = (lambda v: f"{v:.2f}%") if accuracy else (lambda v: f"{v:.5f}")
    change = summary["after"] - summary["before"]
    table.add_row(
        f"{summary['metric']}, held out",
        shown(summary["before"]),
        shown(summary["after"]),
        f"{change:+.2f} points" if accuracy else f"{change:+.5f}",
    )
    console.print(table)
    if summary["stopped_early"]:
        console.print(f"stopped early: the metric reached --target {args.target:g}", highlight=False)
    console.print(f"last training loss {summary['final_loss']:.4g}", highlight=False)
    console.print(as_text(f"wrote {', '.join(summary['files'])} ({format_bytes(summary['file_bytes'])})"))
