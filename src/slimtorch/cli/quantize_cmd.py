"""`slimtorch quantize MODEL -o OUT --scheme int8-dynamic`: quantize, check against the float model, save."""

from __future__ import annotations

import argparse
import copy
from pathlib import Path
from typing import TYPE_CHECKING

from slimtorch.cli.arguments import (
    MAX_SAMPLES,
    add_command,
    add_group_size,
    add_json,
    add_keep_embeddings,
    add_layout,
    add_output,
    add_runs,
    add_scheme,
    add_skip,
    integer,
    print_json,
)
from slimtorch.cli.calibration_data import add_calibration_data, calibration_samples, open_calibration
from slimtorch.cli.choices import INT4_GROUP_SIZE, SCHEMES
from slimtorch.cli.model_input import add_model_arguments, command_model, output_companions
from slimtorch.cli.output_path import check_output, model_inputs
from slimtorch.cli.untrusted_text import as_text
from slimtorch.format.units import format_bytes

if TYPE_CHECKING:
    from rich.console import Console

    from slimtorch.inspection.measure import LatencyComparison
    from slimtorch.quant import QuantizeReport

HELP = "quantize Linear, Embedding, LSTM and GRU layers (int8 / int4), check against the float model, save"
DESCRIPTION = """\
Swaps the model's nn.Linear, nn.Embedding, nn.LSTM and nn.GRU layers (and Hugging Face's Conv1D) for
quantized ones, except the few whose output error on the samples would dominate (--quantize-all: those
too), and saves a slim file in which they stay quantized: load it back with slimtorch.load_model(OUT,
factory) and the float model's factory, and the layers come back quantized, their codes mapped from the
file. From a Hugging Face folder to a folder, the output is one transformers' from_pretrained reads too
(--layout hf, the default there): Linear (and int8 Embedding) layers in the compressed-tensors format,
int4 groups with a zero point each (asymmetric, as accurate as the slim layout); layers it cannot
express written dense. --layout slim keeps the
slim layout, which from_pretrained refuses. Every layer left float that holds a real share of the
weights is listed with the reason; a --skip pattern that matches no module, or a model with nothing to
quantize, is an error.

schemes:
  int8-dynamic  int8 weights and int8 activations (scaled per row on each call): the fastest on CPU
  int8-weight   int8 weights, float activations (computed in the input's dtype)
  int4-weight   4-bit weights, a scale and zero point per --group-size inputs: the smallest

Prints the model's size before and after, CPU latency (median +- IQR, the two models timed in turns),
how closely the outputs agree with the float model on --samples random inputs (cosine similarity, largest
difference) and each layer's error: the relative error of its weight and of its output against the float
layer on the same inputs. int4 chooses its codes by GPTQ on those inputs.

--data gives calibration inputs instead of random ones: a .txt file for a Hugging Face causal language
model (read with the folder's tokenizer: --samples sequences of --length tokens, and the perplexity on the
file's held-out tail printed before and after), or any data recover takes. --awq (int4) scales each
Linear's salient input channels before rounding and folds the inverse into the norm or Linear before it
(Llama-family names; other layers are rounded as they are, and said).

examples:
  slimtorch quantize ./bert-folder -o bert-int8 --scheme int8-dynamic
  slimtorch quantize mypkg.models:mlp --input-shape 8,4096 -o mlp-int4.safetensors --scheme int4-weight
  slimtorch quantize ./train.py:Net --weights ckpt.pt -o net.safetensors --skip "classifier" --layers 20
  slimtorch quantize ./llama -o ./llama-int4 --scheme int4-weight --awq --data text.txt --samples 64
"""


def register(commands: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    parser = add_command(commands, common, "quantize", HELP, DESCRIPTION)
    add_model_arguments(parser, "1,3,224,224")
    add_output(parser, "output .safetensors file or folder")
    add_scheme(parser, SCHEMES, "default int8-dynamic", default="int8-dynamic")
    add_group_size(parser, INT4_GROUP_SIZE)
    add_skip(parser, "module names or patterns that stay float")
    add_keep_embeddings(parser)
    parser.add_argument(
        "--quantize-all",
        action="store_true",
        help="also quantize the few layers whose output error would dominate (kept float by default)",
    )
    parser.add_argument(
        "--samples",
        type=integer(1, MAX_SAMPLES),
        default=4,
        metavar="N",
        help="calibration inputs: random ones to compare on, or sequences of --data (default 4)",
    )
    add_calibration_data(parser, "calibration inputs instead of random ones")
    parser.add_argument(
        "--awq",
        action="store_true",
        help="int4: scale salient input channels before rounding (AWQ), folded into the layer before",
    )
    parser.add_argument(
        "--layers", type=integer(0), default=10, metavar="N", help="layers listed, worst first"
    )
    add_runs(parser)
    add_layout(parser)
    add_json(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from slimtorch.cli.progress import TerminalProgress
    from slimtorch.format.hf_layout import resolve_layout
    from slimtorch.format.progress import announcer
    from slimtorch.inspection.measure import compare
    from slimtorch.quant import QuantizeOptions, quantize
    from slimtorch.recovery import evaluate
    from slimtorch.shrinking.saving import save_model
    from slimtorch.sources.companions import source_provenance

    check_output(args.output, model_inputs(args.model, args.weights))
    options = QuantizeOptions(  # a bad option fails before the model loads
        args.scheme,
        group_size=args.group_size,
        skip=args.skip,
        embeddings=not args.keep_embeddings,
        keep_sensitive=not args.quantize_all,
        awq=args.awq,
    )
    bar = TerminalProgress()  # each stage named as it starts, on a terminal
    stage = announcer(bar)
    with bar:
        stage("loading the model")
        loaded = command_model(args)
        out = Path(args.output)
        folder_out = loaded.folder is not None and out.suffix != ".safetensors"
        extra = output_companions(loaded.folder) if folder_out else {}
        layout = resolve_layout(args.layout, "config.json" in extra, out)
        model = loaded.model.eval()
        data = open_calibration(args) if args.data else None
        samples = calibration_samples(args, data) if data else loaded.samples(max(1, args.samples))
        perplexity = []
        if data is not None and data.metric == "perplexity":
            stage("measuring the perplexity before")
            perplexity.append(evaluate(model, data))
        original = copy.deepcopy(model) if args.runs > 0 else None  # timed beside the quantized one, in turns
        # int4 codes on the grid compressed-tensors reads as they are, for a Hugging Face folder
        report = quantize(model, options, calibration=samples, progress=bar, integer_zero=layout == "hf")
        if perplexity:
            assert data is not None
            stage("measuring the perplexity after")
            perplexity.append(evaluate(model, data))
        if original is not None:
            stage(f"timing the quantized model against the original ({args.runs} rounds)")
        latency = (
            None
            if original is None
            else compare(original, model, loaded.args, loaded.kwargs, rounds=args.runs)
        )
        del original
        stage(f"saving {args.output}")
        provenance = source_provenance(f"quantize {args.scheme}", loaded.folder)
        # a folder written back keeps every tensor of its file, under the file's names
        carry = loaded.rest if folder_out else None
        saved = save_model(model, out, extra_files=extra, layout=layout, metadata=provenance, carry=carry)
    files = saved.files
    report.notes.extend(saved.notes)
    size = sum(Path(f).stat().st_size for f in files if f.endswith(".safetensors"))
    if args.json:
        timing = latency.to_dict() if latency else None
        held = dict(zip(("before", "after"), perplexity, strict=True)) if perplexity else None
        record = {"latency": timing, "file_bytes": size, "files": files, "perplexity": held}
        print_json({**report.to_dict(), **record, "data": data.notes[0] if data and data.notes else None})
        return 0
    _render(args, report, latency, files, size, perplexity)
    return 0


def _render(
    args: argparse.Namespace,
    report: QuantizeReport,
    latency: LatencyComparison | None,
    files: list[str],
    size: int,
    perplexity: list[float],
) -> None:
    from rich.table import Table

    from slimtorch.cli.views.inspect_view import output_console

    console = output_console()
    table = Table(title=as_text(f"{args.model}, {args.scheme}"), title_justify="left", header_style="dim")
    for column in ("", "float", "quantized", "quantized / float"):
        table.add_column(column, justify="left" if not column else "right")
    table.add_row(
        "parameters and buffers",
        format_bytes(report.before_bytes),
        format_bytes(report.after_bytes),
        f"{report.ratio:.3f}x",
    )
    if latency:
        label = f"latency, input {','.join(str(s) for s in args.input_shape)}"
        table.add_row(label, latency.before.describe(), latency.after.describe(), latency.verdict())
    if perplexity:
        before, after = perplexity
        table.add_row("perplexity, held-out text", f"{before:.3f}", f"{after:.3f}", f"{after / before:.3f}x")
    console.print(table)
    if latency:
        console.print(f"  latency: {latency.how}", highlight=False)
    if report.output_cosine is not None:
        console.print(
            f"outputs on {report.samples} {'calibration' if args.data else 'random'} input(s): "
            f"cosine similarity {report.output_cosine:.5f}, "
            f"largest difference {report.output_max_abs:.3g}",
            highlight=False,
        )
    _render_layers(console, report, args.layers)
    for line in _kept_float_lines(report):
        console.print(as_text(line))
    console.print(as_text(f"wrote {', '.join(files)} ({format_bytes(size)})"))


def _kept_float_lines(report: QuantizeReport, shown: int = 8) -> list[str]:
    """One line per layer left float (a line per reason when there are many), then the smaller ones."""
    layers = report.kept_float
    if len(layers) <= shown:
        lines = [f"  kept float: {k.name} ({k.kind}, {format_bytes(k.bytes)}): {k.reason}" for k in layers]
    else:
        by_reason: dict[str, list] = {}
        for layer in layers:
            by_reason.setdefault(layer.reason, []).append(layer)
        lines = [
            f"  kept float: {len(group)} layers ({group[0].name} ...), "
            f"{format_bytes(sum(k.bytes for k in group))}: {reason}"
            for reason, group in by_reason.items()
        ]
    return (
        lines
        + [f"  note: {note}" for note in report.notes]
        + [f"  kernels: {line}" for line in report.kernels]
    )


def _render_layers(console: Console, report: QuantizeReport, shown: int) -> None:
    from rich.table import Table

    if not report.layers or shown <= 0:
        return
    worst = sorted(report.layers, key=lambda r: -(r.output_error or r.weight_error))[:shown]
    title = f"{len(report.layers)} layers quantized, worst {len(worst)} by output error"
    table = Table(title=title, title_justify="left", header_style="dim")
    for column in ("layer", "kind", "weight error", "output error", "bytes"):
        table.add_column(column, justify="left" if column in ("layer", "kind") else "right")
    for layer in worst:
        output = "-" if layer.output_error is None else f"{layer.output_error:.2%}"
        table.add_row(
            as_text(layer.name),
            as_text(layer.kind),
            f"{layer.weight_error:.2%}",
            output,
            f"{format_bytes(layer.before_bytes)} -> {format_bytes(layer.after_bytes)}",
        )
    console.print(table)
