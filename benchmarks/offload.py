"""Benchmark: a model twice the memory budget, run with offload: peak RSS and per-token latency, against
accelerate's ``device_map="auto"`` disk offload.

Run it with ``.venv/bin/python -m benchmarks.offload`` (about 5 minutes on 2 cores; ``--rounds 1`` for a
quick look; ``--check`` exits 1 unless both of our methods stay within the budget plus the largest unit,
with outputs equal to the in-memory model). The model is a toy decoder: a 8192 x 1024 embedding (tied to
the output head) and 16 residual blocks of LayerNorm, Linear(1024, 8192), GELU, Linear(8192, 1024), about
1.03 GiB of float32 (a block is 64 MiB), with ``max_memory={"cpu": "512MB"}``. Methods, each in a fresh
process per round (so every peak is its own), interleaved A B C D in each round:

* ``in memory``: ``slimtorch.load_model`` with no budget (the reference: all of it resident);
* ``ours, safetensors``: ``load_model(..., max_memory=..., offload="disk")`` from a safetensors file:
  the blocks past the budget stay mapped from the file, their pages released after each block's forward;
* ``ours, slim int8``: the same from a slim int8 file into the float model: resident blocks decoded at
  load, offloaded ones decoded in their forward from the mapped codes (outputs compared with the int8
  file loaded in memory: the int8 rounding is the file's, not offload's);
* ``accelerate``: ``load_checkpoint_and_dispatch(meta model, file, device_map="auto", max_memory=...,
  offload_folder=..., no_split_module_classes=["Block"])`` from the safetensors file, the model built
  under its ``init_empty_weights`` and tied again after (that context unties it) (skipped with a
  printed line when accelerate is not installed; ``pip install accelerate``). It writes the offloaded
  weights again into the offload folder: its size is in the table.

In each child: ``base`` is the RSS after importing torch (and accelerate), building the model once on
meta and running its kernels on a tiny copy; the peak is ``VmHWM`` (reset through
``/proc/self/clear_refs`` before the load) minus base, over the load and 11 forwards of one token (batch
1): one warm-up, then 10 timed (their median is the per-token latency); the RSS left after them is shown
beside the peak. Outputs are checked with ``torch.equal``. The page cache is warm (files written by the
setup, read by every round): reading from disk is not measured. Results go to
``benchmarks/results/offload.json``; files are cached under ``--dir`` (default: the system temp folder).
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from benchmarks._harness import (
    child_command,
    child_json,
    emit,
    exit_code,
    results_file,
    status_bytes,
    verdict,
    write_json,
)

RESULTS = results_file("offload")
BUDGET = "512MB"
VOCAB, DIM, FFN, BLOCKS = 8192, 1024, 8192, 16
FORWARDS = 10
MiB = 2**20
METHODS = ("in memory", "ours, safetensors", "ours, slim int8", "accelerate")


class Block(nn.Module):
    """One residual MLP block: the unit that is resident or offloaded whole."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, FFN)
        self.down = nn.Linear(FFN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


class Decoder(nn.Module):
    """Embedding, blocks, norm and a head tied to the embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


TOKENS = torch.tensor([[17]])


def write_files(folder: Path) -> None:
    """The safetensors and slim int8 files, and each one's output as the in-memory model gives it."""
    import safetensors.torch

    import slimtorch

    if (folder / "ref-int8.pt").exists():
        return
    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = Decoder().eval()
    state = {k: v for k, v in model.state_dict().items() if k != "head.weight"}  # the tie, stored once
    safetensors.torch.save_file(state, folder / "model.safetensors")
    slimtorch.save(model.state_dict(), folder / "model-int8.safetensors", quantize="int8-weight")
    with torch.inference_mode():
        torch.save(model(TOKENS), folder / "ref.pt")
    del model, state
    gc.collect()
    int8 = slimtorch.load_model(folder / "model-int8.safetensors", Decoder).model.eval()
    with torch.inference_mode():
        torch.save(int8(TOKENS), folder / "ref-int8.pt")


# -- one run, in a child process ---------------------------------------------------------------------------
def one_run(method: str, folder: Path) -> dict[str, Any]:
    """Load with ``method``, run 11 forwards; peak RSS over base, latency, equality, what was offloaded."""
    if method == "accelerate":
        import accelerate  # noqa: F401  (imported before the base, as our own import is)
    with torch.device("meta"):
        Decoder()
    _warm_kernels()
    gc.collect()
    base = status_bytes("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    offload_dir = folder / f"accelerate-offload-{os.getpid()}"
    clock = time.perf_counter()
    model, extra = _load(method, folder, offload_dir)
    load_s = time.perf_counter() - clock
    times = []
    with torch.inference_mode():
        out = model(TOKENS)
        for _ in range(FORWARDS):
            clock = time.perf_counter()
            out = model(TOKENS)
            times.append(time.perf_counter() - clock)
    peak, after = status_bytes("VmHWM") - base, status_bytes("VmRSS") - base
    ref = torch.load(folder / ("ref-int8.pt" if "int8" in method else "ref.pt"))
    disk = sum(f.stat().st_size for f in offload_dir.rglob("*") if f.is_file()) if offload_dir.exists() else 0
    shutil.rmtree(offload_dir, ignore_errors=True)
    return {
        "method": method,
        "peak_over_base": peak,
        "rss_after": after,
        "load_s": load_s,
        "token_s": statistics.median(times),
        "equal": torch.equal(out, ref),
        "extra_disk": disk,
        **extra,
    }


def _warm_kernels() -> None:
    """Run the model's kernels once on a tiny copy, so the base holds their code pages (every method
    needs them; they are not the model's memory)."""
    tiny = nn.Sequential(nn.Embedding(8, 8), nn.LayerNorm(8), nn.Linear(8, 8), nn.GELU())
    with torch.inference_mode():
        tiny(torch.tensor([[1]]))


def _load(method: str, folder: Path, offload_dir: Path) -> tuple[nn.Module, dict[str, Any]]:
    import slimtorch

    if method == "accelerate":
        from accelerate import init_empty_weights, load_checkpoint_and_dispatch

        with init_empty_weights():
            model = Decoder()
        model.head.weight = model.embed.weight  # init_empty_weights re-registers parameters: tie again
        model = load_checkpoint_and_dispatch(
            model,
            str(folder / "model.safetensors"),
            device_map="auto",
            max_memory={"cpu": BUDGET},
            offload_folder=str(offload_dir),
            no_split_module_classes=["Block"],
        )
        placed = model.hf_device_map
        offloaded = [name for name, where in placed.items() if where == "disk"]
        return model.eval(), {"offloaded": offloaded, "resident_bytes": None}
    path = folder / ("model-int8.safetensors" if "int8" in method else "model.safetensors")
    budget = {} if method == "in memory" else {"max_memory": {"cpu": BUDGET}, "offload": "disk"}
    report = slimtorch.load_model(path, Decoder, **budget).wait()
    extra = {"offloaded": report.offloaded, "resident_bytes": report.resident_bytes}
    return report.model.eval(), extra


# -- the parent ----------------------------------------------------------------------------------------
def run_child(method: str, folder: Path) -> dict[str, Any]:
    return child_json(child_command(__spec__.name, "--one", method, "--dir", str(folder)), what=method)


def summary(method: str, runs: list[dict[str, Any]], limit: int) -> dict[str, Any]:
    peaks, tokens = [r["peak_over_base"] for r in runs], [r["token_s"] for r in runs]
    return {
        "method": method,
        "peak_over_base": statistics.median(peaks),
        "peak_spread": [min(peaks), max(peaks)],
        "within_limit": all(p <= limit for p in peaks),
        "rss_after": statistics.median(r["rss_after"] for r in runs),
        "token_s": statistics.median(tokens),
        "token_spread": [min(tokens), max(tokens)],
        "load_s": statistics.median(r["load_s"] for r in runs),
        "equal": all(r["equal"] for r in runs),
        "offloaded": len(runs[0]["offloaded"]),
        "resident_bytes": runs[0]["resident_bytes"],
        "extra_disk": runs[0]["extra_disk"],
        "runs": runs,
    }


def table(rows: list[dict[str, Any]], budget: int, limit: int) -> str:
    lines = [
        f"budget {budget / MiB:.0f} MiB ({BUDGET}); budget + largest unit {limit / MiB:.0f} MiB",
        "| method | peak RSS over base, median [min..max] | within budget + unit | RSS after the forwards "
        "| per token ms, median [min..max] | load s | units offloaded | extra disk | outputs equal |",
        "|---" * 9 + "|",
    ]
    for r in rows:
        lo, hi = (v / MiB for v in r["peak_spread"])
        tlo, thi = (v * 1e3 for v in r["token_spread"])
        lines.append(
            f"| {r['method']} | {r['peak_over_base'] / MiB:.0f} MiB [{lo:.0f}..{hi:.0f}] "
            f"| {'yes' if r['within_limit'] else 'no'} | {r['rss_after'] / MiB:.0f} MiB "
            f"| {r['token_s'] * 1e3:.1f} [{tlo:.1f}..{thi:.1f}] "
            f"| {r['load_s']:.2f} | {r['offloaded']} | {r['extra_disk'] / MiB:.0f} MiB "
            f"| {'yes' if r['equal'] else 'NO'} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="fresh processes per method (median)")
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--dir", type=Path, help="where the files are cached (default: the temp folder)")
    parser.add_argument("--check", action="store_true", help="exit 1 unless ours stays within the limit")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a child's single run
    args = parser.parse_args()
    folder = args.dir or Path(tempfile.gettempdir()) / "slimtorch-bench-offload"
    if args.one:
        emit(one_run(args.one, folder))
        return 0
    from slimtorch.format.units import parse_size

    methods = list(args.methods)
    if "accelerate" in methods and _missing("accelerate"):
        print("accelerate is not installed: its row is skipped (pip install accelerate)")
        methods.remove("accelerate")
    write_files(folder)
    budget, unit = parse_size(BUDGET), 2 * DIM * FFN * 4 + (FFN + 3 * DIM) * 4
    limit = budget + unit
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in methods}
    for index in range(args.rounds):
        for method in methods:
            runs[method].append(run_child(method, folder))
            print(
                f"  round {index + 1} {method}: {runs[method][-1]['peak_over_base'] / MiB:.0f} MiB",
                flush=True,
            )
    rows = [summary(m, runs[m], limit) for m in methods]
    print(f"load average: {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} {os.getloadavg()[2]:.2f}")
    print(table(rows, budget, limit))
    write_json(RESULTS, {"budget": budget, "limit": limit, "rows": rows})
    ours = [r for r in rows if r["method"].startswith("ours")]
    passed = all(r["within_limit"] and r["equal"] for r in ours)
    print(verdict(passed) + ": ours within budget + the largest unit, outputs equal")
    return exit_code(passed, args.check)


def _missing(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is None


if __name__ == "__main__":
    sys.exit(main())
