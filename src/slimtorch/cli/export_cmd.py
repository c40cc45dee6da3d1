"""`slimtorch export MODEL -o DIR --format onnx`: a verified bundle that runs without PyTorch."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slimtorch.cli.arguments import (
    MAX_SAMPLES,
    add_command,
    add_json,
    add_output,
    add_scheme,
    integer,
    print_json,
    real,
)
from slimtorch.cli.model_input import add_model_arguments, command_model
from slimtorch.cli.output_path import check_output, model_inputs
from slimtorch.cli.untrusted_text import as_text, printable
from slimtorch.errors import SlimtorchError
from slimtorch.format.units import format_bytes
from slimtorch.schemes import scheme

if TYPE_CHECKING:
    import torch

    from slimtorch.deploy import ExportReport
    from slimtorch.loading import ModelInput

HELP = "export to ONNX (runs on onnxruntime, no torch) or .pt2, verified against PyTorch, as a bundle"
DESCRIPTION = """\
Captures the model with torch.export and writes DIR, a bundle that runs without PyTorch:

  model.onnx          translated by torch.onnx (dynamo); --scheme int8-dynamic: int8 weights per channel,
                      each token's activations quantized with its own scale (onnxruntime operators)
  requirements.txt    the runtime only: onnxruntime and numpy (torch and numpy for --format pt2)
  predict.py          the runner: python predict.py input.npy | inputs.npz | inputs.json, or --check
  sample_inputs.npz   the example input, and expected_outputs.npz, what eager PyTorch computed from it
  manifest.json       inputs, outputs, tolerance, verification, versions and every file's sha256

A model folder with a tokenizer.json makes a text bundle: its inputs are the token inputs the model's
forward takes (input_ids, attention_mask, token_type_ids), dynamic in batch and sequence up to the
model's max length (sentence_bert_config's max_seq_length, else the tokenizer's); the tokenizer files go
in the bundle, tokenizers in requirements.txt, and predict.py takes raw text:
  python predict.py --text "a sentence" --text "another"   (or --text-file sentences.json)
A sentence-transformers folder's output is the pooled, normalised sentence_embedding (pooling is in the
graph, checked with the rest). The check runs on tokenized sample sentences and at several lengths.

The exported model is run by its own runtime on the example and on fresh random inputs like it, and
compared with eager PyTorch: the largest absolute difference, and that difference relative to the
output's largest magnitude. The command exits 1 when an output is outside the tolerance:
  fp32       |exported - eager| <= 1e-4 + 1e-5 * max|eager|
  quantized  |exported - eager| <= 0.10 * max|eager|   (--scheme int8-dynamic, or a quantized model)
  quantized text model: the sentence embedding (the sentence-transformers output, or last_hidden_state
             averaged over the attention mask) has cosine >= 0.99 to eager for every text; each
             output's error is still shown
A model quantized by `slimtorch quantize` (--weights its file) keeps its int8 weights: onnxruntime's int8
gives the same codes for its Linear layers; a .pt2 keeps the codes and dequantizes them in its graph.

--format pt2 writes a torch.export ExportedProgram for deployments that keep torch (loads with
torch.export.load, no model code needed). Measure what a bundle costs with `slimtorch footprint DIR`.

If export fails, the message names the construct that blocked it (for example control flow on a
tensor's values), the module and source line where it is, and what was tried.

examples:
  slimtorch export mypkg.models:cnn --input-shape 1,1,8,8 -o cnn-bundle --dynamic-batch
  slimtorch export ./bert-folder -o bert-onnx --scheme int8-dynamic
  slimtorch export ./all-MiniLM-L6-v2 -o minilm-bundle    # then: python minilm-bundle/predict.py --text hi
  slimtorch export mypkg.models:net --weights net-int8.safetensors -o net-bundle --example batch.npz
  slimtorch export ./train.py:Net --weights ckpt.pt -o net-pt2 --format pt2
"""


def register(commands: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    parser = add_command(commands, common, "export", HELP, DESCRIPTION)
    add_model_arguments(parser, "1,3,224,224")
    add_output(parser, "the bundle folder to write", metavar="DIR")
    parser.add_argument("--format", choices=("onnx", "pt2"), default="onnx", help="default onnx")
    add_scheme(parser, ("int8-dynamic",), "int8 weights and per-token int8 activations (onnx)")
    parser.add_argument("--dynamic-batch", action="store_true", help="let the first dimension vary")
    parser.add_argument(
        "--example", nargs="+", metavar="INPUT", help="the example input: .npy per input, or one .npz / .json"
    )
    parser.add_argument(
        "--samples",
        type=integer(1, MAX_SAMPLES),
        default=3,
        metavar="N",
        help="inputs compared (default 3)",
    )
    parser.add_argument(
        "--atol", type=real(0), metavar="X", help="absolute tolerance, 0 or more (default by precision)"
    )
    parser.add_argument(
        "--rtol", type=real(0), metavar="X", help="tolerance relative to max|eager|, 0 or more"
    )
    add_json(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from slimtorch.cli.progress import TerminalProgress
    from slimtorch.deploy import FP32, INT8, ExportOptions, Tolerance, export

    check_output(args.output, [*model_inputs(args.model, args.weights), *(args.example or ())])
    loaded = command_model(args, check_example=not args.example)
    model = loaded.model.eval()
    tokenizer = _tokenizer_folder(loaded)
    given = _example(args, model) if args.example else None
    example: dict[str, Any] | tuple[Any, ...]
    if tokenizer is not None:  # a text bundle: inputs by name
        example = given if given is not None else dict(loaded.kwargs)
    else:
        example = tuple(given.values()) if given is not None else loaded.positional()
    tolerance = None
    if args.atol is not None or args.rtol is not None:
        base = INT8 if args.scheme else FP32
        atol = base.atol if args.atol is None else args.atol
        rtol = base.rtol if args.rtol is None else args.rtol
        tolerance = Tolerance(atol, rtol, f"given: within {atol:g} + {rtol:g} x max|eager|")
    options = ExportOptions(
        format=args.format,
        quantize_to=_quantize_to(args.scheme),
        dynamic_batch=args.dynamic_batch,
        samples=args.samples,
        tolerance=tolerance,
    )
    with TerminalProgress(enabled=not args.json) as status:
        report = export(model, example, args.output, options, tokenizer=tokenizer, progress=status)
    if args.json:
        print_json(report.to_dict())
    else:
        _render(args, report)
    return 0 if report.passed else 1


def _tokenizer_folder(loaded: ModelInput) -> Path | None:
    """The folder whose tokenizer a text bundle carries: a model folder with a ``tokenizer.json`` whose
    model takes token ids; None for anything else."""
    folder = loaded.folder
    if folder is None or "input_ids" not in loaded.kwargs:
        return None
    if not (folder / "tokenizer.json").is_file():
        print(
            f"slimtorch: note: {printable(folder)} has no tokenizer.json: the bundle takes token ids of the "
            "example's shape, not text",
            file=sys.stderr,
        )
        return None
    return folder


def _quantize_to(name: str | None) -> str | None:
    """The exporter's ``quantize_to`` for ``--scheme``: the codec of the scheme's row (``int8-dynamic``:
    ``"int8"``, int8 weights and per-token int8 activations in ONNX)."""
    return scheme(name).codec if name else None


def _example(args: argparse.Namespace, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The example input from files: the first forward arguments, by name (.npz, a JSON object) or in
    order (.npy files, a JSON list)."""
    import torch

    from slimtorch.cli.example_files import read_example
    from slimtorch.models.examples import forward_names

    names = forward_names(model) or ["input"]
    files = args.example
    arrays = read_example(files, names)  # within a budget, numbers only: one line naming the file
    unknown = [name for name in arrays if name not in names]
    if unknown:
        raise SlimtorchError(
            f"{files[0]}: the model has no input {unknown[0]!r} (it takes {', '.join(names)})"
        )
    given = [name for name in names if name in arrays]
    if not given:
        raise SlimtorchError(f"{files[0]}: holds no input (the model takes {', '.join(names)})")
    if given != names[: len(given)]:
        missing = next(name for name in names if name not in arrays)
        raise SlimtorchError(f"{files[0]}: no value for {missing!r}, which comes before {given[-1]!r}")
    floats = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    json_file = len(files) == 1 and files[0].endswith(".json")
    example = {}
    for name in given:
        tensor = torch.from_numpy(arrays[name])
        if json_file:  # JSON numbers have no width: floats take the model's, integers int64
            tensor = tensor.to(floats) if tensor.is_floating_point() else tensor.to(torch.int64)
        example[name] = tensor
    _check_accepts(model, example, files[0])
    return example


def _check_accepts(model: torch.nn.Module, example: dict[str, torch.Tensor], where: str) -> None:
    """Run the example through the model once: one that does not fit it (a width, a dtype) is one line
    naming the file, not a traceback from the layer that choked on it."""
    import torch

    try:
        with torch.no_grad():
            model(*example.values())
    except Exception as exc:  # whatever the model's own code raises on an input it cannot take
        given = ", ".join(
            f"{name} {str(t.dtype).removeprefix('torch.')} {'x'.join(map(str, t.shape)) or 'scalar'}"
            for name, t in example.items()
        )
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        raise SlimtorchError(
            f"{where}: the model does not accept this example ({given}) ({type(exc).__name__}: {first})"
        ) from exc


def _render(args: argparse.Namespace, report: ExportReport) -> None:
    from rich.table import Table

    from slimtorch.cli.views.inspect_view import output_console

    console = output_console()
    title = as_text(f"{args.model} -> {report.bundle}/{report.model_file}")
    table = Table(title=title, title_justify="left", header_style="dim")
    for column in ("output", "shape", "max abs error", "max rel error", "within tolerance"):
        table.add_column(column, justify="left" if column in ("output", "shape") else "right")
    by_cosine = report.tolerance.min_cosine is not None and report.embedding is not None
    for spec, error in zip(report.outputs, report.errors, strict=True):
        table.add_row(
            as_text(error.name),
            "x".join(str(s) for s in spec.shape),
            f"{error.max_abs:.3g}",
            f"{error.max_rel:.3g}",
            "yes" if error.passed else ("no (reported)" if by_cosine else "[red]NO[/red]"),
        )
    console.print(table)
    quantized = f", {report.quantized}" if report.quantized else ""
    console.print(
        f"model file {format_bytes(report.model_bytes)} ({report.format}{quantized}); parameters and buffers "
        f"in PyTorch {format_bytes(report.eager_bytes)}",
        highlight=False,
    )
    stages = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in report.seconds.items())
    console.print(
        f"compared on {report.samples} input(s); {report.tolerance.meaning}; {stages}", highlight=False
    )
    if report.embedding is not None:
        console.print(as_text(report.embedding.summary(by_cosine)))
    for note in report.notes:
        console.print(as_text(f"note: {note}"))
    if report.passed:
        console.print(
            as_text(
                f"next: slimtorch footprint {report.bundle}  "
                f"(or: cd {report.bundle}; python predict.py --check)"
            )
        )
    else:
        print(
            f"slimtorch: verification failed: "
            f"{'sentence embedding below the cosine' if by_cosine else 'outputs outside the tolerance'} "
            f"({printable(report.bundle)})",
            file=sys.stderr,
        )
