"""Benchmark: how small `slimtorch.save` and `slimtorch shrink` make checkpoints, and how fast they run.

Run it with ``.venv/bin/python -m benchmarks.shrink`` (about 5 minutes with the defaults; ``--help`` lists the
flags). It prints side-by-side tables, one PASS/FAIL line per target and a summary line, and writes every
measurement to benchmarks/results/shrink.json. The exit code is 0 even when a target fails (this is a
report); ``--check`` makes it 1 then.

Targets checked (sizes are relative to the dense safetensors file of the same tensors):

* 90 % unstructured-sparse float32 MLP: slimtorch lossless (bitmask + non-zeros) <= 0.14x, int8 <= 0.06x.
* BERT-base encoder (``transformers.BertConfig()`` defaults, random init, embeddings included):
  int8 <= 0.27x, int4 with groups of 64 <= 0.16x (float16 shown for reference).
* Shrink throughput >= 200 MB/s of input (input tensor bytes / seconds of ``slimtorch.save`` from memory, or
  of ``slimtorch.shrink`` from the dense safetensors file), on the ``--size-mib`` sparse MLP and on BERT.
* Load throughput >= 1 GB/s of output (decoded tensor bytes / seconds of ``slimtorch.load`` with every
  tensor touched) for the sparse (lossless) and int8 files. int4 and float16 loads are shown without target.

Method:

* Fixtures are built in this process with torch. The sparse MLP is ``[4096, 4096]`` ``nn.Linear`` layers
  (64 MiB of float32 weight each, plus biases) whose weights are magnitude-pruned to exactly 90 % zeros: the
  smallest 90 % by ``|w|`` of each weight are set to zero (the layers are identically initialised, so this
  is the global threshold up to sampling noise; biases are not pruned, as with ``torch.nn.utils.prune``).
  Sizes use a ``--sizes-mib`` model (default 256 MiB), throughput a ``--size-mib`` one (default 1 GiB).
* "slimtorch.shrink ... (from file)" reads the dense safetensors file of the same tensors.
  Peers: ``torch.save`` / ``safetensors.torch.save_file`` for writing, ``torch.load(weights_only=True)`` /
  ``safetensors.torch.load_file`` of the dense files for loading.
* Timing is in process (no interpreter start-up), with a warm page cache: every file read was just
  written. One untimed warm-up round, then ``--runs`` rounds (default 5); in each round every method runs
  once, interleaved so a noisy neighbour hits them all alike. Reported: the median wall time (targets are
  judged on it), the best run, and the median CPU time of this process (all its threads). Between runs,
  untimed: the previous output is deleted, garbage collected, and ``os.sync()`` flushes dirty pages, so no
  run pays for another's writeback (slimtorch fsyncs what it writes; the peers do not).
* On a shared machine, a median far above the best run with CPU time about equal to wall time means
  torch's threads spin-wait for a core another process holds; ``--threads 1`` avoids that contention.
* "Touched" means one byte of every 4 KiB page of every loaded tensor is read, so lazily mapped tensors
  (safetensors, slimtorch's raw parts) pay for their page faults like eagerly read ones.
* MB and GB are decimal (10^6 and 10^9 bytes); file sizes are shown in MiB.
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
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import safetensors
import safetensors.torch
import torch
from rich.console import Console

import slimtorch
from benchmarks._harness import exit_code, machine, results_file, rich_table, verdict, write_json

RESULTS = results_file("shrink")
MIB = 1 << 20
MB = 1e6
PAGE = 4096
WIDTH = 4096  # sparse MLP layers are nn.Linear(WIDTH, WIDTH): 64 MiB of float32 weight each
SPARSITY = 0.9
SIZE_TARGETS = {  # (case, variant) -> largest allowed ratio to the dense safetensors file
    ("sparse", "lossless"): 0.14,
    ("sparse", "int8"): 0.06,
    ("bert", "int8"): 0.27,
    ("bert", "int4-g64"): 0.16,
}
ENCODE_TARGET_MB_S = 200.0
DECODE_TARGET_MB_S = 1000.0
DECODE_TARGETED = {"lossless", "int8"}  # load targets apply to the sparse (lossless) and int8 files
VARIANTS: dict[str, dict[str, Any]] = {  # slimtorch.ShrinkOptions fields
    "lossless": {},
    "fp16": {"dtype": "fp16"},
    "int8": {"quantize": "int8-weight"},
    "int4-g64": {"quantize": "int4-weight", "group_size": 64},
}
CASE_VARIANTS = {"sparse": ("lossless", "int8"), "bert": ("fp16", "int8", "int4-g64")}
CASE_TITLES = {"sparse": "90% sparse fp32 MLP", "bert": "BERT-base (transformers)"}
console = Console(width=160)


@dataclass
class Check:
    """One target: what was measured against what was asked."""

    name: str
    measured: float
    target: float
    unit: str
    at_most: bool  # True: measured must be <= target (sizes); False: >= target (throughput)

    @property
    def ok(self) -> bool:
        return self.measured <= self.target if self.at_most else self.measured >= self.target

    def line(self) -> str:
        sign = "<=" if self.at_most else ">="
        return (
            f"{verdict(self.ok)}  {self.name}: {fmt(self.measured, self.unit)} "
            f"(target {sign} {fmt(self.target, self.unit)})"
        )


@dataclass
class Method:
    """One timed operation; ``run`` does it once and returns the bytes it processed (the MB/s numerator)."""

    case: str
    op: str  # "write" (input bytes / s) or "load" (decoded bytes / s)
    label: str
    run: Callable[[], int]
    before: Callable[[], None] = lambda: None  # untimed set-up before every run (remove the output file)
    target: float | None = None
    seconds: list[float] = field(default_factory=list)
    cpu_seconds: list[float] = field(default_factory=list)  # this process's CPU time (all its threads)
    nbytes: int = 0

    def summary(self) -> dict[str, Any]:
        median = statistics.median(self.seconds)
        return {
            "case": self.case,
            "op": self.op,
            "method": self.label,
            "bytes": self.nbytes,
            "runs_s": self.seconds,
            "median_s": median,
            "min_s": min(self.seconds),
            "max_s": max(self.seconds),
            "cpu_runs_s": self.cpu_seconds,
            "cpu_median_s": statistics.median(self.cpu_seconds),
            "mb_s": self.nbytes / median / MB,
            "best_mb_s": self.nbytes / min(self.seconds) / MB,
            "target_mb_s": self.target,
        }


def fmt(value: float, unit: str) -> str:
    return f"{value:.3f}x" if unit == "x" else f"{value:,.0f} MB/s"


# -- fixtures ------------------------------------------------------------------------------------------------
def prune_(weight: torch.Tensor, sparsity: float) -> None:
    """Zero the smallest ``sparsity`` of ``weight`` by magnitude, in place (exactly, barring ties)."""
    flat = weight.view(-1)
    magnitude = flat.abs()
    threshold = magnitude.kthvalue(int(sparsity * flat.numel())).values
    flat[magnitude <= threshold] = 0.0


def sparse_mlp(size_mib: float, seed: int = 0) -> dict[str, torch.Tensor]:
    """An MLP of [WIDTH, WIDTH] Linear layers, ~``size_mib`` MiB of float32, weights 90% zeros."""
    torch.manual_seed(seed)
    layers = max(1, round(size_mib * MIB / (WIDTH * WIDTH * 4)))
    state: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for i in range(layers):
            linear = torch.nn.Linear(WIDTH, WIDTH)
            prune_(linear.weight, SPARSITY)
            state[f"layers.{i}.weight"] = linear.weight.detach()
            state[f"layers.{i}.bias"] = linear.bias.detach()
    return state


def bert_base(seed: int = 0) -> dict[str, torch.Tensor]:
    """BertModel(BertConfig()) with random weights (no download), embeddings and pooler included."""
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(seed)
    model = transformers.BertModel(transformers.BertConfig())
    return {name: tensor.detach() for name, tensor in model.state_dict().items()}


def tensor_bytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def zero_fraction(state: dict[str, torch.Tensor]) -> float:
    weights = [t for name, t in state.items() if name.endswith("weight")]
    return sum(int((t == 0).sum()) for t in weights) / sum(t.numel() for t in weights)


def touch(tensors: dict[str, torch.Tensor]) -> int:
    """Read one byte of every page of every tensor; returns the tensors' bytes."""
    total = 0
    for tensor in tensors.values():
        if tensor.numel():
            data = tensor.reshape(-1).view(torch.uint8)
            data[::PAGE].sum()
            total += data.numel()
    return total


def settle() -> None:
    """Between runs (untimed): collect garbage and flush dirty pages, so no run pays for another's writes."""
    gc.collect()
    os.sync()


# -- files ---------------------------------------------------------------------------------------------------
def write_dense(state: dict[str, torch.Tensor], folder: Path) -> dict[str, Path]:
    paths = {"torch.save": folder / "dense.pt", "safetensors": folder / "dense.safetensors"}
    torch.save(state, paths["torch.save"])
    safetensors.torch.save_file(state, paths["safetensors"])
    return paths


def write_slim(state: dict[str, torch.Tensor], path: Path, variant: str) -> dict[str, Any]:
    """slimtorch.save one variant; its size and the worst relative L2 error of any tensor."""
    report = slimtorch.save(state, path, slimtorch.ShrinkOptions(**VARIANTS[variant]))
    errors = [t.rel_l2 for t in report.tensors if t.rel_l2 is not None]
    chains = sorted({t.chain for t in report.tensors})
    return {"bytes": path.stat().st_size, "max_rel_l2": max(errors, default=0.0), "chains": chains}


def check_lossless(state: dict[str, torch.Tensor], path: Path) -> bool:
    loaded = slimtorch.load(path).tensors
    return loaded.keys() == state.keys() and all(torch.equal(loaded[k], v) for k, v in state.items())


# -- phase 1 and 2: sizes ------------------------------------------------------------------------------------
def measure_sizes(case: str, state: dict[str, torch.Tensor], folder: Path) -> dict[str, Any]:
    """Write the dense references and every slim variant of one case; sizes relative to safetensors."""
    dense = write_dense(state, folder)
    reference = dense["safetensors"].stat().st_size
    rows = {name: {"bytes": path.stat().st_size} for name, path in dense.items()}
    for variant in CASE_VARIANTS[case]:
        rows[f"slimtorch {variant}"] = write_slim(state, folder / f"slim-{variant}.safetensors", variant)
    for row in rows.values():
        row["ratio"] = row["bytes"] / reference
    result = {"tensor_bytes": tensor_bytes(state), "tensors": len(state), "files": rows}
    if "lossless" in CASE_VARIANTS[case]:
        result["lossless_roundtrip_equal"] = check_lossless(state, folder / "slim-lossless.safetensors")
    if case == "sparse":
        result["weight_zero_fraction"] = zero_fraction(state)
    return result


def size_checks(case: str, sizes: dict[str, Any]) -> list[Check]:
    return [
        Check(
            f"{CASE_TITLES[case]}: slimtorch {variant} size / safetensors",
            sizes["files"][f"slimtorch {variant}"]["ratio"],
            target,
            "x",
            at_most=True,
        )
        for (of_case, variant), target in SIZE_TARGETS.items()
        if of_case == case
    ]


def print_sizes(all_sizes: dict[str, dict[str, Any]]) -> None:
    table = rich_table(
        "File sizes (ratio to the dense safetensors file of the same tensors)",
        ("model", "format", "file MiB", "x safetensors", "max rel L2 err", "target", "verdict"),
        left={"model", "format"},
    )
    for case, sizes in all_sizes.items():
        title = f"{CASE_TITLES[case]}\n{sizes['tensor_bytes'] / MIB:.0f} MiB of tensors"
        for i, (name, row) in enumerate(sizes["files"].items()):
            target = SIZE_TARGETS.get((case, name.removeprefix("slimtorch ")))
            error = row.get("max_rel_l2")
            table.add_row(
                title if i == 0 else "",
                name,
                f"{row['bytes'] / MIB:.1f}",
                f"{row['ratio']:.3f}",
                "-" if error is None else "0 (exact)" if error == 0 else f"{error:.2e}",
                "-" if target is None else f"<= {target:.2f}",
                "-" if target is None else verdict(row["ratio"] <= target),
                end_section=i == len(sizes["files"]) - 1,
            )
    console.print(table)
    for case, sizes in all_sizes.items():
        notes = []
        if "weight_zero_fraction" in sizes:
            notes.append(f"weights {100 * sizes['weight_zero_fraction']:.2f}% zeros")
        if "lossless_roundtrip_equal" in sizes:
            notes.append(f"lossless round trip equal: {sizes['lossless_roundtrip_equal']}")
        if notes:
            console.print(f"  {CASE_TITLES[case]}: {', '.join(notes)}")


# -- phase 3 and 4: throughput -------------------------------------------------------------------------------
def write_methods(case: str, state: dict[str, torch.Tensor], folder: Path) -> list[Method]:
    """slimtorch.save from memory and slimtorch.shrink from the dense file, per variant, plus the peers."""
    source = folder / "dense.safetensors"
    nbytes = tensor_bytes(state)
    methods = []

    def output(name: str) -> tuple[Path, Callable[[], None]]:
        path = folder / "out" / name
        return path, lambda: path.unlink(missing_ok=True)

    for variant in CASE_VARIANTS[case]:
        out, clear = output(f"save-{variant}.safetensors")
        options = slimtorch.ShrinkOptions(**VARIANTS[variant])

        def save(out: Path = out, options: slimtorch.ShrinkOptions = options) -> int:
            slimtorch.save(state, out, options)
            return nbytes

        methods.append(Method(case, "write", f"slimtorch.save {variant}", save, clear, ENCODE_TARGET_MB_S))
        out, clear = output(f"shrink-{variant}.safetensors")

        def shrink(out: Path = out, options: slimtorch.ShrinkOptions = options) -> int:
            slimtorch.shrink(source, out, options)
            return nbytes

        label = f"slimtorch.shrink {variant} (from file)"
        methods.append(Method(case, "write", label, shrink, clear, ENCODE_TARGET_MB_S))

    for label, writer, name in (
        ("peer: torch.save, no fsync", torch.save, "peer.pt"),
        ("peer: safetensors save_file, no fsync", safetensors.torch.save_file, "peer.safetensors"),
    ):
        out, clear = output(name)
        run = lambda writer=writer, out=out: writer(state, out) or nbytes  # noqa: E731
        methods.append(Method(case, "write", label, run, clear))
    return methods


def load_methods(case: str, folder: Path) -> list[Method]:
    """slimtorch.load of each slim file, and the peers on the dense files; every tensor touched."""
    methods = []
    for variant in CASE_VARIANTS[case]:
        path = folder / f"slim-{variant}.safetensors"
        target = DECODE_TARGET_MB_S if variant in DECODE_TARGETED else None
        run = lambda path=path: touch(slimtorch.load(path).tensors)  # noqa: E731
        methods.append(Method(case, "load", f"slimtorch.load {variant}", run, target=target))
    pt, st = folder / "dense.pt", folder / "dense.safetensors"
    methods.append(Method(case, "load", "peer: torch.load", lambda: touch(torch.load(pt, weights_only=True))))
    methods.append(
        Method(case, "load", "peer: safetensors load_file", lambda: touch(safetensors.torch.load_file(st)))
    )
    return methods


def time_rounds(methods: list[Method], runs: int) -> None:
    """A warm-up round, then ``runs`` rounds of every method in turn; fills each method's seconds."""
    for round_ in range(runs + 1):
        for method in methods:
            method.before()
            settle()
            start, cpu_start = time.perf_counter(), time.process_time()
            method.nbytes = method.run()
            elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
            gc.collect()
            if round_:
                method.seconds.append(elapsed)
                method.cpu_seconds.append(cpu)
        label = "warm-up" if round_ == 0 else f"round {round_}/{runs}"
        console.print(f"  {label} done", highlight=False)


def measure_throughput(case: str, state: dict[str, torch.Tensor], folder: Path, runs: int) -> list[Method]:
    (folder / "out").mkdir(exist_ok=True)
    methods = write_methods(case, state, folder) + load_methods(case, folder)
    console.print(f"timing {CASE_TITLES[case]}: {len(methods)} methods, 1 warm-up + {runs} rounds")
    time_rounds(methods, runs)
    shutil.rmtree(folder / "out", ignore_errors=True)
    return methods


def throughput_checks(methods: list[Method]) -> list[Check]:
    checks = []
    for method in methods:
        if method.target is not None:
            s = method.summary()
            name = f"{CASE_TITLES[method.case]}: {method.label} ({method.op})"
            checks.append(Check(name, s["mb_s"], method.target, "MB/s", at_most=False))
    return checks


def print_throughput(case: str, methods: list[Method], tensor_mib: float, runs: int) -> None:
    title = (
        f"Throughput, {CASE_TITLES[case]}, {tensor_mib:.0f} MiB of tensors: median of {runs} runs, "
        f"warm page cache, {torch.get_num_threads()} torch threads"
    )
    headers = (
        "op",
        "method",
        "MB in/out",
        "median s",
        "min-max s",
        "CPU s\n(median)",
        "MB/s\n(median)",
        "MB/s\n(best)",
        "target\nMB/s",
        "verdict",
    )
    table = rich_table(title, headers, left={"op", "method"})
    for i, method in enumerate(methods):
        s = method.summary()
        last_of_op = i + 1 == len(methods) or methods[i + 1].op != method.op
        table.add_row(
            "write (input)" if method.op == "write" else "load+touch (output)",
            method.label,
            f"{s['bytes'] / MB:,.0f}",
            f"{s['median_s']:.3f}",
            f"{s['min_s']:.2f}-{s['max_s']:.2f}",
            f"{s['cpu_median_s']:.2f}",
            f"{s['mb_s']:,.0f}",
            f"{s['best_mb_s']:,.0f}",
            "-" if method.target is None else f">= {method.target:,.0f}",
            "-" if method.target is None else verdict(s["mb_s"] >= method.target),
            end_section=last_of_op,
        )
    console.print(table)


# -- driver --------------------------------------------------------------------------------------------------
def benchmark(args: argparse.Namespace, workdir: Path) -> list[Check]:
    sizes: dict[str, Any] = {}
    throughput: dict[str, list[Method]] = {}
    tensor_mib: dict[str, float] = {}
    checks: list[Check] = []

    console.print(f"building the sparse MLP for sizes ({args.sizes_mib} MiB) ...")
    (folder := workdir / "sparse-sizes").mkdir()
    state = sparse_mlp(args.sizes_mib)
    sizes["sparse"] = measure_sizes("sparse", state, folder)
    del state
    shutil.rmtree(folder)
    gc.collect()

    console.print("building BERT-base ...")
    (bert_folder := workdir / "bert").mkdir()
    bert = bert_base()
    sizes["bert"] = measure_sizes("bert", bert, bert_folder)
    print_sizes(sizes)
    for case in sizes:
        checks += size_checks(case, sizes[case])

    console.print(f"building the sparse MLP for throughput ({args.size_mib} MiB) ...")
    (folder := workdir / "sparse-speed").mkdir()
    state = sparse_mlp(args.size_mib)
    speed_sizes = measure_sizes("sparse", state, folder)  # also writes the files the loads read
    throughput["sparse"] = measure_throughput("sparse", state, folder, args.runs)
    tensor_mib["sparse"] = tensor_bytes(state) / MIB
    del state
    shutil.rmtree(folder)
    gc.collect()

    throughput["bert"] = measure_throughput("bert", bert, bert_folder, args.runs)
    tensor_mib["bert"] = tensor_bytes(bert) / MIB
    del bert
    gc.collect()

    for case, methods in throughput.items():
        print_throughput(case, methods, tensor_mib[case], args.runs)
        checks += throughput_checks(methods)

    record = {
        "args": vars(args),
        "machine": machine(
            torch_threads=torch.get_num_threads(),
            safetensors=safetensors.__version__,
            slimtorch=slimtorch.__version__,
        ),
        "sizes": sizes,
        "sizes_at_throughput_size": speed_sizes,
        "throughput": {case: [m.summary() for m in methods] for case, methods in throughput.items()},
        "checks": [{**asdict(c), "ok": c.ok} for c in checks],
        "all_pass": all(c.ok for c in checks),
    }
    write_json(RESULTS, record)
    return checks


def report(checks: list[Check]) -> None:
    console.print("\nTargets:", style="bold")
    for check in checks:
        console.print(check.line(), style="green" if check.ok else "red", highlight=False)
    failed = [c for c in checks if not c.ok]
    summary = f"{len(checks) - len(failed)}/{len(checks)} targets pass"
    console.print(f"{summary}; failing: {len(failed)}" if failed else f"{summary}: all pass", style="bold")
    console.print(f"results: {RESULTS}", highlight=False)


def main() -> None:
    parser = argparse.ArgumentParser(
        prog=f"python -m {__spec__.name}",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--size-mib", type=float, default=1024, help="sparse MLP size for throughput (default 1024)"
    )
    parser.add_argument(
        "--sizes-mib", type=float, default=256, help="sparse MLP size for the size table (default 256)"
    )
    parser.add_argument("--runs", type=int, default=5, help="timed rounds after the warm-up (default 5)")
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's own choice)")
    parser.add_argument("--dir", help="parent of the temporary work folder (default: system temp)")
    parser.add_argument("--check", action="store_true", help="exit 1 when any target fails")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    workdir = Path(tempfile.mkdtemp(prefix="slimtorch-shrink-bench-", dir=args.dir))
    try:
        checks = benchmark(args, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    report(checks)
    sys.exit(exit_code(all(c.ok for c in checks), args.check))


if __name__ == "__main__":
    main()
