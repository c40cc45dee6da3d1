"""`slimtorch quantize MODEL -o OUT --scheme int8-dynamic`: quantize, check against the float model, save."""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path

from rich.table import Table

from slimtorch.cli.arguments import add_command, print_json
from slimtorch.cli.model_input import add_model_arguments, command_model
from slimtorch.measure import measure_latency
from slimtorch.quant import SCHEMES, QuantizeReport, quantize_with_report
from slimtorch.report.inspect_view import output_console
from slimtorch.report.units import format_bytes
from slimtorch.shrinking import COMPANION_FILES, save_model

HELP = "quantize Linear and Embedding layers (int8 / int4), check them against the float model, save"
DESCRIPTION = """\
Swaps the model's nn.Linear and nn.Embedding layers (and Hugging Face's Conv1D) for quantized ones and
saves a slim file in which they stay quantized: load it back with slimtorch.load_model(OUT, factory) and
the float model's factory, and the layers come back quantized, their codes mapped from the file.

schemes:
  int8-dynamic  int8 weights and int8 activations (scaled per row on each call): the fastest on CPU
  int8-weight   int8 weights, float activations (computed in the input's dtype)
  int4-weight   4-bit weights, a scale and zero point per --group-size inputs: the smallest

Prints the model's size before and after, CPU latency (median), how closely the outputs agree with the
float model on --samples random inputs (cosine similarity, largest difference) and each layer's error:
the relative error of its weight and of its output against the float layer on the same inputs.

examples:
  slimtorch quantize ./bert-folder -o bert-int8 --scheme int8-dynamic
  slimtorch quantize mypkg.models:mlp --input-shape 8,4096 -o mlp-int4.safetensors --scheme int4-weight
  slimtorch quantize ./train.py:Net --weights ckpt.pt -o net.safetensors --skip "classifier" --layers 20
"""


def register(commands: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    parser = add_command(commands, common, "quantize", HELP, DESCRIPTION)
    add_model_arguments(parser, "1,3,224,224")
    parser.add_argument(
        "-o", "--output", required=True, metavar="OUT", help="output .safetensors file or folder"
    )
    parser.add_argument("--scheme", choices=SCHEMES, default="int8-dynamic", help="default int8-dynamic")
    parser.add_argument(
        "--group-size", type=int, default=128, metavar="N", help="int4 inputs per scale (default 128)"
    )
    parser.add_argument(
        "--skip", nargs="+", default=[], metavar="PATTERN", help="module names or patterns that stay float"
    )
    parser.add_argument("--no-embeddings", action="store_true", help="keep nn.Embedding layers float")
    parser.add_argument(
        "--samples", type=int, default=4, metavar="N", help="random inputs to compare on (default 4)"
    )
    parser.add_argument("--layers", type=int, default=10, metavar="N", help="layers listed, worst first")
    parser.add_argument("--runs", type=int, default=10, help="timed forward passes for latency (default 10)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    loaded = command_model(args)
    model = loaded.model.eval()
    samples = loaded.samples(max(1, args.samples))
    before = measure_latency(model, loaded.example, runs=args.runs) if args.runs else 0.0
    _, report = quantize_with_report(
        model,
        args.scheme,
        group_size=args.group_size,
        skip=args.skip,
        calibration=samples,
        embeddings=not args.no_embeddings,
    )
    after = measure_latency(model, loaded.example, runs=args.runs) if args.runs else 0.0
    out = Path(args.output)
    extra = (
        {name: loaded.folder / name for name in COMPANION_FILES if (loaded.folder / name).is_file()}
        if loaded.folder is not None and out.suffix != ".safetensors"
        else {}
    )
    files = save_model(model, out, extra_files=extra).files
    size = sum(Path(f).stat().st_size for f in files if f.endswith(".safetensors"))
    if args.json:
        latency = {"before_s": before, "after_s": after}
        print_json({**report.to_dict(), "latency": latency, "file_bytes": size, "files": files})
        return 0
    _render(args, report, before, after, files, size)
    return 0


def _render(
    args: argparse.Namespace,
    report: QuantizeReport,
    before: float,
    after: float,
    files: list[str],
    size: int,
) -> None:
    console = output_console()
    table = Table(title=f"{args.model}, {args.scheme}", title_justify="left", header_style="dim")
    for column in ("", "float", "quantized", "quantized / float"):
        table.add_column(column, justify="left" if not column else "right")
    table.add_row(
        "parameters and buffers",
        format_bytes(report.before_bytes),
        format_bytes(report.after_bytes),
        f"{report.ratio:.3f}x",
    )
    if before and after:
        batch = f"latency, input {','.join(str(s) for s in args.input_shape)}"
        table.add_row(batch, f"{before * 1e3:.2f} ms", f"{after * 1e3:.2f} ms", f"{after / before:.3f}x")
    console.print(table)
    if report.output_cosine is not None:
        console.print(
            f"outputs on {report.samples} random input(s): cosine similarity {report.output_cosine:.5f}, "
            f"largest difference {report.output_max_abs:.3g}",
            highlight=False,
        )
    _render_layers(console, report, args.layers)
    for reason, count in Counter(report.skipped.values()).most_common():
        console.print(f"  kept float: {count} layer(s): {reason}", highlight=False)
    console.print(f"wrote {', '.join(files)} ({format_bytes(size)})", highlight=False)


def _render_layers(console, report: QuantizeReport, shown: int) -> None:
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
            layer.name,
            layer.kind,
            f"{layer.weight_error:.2%}",
            output,
            f"{format_bytes(layer.before_bytes)} -> {format_bytes(layer.after_bytes)}",
        )
    console.print(table)
