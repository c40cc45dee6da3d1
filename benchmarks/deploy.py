"""Benchmark: deployment bundles against shipping torch itself.

Run it with ``.venv/bin/python -m benchmarks.deploy`` (about 4 minutes on 2 cores, plus about 30 s once
to measure torch's own footprint, which is then cached; ``--check`` exits 1 when a target fails).

Three models, each exported with ``slimtorch.deploy.export`` to an ONNX bundle on 2 threads:

* ``digits CNN``: the CNN of examples/digits.py (8x8 images), fp32;
* ``BERT-base``: ``BertModel(BertConfig())`` (110 M parameters, random weights), 128 tokens, fp32;
* ``BERT-base pruned+int8``: the same, half of every prunable group removed by ``slimtorch.prune.channels``
  (attention heads and FFN channels), then ``slimtorch.quantize(..., "int8-dynamic")``: the bundle keeps
  its int8 weights (onnxruntime int8).

For each: export and verification time (median of ``--runs``), the largest difference from eager
PyTorch over the samples (fp32 target: 1e-4; quantized: within 10% of the output's largest magnitude),
the model file's bytes beside the parameters' bytes in PyTorch, and the runtime footprint:
``slimtorch.deploy.measure_footprint`` installs the bundle's requirements.txt alone in a fresh venv
(``pip install --no-compile``, as a deployment image does), runs its sample check there (no torch
installed; the bytecode it writes is counted) and weighs each installed package (pip and setuptools
aside). Once more for the first bundle as plain ``pip install`` leaves it (every module compiled to
bytecode). The peer is torch CPU measured the same two ways (``torch==<this version>`` alone in a
fresh venv, imported once). Targets: runtime <= 150 MB (about 870 MB for torch CPU), BERT-base export
+ verification < 60 s. MB here are 10^6 bytes.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from examples.digits import DigitsCNN
from torch import nn

import slimtorch
from benchmarks._harness import exit_code, print_checks, results_file, write_json
from slimtorch.deploy import export, measure_footprint, torch_baseline

RESULTS = results_file("deploy")
RUNTIME_LIMIT = 150 * 10**6
BERT_SECONDS = 60.0
MB = 1e6


def _bert() -> nn.Module:
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers.BertModel(transformers.BertConfig()).eval()


def _pruned_int8_bert() -> nn.Module:
    model = _bert()
    slimtorch.prune.channels(model, (_tokens(),), ratio=0.5)
    return slimtorch.quantize(model, "int8-dynamic").model


def _tokens() -> torch.Tensor:
    return torch.randint(0, 30522, (1, 128), generator=torch.Generator().manual_seed(0))


MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[], torch.Tensor]]] = {
    "digits CNN": (lambda: DigitsCNN().eval(), lambda: torch.randn(1, 1, 8, 8)),
    "BERT-base": (_bert, _tokens),
    "BERT-base pruned+int8": (_pruned_int8_bert, _tokens),
}


def measure(name: str, runs: int, work: Path) -> dict[str, Any]:
    make, example = MODELS[name]
    model, inputs = make(), example()
    bundle = work / name.replace(" ", "-").replace("+", "-")
    seconds, report = [], None
    for _ in range(runs):
        start = time.perf_counter()
        report = export(copy.deepcopy(model) if runs > 1 else model, inputs, bundle, dynamic_batch=True)
        seconds.append(time.perf_counter() - start)
    assert report is not None
    found = measure_footprint(bundle, baseline=False)
    return {
        "model": name,
        "export_verify_s": statistics.median(seconds),
        "export_verify_runs_s": seconds,
        "quantized": report.quantized,
        "max_abs_error": max(e.max_abs for e in report.errors),
        "max_rel_error": max(e.max_rel for e in report.errors),
        "tolerance": report.tolerance.meaning,
        "verified": report.passed,
        "model_file_bytes": report.model_bytes,
        "parameter_bytes": report.eager_bytes,
        "runtime_bytes": found.runtime_bytes,
        "runtime_packages": {p.name: p.bytes for p in found.packages},
        "sample_ok_without_torch": found.sample_ok,
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        prog=f"python -m {__spec__.name}",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--runs", type=int, default=3, help="exports timed per model (median)")
    parser.add_argument("--refresh-baseline", action="store_true", help="measure torch's footprint again")
    parser.add_argument("--check", action="store_true", help="exit 1 when a target fails")
    args = parser.parse_args()
    torch.set_num_threads(2)
    torch.manual_seed(0)
    torch_cpu = torch_baseline(refresh=args.refresh_baseline)
    torch_compiled = torch_baseline(refresh=args.refresh_baseline, compile_bytecode=True)
    with tempfile.TemporaryDirectory(prefix="slimtorch-deploy-bench-") as work:
        rows = [measure(name, args.runs, Path(work)) for name in args.models]
        first = Path(work) / args.models[0].replace(" ", "-").replace("+", "-")
        compiled = measure_footprint(first, baseline=False, compile_bytecode=True)
    for label, base in (("--no-compile", torch_cpu), ("plain pip, compiled", torch_compiled)):
        when = "cached" if base.cached else "measured now"
        print(
            f"torch CPU, {base.requirement} alone in a fresh venv, {label} ({when}, {base.measured_at[:10]}):"
        )
        print("  " + ", ".join(f"{p.name} {p.bytes / MB:.1f}" for p in base.packages) + " MB")
    header = (
        f"\n{'model':24} {'runtime MB':>10} {'torch CPU MB':>12} {'ratio':>7} {'model file MB':>13} "
        f"{'params MB':>9} {'max abs err':>11} {'max rel err':>11} {'export+verify s':>15}"
    )
    print(header)
    for row in rows:
        print(
            f"{row['model']:24} {row['runtime_bytes'] / MB:10.1f} {torch_cpu.runtime_bytes / MB:12.1f} "
            f"{row['runtime_bytes'] / torch_cpu.runtime_bytes:6.3f}x {row['model_file_bytes'] / MB:13.1f} "
            f"{row['parameter_bytes'] / MB:9.1f} {row['max_abs_error']:11.2e} {row['max_rel_error']:11.2e} "
            f"{row['export_verify_s']:15.1f}"
        )
    print("\nruntime: " + ", ".join(f"{k} {v / MB:.1f} MB" for k, v in rows[0]["runtime_packages"].items()))
    print(
        f"as plain pip installs it (every module compiled): runtime {compiled.runtime_bytes / MB:.1f} MB "
        f"against torch CPU {torch_compiled.runtime_bytes / MB:.1f} MB "
        f"({compiled.runtime_bytes / torch_compiled.runtime_bytes:.3f}x)"
    )
    checks = []
    for row in rows:
        name = row["model"]
        checks.append(
            (
                f"{name}: runtime <= 150 MB",
                row["runtime_bytes"] <= RUNTIME_LIMIT,
                f"{row['runtime_bytes'] / MB:.1f} MB",
            )
        )
        checks.append(
            (f"{name}: sample runs in the bundle's venv, no torch", row["sample_ok_without_torch"], "")
        )
        if row["quantized"]:
            checks.append((f"{name}: within the int8 tolerance", row["verified"], row["tolerance"]))
        else:
            checks.append(
                (f"{name}: within 1e-4 of eager", row["max_abs_error"] <= 1e-4, f"{row['max_abs_error']:.2e}")
            )
        if name.startswith("BERT-base"):
            checks.append(
                (
                    f"{name}: export + verify < 60 s",
                    row["export_verify_s"] < BERT_SECONDS,
                    f"{row['export_verify_s']:.1f} s",
                )
            )
    print()
    passed = print_checks(checks)
    results = {
        "torch_cpu": torch_cpu.to_dict(),
        "torch_cpu_compiled": torch_compiled.to_dict(),
        "runtime_compiled_bytes": compiled.runtime_bytes,
        "rows": rows,
    }
    write_json(RESULTS, results)
    print(f"\nwrote {RESULTS}")
    return exit_code(passed, args.check)


if __name__ == "__main__":
    sys.exit(main())
