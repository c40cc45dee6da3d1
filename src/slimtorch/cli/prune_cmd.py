"""`slimtorch prune MODEL -o OUT --ratio 0.5`: remove channels for real, save without pickle, show gains;
`--unstructured 0.9` / `--n-m 2:4`: zero weights instead, stored sparse."""

from __future__ import annotations

import argparse
import copy
import math
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from slimtorch.cli.arguments import (
    MAX_SAMPLES,
    MAX_STEPS,
    add_command,
    add_json,
    add_layout,
    add_output,
    add_runs,
    add_scheme,
    add_skip,
    fraction,
    integer,
    print_json,
)
from slimtorch.cli.calibration_data import add_calibration_data, calibration_samples, open_calibration
from slimtorch.cli.choices import WRITTEN
from slimtorch.cli.model_input import add_model_arguments, command_model, output_companions
from slimtorch.cli.output_path import check_output, model_inputs
from slimtorch.cli.untrusted_text import as_text
from slimtorch.errors import SlimtorchError
from slimtorch.format.units import format_bytes

if TYPE_CHECKING:
    from torch import nn

    from slimtorch.inspection.measure import LatencyComparison, ModelCost
    from slimtorch.loading import ModelInput
    from slimtorch.prune import PruneReport, SparsityReport

HELP = "remove whole channels (structured pruning), or zero weights (--unstructured, --n-m), and save"
MAX_ROUND_TO = 2**16
"""the largest --round-to: no layer has more channels"""
MAX_GROUP = 1024
"""the largest M of --n-m: 2:4 and 4:8 are what hardware runs"""
CHANNEL_ONLY = {"importance": "l2", "scope": "layer", "round_to": None, "steps": 1, "input_shape": None}
"""options of channel pruning, with their defaults: given to --unstructured or --n-m, they are refused"""
SPARSE_ONLY = {"method": "magnitude", "data": None, "samples": 64, "length": 512}
"""options of --unstructured / --n-m, with their defaults: given to channel pruning, they are refused"""

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

--unstructured SHARE zeroes that share of the Linear, Conv and recurrent weights instead (the smallest
magnitudes, one threshold over all of them); --n-m N:M keeps at most N non-zeros in every M consecutive
inputs (2:4, the pattern sparse tensor cores run). Nothing is removed, so the model keeps its shapes and
speed; the file stores the zeros sparsely (a bitmask and the non-zeros). Prints the zeros before and
after and the file size against the same model saved dense; layers N:M cannot group are named.

--method wanda or sparsegpt chooses those zeros from calibration data (--data) instead of by magnitude,
one block of a language model at a time: Wanda by |weight| x the norm of the input it multiplies,
SparseGPT by the output error each costs, updating the weights kept to make up for it. Each Linear layer
loses the same share (or keeps N:M). --data is a .txt file for a Hugging Face causal language model (read
with the folder's tokenizer: --samples sequences of --length tokens, the file's last fifth held out, and
the perplexity on it printed before and after), or any data recover takes (its training inputs). Skip
a language model's output head (--skip lm_head): a head tied to the token embeddings is left dense anyway.

examples:
  slimtorch prune mypkg.models:resnet18 -o r18-half.safetensors --ratio 0.5
  slimtorch prune ./train.py:Net --weights ckpt.pt -o small.safetensors --ratio 0.3 --importance bn_scale
  slimtorch prune mypkg.models:unet -o unet.safetensors --ratio 0.5 --input-shape 1,3,256,256 --skip head
  slimtorch prune mypkg.models:resnet50 -o r50.safetensors --target-macs 1e9 --round-to 8
  slimtorch prune ./llama-folder -o ./llama-half --ratio 0.5   (a Hugging Face folder: writes a folder)
  slimtorch prune ./train.py:Net --weights ckpt.pt -o sparse.safetensors --unstructured 0.9 --skip head
  slimtorch prune mypkg.models:mlp -o mlp-24.safetensors --n-m 2:4 --scheme int8-weight
  slimtorch prune ./llama -o ./llama-half --unstructured 0.5 --method wanda --data text.txt --skip lm_head
  slimtorch prune ./llama -o ./llama-24 --n-m 2:4 --method sparsegpt --data text.txt --skip lm_head
"""


def register(commands: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    parser = add_command(commands, common, "prune", HELP, DESCRIPTION)
    add_model_arguments(parser, "1,3,224,224")
    add_output(parser, "output .safetensors file or folder")
    budget = parser.add_mutually_exclusive_group(required=True)
    budget.add_argument("--ratio", type=fraction, help="share of channels to remove, 0 to <1")
    budget.add_argument("--target-params", type=_count, metavar="N", help="prune until at most N parameters")
    budget.add_argument(
        "--target-macs", type=_count, metavar="N", help="prune until at most N MACs (on --input-shape)"
    )
    budget.add_argument(
        "--unstructured",
        type=fraction,
        metavar="SHARE",
        help="zero this share of the weights instead, 0 to <1",
    )
    budget.add_argument("--n-m", type=_n_m, metavar="N:M", help="keep N non-zeros in every M inputs (2:4)")
    parser.add_argument("--importance", choices=("l2", "l1", "bn_scale"), default="l2", help="default l2")
    parser.add_argument("--scope", choices=("layer", "global"), default="layer", help="default layer")
    parser.add_argument(
        "--round-to", type=integer(1, MAX_ROUND_TO), metavar="K", help="keep channel counts multiples of K"
    )
    parser.add_argument(
        "--steps",
        type=integer(1, MAX_STEPS),
        default=1,
        help="reach the ratio in this many steps (default 1)",
    )
    parser.add_argument(
        "--method",
        choices=("magnitude", "wanda", "sparsegpt"),
        default="magnitude",
        help="how --unstructured / --n-m choose the zeros (default magnitude; wanda, sparsegpt need --data)",
    )
    add_calibration_data(parser, "calibration for wanda / sparsegpt")
    parser.add_argument(
        "--samples",
        type=integer(1, MAX_SAMPLES),
        default=64,
        metavar="N",
        help="calibration sequences (batches for other data) read from --data (default 64)",
    )
    add_skip(parser, "module names whose outputs stay (with --unstructured, --n-m: whose weights stay)")
    add_scheme(parser, WRITTEN, "also quantize the saved weights (as shrink --scheme does)")
    add_runs(parser)
    add_layout(parser)
    add_json(parser, "slimtorch.prune/1; slimtorch.sparsity/1 with --unstructured or --n-m")
    parser.set_defaults(run=run)


def _n_m(text: str) -> tuple[int, int]:
    n, sep, m = text.partition(":")
    try:
        pair = int(n), int(m)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N:M such as 2:4, not {text!r}") from None
    if not sep or not 0 < pair[0] < pair[1] <= MAX_GROUP:
        raise argparse.ArgumentTypeError(f"N:M needs 0 < N < M <= {MAX_GROUP}, not {text[:40]!r}")
    return pair


def _count(text: str) -> int:
    """A parameter or MAC count: 5e6, 1,000,000 or 1_000_000; positive and finite."""
    try:
        value = float(text.replace("_", "").replace(",", ""))
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 1:
        raise argparse.ArgumentTypeError(f"must be a finite number, at least 1, not {text[:40]!r}")
    return int(value)


def run(args: argparse.Namespace) -> int:
    from slimtorch.cli.progress import TerminalProgress
    from slimtorch.format.progress import announcer
    from slimtorch.inspection.measure import compare, measure
    from slimtorch.prune import ChannelOptions, channels

    if args.unstructured is not None or args.n_m is not None:
        return _run_sparse(args)
    given = [f"--{k.replace('_', '-')}" for k, default in SPARSE_ONLY.items() if getattr(args, k) != default]
    if given:
        raise SlimtorchError(f"{', '.join(given)}: with --unstructured or --n-m only, not channel pruning")
    check_output(args.output, model_inputs(args.model, args.weights))
    options = ChannelOptions(  # a bad option fails before the model loads
        ratio=args.ratio,
        target_params=args.target_params,
        target_macs=args.target_macs,
        iterative_steps=args.steps,
        importance=args.importance,
        scope=args.scope,
        round_to=args.round_to,
        ignore=tuple(args.skip),
    )
    progress = TerminalProgress()  # each stage named as it starts, on a terminal
    stage = announcer(progress)
    with progress:
        stage("loading the model")
        loaded = command_model(args)
        model, example = loaded.model, loaded.positional()
        model.eval()
        stage("counting parameters and MACs")
        before = measure(model, example)
        original = copy.deepcopy(model) if args.runs > 0 else None  # timed beside the pruned one, in turns
        report = channels(model, loaded.args, options, example_kwargs=loaded.kwargs, progress=progress)
        stage("counting parameters and MACs")
        after = measure(model, example)
        if original is not None:
            stage(f"timing the pruned model against the original ({args.runs} rounds)")
        latency = (
            None
            if original is None
            else compare(original, model, loaded.args, loaded.kwargs, rounds=args.runs)
        )
        del original
        stage(f"saving {args.output}")
        files, size, problems = _save(args, model, loaded)
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
    _render(args, before, after, latency, report, files, size, problems)
    return 0


def _save(args: argparse.Namespace, model: nn.Module, loaded: ModelInput) -> tuple[list[str], int, list[str]]:
    """The pruned model written to ``-o``: its files, their bytes, and what from_pretrained cannot rebuild."""
    from slimtorch.shrinking.pretrained import save_pretrained
    from slimtorch.shrinking.saving import save_model
    from slimtorch.sources.companions import source_provenance

    hugging_face = loaded.folder is not None
    problems: list[str] = []
    if hugging_face:
        companions = output_companions(loaded.folder)
        provenance = source_provenance("prune", loaded.folder)
        saved = save_pretrained(
            model,
            args.output,
            companions=companions,
            metadata=provenance,
            quantize=args.scheme,
            layout=args.layout,
        )
        assert saved.config_update is not None  # save_pretrained reports the config it wrote
        problems = saved.config_update.problems
        files = sorted(str(path) for path in Path(args.output).iterdir())
    else:
        files = save_model(model, args.output, quantize=args.scheme, layout=args.layout).files
    size = sum(Path(f).stat().st_size for f in files if f.endswith(".safetensors"))
    return files, size, problems


def _render(
    args: argparse.Namespace,
    before: ModelCost,
    after: ModelCost,
    latency: LatencyComparison | None,
    report: PruneReport,
    files: list[str],
    size: int,
    problems: list[str],
) -> None:
    from rich.table import Table

    from slimtorch.cli.views.inspect_view import output_console

    console = output_console()
    unit = "parameters" if args.target_params else "MACs"
    asked = (
        f"ratio {args.ratio}"
        if args.ratio is not None
        else f"at most {args.target_params or args.target_macs:,} {unit}"
    )
    table = Table(title=as_text(f"{args.model}, {asked}"), title_justify="left", header_style="dim")
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
        console.print(as_text(f"  kept whole: {count} group(s): {reason}"))
    console.print(as_text(f"wrote {', '.join(files)} ({format_bytes(size)})"))
    for problem in problems:
        console.print(as_text(f"  from_pretrained cannot rebuild it: {problem}; slimtorch.load_model can"))


def _run_sparse(args: argparse.Namespace) -> int:
    """``--unstructured`` / ``--n-m``: zeros in place of channels, saved sparse, measured against the same
    model saved dense."""
    from slimtorch.cli.progress import TerminalProgress
    from slimtorch.format.progress import announcer
    from slimtorch.prune import SparsityOptions, weights
    from slimtorch.prune.unstructured import sparsity_of
    from slimtorch.recovery import evaluate

    given = [f"--{k.replace('_', '-')}" for k, default in CHANNEL_ONLY.items() if getattr(args, k) != default]
    if given:
        raise SlimtorchError(f"{', '.join(given)}: channel pruning only, not --unstructured or --n-m")
    check_output(args.output, model_inputs(args.model, args.weights))
    n, m = args.n_m or (2, 4)
    calibrated = args.method != "magnitude"
    if calibrated != (args.data is not None):
        raise SlimtorchError(
            f"--method {args.method} chooses the zeros from calibration data: give --data"
            if calibrated
            else "--data is read by --method wanda or sparsegpt only"
        )
    options = SparsityOptions(  # a bad option fails before the model loads
        amount=args.unstructured if args.unstructured is not None else (None if calibrated else 0.0),
        method=args.method if calibrated else "n:m" if args.n_m else "global_magnitude",
        n=n,
        m=m,
        skip=tuple(args.skip),
        n_m=f"{n}:{m}" if calibrated and args.n_m else None,
    )
    progress = TerminalProgress()
    stage = announcer(progress)
    perplexity: list[float] = []
    with progress:
        stage("loading the model")
        loaded = command_model(args, check_example=False)  # no forward: zeros need no input
        model = loaded.model
        before = sparsity_of(model)
        data = open_calibration(args) if calibrated else None
        stage("saving the dense model, to measure its file")
        dense_bytes = _dense_bytes(args, model, loaded)
        if data is not None and data.metric == "perplexity":
            stage("measuring the perplexity before")
            perplexity.append(evaluate(model, data))
        stage("zeroing weights")
        samples = calibration_samples(args, data) if data is not None else None
        report = weights(model, options, data=samples, progress=progress if calibrated else None)
        if data is not None and data.metric == "perplexity":
            stage("measuring the perplexity after")
            perplexity.append(evaluate(model, data))
        stage(f"saving {args.output}")
        files, size, problems = _save(args, model, loaded)
    zeros_before = _zeros_of(before, report, model)
    if args.json:
        print_json(
            {
                **report.to_dict(),
                "method": report.method,
                "perplexity": dict(zip(("before", "after"), perplexity, strict=True)) if perplexity else None,
                "data": data.notes[0] if data is not None and data.notes else None,
                "amount": args.unstructured,
                "n_m": f"{n}:{m}" if args.n_m else None,
                "sparsity_before": zeros_before,
                "model_sparsity_before": before.model_sparsity,
                "file_bytes_before": dense_bytes,
                "file_bytes": size,
                "files": files,
                "config_problems": problems,
            }
        )
        return 0
    _render_sparse(
        args, report, (zeros_before, before.model_sparsity), (dense_bytes, size), files, problems, perplexity
    )
    return 0


def _dense_bytes(args: argparse.Namespace, model: nn.Module, loaded: ModelInput) -> int:
    """The bytes the model takes saved as the output will be, before any weight is zeroed (written to a
    temporary folder beside the output, then deleted)."""
    parent = Path(args.output).resolve().parent
    with tempfile.TemporaryDirectory(dir=parent if parent.is_dir() else None) as folder:
        dense = argparse.Namespace(**{**vars(args), "output": str(Path(folder) / Path(args.output).name)})
        return _save(dense, model, loaded)[1]


def _zeros_of(before: SparsityReport, after: SparsityReport, model: nn.Module) -> float:
    """The share of zeros the weights that were pruned had before."""
    from slimtorch.prune.unstructured import prunable_weights

    sizes = {name: w.numel() for name, w in prunable_weights(model).items() if name in after.layers}
    total = sum(sizes.values())
    return sum(before.layers[name] * size for name, size in sizes.items()) / total if total else 0.0


def _render_sparse(
    args: argparse.Namespace,
    report: SparsityReport,
    zeros: tuple[float, float],
    sizes: tuple[int, int],
    files: list[str],
    problems: list[str],
    perplexity: list[float],
) -> None:
    from rich.table import Table

    from slimtorch.cli.views.inspect_view import output_console

    console = output_console()
    asked = (
        f"{args.unstructured:.0%} of the weights zeroed"
        if args.n_m is None
        else "{}:{} sparsity".format(*args.n_m)
    )
    table = Table(title=as_text(f"{args.model}, {asked}"), title_justify="left", header_style="dim")
    for column in ("", "before", "after", "after / before"):
        table.add_column(column, justify="left" if not column else "right")
    table.add_row(
        f"zeros, the {len(report.layers)} weight(s) pruned", f"{zeros[0]:.1%}", f"{report.sparsity:.1%}", ""
    )
    table.add_row("zeros, all parameters", f"{zeros[1]:.1%}", f"{report.model_sparsity:.1%}", "")
    ratio = f"{sizes[1] / sizes[0]:.3f}x" if sizes[0] else "-"
    label = f"file, {args.scheme}" if args.scheme else "file"  # both saved the same way
    table.add_row(label, format_bytes(sizes[0]), format_bytes(sizes[1]), ratio)
    if perplexity:
        before, after = perplexity
        table.add_row("perplexity, held-out text", f"{before:.3f}", f"{after:.3f}", f"{after / before:.3f}x")
    console.print(table)
    console.print(as_text(f"{report.summary} ({report.method})"))
    for note in report.notes:
        console.print(as_text(f"  {note}"))
    for name, reason in report.by_magnitude.items():
        console.print(as_text(f"  by magnitude: {name}: {reason}"))
    for name, reason in report.skipped.items():
        console.print(as_text(f"  left dense: {name}: {reason}"))
    if sizes[1] >= sizes[0]:
        console.print("  the file is not smaller: the layout written stores these zeros as they are")
    console.print("latency not timed: zeros cost a dense kernel the same multiply", highlight=False)
    console.print(as_text(f"wrote {', '.join(files)} ({format_bytes(sizes[1])})"))
    for problem in problems:
        console.print(as_text(f"  from_pretrained cannot rebuild it: {problem}; slimtorch.load_model can"))
