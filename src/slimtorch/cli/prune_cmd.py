"""`slimtorch prune MODEL -o OUT --ratio 0.5`: remove channels for real, save without pickle, show gains."""

from __future__ import annotations

import argparse
import copy
from pathlib import Path

from rich.table import Table

from slimtorch.cli.arguments import add_command, add_layout, add_runs, print_json
from slimtorch.cli.model_input import add_model_arguments, command_model, output_companions
from slimtorch.cli.output_path import check_output, model_inputs
from slimtorch.cli.progress import TerminalProgress
from slimtorch.cli.views.inspect_view import output_console
from slimtorch.format.units import format_bytes
from slimtorch.inspection.measure import compare, measure
from slimtorch.prune import ChannelOptions, channels
from slimtorch.shrinking.pretrained import save_pretrained
from slimtorch.shrinking.saving import save_model
from slimtorch.sources.companions import source_provenance

HELP = "remove whole channels (structured pruning) and save the smaller model without pickle"
DESCRIPTION = """\
Builds the model, captures its graph with torch.export (no autograd needed), groups the channels that
must go together (residual adds, concatenations, flatten -> Linear, depthwise convolutions, norms),
removes the least important share of each group from every weight, bias, running statistic and size
attribute, and saves a slim file that records the new structure: load it back with
slimtorch.load_model(OUT, factory) and the original model's factory.

Prints parameters, MACs and CPU latency (median +- IQR, the two models timed in turns) before and
after, on an example input (from the model: token ids and a mask for a text model, an image for a vision
one; or of --input-shape).
Channels that reach the model's output, or ops whose channel layout is unknown, are left alone; the
report says which and why.

examples:
  slimtorch prune mypkg.models:resnet18 -o r18-half.safetensors --ratio 0.5
  slimtorch prune ./train.py:Net --weights ckpt.pt -o small.safetensors --ratio 0.3 --importance bn_scale
  slimtorch prune mypkg.models:unet -o unet.safetensors --ratio 0.5 --input-shape 1,3,256,256 --ignore head
  slimtorch prune mypkg.models:resnet50 -o r50.safetensors --target-macs 1e9 --round-to 8
  slimtorch prune ./llama-folder -o ./llama-half --ratio 0.5   (a Hugging Face folder: writes a folder)
"""


def register(commands: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    parser = add_command(commands, common, "prune", HELP, DESCRIPTION)
    add_model_arguments(parser, "1,3,224,224")
    parser.add_argument(
        "-o", "--output", required=True, metavar="OUT", help="output .safetensors file or folder"
    )
    budget = parser.add_mutually_exclusive_group(required=True)
    budget.add_argument("--ratio", type=_ratio, help="share of channels to remove, 0 to <1")
    budget.add_argument("--target-params", type=_count, metavar="N", help="prune until at most N parameters")
    budget.add_argument(
        "--target-macs", type=_count, metavar="N", help="prune until at most N MACs (on --input-shape)"
    )
    parser.add_argument("--importance", choices=("l2", "l1", "bn_scale"), default="l2", help="default l2")
    parser.add_argument("--scope", choices=("layer", "global"), default="layer", help="default layer")
    parser.add_argument("--round-to", type=int, metavar="K", help="keep channel counts multiples of K")
    parser.add_argument("--steps", type=int, default=1, help="reach the ratio in this many steps (default 1)")
    parser.add_argument(
        "--ignore", nargs="+", default=[], metavar="MODULE", help="modules whose outputs stay"
    )
    parser.add_argument("--quantize", choices=("int8", "int4"), help="also quantize the saved weights")
    add_runs(parser)
    add_layout(parser)
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.set_defaults(run=run)


def _ratio(text: str) -> float:
    value = float(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError("must be at least 0 and below 1")
    return value


def _count(text: str) -> int:
    try:
        value = int(float(text.replace("_", "").replace(",", "")))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError("must be positive")
    return value


def run(args: argparse.Namespace) -> int:
    check_output(args.output, model_inputs(args.model, args.weights))
    loaded = command_model(args)
    model, example, hugging_face = loaded.model, loaded.positional(), loaded.folder is not None
    model.eval()
    before = measure(model, example)
    original = copy.deepcopy(model) if args.runs > 0 else None  # timed beside the pruned model, in turns
    options = ChannelOptions(
        ratio=args.ratio,
        target_params=args.target_params,
        target_macs=args.target_macs,
        iterative_steps=args.steps,
        importance=args.importance,
        scope=args.scope,
        round_to=args.round_to,
        ignore=tuple(args.ignore),
    )
    with TerminalProgress() as progress:
        report = channels(model, loaded.args, options, example_kwargs=loaded.kwargs, progress=progress)
    after = measure(model, example)
    latency = (
        None if original is None else compare(original, model, loaded.args, loaded.kwargs, rounds=args.runs)
    )
    del original
    problems: list[str] = []
    if hugging_face:
        companions = output_companions(loaded.folder)
        provenance = source_provenance("prune", loaded.folder)
        saved = save_pretrained(
            model,
            args.output,
            companions=companions,
            metadata=provenance,
            quantize=args.quantize,
            layout=args.layout,
        )
        problems = saved.config_update.problems
        files = sorted(str(path) for path in Path(args.output).iterdir())
    else:
        files = save_model(model, args.output, quantize=args.quantize, layout=args.layout).files
    size = sum(Path(f).stat().st_size for f in files if f.endswith(".safetensors"))
    if args.json:
        print_json(
            {
                "schema": "slimtorch.prune/1",
                "before": before.to_dict(),
                "after": after.to_dict(),
                "latency": latency.to_dict() if latency else None,
                "file_bytes": size,
                "files": files,
                "config_problems": problems,
                **report.to_dict(),
            }
        )
        return 0
    console = output_console()
    unit = "parameters" if args.target_params else "MACs"
    asked = (
        f"ratio {args.ratio}"
        if args.ratio is not None
        else f"at most {args.target_params or args.target_macs:,} {unit}"
    )
    table = Table(title=f"{args.model}, {asked}", title_justify="left", header_style="dim")
    for column in ("", "before", "after", "after / before"):
        table.add_column(column, justify="left" if not column else "right")
    rows = (
        ("parameters", before.params, after.params, f"{after.params:,}", f"{before.params:,}"),
        ("MACs", before.macs, after.macs, f"{after.macs / 1e9:.3f} G", f"{before.macs / 1e9:.3f} G"),
    )
    for label, b, a, a_text, b_text in rows:
        table.add_row(label, b_text, a_text, f"{a / b:.3f}x" if b else "-")
    if latency:
        label = f"latency, batch {args.input_shape[0]}"
        table.add_row(label, latency.before.describe(), latency.after.describe(), latency.verdict())
    console.print(table)
    if latency:
        console.print(f"  latency: {latency.how}", highlight=False)
    console.print(
        f"{report.pruned_groups} of {report.groups} channel groups pruned "
        f"({report.channels_before:,} -> {report.channels_after:,} channels)",
        highlight=False,
    )
    for reason, count in report.frozen.items():
        console.print(f"  kept whole: {count} group(s): {reason}", highlight=False)
    console.print(f"wrote {', '.join(files)} ({format_bytes(size)})", highlight=False)
    for problem in problems:
        console.print(
            f"  from_pretrained cannot rebuild it: {problem}; slimtorch.load_model can", highlight=False
        )
    return 0
