"""Benchmark: a training step's peak memory, estimated on fake tensors against measured on real ones.

Run it with ``.venv/bin/python benchmarks/memory.py`` (about 2 minutes; ``--check`` exits 1 when a target
fails). For each zoo model, batch size and mode (train with AdamW, inference) it prints:

* ``estimate``: ``slimtorch.memory.estimate(..., device="cpu")``, fake tensors, no real memory used;
* ``measured``: ``slimtorch.memory.profile(...)``, the same step run for real (after one warm-up step),
  as the C library's heap counts it (bytes in use, read after every op, from before the step made its
  weights and inputs): an allocator-level figure that also sees what no tensor shows (kernel scratch,
  autograd's own records);
* the ratio, and PASS when it is within 10%.

Then it estimates a 7B-parameter Llama (``LlamaConfig`` of Llama-2-7B, built on the meta device) for
batch 1, sequence 2048, AdamW, bf16-mixed, on CUDA, in a fresh process, and reports its wall time and the
process's peak resident memory (``VmHWM``; targets: < 60 s, < 2 GB).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))
from tests.zoo import UNet, resnet18  # noqa: E402

import slimtorch.memory as memory  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "memory.json"
TOLERANCE = 0.10
BATCHES = (4, 16, 32)


def _transformers():
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers


def bert() -> nn.Module:
    t = _transformers()
    config = t.BertConfig(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=1024)
    return t.BertModel(config)


def gpt2() -> nn.Module:
    t = _transformers()
    return t.GPT2LMHeadModel(t.GPT2Config(n_embd=256, n_layer=4, n_head=4, n_positions=256))


def llama() -> nn.Module:
    t = _transformers()
    config = t.LlamaConfig(
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=8000,
    )
    return t.LlamaForCausalLM(config)


ZOO: dict[str, tuple[Callable[[], nn.Module], Callable[[int], torch.Tensor]]] = {
    "resnet18": (resnet18, lambda b: torch.randn(b, 3, 64, 64)),
    "unet": (UNet, lambda b: torch.randn(b, 3, 64, 64)),
    "bert": (bert, lambda b: torch.randint(0, 30522, (b, 128))),
    "gpt2": (gpt2, lambda b: torch.randint(0, 50257, (b, 128))),
    "llama": (llama, lambda b: torch.randint(0, 8000, (b, 128))),
}

LLAMA_7B = textwrap.dedent(
    """
    import json, sys, time
    sys.path.insert(0, {src!r})

    def high_water():
        # this process's own peak resident memory (getrusage's ru_maxrss keeps the parent's across exec)
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024

    import torch, transformers
    import slimtorch.memory as memory
    transformers.logging.set_verbosity_error()
    start = time.perf_counter()
    config = transformers.LlamaConfig(
        hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096,
    )
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    tokens = torch.zeros(1, 2048, dtype=torch.long)
    report = memory.estimate(model, tokens, optimizer="adamw", precision="bf16-mixed", device="cuda")
    step = report.steps[0]
    print(json.dumps({{
        "seconds": time.perf_counter() - start,
        "max_rss_bytes": high_water(),
        "parameters": sum(p.numel() for p in model.parameters()),
        "peak_bytes": step.peak_bytes, "peak_phase": step.peak_phase,
        "breakdown": step.breakdown, "phases": step.phases,
    }}))
    """
)


def compare(name: str, mode: str) -> list[dict[str, Any]]:
    factory, inputs = ZOO[name]
    torch.manual_seed(0)
    model = factory().train()
    example = inputs(BATCHES[0])
    estimated = memory.estimate(model, example, batch_sizes=BATCHES, mode=mode, device="cpu")
    # one untimed real step first: libraries allocate their own buffers once, on first use (a training
    # loop's first step pays that, every later step does not)
    memory.profile(model, example, mode=mode, device="cpu")
    measured = memory.profile(model, example, batch_sizes=BATCHES, mode=mode, device="cpu")
    rows = []
    for guess, real in zip(estimated.steps, measured.steps, strict=True):
        ratio = guess.peak_bytes / real.allocator_peak_bytes if real.allocator_peak_bytes else float("nan")
        rows.append(
            {
                "model": name,
                "mode": mode,
                "batch": guess.batch_size,
                "estimate_bytes": guess.peak_bytes,
                "measured_bytes": real.allocator_peak_bytes,
                "measured_tensor_bytes": real.peak_bytes,
                "ratio": ratio,
                "peak_phase": guess.peak_phase,
            }
        )
    return rows


def llama_7b() -> dict[str, Any]:
    script = LLAMA_7B.format(src=str(ROOT / "src"))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    if done.returncode:
        raise SystemExit(f"the 7B estimate failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", nargs="+", default=list(ZOO), choices=list(ZOO))
    parser.add_argument("--skip-7b", action="store_true", help="leave out the 7B-parameter Llama estimate")
    parser.add_argument("--check", action="store_true", help="exit 1 when a target fails")
    args = parser.parse_args()
    torch.set_num_threads(2)
    rows = [row for name in args.models for mode in ("train", "inference") for row in compare(name, mode)]
    print(f"{'model':10} {'mode':10} {'batch':>5} {'estimate':>12} {'measured':>12} {'ratio':>7}  within 10%")
    for row in rows:
        ok = abs(row["ratio"] - 1) <= TOLERANCE
        print(
            f"{row['model']:10} {row['mode']:10} {row['batch']:>5} {row['estimate_bytes'] / 2**20:10.1f}Mi "
            f"{row['measured_bytes'] / 2**20:10.1f}Mi {row['ratio']:7.3f}  {'PASS' if ok else 'FAIL'}"
        )
    checks = [
        (
            f"estimate within {TOLERANCE:.0%} of measured: {len(rows)} cases",
            all(abs(r["ratio"] - 1) <= TOLERANCE for r in rows),
            f"worst ratio {max(rows, key=lambda r: abs(r['ratio'] - 1))['ratio']:.3f}",
        )
    ]
    big = None if args.skip_7b else llama_7b()
    if big is not None:
        print(
            f"\nLlama 7B ({big['parameters'] / 1e9:.2f} B parameters), batch 1 x 2048, AdamW, bf16-mixed, "
            f"CUDA: peak {big['peak_bytes'] / 2**30:.1f} GiB in the {big['peak_phase']} phase"
        )
        print("  " + ", ".join(f"{k} {v / 2**30:.1f} GiB" for k, v in big["breakdown"].items() if v))
        checks.append(("7B estimate in < 60 s", big["seconds"] < 60, f"{big['seconds']:.1f} s"))
        checks.append(
            ("7B estimate in < 2 GB RAM", big["max_rss_bytes"] < 2e9, f"{big['max_rss_bytes'] / 1e9:.2f} GB")
        )
    print()
    for label, ok, value in checks:
        print(f"{'PASS' if ok else 'FAIL'}  {label}: {value}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"rows": rows, "llama_7b": big}, indent=2))
    print(f"\nwrote {RESULTS}")
    return 1 if args.check and not all(ok for _, ok, _ in checks) else 0


if __name__ == "__main__":
    sys.exit(main())
