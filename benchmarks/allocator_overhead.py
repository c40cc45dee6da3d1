"""Benchmark: what the CPU allocator adds over a real training loop, and how well ``estimate`` predicts it.

Run it with ``.venv/bin/python -m benchmarks.allocator_overhead`` (about 12 minutes on 2 cores;
``--models bert --batches 4`` for a quick look; ``--check`` exits 1 when a prediction misses by more than
15%). The two CNNs also run at batch 32 (``LARGE_BATCHES``): their kernels' scratch grows with the batch,
so a rule fitted at one batch would show it there. For each model and batch size, in a fresh process each
run (a second run in one process reuses the heap the first freed, and grows RSS by almost nothing), it
measures with
``slimtorch.memory.allocator.measure_host`` a loop that builds the model and an AdamW optimizer and trains
3 real steps, fp32, on the CPU:

* ``live peak``: the most bytes of CPU tensor storages alive at once (weights included: the run makes them);
* ``RSS growth``: the process's resident memory at its highest, above where it stood before the run, and
  of it the code pages (``RssFile`` growth: library code and data the loop's kernels paged in);
* ``malloc held``: glibc's heap (``mallinfo2``) at its highest above where it stood, in use plus the freed
  chunks it keeps for reuse;
* ``predicted``: ``slimtorch.memory.estimate(model, batch, device="cpu").steps[0].resident_bytes``, on fake
  tensors (run after the measurement so it cannot inflate it): the steps' allocations, and the scratch
  blocks the kernels make unseen, through a model of glibc's malloc (``slimtorch.memory.heap``); its error
  against the RSS growth.

Medians of ``--runs`` (3) runs; the results go to ``benchmarks/results/allocator_overhead.json``.
``--mmap-threshold 65536`` runs the loops with glibc's ``MALLOC_MMAP_THRESHOLD_`` fixed there: every
allocation above it gets pages of its own, given back on free, instead of heap that malloc keeps (the
prediction models glibc's defaults, so its error column means little then).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections.abc import Callable
from typing import Any

import torch
from tests.zoo import resnet18
from torch import nn

import slimtorch.memory as memory
from benchmarks._harness import (
    child_command,
    child_json,
    emit,
    exit_code,
    relative_spread,
    results_file,
    status_bytes,
    write_json,
)
from benchmarks.memory import ZOO as MEMORY_ZOO  # the models the memory benchmark measures
from slimtorch.memory.allocator import measure_host

RESULTS = results_file("allocator_overhead")
BATCHES = (4, 16)
LARGE_BATCHES = {"resnet18": (32,), "unet": (32,)}
"""batches run beside ``BATCHES`` when ``--batches`` is not given"""
STEPS = 3
TOLERANCE = 0.15
MiB = 2**20


ZOO: dict[str, tuple[Callable[[], nn.Module], Callable[[int], torch.Tensor]]] = {
    **MEMORY_ZOO,
    "resnet18": (resnet18, lambda b: torch.randn(b, 3, 224, 224)),  # 224², not the memory benchmark's 64²
}


def first_float(output: Any) -> torch.Tensor:
    """The loss both the real loop and ``estimate`` use: the sum of the first floating-point output."""
    if isinstance(output, torch.Tensor):
        return output.float().sum()
    values = output.values() if isinstance(output, dict) else output
    return next(v for v in values if isinstance(v, torch.Tensor) and v.is_floating_point()).float().sum()


def one_run(name: str, batch_size: int) -> dict[str, Any]:
    """Build ``name``, train it ``STEPS`` AdamW steps under ``measure_host``, then estimate the same loop."""
    factory, inputs = ZOO[name]
    batch = inputs(batch_size)
    kept: list[nn.Module] = []
    with torch.device("meta"):  # a script imports its model's code before it trains: not the loop's cost
        factory()

    def train() -> None:
        torch.manual_seed(0)
        model = factory().train()
        optimizer = torch.optim.AdamW(model.parameters())
        for _ in range(STEPS):
            optimizer.zero_grad(set_to_none=True)
            first_float(model(batch)).backward()
            optimizer.step()
        kept.append(model)

    measure_host(lambda: None)  # its first op imports torch's dispatch machinery: not the loop's
    code = status_bytes("RssFile")  # library code and data paged in
    host = measure_host(train)
    code = status_bytes("RssFile") - code
    step = memory.estimate(kept[0], batch, device="cpu", loss_fn=first_float).steps[0]
    parameters = sum(p.numel() for p in kept[0].parameters())
    return {
        **host.to_dict(),
        "code_growth": code,
        "estimate": step.peak_bytes,
        "predicted": step.resident_bytes,
        "parameters": parameters,
    }


def measured(name: str, batch_size: int, runs: int, mmap_threshold: int | None) -> dict[str, Any]:
    """Medians over ``runs`` fresh processes of :func:`one_run` (glibc's mmap threshold fixed, if given)."""
    env = dict(os.environ)
    if mmap_threshold is not None:
        env["MALLOC_MMAP_THRESHOLD_"] = str(mmap_threshold)
    command = child_command(__spec__.name, "--one", name, str(batch_size))
    rows = [child_json(command, what=f"{name} batch {batch_size}", env=env) for _ in range(runs)]
    keys = ("rss_growth", "code_growth", "live_tensor_peak", "malloc_held", "estimate", "predicted")
    median = {key: statistics.median(row[key] or 0 for row in rows) for key in keys}
    growths = [row["rss_growth"] for row in rows]
    return {
        "model": name,
        "batch": batch_size,
        "parameters": rows[0]["parameters"],
        **median,
        "ratio": median["rss_growth"] / median["live_tensor_peak"],
        "spread": relative_spread(growths),
        "error": median["predicted"] / median["rss_growth"] - 1,
        "runs": rows,
    }


def table(results: list[dict[str, Any]]) -> str:
    head = "| model | batch | live peak | RSS growth (spread) | of it code pages | ratio | malloc held "
    lines = [head + "| predicted | error |", "|---" * 9 + "|"]
    for r in results:
        lines.append(
            f"| {r['model']} | {r['batch']} | {r['live_tensor_peak'] / MiB:.0f} MiB "
            f"| {r['rss_growth'] / MiB:.0f} MiB ({r['spread']:.0%}) | {r['code_growth'] / MiB:.0f} MiB "
            f"| {r['ratio']:.2f} | {r['malloc_held'] / MiB:.0f} MiB | {r['predicted'] / MiB:.0f} MiB "
            f"| {r['error']:+.0%} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=sorted(ZOO), default=list(ZOO))
    parser.add_argument(
        "--batches", nargs="+", type=int, help=f"batch sizes (default {BATCHES}, and {LARGE_BATCHES})"
    )
    parser.add_argument("--runs", type=int, default=3, help="fresh processes per case (median)")
    parser.add_argument(
        "--mmap-threshold",
        type=int,
        help="run the loops with MALLOC_MMAP_THRESHOLD_ set to this many bytes (e.g. 65536)",
    )
    parser.add_argument("--check", action="store_true", help=f"exit 1 on an error over {TOLERANCE:.0%}%")
    parser.add_argument("--one", nargs=2, help=argparse.SUPPRESS)  # a child's single run: model, batch
    args = parser.parse_args()
    if args.one:
        emit(one_run(args.one[0], int(args.one[1])))
        return 0
    results = []
    for name in args.models:
        for batch_size in args.batches or (*BATCHES, *LARGE_BATCHES.get(name, ())):
            results.append(measured(name, batch_size, args.runs, args.mmap_threshold))
            print(
                f"  {name} batch {batch_size}: error {results[-1]['error']:+.1%}", file=sys.stderr, flush=True
            )
    malloc = f"MALLOC_MMAP_THRESHOLD_={args.mmap_threshold}" if args.mmap_threshold else "glibc's defaults"
    print(f"{STEPS} AdamW steps, fp32, CPU, {malloc}; medians of {args.runs} fresh processes")
    print(table(results))
    worst = max(results, key=lambda r: abs(r["error"]))
    within = sum(abs(r["error"]) <= TOLERANCE for r in results)
    print(
        f"predicted RSS growth within {TOLERANCE:.0%}: {within} of {len(results)} cases; worst "
        f"{worst['error']:+.1%} ({worst['model']}, batch {worst['batch']})"
    )
    write_json(RESULTS.with_stem(RESULTS.stem + "-mmap") if args.mmap_threshold else RESULTS, results)
    return exit_code(within == len(results), args.check)


if __name__ == "__main__":
    sys.exit(main())
