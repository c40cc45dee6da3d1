"""Benchmark: int8 LSTM / GRU on the CPU against fp32 and torch.ao, each measured in fresh processes.

Run it with ``.venv/bin/python -m benchmarks.recurrent`` (27 minutes on this shared 2-core machine under
load 4 to 9, two-thread runs the slowest; ``--processes``, ``--rounds``, ``--help``). It prints
one table per model and thread count, one PASS/FAIL line per target of issue 21, and writes every
measurement to benchmarks/results/recurrent.json. ``--check`` exits 1 when a target fails.

Models (nothing is downloaded):

* ``lstm``: ``nn.LSTM(768, 768, num_layers=3, batch_first=True)`` with torch's random initialisation
  (seed 0, the same weights in every process), input ``randn(batch, 64, 768)``: 64 steps.
* ``gru``: the same shapes as an ``nn.GRU``.
* ``resemblyzer`` (when the package is installed, as in the wild suite): its trained speaker encoder (a
  3-layer ``nn.LSTM(40, 256)``, Linear, ReLU, L2 norm; tests/wild's re-implementation with the package's
  own weights) on partial utterances of 160 frames x 40 mel bands made by resemblyzer's preprocessing
  of synthetic voices (``tests.wild.inputs.speaker_partials``).

Methods: ``fp32``; ``slimtorch int8-dynamic`` (``slimtorch.quantize(model, "int8-dynamic",
calibration=[x])``, its defaults: a layer whose error would dominate stays float); ``torch.ao
quantize_dynamic`` with ``{nn.LSTM, nn.GRU, nn.Linear}`` and ``qint8`` (deprecated; its warnings are
silenced).

slimtorch picks its kernel (``quantized_rnn``, torch's int8 RNN on our codes, or ``dequantize``, the float
RNN) by timing on first use, once per process: so each (model, threads) cell runs in ``--processes`` fresh
processes, and the table counts which kernel each process chose at each batch size, with the ratio it
measured. In a process: the three methods are built, each called once per batch size (slimtorch's choice is
made there), then ``--rounds`` rounds each call every method once per batch size, in turns. Per process,
"x fp32" and "vs ao" are the medians over rounds of the paired ratios (fp32's time over ours; ours over
torch.ao's in the same round); across processes the table shows the median with [min..max]. Cosine: of the
output sequence (``resemblyzer``: the embedding) with fp32's, per sequence of the batch of 16, the worst.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import warnings
from collections import Counter
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import slimtorch
from benchmarks._harness import (
    child_command,
    child_json,
    emit,
    exit_code,
    interleaved,
    load_average,
    paired_ratio,
    print_checks,
    results_file,
    spread,
    summary,
    write_json,
)
from slimtorch.quant import kernels

RESULTS = results_file("recurrent")
WIDTH, LAYERS, STEPS = 768, 3, 64
METHODS = ("fp32", "slimtorch int8-dynamic", "torch.ao quantize_dynamic")
SPEEDUP_TARGET, COSINE_TARGET = 1.5, 0.99
AO_ALLOWANCE = 1.05  # "as fast as torch.ao": the paired ratio within 5%, the noise of pairs on this machine


class Sequence(nn.Module):
    """An LSTM / GRU whose output is its output sequence (the state is dropped): the module quantized."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.rnn = getattr(nn, mode)(WIDTH, WIDTH, LAYERS, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rnn(x)[0]


def build(model: str) -> tuple[nn.Module, torch.Tensor]:
    """The float model and an input batch of 16 (the first row is the batch of 1), the same every time."""
    torch.manual_seed(0)
    if model in ("lstm", "gru"):
        return Sequence(model.upper()).eval(), torch.randn(16, STEPS, WIDTH)
    from tests.wild.classes import voice_encoder_original
    from tests.wild.inputs import speaker_partials

    mels = torch.cat([speaker_partials(seed=seed) for seed in range(8)])  # 16 x (160 frames, 40 mels)
    return voice_encoder_original().eval(), mels


def resemblyzer_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("resemblyzer") is not None


def methods(base: nn.Module, x: torch.Tensor) -> dict[str, nn.Module]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the peer is deprecated and says so
        peer = torch.ao.quantization.quantize_dynamic(
            copy.deepcopy(base), {nn.LSTM, nn.GRU, nn.Linear}, dtype=torch.qint8
        )
    ours = slimtorch.quantize(copy.deepcopy(base), "int8-dynamic", calibration=[x[:4]]).model
    return dict(zip(METHODS, (base, ours, peer), strict=True))


def child(spec: dict[str, Any]) -> dict[str, Any]:
    """One process's measurement of one model at one thread count (see the module docstring)."""
    torch.set_num_threads(spec["threads"])
    base, x = build(spec["model"])
    made = methods(base, x)
    out: dict[str, Any] = {"cosine": {}, "kernels": {}, "ms": {}, "x fp32": {}, "vs ao": {}}
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = made["fp32"](x)
        for method, model in made.items():
            got = model(x)  # the batch of 16: slimtorch times its kernels for this batch size here
            out["cosine"][method] = float(F.cosine_similarity(got.flatten(1), reference.flatten(1)).min())
        for batch in spec["batches"]:
            calls = {method: (lambda m=model, b=x[:batch]: m(b)) for method, model in made.items()}
            for run in calls.values():
                run()  # warm-up; slimtorch's kernel choice for this batch size, if not made above
            out["kernels"][str(batch)] = recurrent_choices(batch)
            times = interleaved(calls, spec["rounds"])
            fp32, ours, peer = (times[m] for m in METHODS)
            out["ms"][str(batch)] = {m: statistics.median(t) * 1e3 for m, t in times.items()}
            out["x fp32"][str(batch)] = paired_ratio(fp32, ours)
            out["vs ao"][str(batch)] = paired_ratio(ours, peer)
    return out


def recurrent_choices(batch: int) -> list[dict[str, Any]]:
    """What this process chose for its LSTM / GRU layers at ``batch`` rows, and the ratio it measured."""
    bucket = kernels.batch_bucket(batch)
    return [
        {**decision.to_dict(), "describe": decision.describe()}
        for key, decision in kernels.CHOICES.decisions().items()
        if key[0] == "Int8DynamicRecurrent" and key[-4] == bucket  # (..., bucket, dtype, device, threads)
    ]


def in_processes(spec: dict[str, Any], processes: int) -> list[dict[str, Any]]:
    """``child(spec)`` in ``processes`` fresh Python processes, one after another."""
    command = child_command(__spec__.name, "--child", json.dumps(spec))
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return [
        child_json(command, what=f"{spec['model']}, {spec['threads']} thread(s)", env=env)
        for _ in range(processes)
    ]


def aggregate(runs: list[dict[str, Any]], batches: list[int]) -> dict[str, Any]:
    """The processes' measurements as medians with [min..max], and how many processes chose each kernel."""
    rows: dict[str, Any] = {"processes": len(runs), "load": os.getloadavg()[0]}
    for method in METHODS:
        rows[method] = {"cosine_min": min(r["cosine"][method] for r in runs)}
        for b in map(str, batches):
            rows[method][f"batch {b} ms"] = summary([r["ms"][b][method] for r in runs])
    for b in map(str, batches):
        rows[f"batch {b} x fp32"] = summary([r["x fp32"][b] for r in runs])
        rows[f"batch {b} vs ao"] = summary([r["vs ao"][b] for r in runs])
        rows[f"batch {b} ao x fp32"] = summary(
            [r["ms"][b]["fp32"] / r["ms"][b]["torch.ao quantize_dynamic"] for r in runs]
        )
        choices = [choice for r in runs for choice in r["kernels"][b]]
        rows[f"batch {b} kernels"] = dict(Counter(choice["kernel"] for choice in choices))
        rows[f"batch {b} choices"] = [choice["describe"] for choice in choices]
        rows[f"batch {b} measured ratio"] = summary([choice["ratio"] for choice in choices] or [1.0])
    return rows


def print_table(title: str, rows: dict[str, Any], batches: list[int]) -> None:
    print(f"\n{title}  ({rows['processes']} processes; {load_average()})")
    header = "".join(f"{f'batch {b} ms [min..max]':>28}" for b in batches)
    print(f"  {'method':28}{header} {'cosine min':>11}")
    for method in METHODS:
        cells = "".join(f"{spread(rows[method][f'batch {b} ms'], 1):>28}" for b in batches)
        print(f"  {method:28}{cells} {rows[method]['cosine_min']:11.5f}")
    for b in batches:
        print(
            f"  batch {b}: slimtorch {spread(rows[f'batch {b} x fp32'])}x fp32, "
            f"torch.ao {spread(rows[f'batch {b} ao x fp32'])}x fp32, "
            f"slimtorch / torch.ao time {spread(rows[f'batch {b} vs ao'])}; "
            f"kernels chosen: {rows[f'batch {b} kernels']}, "
            f"measured {spread(rows[f'batch {b} measured ratio'])}x the other"
        )


def targets(results: dict[str, Any]) -> list[tuple[str, bool, str]]:
    """Issue 21's recurrent line for the LSTM (and the GRU beside it), and the torch.ao comparison."""
    checks = []
    for model in ("lstm", "gru"):
        for threads, rows in results.get(model, {}).items():
            speed, ratio = rows["batch 1 x fp32"], rows["batch 1 vs ao"]
            cosine = rows["slimtorch int8-dynamic"]["cosine_min"]
            name = f"{model.upper()} 3 x {WIDTH}, {threads} thread(s), batch 1"
            checks += [
                (
                    f"{name}: int8 >= {SPEEDUP_TARGET}x fp32 in every process",
                    speed["min"] >= SPEEDUP_TARGET,
                    f"{spread(speed)}x",
                ),
                (f"{name}: cosine >= {COSINE_TARGET}", cosine >= COSINE_TARGET, f"{cosine:.5f}"),
                (
                    f"{name}: as fast as torch.ao (time ratio median <= {AO_ALLOWANCE})",
                    ratio["median"] <= AO_ALLOWANCE,
                    f"{spread(ratio)}",
                ),
            ]
    for threads, rows in results.get("resemblyzer", {}).items():
        cosine = rows["slimtorch int8-dynamic"]["cosine_min"]
        checks.append(
            (
                f"resemblyzer, {threads} thread(s): embedding cosine >= {COSINE_TARGET}",
                cosine >= 0.99,
                f"{cosine:.5f}",
            )
        )
    return checks


def main() -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["lstm", "gru", "resemblyzer"])
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 16])
    parser.add_argument("--processes", type=int, default=4, help="fresh processes per model and threads")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds per process")
    parser.add_argument("--check", action="store_true", help="exit 1 when a target fails")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        emit(child(json.loads(args.child)))
        return 0
    if "resemblyzer" in args.models and not resemblyzer_installed():
        print("resemblyzer is not installed: its row is left out")
        args.models.remove("resemblyzer")
    results: dict[str, Any] = {}
    for model in args.models:
        for threads in args.threads:
            spec = {"model": model, "threads": threads, "batches": args.batches, "rounds": args.rounds}
            rows = aggregate(in_processes(spec, args.processes), args.batches)
            results.setdefault(model, {})[str(threads)] = rows
            print_table(f"{model}, {threads} thread(s)", rows, args.batches)
    checks = targets(results)
    print()
    passed = print_checks(checks)
    write_json(RESULTS, {"results": results, "targets": checks, "argv": sys.argv[1:]}, indent=1)
    return exit_code(passed, args.check)


if __name__ == "__main__":
    sys.exit(main())
