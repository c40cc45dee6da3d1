"""`slimtorch memory MODEL --batch 32 --optimizer adamw --precision bf16-mixed`: a training step's peak
memory, predicted without running it, and what it is made of."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from slimtorch.cli.arguments import (
    MAX_BATCH,
    MAX_RANKS,
    add_command,
    add_device,
    add_json,
    integer,
    machine_memory,
    print_json,
    size,
)
from slimtorch.cli.choices import OPTIMIZERS, PARALLEL, PRECISIONS
from slimtorch.cli.model_input import MODEL_HELP, add_input_shape, meta_model
from slimtorch.cli.output_path import check_output, model_inputs
from slimtorch.cli.untrusted_text import as_text
from slimtorch.errors import SlimtorchError
from slimtorch.format.units import format_bytes, format_share

if TYPE_CHECKING:
    from slimtorch.loading import ModelInput
    from slimtorch.memory import MemoryReport

MAX_ACCUMULATION = 1024
MAX_CONTEXT = 1 << 24  # tokens: slimtorch.memory.generation.MAX_CONTEXT
"""the most micro-batches of --accumulation: each is simulated, and the peak is reached by the second"""

HELP = "predict a training loop's (or inference's) peak memory, and what it is made of, without running it"
DESCRIPTION = """\
Builds the model on the meta device (no memory, no weights read) and runs its step, forward, backward
and optimizer, on fake tensors that have shapes but no data, recording every tensor the step would
allocate and free. The step runs again, the optimizer kept, until the steps repeat: from step 2 on the
optimizer's state is alive through forward and backward, so the steady state's peak is the one to size
by (the first step's is shown beside it). Prints the peak, where it happens, and what it holds:
parameters, gradients, optimizer state, activations kept for backward, inputs and temporaries; the
activations by module; and, with several --batch values, the peak as a line in the batch size. With
--budget, whether the step fits and the largest batch that would; with --chart, a PNG of memory over
the steady step.

On the CPU, the process's RSS growth is predicted too: the tensors, what glibc's malloc keeps of the
freed ones and the library code paged in (1.2-2x the live peak; within 15% of real loops in 11 of 12
cases, CNNs, transformers and an LSTM). Sizes on CUDA are rounded as its caching allocator rounds them.
Mixed precision is simulated with CPU autocast, whose op lists match CUDA's for the layers that matter
(linear, matmul, convolution).

examples:
  slimtorch memory ./llama-folder --batch 1 --input-shape 1,2048 --precision bf16-mixed
  slimtorch memory ./llama-folder --batch 1 2 4 8 --checkpointing blocks --budget 80GB --chart mem.png
  slimtorch memory Qwen/Qwen2.5-0.5B --batch 8 --input-shape 1,512   (from the local Hugging Face cache)
  slimtorch memory ./llama-folder --mode generate --precision bf16 --context 4096 32768 --budget 24GB
  slimtorch memory mypkg.models:resnet50 --batch 64 --input-shape 1,3,224,224 --optimizer sgd --device cpu
"""


def register(commands: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    parser = add_command(commands, common, "memory", HELP, DESCRIPTION)
    parser.add_argument("model", metavar="MODEL", help=MODEL_HELP)
    add_input_shape(parser)
    parser.add_argument(
        "--batch",
        type=integer(1, MAX_BATCH),
        nargs="+",
        metavar="N",
        help="batch sizes (default: the input's)",
    )
    parser.add_argument(
        "--mode",
        choices=("train", "inference", "generate"),
        default="train",
        help="default train; generate: a causal LM's weights plus the KV cache of --context tokens",
    )
    parser.add_argument(
        "--context",
        type=integer(1, MAX_CONTEXT),
        nargs="+",
        metavar="TOKENS",
        help="--mode generate: tokens per sequence in the KV cache (prompt + new tokens); default 2048",
    )
    parser.add_argument("--optimizer", choices=tuple(OPTIMIZERS), default="adamw", help="default adamw")
    parser.add_argument("--precision", choices=PRECISIONS, default="fp32", help="default fp32")
    parser.add_argument(
        "--checkpointing",
        nargs="+",
        metavar="MODULE",
        help="activation checkpointing: 'blocks' (each layer of the longest nn.ModuleList) or module names",
    )
    add_device(parser, "sizes as allocated there")
    parser.add_argument(
        "--keep-grads",
        action="store_true",
        help="gradients kept as zeros between steps (zero_grad(set_to_none=False)); default: freed",
    )
    parser.add_argument(
        "--accumulation",
        type=integer(1, MAX_ACCUMULATION),
        default=1,
        metavar="K",
        help="micro-batches per optimizer step (default 1)",
    )
    parser.add_argument(
        "--parallel",
        choices=PARALLEL,
        help="also each rank's peak under this strategy (the batch is then per rank; needs --world-size)",
    )
    parser.add_argument(
        "--world-size", type=integer(1, MAX_RANKS), default=1, metavar="N", help="ranks of --parallel"
    )
    parser.add_argument("--budget", type=size, metavar="SIZE", help="memory to fit in, e.g. 24GB or 80GiB")
    parser.add_argument(
        "--chart", metavar="PNG", help="also draw memory over the step to this PNG (needs matplotlib)"
    )
    add_json(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from slimtorch.cli.progress import TerminalProgress
    from slimtorch.cli.views.inspect_view import output_console
    from slimtorch.cli.views.memory_chart import write_chart
    from slimtorch.memory import StepOptions, estimate

    if args.mode == "generate":
        return _generation(args)
    if args.context:
        raise SlimtorchError("--context sizes the KV cache of --mode generate; add --mode generate")
    if args.chart:
        check_output(args.chart, model_inputs(args.model))
    loaded = meta_model(args)
    _check_batches(args.batch or (), loaded)
    step = StepOptions(
        mode=args.mode,
        optimizer=args.optimizer,
        precision=args.precision,
        checkpointing=args.checkpointing,  # ["blocks"] is "blocks"
        device=args.device,
        batch_sizes=args.batch,
        set_to_none=not args.keep_grads,
        accumulation=args.accumulation,
        parallel=args.parallel,
        world_size=args.world_size,
    )
    with TerminalProgress() as bar:
        report = estimate(loaded.model, loaded.example, step, progress=bar)
    fits = _largest_batch(report, args.budget) if args.budget else None
    chart = None
    if args.chart:
        what = f"{args.model}: {args.mode}, {args.precision}, on {report.device}"
        chart = write_chart(report, args.chart, title=what, budget=args.budget)
    if args.json:
        print_json({**report.to_dict(), "budget_bytes": args.budget, "largest_batch_in_budget": fits})
        return 0
    _render(args, report, fits)
    if chart is not None:
        output_console().print(as_text(f"wrote {chart}"))
    return 0


GENERATE_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def _generation(args: argparse.Namespace) -> int:
    """--mode generate: weights + KV cache per context, and the longest context within --budget."""
    import torch
    from rich.table import Table

    from slimtorch.cli.views.inspect_view import output_console
    from slimtorch.memory.generation import generation_memory

    if args.precision not in GENERATE_DTYPES:
        raise SlimtorchError(
            f"--mode generate takes --precision fp32, bf16 or fp16 (the weights' and the cache's dtype), "
            f"not {args.precision}"
        )
    if args.chart or args.parallel or len(args.batch or ()) > 1:
        raise SlimtorchError("--mode generate takes one --batch, and no --chart or --parallel")
    loaded = meta_model(args)
    dtype = getattr(torch, GENERATE_DTYPES[args.precision])
    batch = (args.batch or [1])[0]
    report = generation_memory(
        loaded.model, list(args.context or [2048]), batch=batch, dtype=dtype, budget=args.budget
    )
    if args.json:
        print_json(report.to_dict())
        return 0
    console = output_console()
    title = as_text(f"{args.model}: generate, batch {batch}, {args.precision} weights and KV cache")
    table = Table(title=title, title_justify="left", header_style="dim")
    for column in ("context (tokens)", "KV cache", "weights + KV cache"):
        table.add_column(column, justify="right")
    for row in report.contexts:
        table.add_row(f"{row.context:,}", format_bytes(row.kv_cache_bytes), format_bytes(row.total_bytes))
    console.print(table)
    console.print(
        f"weights {format_bytes(report.weights_bytes)}; the KV cache grows by "
        f"{format_bytes(report.kv_bytes_per_token)} a token; a long prompt's prefill adds its activations "
        "for that step (--mode inference --input-shape 1,LENGTH sizes them)",
        highlight=False,
    )
    if report.largest_context is not None:
        console.print(
            f"budget {format_bytes(report.budget_bytes or 0)}: the longest context whose weights and KV "
            f"cache fit is {report.largest_context:,} tokens",
            highlight=False,
        )
    return 0


def _check_batches(batches: tuple[int, ...] | list[int], loaded: ModelInput) -> None:
    """Each --batch makes the example input that many samples for real (rows repeated, with an int64
    index of the rows) before the step runs on fake tensors: one line where that input alone would not
    fit in this machine's memory."""
    import torch

    inputs = [v for v in (*loaded.args, *loaded.kwargs.values()) if isinstance(v, torch.Tensor) and v.dim()]
    per_sample = sum(v.nbytes // max(1, v.shape[0]) for v in inputs) + 8
    memory = machine_memory()
    for batch in batches:
        if batch * per_sample > memory:
            raise SlimtorchError(
                f"--batch {batch:,}: its input would take {format_bytes(batch * per_sample)} "
                f"({per_sample:,} bytes a sample), more than this machine's {format_bytes(memory)}"
            )


def _largest_batch(report: MemoryReport, budget: int) -> int | None:
    """The largest batch whose predicted peak fits ``budget`` (None: the lines need two batch sizes)."""
    return report.largest_batch(budget) if report.phase_lines else None


def _render(args: argparse.Namespace, report: MemoryReport, fits: int | None) -> None:
    from rich.table import Table

    from slimtorch.cli.views.inspect_view import output_console
    from slimtorch.memory import CATEGORIES

    console = output_console()
    what = f"{args.mode}, {args.precision}" + (f", {args.optimizer}" if args.mode == "train" else "")
    title = as_text(f"{args.model}: {what}, on {report.device}")
    table = Table(title=title, title_justify="left", header_style="dim")
    table.add_column("at the peak")
    for step in report.steps:
        table.add_column(f"batch {step.batch_size or args.input_shape[0]}", justify="right")
    for category in CATEGORIES:
        values = [step.breakdown[category] for step in report.steps]
        if any(values):
            cells = (_cell(v, s.peak_bytes) for v, s in zip(values, report.steps, strict=True))
            table.add_row(category.replace("_", " "), *cells)
    table.add_row("peak, steady state", *(format_bytes(s.peak_bytes) for s in report.steps), style="bold")
    table.add_row("in phase", *(f"{s.peak_phase}" for s in report.steps))
    table.add_row("peak, first step", *(format_bytes(s.first_step_peak_bytes) for s in report.steps))
    grown = [(s.resident_bytes, s.peak_bytes) for s in report.steps if s.resident_bytes is not None]
    if len(grown) == len(report.steps):  # the CPU: what the process's RSS grows by
        table.add_row("RSS growth, predicted", *(_resident(resident, peak) for resident, peak in grown))
    console.print(table)
    last = report.steps[-1]
    phases = ", ".join(
        f"{name} {format_bytes(value)}" for name, value in last.phases.items() if name != "setup"
    )
    console.print(f"highest by phase (last batch): {phases}", highlight=False)
    if last.modules:
        top = list(last.modules.items())[:5]
        console.print(
            as_text(
                "activations kept for backward, largest: "
                + ", ".join(f"{name or '(model)'} {format_bytes(value)}" for name, value in top)
            )
        )
    if report.fixed_bytes is not None and report.per_sample_bytes is not None:  # fitted together
        console.print(
            f"peak = {format_bytes(report.fixed_bytes)} + {format_bytes(report.per_sample_bytes)} per sample",
            highlight=False,
        )
    if report.per_rank is not None:
        rank = report.per_rank
        console.print(
            as_text(
                f"per rank, {rank.strategy} on {rank.world_size}: peak {format_bytes(rank.peak_bytes)} "
                f"in {rank.where}"
            )
        )
    if args.budget:
        verdict = "fits" if report.peak_bytes <= args.budget else "does NOT fit"
        console.print(
            f"budget {format_bytes(args.budget)}: the largest batch asked {verdict}", highlight=False
        )
        if fits is not None:
            console.print(f"  largest batch predicted to fit: {fits}", highlight=False)


def _resident(resident: int, peak: int) -> str:
    """The predicted RSS growth, with how much more than the live peak malloc keeps."""
    return f"{format_bytes(resident)} (x{resident / peak:.2f})" if peak else format_bytes(resident)


def _cell(value: int, peak: int) -> str:
    return f"{format_bytes(value)} ({format_share(value, peak)})"
