"""Benchmark: time until a model is ready, and peak memory, for every way of loading it.

Run it with ``.venv/bin/python benchmarks/load.py`` (about 6 minutes; ``--help`` lists the flags). It prints
one table per model, one PASS/FAIL line per target, and writes every measurement to
benchmarks/results/load.json. ``--check`` exits 1 when a target fails.

Methods (each run in a fresh Python process, imports done before the clock starts):

* ``torch.load + load_state_dict``: build the model (random init), ``torch.load(weights_only=True)`` the
  .pt file, copy it in.
* ``torch.load(mmap) + assign``: PyTorch's recipe: build under ``torch.device("meta")``,
  ``torch.load(mmap=True, weights_only=True)``, ``load_state_dict(assign=True)``. Buffers that no
  checkpoint holds (BERT's ``position_ids``) stay on meta, so that model is not usable; the table says so.
* ``safetensors load_model``: build the model (random init), ``safetensors.torch.load_model``.
* ``slimtorch raw``: ``slimtorch.load_model(slim file, factory)``; the slim file of dense random weights
  stores every tensor as is.
* ``slimtorch raw, model pre-built``: the same with the model already built on the meta device before
  the clock starts; the difference to ``slimtorch raw`` is what building the model adds to the load.
* ``slimtorch int8``: the same on an int8 slim file (``slimtorch.save(quantize="int8")``).
* ``slimtorch on .safetensors`` / ``on .pt``: ``slimtorch.load_model`` on the dense peer files.
* ``floor: read into a buffer``: ``readinto`` of the dense safetensors file into one buffer allocated in
  the timed region (an untouched allocation, so its page faults count, as they do for every method).

"Ready" means the model holds its weights and one byte of every 4 KiB page of every parameter and buffer
has been read, so lazily mapped weights pay for their page faults inside the timed region. Peak RSS is the
process's high-water mark (``VmHWM``, reset after the imports) minus its RSS before the load; mapped file
pages count, as they do for the kernel. The page cache is warm (one untimed warm-up round), rounds are
interleaved so a noisy neighbour hits every method alike, and the figures are medians of ``--runs`` runs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

RESULTS = Path(__file__).resolve().parent / "results" / "load.json"
MIB = 1 << 20
PAGE = 4096
WIDTH = 4096
METHODS = (
    "torch.load + load_state_dict",
    "torch.load(mmap) + assign",
    "safetensors load_model",
    "slimtorch raw",
    "slimtorch raw, model pre-built",
    "slimtorch int8",
    "slimtorch on .safetensors",
    "slimtorch on .pt",
    "floor: read into a buffer",
)
TITLES = {"mlp": "synthetic MLP", "bert": "BERT-base (transformers)"}


# -- models --------------------------------------------------------------------------------------------------
def mlp(layers: int) -> nn.Module:
    return nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(layers)))


def bert() -> nn.Module:
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers.BertModel(transformers.BertConfig())


def factory(model: str, layers: int):
    return (lambda: mlp(layers)) if model == "mlp" else bert


def files(folder: Path, model: str) -> dict[str, Path]:
    return {
        "pt": folder / f"{model}.pt",
        "safetensors": folder / f"{model}.safetensors",
        "slim": folder / f"{model}-slim.safetensors",
        "int8": folder / f"{model}-int8.safetensors",
    }


def write_files(folder: Path, model: str, layers: int) -> int:
    """Write the four files of one model; returns the model's tensor bytes."""
    import safetensors.torch

    import slimtorch

    torch.manual_seed(0)
    state = {k: v.detach().contiguous() for k, v in factory(model, layers)().state_dict().items()}
    paths = files(folder, model)
    torch.save(state, paths["pt"])
    safetensors.torch.save_file(state, paths["safetensors"])
    slimtorch.save(state, paths["slim"])
    slimtorch.save(state, paths["int8"], quantize="int8")
    return sum(t.numel() * t.element_size() for t in state.values())


# -- one run, in a fresh process -----------------------------------------------------------------------------
def status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def touch(tensors: list[torch.Tensor]) -> int:
    """Read one byte of every page of every tensor (meta tensors cannot be read: counted instead)."""
    on_meta = 0
    for tensor in tensors:
        if tensor.is_meta:
            on_meta += 1
        elif tensor.numel():
            tensor.detach().reshape(-1).view(torch.uint8)[::PAGE].sum()
    return on_meta


def load_once(method: str, model: str, folder: Path, layers: int) -> dict[str, Any]:
    import safetensors.torch

    import slimtorch

    build = factory(model, layers)
    paths = files(folder, model)
    construct_s = None
    if method == "slimtorch raw, model pre-built":
        from slimtorch.loading.construct import build_on_meta

        build = build_on_meta(build)
    with open("/proc/self/clear_refs", "w") as stream:
        stream.write("5")  # reset VmHWM to the current RSS
    rss_before = status("VmRSS")
    start = time.perf_counter()
    if method == "torch.load + load_state_dict":
        net = build()
        net.load_state_dict(torch.load(paths["pt"], weights_only=True))
    elif method == "torch.load(mmap) + assign":
        with torch.device("meta"):
            net = build()
        net.load_state_dict(torch.load(paths["pt"], mmap=True, weights_only=True), assign=True)
    elif method == "safetensors load_model":
        net = build()
        safetensors.torch.load_model(net, paths["safetensors"])
    elif method.startswith("slimtorch"):
        key = {
            "raw": "slim",
            "raw, model pre-built": "slim",
            "int8": "int8",
            "on .safetensors": "safetensors",
            "on .pt": "pt",
        }[method.removeprefix("slimtorch ")]
        report = slimtorch.load_model(paths[key], build)
        net, construct_s = report.model, report.construct_s
    else:
        buffer = torch.empty(paths["safetensors"].stat().st_size, dtype=torch.uint8)
        with open(paths["safetensors"], "rb", buffering=0) as stream:
            stream.readinto(memoryview(buffer.numpy()))
        net = None
    tensors = [buffer] if net is None else [*net.parameters(), *net.buffers()]
    on_meta = touch(tensors)
    seconds = time.perf_counter() - start
    return {
        "seconds": seconds,
        "construct_s": construct_s,
        "peak_rss_growth": status("VmHWM") - rss_before,
        "on_meta": on_meta,
    }


def child(args: argparse.Namespace) -> None:
    if args.model == "bert":
        # transformers imports a model's code on first use of its class: do it before the clock, like
        # `import torch` (it is import time, not load time, and it is the same for every method).
        from transformers import BertConfig, BertModel  # noqa: F401
    print(json.dumps(load_once(args.child, args.model, Path(args.dir), args.layers)))


# -- driver --------------------------------------------------------------------------------------------------
def run_child(method: str, model: str, folder: Path, layers: int, threads: int | None) -> dict[str, Any]:
    command = [sys.executable, __file__, "--child", method, "--model", model, "--dir", str(folder)]
    command += ["--layers", str(layers)] + (["--threads", str(threads)] if threads else [])
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"{method} on {model} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure(model: str, folder: Path, layers: int, runs: int, threads: int | None) -> dict[str, list[dict]]:
    results: dict[str, list[dict]] = {m: [] for m in METHODS}
    for round_ in range(runs + 1):
        for method in METHODS:
            result = run_child(method, model, folder, layers, threads)
            if round_:
                results[method].append(result)
        print(f"  {TITLES[model]}: {'warm-up' if round_ == 0 else f'round {round_}/{runs}'} done", flush=True)
    return results


def summarize(results: dict[str, list[dict]], model_bytes: int) -> dict[str, dict[str, Any]]:
    rows = {}
    for method, runs in results.items():
        seconds = [r["seconds"] for r in runs]
        rows[method] = {
            "median_s": statistics.median(seconds),
            "min_s": min(seconds),
            "max_s": max(seconds),
            "runs_s": seconds,
            "peak_rss_growth": statistics.median(r["peak_rss_growth"] for r in runs),
            "peak_rss_x_model": statistics.median(r["peak_rss_growth"] for r in runs) / model_bytes,
            "on_meta": max(r["on_meta"] for r in runs),
        }
        constructs = [r["construct_s"] for r in runs if r["construct_s"] is not None]
        if constructs:
            rows[method]["construct_median_s"] = statistics.median(constructs)
            rows[method]["construct_share"] = statistics.median(r["construct_s"] / r["seconds"] for r in runs)
    return rows


def checks(model: str, rows: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    raw, int8 = rows["slimtorch raw"], rows["slimtorch int8"]
    floor, peer = rows["floor: read into a buffer"]["median_s"], rows["safetensors load_model"]["median_s"]
    title = TITLES[model]
    found = [
        (f"{title}: slimtorch raw time / safetensors load_model", raw["median_s"] / peer, 1.0),
        (f"{title}: slimtorch raw time / read floor", raw["median_s"] / floor, 1.3),
        (f"{title}: slimtorch raw peak RSS / model bytes", raw["peak_rss_x_model"], 1.1),
        (f"{title}: slimtorch int8 time / read floor of the dense file", int8["median_s"] / floor, 1.5),
        (f"{title}: building the model on meta / slimtorch raw load", raw["construct_share"], 0.05),
    ]
    added = (raw["median_s"] - rows["slimtorch raw, model pre-built"]["median_s"]) / raw["median_s"]
    print(
        f"  {title}: building on meta takes {1000 * raw['construct_median_s']:.1f} ms "
        f"({100 * raw['construct_share']:.1f}% of the load) and adds {100 * added:.1f}% to it "
        "(raw against raw with the model pre-built; the pool verifies the file meanwhile)"
    )
    return [{"name": n, "measured": v, "target": t, "ok": v <= t} for n, v, t in found]


def print_table(model: str, rows: dict[str, dict[str, Any]], model_bytes: int, runs: int) -> None:
    from rich.console import Console
    from rich.table import Table

    floor = rows["floor: read into a buffer"]["median_s"]
    peer = rows["safetensors load_model"]["median_s"]
    table = Table(
        title=f"{TITLES[model]}, {model_bytes / MIB:,.0f} MiB of tensors: time until ready (every page "
        f"touched), median of {runs} fresh processes, warm page cache"
    )
    for header in ("method", "median s", "min-max s", "x floor", "x safetensors", "peak RSS MiB", "x model"):
        table.add_column(header, justify="left" if header == "method" else "right")
    table.add_column("note")
    for method, row in rows.items():
        note = []
        if row["on_meta"]:
            note.append(f"{row['on_meta']} tensors left on meta: not usable")
        if "construct_share" in row:
            note.append(f"meta build {1000 * row['construct_median_s']:.1f} ms")
        table.add_row(
            method,
            f"{row['median_s']:.3f}",
            f"{row['min_s']:.2f}-{row['max_s']:.2f}",
            f"{row['median_s'] / floor:.2f}",
            f"{row['median_s'] / peer:.2f}",
            f"{row['peak_rss_growth'] / MIB:,.0f}",
            f"{row['peak_rss_x_model']:.2f}",
            ", ".join(note),
        )
    Console(width=170).print(table)


def machine() -> dict[str, Any]:
    import safetensors

    import slimtorch

    return {
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "safetensors": safetensors.__version__,
        "slimtorch": slimtorch.__version__,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size-mib", type=float, default=1024, help="synthetic MLP size (default 1024)")
    parser.add_argument("--runs", type=int, default=5, help="timed runs per method (default 5)")
    parser.add_argument("--models", default="mlp,bert", help="comma-separated: mlp, bert (default both)")
    parser.add_argument("--threads", type=int, help="torch intra-op threads in each run")
    parser.add_argument("--dir", help="folder for the files (default: a temporary one)")
    parser.add_argument("--check", action="store_true", help="exit 1 when any target fails")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--layers", type=int, default=16, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.child:
        child(args)
        return
    layers = max(1, round(args.size_mib * MIB / (WIDTH * WIDTH * 4)))
    with tempfile.TemporaryDirectory(prefix="slimtorch-load-bench-", dir=args.dir) as tmp:
        record: dict[str, Any] = {"args": vars(args), "machine": machine(), "models": {}, "checks": []}
        for model in args.models.split(","):
            print(f"writing the {TITLES[model]} files ...", flush=True)
            model_bytes = write_files(Path(tmp), model, layers)
            rows = summarize(measure(model, Path(tmp), layers, args.runs, args.threads), model_bytes)
            print_table(model, rows, model_bytes, args.runs)
            record["models"][model] = {"model_bytes": model_bytes, "rows": rows}
            record["checks"] += checks(model, rows)
            for path in files(Path(tmp), model).values():
                path.unlink()
    print("\nTargets:")
    for check in record["checks"]:
        verdict = "PASS" if check["ok"] else "FAIL"
        print(f"{verdict}  {check['name']}: {check['measured']:.3f} (target <= {check['target']})")
    passed = sum(c["ok"] for c in record["checks"])
    print(f"{passed}/{len(record['checks'])} targets pass")
    record["all_pass"] = passed == len(record["checks"])
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(record, indent=2))
    print(f"results: {RESULTS}")
    if args.check and not record["all_pass"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
