"""Benchmark: slimtorch at language-model scale, on Llama-shaped bf16 checkpoints of 1, 4 and 16 GB.

Run it with ``.venv/bin/python benchmarks/scale.py`` (1 and 4 GB: about 25 minutes on 2 cores; ``--large``
adds the 16 GB file, ``--sizes 1`` runs one size, ``--cases`` a few rows). It writes each file once
(Llama-2-7B's shapes: hidden 4096, MLP 11008, vocabulary 32000, bf16 weights drawn from N(0, 0.02); the layer
count sets the size, so the 16 GB file is a 38-layer, 7.9B-parameter model), then times every case in a fresh
process, ``--runs`` rounds (default 3), each round starting one case further down the list. It prints one
table per size and the targets' PASS/FAIL lines, and writes every measurement to
benchmarks/results/scale.json. The exit code is 0 even when a target fails (this is a report); ``--check``
makes it 1 then.

Cases (each reads the same file; the page cache holds it warm, as a file just written or read is):

* ``read + write``: the file's bytes read in 64 MiB chunks and written to a new file, fsynced: the least a
  lossless rewrite costs. ``slimtorch shrink (lossless)`` is judged against it (<= 1.5x).
* ``plain int8 loop`` / ``plain int4 loop``: the anchor a quantizer cannot beat by much: each tensor read with
  safetensors, its matrices quantized a block of rows at a time with torch (int8: a symmetric scale per row;
  int4: min/max groups of 32, shrink's group size, round to nearest, no search), the codes and scales written
  to one file, fsynced. ``slimtorch shrink --scheme int8-weight`` is judged against the first (<= 1.5x),
  ``int4-weight`` (which searches each group's clipping) against the second (<= 3x).
* ``slimtorch inspect``: the breakdown of the file, shown without a target.
* torchao ``quantize_`` (int8 weight-only) on the model loaded by transformers, where torchao is installed:
  the way a torch user gets an int8 model today, shown without a target (its output is a model, not a file).

Measured per case: wall time (median, and the spread min-max), CPU time of the child (all its threads), and
peak RssAnon: the child's anonymous resident memory, sampled every 10 ms by this process (the page cache and
the file's mapped pages are not in it). Every shrink must stay within 1.5 GiB of it at every size.

With ``--generate`` (the 1 GB size): the folder's int4 file is made once with ``slimtorch quantize
--scheme int4-weight --layout slim`` (about 8 minutes here), then ``slimtorch load_model`` into a
``LlamaForCausalLM`` built from the config and ``generate`` at batch 1 (time to ready, first token cold,
tokens per second once warm, peak RSS) against torchao's CPU int4 path (``PrototypeInt4WeightOnlyConfig`` on
the bf16 model transformers loads), without targets.

Not measured here yet: an 8B-class int4 file, onnxruntime's ``MatMulNBits`` at this scale, and ``--device
cuda`` (not built: no CUDA number is claimed anywhere).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results" / "scale.json"
GIB = 1 << 30
MIB = 1 << 20
HIDDEN, MLP, VOCAB = 4096, 11008, 32000
RSS_LIMIT = 1.5 * GIB
JUDGED_SIZE = 4  # GB: the size the time targets are judged at (the largest run if smaller)
TIME_TARGETS = {  # case -> (anchor, largest ratio)
    "slimtorch shrink (lossless)": ("read + write", 1.5),
    "slimtorch shrink int8-weight": ("plain int8 loop", 1.5),
    "slimtorch shrink int4-weight": ("plain int4 loop", 3.0),
}
SHRINKS = [case for case in TIME_TARGETS]

# -- the files ---------------------------------------------------------------------------------------------
LAYER_BYTES = 2 * (4 * HIDDEN * HIDDEN + 3 * HIDDEN * MLP + 2 * HIDDEN)
EMBED_BYTES = 2 * 2 * VOCAB * HIDDEN + 2 * HIDDEN


def layers_for(gigabytes: float) -> int:
    """Llama-2-7B-shaped layers that bring embeddings + layers nearest ``gigabytes`` (10^9 bytes)."""
    return max(1, round((gigabytes * 1e9 - EMBED_BYTES) / LAYER_BYTES))


def tensor_shapes(layers: int) -> list[tuple[str, tuple[int, ...]]]:
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (VOCAB, HIDDEN))]
    for i in range(layers):
        prefix = f"model.layers.{i}."
        shapes += [(f"{prefix}self_attn.{p}_proj.weight", (HIDDEN, HIDDEN)) for p in "qkvo"]
        shapes += [
            (f"{prefix}mlp.gate_proj.weight", (MLP, HIDDEN)),
            (f"{prefix}mlp.up_proj.weight", (MLP, HIDDEN)),
            (f"{prefix}mlp.down_proj.weight", (HIDDEN, MLP)),
            (f"{prefix}input_layernorm.weight", (HIDDEN,)),
            (f"{prefix}post_attention_layernorm.weight", (HIDDEN,)),
        ]
    return [*shapes, ("model.norm.weight", (HIDDEN,)), ("lm_head.weight", (VOCAB, HIDDEN))]


def config(layers: int) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": MLP,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "num_hidden_layers": layers,
        "vocab_size": VOCAB,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
    }


def write_checkpoint(folder: Path, gigabytes: float) -> Path:
    """A Llama folder (config.json, model.safetensors) of about ``gigabytes``, written a tensor at a time
    (memory: one tensor); reused when it is already there."""
    import torch

    layers = layers_for(gigabytes)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "model.safetensors"
    shapes = tensor_shapes(layers)
    header, offset = {}, 0
    for name, shape in shapes:
        nbytes = 2 * int(torch.Size(shape).numel())
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header).encode()
    raw += b" " * (-(8 + len(raw)) % 8)
    if path.exists() and path.stat().st_size == 8 + len(raw) + offset:
        return path
    (folder / "config.json").write_text(json.dumps(config(layers), indent=2))
    generator = torch.Generator().manual_seed(0)
    staged = path.with_suffix(".partial")
    with open(staged, "wb") as stream:
        stream.write(struct.pack("<Q", len(raw)) + raw)
        for _, shape in shapes:
            if len(shape) == 2:
                value = torch.randn(shape, generator=generator).mul_(0.02).to(torch.bfloat16)
            else:
                value = torch.ones(shape, dtype=torch.bfloat16)
            stream.write(value.view(torch.int16).numpy().tobytes())
            if sys.stdout.isatty():
                print(f"\r  writing {path}: {stream.tell() / 1e9:.2f} GB", end="", flush=True)
        stream.flush()
        os.fsync(stream.fileno())
    staged.rename(path)
    print()
    return path


# -- the cases, each run in a fresh child ------------------------------------------------------------------
def read_write(source: str, out: str) -> None:
    with open(source, "rb") as reader, open(out, "wb") as writer:
        while chunk := reader.read(64 * MIB):
            writer.write(chunk)
        writer.flush()
        os.fsync(writer.fileno())


def plain_loop(source: str, out: str, bits: int, group: int = 32) -> None:
    """Round to nearest, streaming: each matrix a block of rows at a time, codes and scales to one file."""
    import torch
    from safetensors import safe_open

    def put(tensor: Any) -> None:
        writer.write(tensor.contiguous().view(torch.uint8).numpy().tobytes())

    with safe_open(source, "pt") as reader, open(out, "wb") as writer:
        for name in reader.keys():  # noqa: SIM118 (safe_open has no __iter__)
            weight = reader.get_tensor(name)
            if weight.dim() != 2:
                put(weight)
                continue
            step = max(1, (1 << 22) // weight.shape[1])
            for start in range(0, weight.shape[0], step):
                rows = weight[start : start + step].float()
                if bits == 8:
                    scale = rows.abs().amax(dim=1, keepdim=True).div_(127)
                    put(rows.div_(scale).round_().clamp_(-127, 127).to(torch.int8))
                    put(scale)
                    continue
                groups = rows.reshape(-1, group)
                low, high = groups.aminmax(dim=1, keepdim=True)
                scale = (high - low).div_(15)
                codes = groups.sub_(low).div_(scale).round_().clamp_(0, 15).to(torch.uint8).reshape(-1)
                put(codes[0::2] | (codes[1::2] << 4))
                put(scale.half())
                put(low.half())
        writer.flush()
        os.fsync(writer.fileno())


def torchao_int8(folder: str) -> None:
    import torch
    from torchao.quantization import Int8WeightOnlyConfig, quantize_
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    quantize_(model, Int8WeightOnlyConfig())


GENERATE_PROMPT, GENERATE_NEW = 16, 16


def generation(case: str, folder: str) -> dict[str, float]:
    """Time to a ready model, the first token (cold: the first call of each shape pays for any kernel
    choice) and the steady rate of the next tokens of ``generate`` at batch 1: slimtorch's int4 file
    (``slimtorch quantize --scheme int4-weight --layout slim`` of the folder) loaded into a
    ``LlamaForCausalLM`` built from the config, or torchao's CPU int4 path on the bf16 model."""
    import torch
    from transformers import AutoConfig, LlamaForCausalLM

    started = time.perf_counter()
    config = AutoConfig.from_pretrained(folder)
    config.dtype = torch.bfloat16
    if case.startswith("slimtorch"):
        import slimtorch

        model = slimtorch.load_model(quantized_file(Path(folder)), lambda: LlamaForCausalLM(config)).model
    else:
        from torchao.prototype.quantization.int4 import PrototypeInt4WeightOnlyConfig
        from torchao.quantization import quantize_

        model = LlamaForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
        quantize_(model, PrototypeInt4WeightOnlyConfig(group_size=128, set_inductor_config=False))
    model.eval()
    ready = time.perf_counter() - started
    ids = torch.randint(0, VOCAB, (1, GENERATE_PROMPT), generator=torch.Generator().manual_seed(0))

    def timed(new: int) -> float:
        begun = time.perf_counter()
        model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False)
        return time.perf_counter() - begun

    with torch.no_grad():
        first = timed(1)
        timed(2)  # the first decoding step's shape, once
        prefill, whole = timed(1), timed(GENERATE_NEW + 1)
    return {"ready_s": ready, "first_token_s": first, "tokens_per_s": GENERATE_NEW / (whole - prefill)}


def quantized_file(folder: Path) -> Path:
    return folder / "int4-slim.safetensors"


def run_case(case: str, folder: str, out: str) -> None:
    source = str(Path(folder) / "model.safetensors")
    if case == "read + write":
        read_write(source, out)
    elif case == "plain int8 loop":
        plain_loop(source, out, 8)
    elif case == "plain int4 loop":
        plain_loop(source, out, 4)
    elif case == "slimtorch inspect":
        import slimtorch

        slimtorch.inspect(source)
    elif case.startswith("slimtorch shrink"):
        import slimtorch

        scheme = case.split()[-1]
        quantize = None if scheme == "(lossless)" else scheme.split("-")[0]
        slimtorch.shrink(source, out + ".safetensors", quantize=quantize)
    elif case == "torchao quantize_ int8":
        torchao_int8(folder)
    elif case in GENERATE_CASES:
        print(json.dumps(generation(case, folder)))
    else:
        raise SystemExit(f"unknown case {case!r}")


CASES = [
    "read + write",
    "slimtorch shrink (lossless)",
    "plain int8 loop",
    "slimtorch shrink int8-weight",
    "plain int4 loop",
    "slimtorch shrink int4-weight",
    "slimtorch inspect",
    "torchao quantize_ int8",
]
GENERATE_CASES = ["slimtorch load_model int4 + generate", "torchao int4 + generate"]


def prepare_quantized(folder: Path) -> Path:
    """The folder's int4 slim file, made once by ``slimtorch quantize`` (its layers come back quantized)."""
    path = quantized_file(folder)
    if not path.exists():
        print(f"  making {path} with slimtorch quantize (once)", flush=True)
        command = [sys.executable, "-m", "slimtorch", "quantize", str(folder), "-o", str(path)]
        subprocess.run([*command, "--scheme", "int4-weight", "--layout", "slim"], check=True)
    return path


def anon_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def measure(case: str, folder: Path, scratch: Path) -> dict[str, Any]:
    """One fresh process running ``case``: wall and CPU seconds, peak RssAnon (sampled every 10 ms)."""
    out = scratch / "out"
    command = [sys.executable, __file__, "--child", case, "--folder", str(folder), "--out", str(out)]
    started = time.perf_counter()
    # the child's output goes to files, read after it ends: a pipe would fill (64 KiB of a library's
    # warnings) and block the child while this process waits for it
    stdout_file = tempfile.TemporaryFile("w+")  # noqa: SIM115 (closed once read, below)
    stderr_file = tempfile.TemporaryFile("w+")  # noqa: SIM115
    child = subprocess.Popen(command, stdout=stdout_file, stderr=stderr_file, text=True)
    peak, done = 0, threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, anon_bytes(child.pid))
            time.sleep(0.01)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    _, status, usage = os.wait4(child.pid, 0)
    wall = time.perf_counter() - started
    done.set()
    sampler.join()
    stdout_file.seek(0)
    stderr_file.seek(0)
    stdout, stderr = stdout_file.read(), stderr_file.read()
    stdout_file.close()
    stderr_file.close()
    extra = json.loads(stdout.strip().splitlines()[-1]) if stdout.strip().startswith("{") else {}
    child.returncode = os.waitstatus_to_exitcode(status)
    for leftover in scratch.iterdir():
        shutil.rmtree(leftover) if leftover.is_dir() else leftover.unlink()
    os.sync()  # untimed: the next case does not pay for this one's writeback
    if child.returncode:
        return {"error": stderr.strip().splitlines()[-1] if stderr.strip() else f"exit {child.returncode}"}
    return {
        "wall_s": wall,
        "cpu_s": usage.ru_utime + usage.ru_stime,
        "peak_anon": peak,
        **extra,
        "peak_rss": usage.ru_maxrss * 1024,
    }


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    good = [r for r in runs if "wall_s" in r]
    if not good:
        return {"error": runs[0].get("error", "no run")}
    walls = [r["wall_s"] for r in good]
    return {
        "wall_s": statistics.median(walls),
        "min_s": min(walls),
        "max_s": max(walls),
        "cpu_s": statistics.median(r["cpu_s"] for r in good),
        "peak_anon": max(r["peak_anon"] for r in good),
        "peak_rss": max(r["peak_rss"] for r in good),
        "runs": len(good),
        **{
            key: statistics.median(r[key] for r in good)
            for key in ("ready_s", "first_token_s", "tokens_per_s")
            if key in good[0]
        },
    }


def table(size: float, file_bytes: int, rows: dict[str, dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    out = Table(title=f"Llama-shaped bf16 file of {file_bytes / 1e9:.2f} GB ({size:g} GB asked)")
    for column in ("case", "median s", "spread s", "CPU s", "GB/s", "peak RssAnon", "vs anchor"):
        out.add_column(column, justify="left" if column == "case" else "right")
    for case, row in rows.items():
        if "error" in row:
            out.add_row(case, "-", "-", "-", "-", "-", f"failed: {row['error'][:60]}")
            continue
        anchor, _ = TIME_TARGETS.get(case, (None, None))
        ratio = "-"
        if anchor and "wall_s" in rows.get(anchor, {}):
            ratio = f"{row['wall_s'] / rows[anchor]['wall_s']:.2f}x {anchor}"
        out.add_row(
            case,
            f"{row['wall_s']:.1f}",
            f"{row['min_s']:.1f}-{row['max_s']:.1f}",
            f"{row['cpu_s']:.1f}",
            f"{file_bytes / row['wall_s'] / 1e9:.2f}",
            f"{row['peak_anon'] / MIB:,.0f} MiB",
            ratio,
        )
    Console(width=150).print(out)
    generated = {case: row for case, row in rows.items() if "tokens_per_s" in row}
    if generated:
        gen = Table(title=f"int4 generate at batch 1, {GENERATE_PROMPT}-token prompt (medians)")
        for column in ("case", "ready s", "first token s", "tokens/s", "peak RSS", "peak RssAnon"):
            gen.add_column(column, justify="left" if column == "case" else "right")
        for case, row in generated.items():
            gen.add_row(
                case,
                f"{row['ready_s']:.1f}",
                f"{row['first_token_s']:.2f}",
                f"{row['tokens_per_s']:.2f}",
                f"{row['peak_rss'] / MIB:,.0f} MiB",
                f"{row['peak_anon'] / MIB:,.0f} MiB",
            )
        Console(width=150).print(gen)


def checks(results: dict[str, dict[str, Any]], judged: str) -> list[dict[str, Any]]:
    found = []
    rows = results[judged]["rows"]
    for case, (anchor, limit) in TIME_TARGETS.items():
        if "wall_s" in rows.get(case, {}) and "wall_s" in rows.get(anchor, {}):
            ratio = rows[case]["wall_s"] / rows[anchor]["wall_s"]
            found.append({"what": f"{judged} GB: {case} / {anchor} time", "value": ratio, "limit": limit})
    for size, result in results.items():
        for case in SHRINKS:
            row = result["rows"].get(case, {})
            if "peak_anon" in row:
                value = row["peak_anon"] / GIB
                found.append({"what": f"{size} GB: {case} peak RssAnon (GiB)", "value": value, "limit": 1.5})
    for check in found:
        check["pass"] = check["value"] <= check["limit"]
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1,4", help="file sizes in GB, comma-separated (default 1,4)")
    parser.add_argument("--large", action="store_true", help="add the 16 GB file (int4 shrink and anchors)")
    parser.add_argument("--runs", type=int, default=3, help="rounds of fresh processes (default 3)")
    parser.add_argument("--cases", default="", help="comma-separated substrings of the cases to run")
    parser.add_argument("--dir", default=None, help="where the files go (default: a folder in /tmp, kept)")
    parser.add_argument("--check", action="store_true", help="exit 1 when a target fails")
    parser.add_argument(
        "--generate",
        action="store_true",
        help="also load an int4 file and generate on the 1 GB model (its int4 file made once: ~10 minutes)",
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        run_case(args.child, args.folder, args.out)
        return 0
    sizes = [float(s) for s in args.sizes.split(",") if s] + ([16.0] if args.large else [])
    wanted = [c for c in CASES if not args.cases or any(w in c for w in args.cases.split(","))]
    base = Path(args.dir or Path(tempfile.gettempdir()) / "slimtorch-scale")
    results: dict[str, dict[str, Any]] = {}
    for size in sizes:
        folder = base / f"llama-{size:g}gb"
        path = write_checkpoint(folder, size)
        cases = [c for c in wanted if size < 16 or c in ("plain int4 loop", "slimtorch shrink int4-weight")]
        if args.generate and size <= 1:
            prepare_quantized(folder)
            cases += GENERATE_CASES
        runs: dict[str, list[dict[str, Any]]] = {c: [] for c in cases}
        with tempfile.TemporaryDirectory(dir=base) as scratch:
            for round_ in range(args.runs):
                order = cases[round_ % len(cases) :] + cases[: round_ % len(cases)]
                for case in order:
                    runs[case].append(measure(case, folder, Path(scratch)))
                    last = runs[case][-1]
                    shown = f"{last['wall_s']:.1f} s" if "wall_s" in last else last["error"][:80]
                    print(f"  {size:g} GB, round {round_ + 1}/{args.runs}: {case}: {shown}", flush=True)
        rows = {case: summarize(r) for case, r in runs.items()}
        results[f"{size:g}"] = {"file_bytes": path.stat().st_size, "layers": layers_for(size), "rows": rows}
        table(size, path.stat().st_size, rows)
    judged = max((k for k in results if float(k) <= JUDGED_SIZE), key=float, default=next(iter(results)))
    found = checks(results, judged)
    for check in found:
        verdict = "PASS" if check["pass"] else "FAIL"
        print(f"{verdict}  {check['what']}: {check['value']:.2f} (target <= {check['limit']})")
    passed = sum(c["pass"] for c in found)
    print(f"{passed} of {len(found)} targets met")
    RESULTS.parent.mkdir(exist_ok=True)
    machine = {"platform": platform.platform(), "cpu": platform.processor(), "cores": os.cpu_count()}
    kept = json.loads(RESULTS.read_text()).get("results", {}) if RESULTS.exists() else {}
    merged = dict(kept)  # sizes and cases not run this time keep their last measurement
    for size, result in results.items():
        rows = {**merged.get(size, {}).get("rows", {}), **result["rows"]}
        merged[size] = {**result, "rows": rows}
    RESULTS.write_text(json.dumps({"machine": machine, "results": merged, "checks": found}, indent=2))
    return 1 if args.check and passed < len(found) else 0


if __name__ == "__main__":
    sys.exit(main())
