"""`slimtorch shrink IN -o OUT`: a smaller, safe copy of any checkpoint in the slim format."""

from __future__ import annotations

import argparse

from slimtorch.cli.arguments import (
    add_allow_global,
    add_command,
    add_group_size,
    add_json,
    add_keep_embeddings,
    add_layout,
    add_output,
    add_scheme,
    add_skip,
    print_json,
    size,
)
from slimtorch.cli.choices import SHRINK_INT4_GROUP_SIZE, WRITTEN
from slimtorch.cli.model_spec import PATH_HELP

HELP = "write a smaller, safe copy of a checkpoint (slim format on safetensors)"
DESCRIPTION = """\
Reads any checkpoint slimtorch reads and writes only what carries information, as safetensors files
any safetensors reader opens (codecs are described in the file's metadata; nothing is pickled):

  - drops optimizer and training state (--keep-optimizer keeps them)
  - keeps the other non-tensor values that are plain data (a config, an epoch, constructor arguments) as
    JSON in the file's metadata, read back by slimtorch.load_objects(); lists what it cannot keep
    (--no-objects drops them all)
  - folds torch.nn.utils.prune masks into their weights (weight = weight_orig * weight_mask)
  - stores tied and duplicated tensors once (ties come back tied on load)
  - stores zeros sparsely (bitmask + non-zeros) where that is smaller (--sparse off disables)
  - optionally converts floats (--dtype) and quantizes weights (--scheme int8-weight or int4-weight):
    norms, biases and small tensors keep their precision; embeddings are quantized per row unless
    --keep-embeddings; int4 groups hold 32 values (--group-size); unless --quantize-all, the weights
    quantizing would hurt most are stored at a higher precision and listed: those whose rounding error
    would dominate (5x the median or more: typically an input layer on raw features) at float16, and
    recurrent layers' weights (LSTM, GRU, RNN: their error compounds over time steps) at int8 under int4,
    their recurrent matrices at float16 under int8

The write is atomic (temp file, fsync, rename) and every part carries a CRC-32.
OUT ending in .safetensors is one file; any other OUT is a folder (shards + index, Hugging Face style;
config and tokenizer files of a model folder are copied along). A folder from a Hugging Face folder is
written so that transformers' from_pretrained reads it (--layout hf, the default there): every tensor
dense under its own name, int8 / int4 weights of Linear (int8: also Embedding) layers in the
compressed-tensors format with a quantization_config in config.json, other weights kept at their
precision. --layout slim writes the smaller slim layout, whose config.json makes from_pretrained refuse
the folder (slimtorch.load_model reads both).

examples:
  slimtorch shrink checkpoint.pt -o model.safetensors
  slimtorch shrink ./bert -o ./bert-int8 --scheme int8-weight
  slimtorch shrink pruned.pt -o small.safetensors --scheme int4-weight --group-size 64
  slimtorch shrink big.pt -o out/ --dtype bf16 --shard-size 5GB --skip 'lm_head.*'
"""


def register(commands: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    parser = add_command(commands, common, "shrink", HELP, DESCRIPTION)
    parser.add_argument("source", metavar="IN", help=PATH_HELP)
    add_output(parser, "output .safetensors file or folder")
    parser.add_argument("--dtype", choices=("fp16", "bf16"), help="convert floating-point tensors (lossy)")
    add_scheme(parser, WRITTEN, "quantize weights (lossy): int8 per row, or int4 in groups")
    add_group_size(parser, SHRINK_INT4_GROUP_SIZE)
    parser.add_argument(
        "--sparse",
        choices=("auto", "off"),
        default="auto",
        help="store zeros sparsely where smaller (default auto)",
    )
    parser.add_argument(
        "--entropy",
        action="store_true",
        help="zstandard over the stored parts where it saves >= 5%% (slower load)",
    )
    parser.add_argument("--keep-optimizer", action="store_true", help="keep optimizer and training state")
    add_keep_embeddings(parser)
    parser.add_argument(
        "--quantize-all",
        action="store_true",
        help="quantize every weight as asked, even those stored at a higher precision by default",
    )
    parser.add_argument(
        "--no-objects",
        action="store_true",
        help="drop every non-tensor value (by default plain data such as a config or an epoch is kept)",
    )
    parser.add_argument(
        "--keep-names", action="store_true", help="keep a training wrapper prefix such as 'model.'"
    )
    parser.add_argument(
        "--shard-size",
        type=size,
        metavar="SIZE",
        help="largest shard of a folder output, e.g. 2GB or 500MiB (default 2GB)",
    )
    add_skip(
        parser, "tensor names (glob patterns) kept exact: no conversion, no quantization; each must match"
    )
    parser.add_argument(
        "--top", type=int, default=15, metavar="K", help="largest tensors to list (default 15)"
    )
    add_layout(parser)
    add_json(parser)
    add_allow_global(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from slimtorch.cli.output_path import check_output
    from slimtorch.cli.progress import TerminalProgress
    from slimtorch.cli.views.inspect_view import output_console
    from slimtorch.cli.views.shrink_view import render_shrink
    from slimtorch.format.policy import ShrinkOptions
    from slimtorch.shrinking.saving import shrink

    options = ShrinkOptions(
        dtype=args.dtype,
        quantize=args.scheme,
        group_size=args.group_size,
        sparse=args.sparse,
        entropy=args.entropy,
        quantize_embeddings=not args.keep_embeddings,
        skip=args.skip,
        quantize_all=args.quantize_all,
        layout=args.layout,
        shard_bytes=args.shard_size,
        keep_optimizer=args.keep_optimizer,
        keep_names=args.keep_names,
        keep_objects=not args.no_objects,
        allow_globals=args.allow_global,
    )
    check_output(args.output, [args.source])
    with TerminalProgress() as bar:
        report = shrink(args.source, args.output, options, progress=bar)
    if args.json:
        print_json(report.to_dict())
    else:
        render_shrink(report, output_console(), top=args.top)
    return 0
