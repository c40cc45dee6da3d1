"""`slimtorch ops MODEL [-o OPS.yaml]`: the operators a model uses, as PyTorch's selective-build list."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from slimtorch.cli.arguments import add_command, add_json, add_output, print_json
from slimtorch.cli.model_input import add_model_arguments, command_model
from slimtorch.cli.output_path import check_output, model_inputs
from slimtorch.cli.untrusted_text import printable

HELP = "list the operators a model uses, as the YAML PyTorch's selective build reads (a minimal libtorch)"
DESCRIPTION = """\
Runs the model once on an example input and writes the operators it needs from libtorch, in the operator
list format of PyTorch's tracing-based selective build. A libtorch built from it keeps only those
operators, and is much smaller than a full one.

Two kinds of operators are listed, and a build needs both:
  root operators    the ones the model's forward calls (is_root_operator: true), from the graph
                    torch.export captures: aten::conv2d, aten::linear, ...
  called inside     the ones those call in turn through the dispatcher, recorded while the model runs:
                    aten::linear calls aten::t and aten::addmm; aten::conv2d reaches aten::convolution
                    and, on CPU, aten::mkldnn_convolution. A build without them fails at run time.

Only what runs on the example input is recorded: give an input that takes the paths the deployed model
takes (--input-shape), and add --training if the model is trained on the device (backward operators).

Build libtorch with it (TRACING_BASED=1 makes the build read this format):
  SELECTED_OP_LIST=$PWD/ops.yaml TRACING_BASED=1 scripts/build_pytorch_android.sh

examples:
  slimtorch ops mypkg.models:resnet18 -o ops.yaml
  slimtorch ops ./bert-folder --input-shape 1,128 -o bert-ops.yaml
  slimtorch ops ./train.py:Net --weights ckpt.pt --training -o train-ops.yaml
  slimtorch ops mypkg.models:mlp --input-shape 8,64 --json
"""


def register(commands: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    parser = add_command(commands, common, "ops", HELP, DESCRIPTION)
    add_model_arguments(parser, "1,3,224,224")
    add_output(parser, "write the YAML to FILE (default: print it on stdout)", required=False, metavar="FILE")
    parser.add_argument(
        "--training", action="store_true", help="also run a backward pass: list what on-device training needs"
    )
    add_json(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from slimtorch.deploy.ops import OperatorOptions, operators
    from slimtorch.format.writer import write_atomic_text

    if args.output:
        check_output(args.output, model_inputs(args.model, args.weights))
    loaded = command_model(args)
    found = operators(loaded.model, loaded.positional(), OperatorOptions(training=args.training))
    for note in found.notes:
        print(f"slimtorch: note: {printable(note)}", file=sys.stderr)
    if args.output:
        out = Path(args.output)
        out.parent.mkdir(parents=True, exist_ok=True)
        write_atomic_text(out, found.to_yaml(args.model))
        total, roots = len(found.operators), found.roots
        summary = f"{total} operators ({roots} called by the model, {total - roots} inside them) -> {out}"
        print(printable(summary), file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print_json(found.to_dict())
    elif not args.output:
        sys.stdout.write(found.to_yaml(args.model))
    return 0
