"""Benchmark: `slimtorch inspect` of a ~1 GiB checkpoint against the ways people look inside one today.

Requirement checked: inspect of a 1 GiB checkpoint with per-tensor sparsity finishes in under 5 s on a
2-core, 24 GB machine, without reading the whole file into anonymous memory.

Method:
* A nested training-style checkpoint ({"model": {float32 weights and biases}, "epoch": 3}) is written once
  with torch.save (zip format); a third of the weights are 50-90 % zeros (seeded masks), half the biases are
  zero. The fixture is built in a child process so the parent never imports torch.
* One untimed sequential read warms the page cache. Every measured run is a fresh process; the methods are
  interleaved round by round so a noisy neighbour hits them all alike. Medians over --runs rounds.
* Methods: the `slimtorch inspect --json` CLI (full scan: sparsity and duplicate search), timed end to end;
  torch.load(weights_only=True) with and without mmap=True, then count_nonzero on every tensor (the kernel
  slimtorch uses too); a floor that reads the file in 16 MiB chunks into one preallocated buffer (no parsing).
* Time: "work" is measured inside the child from just before the load/read to after the last zero count;
  "end-to-end" is the parent's wall time of the whole child (interpreter start and imports included).
* Memory: the parent samples the child's RssAnon (/proc/<pid>/status) every ~5 ms. Each child prints its
  RssAnon right after its imports (baseline); "anon growth" = peak - baseline. The CLI's baseline is that of
  a child that only imports slimtorch, measured in the same round. Peak total RSS is the child's VmHWM (the
  CLI's comes from wait4's ru_maxrss, the same counter).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks._harness import (
    child_command,
    emit,
    machine,
    memory_gib,
    proc_status,
    results_file,
    rich_table,
    sampled_run,
    show,
    verdict,
    write_json,
)

RESULTS = results_file("inspect_speed")
CHUNK_BYTES = 16 << 20
SIDE = 2048  # weights are [SIDE, SIDE] float32 (16 MiB each), biases [SIDE]
METHODS = {
    "slimtorch_cli": "slimtorch inspect --json (CLI)",
    "slimtorch_api": "slimtorch.inspect() (API, in process)",
    "torch_load": "torch.load(weights_only) + count zeros",
    "torch_load_mmap": "torch.load(weights_only, mmap) + count zeros",
    "read_floor": "floor: readinto 16 MiB chunks, no parsing",
}
CHILD_MODES = ("build", "import_slimtorch", "slimtorch_api", "torch_load", "torch_load_mmap", "read_floor")
MIB = 1 << 20
COLUMNS: dict[str, Callable[[dict[str, Any]], str]] = {  # table header -> cell, from a summary row
    "work s\n(in child)": lambda r: "—" if r["work_s"] is None else f"{r['work_s']:.2f}",
    "end-to-end s\n(parent)": lambda r: f"{r['wall_s']:.2f}",
    "× slimtorch\n(end-to-end)": lambda r: f"{r['ratio']:.2f}",
    "baseline\nanon MiB": lambda r: f"{r['baseline_kib'] / 1024:.0f}",
    "peak anon\ngrowth MiB": lambda r: f"{r['anon_growth_kib'] / 1024:.0f}",
    "growth\n% of file": lambda r: f"{100 * r['growth_fraction']:.1f}",
    "peak RSS\nMiB": lambda r: f"{r['peak_rss_kib'] / 1024:.0f}",
    "file\nMiB": lambda r: f"{r['file_mib']:.0f}",
}


# -- child side: runs in a fresh process, talks to the parent in JSON lines on stdout -----------------------
def build_fixture(path: str, size_gib: float) -> None:
    import torch

    torch.manual_seed(0)
    count = max(1, round(size_gib * (1 << 30) / (SIDE * SIDE * 4)))
    model: dict[str, torch.Tensor] = {}
    for i in range(count):
        weight = torch.randn(SIDE, SIDE)
        if i % 3 == 0:  # 50, 60, 70, 80, 90 % zeros in turn
            weight *= torch.rand(SIDE, SIDE) >= 0.5 + 0.1 * ((i // 3) % 5)
        prefix = f"layers.{i // 4}.{('attn.qkv', 'attn.out', 'mlp.up', 'mlp.down')[i % 4]}"
        model[f"{prefix}.weight"] = weight
        model[f"{prefix}.bias"] = torch.zeros(SIDE) if i % 2 else torch.randn(SIDE) * 0.02
    torch.save({"model": model, "epoch": 3}, path)
    emit({"tensors": len(model), "torch": torch.__version__})


def read_floor(path: str) -> int:
    buffer = bytearray(CHUNK_BYTES)
    total = 0
    with open(path, "rb", buffering=0) as file:
        while n := file.readinto(buffer):
            total += n
    return total


def torch_count_zeros(path: str, mmap: bool) -> int:
    import torch

    def tensors(obj: Any) -> list[torch.Tensor]:
        if isinstance(obj, torch.Tensor):
            return [obj]
        items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, list | tuple) else ()
        return [t for item in items for t in tensors(item)]

    checkpoint = torch.load(path, weights_only=True, mmap=mmap)
    return sum(t.numel() - int(torch.count_nonzero(t)) for t in tensors(checkpoint))


def child(mode: str, path: str, size_gib: float) -> None:
    if mode == "build":
        return build_fixture(path, size_gib)
    if mode != "read_floor":
        import torch  # noqa: F401  (imported before the baseline, as a user's script would)
    if mode in ("import_slimtorch", "slimtorch_api"):
        import slimtorch
    emit({"baseline_kib": proc_status()["RssAnon"]})
    start = time.perf_counter()
    result = read_floor(path) if mode == "read_floor" else None
    if mode.startswith("torch_load"):
        result = torch_count_zeros(path, mmap=mode.endswith("mmap"))
    if mode == "slimtorch_api":
        report = slimtorch.inspect(path)
        result = sum(round(t.sparsity * math.prod(t.shape)) for t in report.tensors if t.sparsity is not None)
    work_s, status = time.perf_counter() - start, proc_status()
    emit({"work_s": work_s, "result": result, "hwm_kib": status["VmHWM"], "anon_kib": status["RssAnon"]})


# -- parent side ---------------------------------------------------------------------------------------------
def measure(cmd: list[str], capture: bool = True) -> dict[str, Any]:
    """Run ``cmd`` to completion; wall time, peak sampled RssAnon, ru_maxrss and its JSON lines."""
    run = sampled_run(cmd, every=0.005, capture=capture)
    if run.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({run.returncode}):\n{run.stderr}")
    lines = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    return {
        "wall_s": run.wall_s,
        "peak_anon_kib": run.peak_anon // 1024,
        "maxrss_kib": run.usage.ru_maxrss,
        "lines": lines,
    }


def child_cmd(mode: str, path: Path, size_gib: float = 0.0) -> list[str]:
    return child_command(__spec__.name, "--child", mode, "--size-gib", str(size_gib), str(path))


def slimtorch_cli() -> str:
    beside = Path(sys.executable).with_name("slimtorch")
    return str(beside) if beside.exists() else shutil.which("slimtorch") or "slimtorch"


def one_run(method: str, path: Path, cli_baseline_kib: int) -> dict[str, Any]:
    if method == "slimtorch_cli":
        run = measure([slimtorch_cli(), "inspect", str(path), "--json"], capture=False)
        run.update(baseline_kib=cli_baseline_kib, work_s=None, hwm_kib=run["maxrss_kib"])
    else:
        run = measure(child_cmd(method, path))
        first, last = run.pop("lines")
        run.update(baseline_kib=first["baseline_kib"], work_s=last["work_s"], hwm_kib=last["hwm_kib"])
        run["result"] = last["result"]
    run.pop("lines", None)
    return {"method": method, **run, "anon_growth_kib": run["peak_anon_kib"] - run["baseline_kib"]}


def check_sparsity(path: Path, torch_zeros: int) -> bool:
    """The CLI really counted zeros: its per-tensor sparsity adds up to torch's count."""
    cmd = [slimtorch_cli(), "inspect", str(path), "--json"]
    report = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    zeros = sum(round(t["sparsity"] * math.prod(t["shape"])) for t in report["tensors"])
    return report["scanned"] and zeros == torch_zeros


def summarize(runs: list[dict[str, Any]], file_bytes: int) -> dict[str, dict[str, Any]]:
    def med(method: str, key: str) -> float | None:
        values = [r[key] for r in runs if r["method"] == method and r[key] is not None]
        return statistics.median(values) if values else None

    subject = med("slimtorch_cli", "wall_s")
    summary = {}
    for method in METHODS:
        row = {key: med(method, key) for key in ("work_s", "wall_s", "baseline_kib", "anon_growth_kib")}
        row.update(peak_rss_kib=med(method, "hwm_kib"), ratio=row["wall_s"] / subject)
        row.update(growth_fraction=row["anon_growth_kib"] * 1024 / file_bytes, file_mib=file_bytes / MIB)
        summary[method] = row
    return summary


def print_table(summary: dict[str, dict[str, Any]], runs: int) -> None:
    cpus = f"{os.cpu_count()} CPUs, {memory_gib():.0f} GiB RAM"
    title = f"inspect speed: median of {runs} fresh processes, warm page cache, {cpus}"
    table = rich_table(title, ["method", *COLUMNS], left={"method"})
    for method, row in summary.items():
        table.add_row(METHODS[method], *(cell(row) for cell in COLUMNS.values()))
    show(table, 160)


def verdicts(summary: dict[str, dict[str, Any]], sparsity_ok: bool) -> dict[str, bool]:
    subject = summary["slimtorch_cli"]
    checks = {
        "slimtorch inspect end-to-end median < 5 s": subject["wall_s"] < 5.0,
        "slimtorch anon growth < 25% of file size": subject["growth_fraction"] < 0.25,
        "slimtorch zero counts equal torch's": sparsity_ok,
    }
    for name, ok in checks.items():
        print(f"{verdict(ok)}: {name}")
    return checks


def run_rounds(path: Path, rounds: int) -> list[dict[str, Any]]:
    """Every method once per round, in a fresh process each, with the CLI's baseline taken in the round."""
    runs: list[dict[str, Any]] = []
    for round_ in range(rounds):
        baseline = measure(child_cmd("import_slimtorch", path))["lines"][0]["baseline_kib"]
        runs += [{"round": round_, **one_run(method, path, baseline)} for method in METHODS]
        times = ", ".join(f"{r['method']} {r['wall_s']:.2f} s" for r in runs[-len(METHODS) :])
        print(f"round {round_ + 1}/{rounds}: {times}", flush=True)
    return runs


def benchmark(args: argparse.Namespace) -> None:
    workdir = Path(args.dir or tempfile.mkdtemp(prefix="inspect_speed_"))
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / "checkpoint.pt"
    try:
        built = measure(child_cmd("build", path, args.size_gib))["lines"][-1]
        size = path.stat().st_size
        print(f"fixture: {path}, {size / MIB:.0f} MiB, {built['tensors']} tensors, torch {built['torch']}")
        measure(child_cmd("read_floor", path))  # untimed warm-up: the whole file into the page cache
        runs = run_rounds(path, args.runs)
        summary = summarize(runs, size)
        print_table(summary, args.runs)
        torch_zeros = next(r["result"] for r in runs if r["method"] == "torch_load")
        checks = verdicts(summary, check_sparsity(path, torch_zeros))
        record = dict(args=vars(args), machine=machine(**built), file_bytes=size, runs=runs, summary=summary)
        write_json(RESULTS, {**record, "checks": checks})
        print(f"raw runs: {RESULTS}")
    finally:
        if not args.keep:
            path.unlink(missing_ok=True)
            if not args.dir:
                shutil.rmtree(workdir, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(
        prog=f"python -m {__spec__.name}",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--dir", help="where to write the fixture (default: a fresh temp dir)")
    parser.add_argument("--size-gib", type=float, default=1.0, help="checkpoint size in GiB (default 1.0)")
    parser.add_argument("--runs", type=int, default=5, help="fresh-process runs per method (default 5)")
    parser.add_argument("--keep", action="store_true", help="keep the fixture file afterwards")
    parser.add_argument("--child", choices=CHILD_MODES, help=argparse.SUPPRESS)
    parser.add_argument("path", nargs="?", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.path, args.size_gib)
    else:
        benchmark(args)


if __name__ == "__main__":
    main()
