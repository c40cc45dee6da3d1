"""Benchmark: what the CPU allocator adds over a real training loop, and how well ``estimate`` predicts it.

Run it with ``.venv/bin/python benchmarks/allocator_overhead.py`` (about 3 minutes on 2 cores;
``--models bert`` for one, ``--runs 1`` for a quick look). For each model, in a fresh process each run
(a second run in one process reuses the heap the first freed, and grows RSS by almost nothing), it
measures with ``slimtorch.memory.allocator.measure_host`` a loop that builds the model and an AdamW
optimizer and trains 3 real steps at batch 8, fp32, on the CPU:

* ``live peak``: the most bytes of CPU tensor storages alive at once (weights included: the run makes them);
* ``RSS growth``: the process's resident memory at its highest, above where it stood before the run;
* ``ratio``: RSS growth / live peak, what a live-tensor figure is to be multiplied by;
* ``malloc in use`` / ``malloc held``: glibc's heap (``mallinfo2``) at its highest, above where it stood:
  the bytes in use, and those the heap holds (in use plus freed chunks it keeps for reuse);
* ``estimate``: ``slimtorch.memory.estimate(model, batch, device="cpu")``'s peak (fake tensors, run after
  the measurement so it cannot inflate it), and RSS growth / estimate.

Medians of ``--runs`` (3) runs; the results go to ``benchmarks/results/allocator_overhead.json``.
``--mmap-threshold 65536`` runs the loops with glibc's ``MALLOC_MMAP_THRESHOLD_`` fixed there: every
allocation above it gets pages of its own, given back on free, instead of heap that malloc keeps.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))
from benchmarks.memory import bert, gpt2  # noqa: E402  (the 256-wide models the memory benchmark measures)
from tests.zoo import resnet18  # noqa: E402

import slimtorch.memory as memory  # noqa: E402
from slimtorch.memory.allocator import measure_host  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "allocator_overhead.json"
BATCH = 8
STEPS = 3
MiB = 2**20


ZOO: dict[str, tuple[Callable[[], nn.Module], Callable[[int], torch.Tensor]]] = {
    "resnet18": (resnet18, lambda b: torch.randn(b, 3, 224, 224)),
    "bert": (bert, lambda b: torch.randint(0, 30522, (b, 128))),
    "gpt2": (gpt2, lambda b: torch.randint(0, 50257, (b, 128))),
}


def first_float(output: Any) -> torch.Tensor:
    """The loss both the real loop and ``estimate`` use: the sum of the first floating-point output."""
    if isinstance(output, torch.Tensor):
        return output.float().sum()
    values = output.values() if isinstance(output, dict) else output
    return next(v for v in values if isinstance(v, torch.Tensor) and v.is_floating_point()).float().sum()


def one_run(name: str) -> dict[str, Any]:
    """Build ``name``, train it ``STEPS`` AdamW steps under ``measure_host``, then estimate the same step."""
    factory, inputs = ZOO[name]
    batch = inputs(BATCH)
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

    host = measure_host(train)
    report = memory.estimate(kept[0], batch, device="cpu", loss_fn=first_float)
    parameters = sum(p.numel() for p in kept[0].parameters())
    return {**host.to_dict(), "estimate": report.steps[0].peak_bytes, "parameters": parameters}


def measured(name: str, runs: int, mmap_threshold: int | None) -> dict[str, Any]:
    """Medians over ``runs`` fresh processes of :func:`one_run` (glibc's mmap threshold fixed, if given)."""
    env = dict(os.environ)
    if mmap_threshold is not None:
        env["MALLOC_MMAP_THRESHOLD_"] = str(mmap_threshold)
    rows = []
    for _ in range(runs):
        command = [sys.executable, __file__, "--one", name]
        done = subprocess.run(command, capture_output=True, text=True, check=True, cwd=ROOT, env=env)
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    keys = ("rss_before", "rss_growth", "live_tensor_peak", "malloc_in_use", "malloc_held", "estimate")
    median = {key: statistics.median(row[key] or 0 for row in rows) for key in keys}
    ratios = [row["rss_growth"] / row["live_tensor_peak"] for row in rows]
    to_estimate = [row["rss_growth"] / row["estimate"] for row in rows]
    return {
        "model": name,
        "parameters": rows[0]["parameters"],
        **median,
        "ratio": statistics.median(ratios),
        "growth_over_estimate": statistics.median(to_estimate),
        "runs": rows,
    }


def table(results: list[dict[str, Any]]) -> str:
    head = "| model | params | live peak | RSS growth | ratio | malloc in use | malloc held | estimate "
    lines = [head + "| growth / estimate |", "|---" * 9 + "|"]
    for r in results:
        lines.append(
            f"| {r['model']} | {r['parameters'] / 1e6:.1f}M | {r['live_tensor_peak'] / MiB:.0f} MiB "
            f"| {r['rss_growth'] / MiB:.0f} MiB | {r['ratio']:.2f} | {r['malloc_in_use'] / MiB:.0f} MiB "
            f"| {r['malloc_held'] / MiB:.0f} MiB | {r['estimate'] / MiB:.0f} MiB "
            f"| {r['growth_over_estimate']:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=sorted(ZOO), default=list(ZOO))
    parser.add_argument("--runs", type=int, default=3, help="fresh processes per model (median)")
    parser.add_argument(
        "--mmap-threshold",
        type=int,
        help="run the loops with MALLOC_MMAP_THRESHOLD_ set to this many bytes (e.g. 65536)",
    )
    parser.add_argument("--one", choices=sorted(ZOO), help=argparse.SUPPRESS)  # a child's single run
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one_run(args.one)))
        return
    results = [measured(name, args.runs, args.mmap_threshold) for name in args.models]
    malloc = f"MALLOC_MMAP_THRESHOLD_={args.mmap_threshold}" if args.mmap_threshold else "glibc's defaults"
    print(f"{STEPS} AdamW steps, batch {BATCH}, fp32, CPU, {malloc}; medians of {args.runs} fresh processes")
    print(table(results))
    RESULTS.parent.mkdir(exist_ok=True)
    results_file = RESULTS.with_stem(RESULTS.stem + "-mmap") if args.mmap_threshold else RESULTS
    results_file.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
