"""Benchmark: slimtorch at language-model scale, on Llama-shaped bf16 checkpoints of 1, 4 and 16 GB.

Run it with ``.venv/bin/python -m benchmarks.scale`` (1 and 4 GB: about 25 minutes on 2 cores; ``--large``
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

With ``--generate`` (every size run): the folder's int4 file is made once, timed as the case ``slimtorch
quantize int4 (mapped)``: ``load_model`` of the bf16 file into a ``LlamaForCausalLM`` built from the config
(weights mapped, not read into memory), ``slimtorch.quantize(model, "int4-weight")`` (groups of 128, no
calibration: GPTQ on calibration samples, ``slimtorch quantize``'s default with data, takes hours at this
size on 2 cores) and ``save_model``. Then ``load_model`` of that file and ``generate`` at batch 1: time to
ready, first token cold, tokens per second once warm, and peak RSS (file pages included) against the int4
file's size (target <= 1.1x at the largest size), beside torchao's CPU int4 path
(``PrototypeInt4WeightOnlyConfig`` on the bf16 model transformers loads; not at 16 GB, where the bf16 model
alone nearly fills this machine's 24 GB). ``--generate-runs`` sets its rounds (default ``--runs``).

With ``--decode``: one Llama-2-7B decoder layer's seven int4 weight products at batch 1, in fresh processes:
slimtorch's int4 layers, onnxruntime's ``MatMulNBits`` (the layer as an ONNX graph of MatMuls, quantized by
its ``MatMulNBitsQuantizer``) and torchao's CPU int4 path: a decode step's cost without attention.

Not measured here yet: a whole model through onnxruntime, and ``--device cuda`` (not built: no CUDA number
is claimed anywhere).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import struct
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks._harness import (
    child_command,
    emit,
    exit_code,
    interleaved,
    machine,
    results_file,
    rich_table,
    rotated,
    sampled_run,
    show,
    verdict,
    write_json,
)

RESULTS = results_file("scale")
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
    if case.startswith("slimtorch"):
        import slimtorch

        model = slimtorch.load_model(quantized_file(Path(folder)), lambda: bf16_model(config)).model
        model.generation_config.pad_token_id = model.generation_config.eos_token_id
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


DECODE_SHAPES = {  # one Llama-2-7B decoder layer's linear layers: name -> (out, in)
    "q": (HIDDEN, HIDDEN),
    "k": (HIDDEN, HIDDEN),
    "v": (HIDDEN, HIDDEN),
    "o": (HIDDEN, HIDDEN),
    "gate": (MLP, HIDDEN),
    "up": (MLP, HIDDEN),
    "down": (HIDDEN, MLP),
}
DECODE_LAYERS = 32  # Llama-2-7B's layers: a decode step's weight products are this many layers' worth
DECODE_CASES = [
    "slimtorch int4 decode layer",
    "onnxruntime MatMulNBits decode layer",
    "torchao int4 decode layer",
]
DECODE_CALLS = 30


def decode_layer(case: str) -> dict[str, float]:
    """One decoder layer's seven weight products at batch 1 (a decode step's, attention left out), int4
    weights in groups of 128, the median of :data:`DECODE_CALLS` calls after a warm-up (each tool's kernel
    choice done). slimtorch and torchao in bfloat16 (a bf16 model's activations); onnxruntime's
    ``MatMulNBits`` in float32 with ``accuracy_level=4`` (int8 activations, its fastest CPU path), on
    ``torch.get_num_threads()`` threads like the others. The tokens per second of a 32-layer 7B model follow
    from it as an upper bound (no attention, no lm_head)."""
    import numpy
    import torch
    from torch import nn

    generator = torch.Generator().manual_seed(0)
    linears = nn.ModuleDict(
        {name: nn.Linear(i, o, bias=False, dtype=torch.bfloat16) for name, (o, i) in DECODE_SHAPES.items()}
    )
    for layer in linears.values():
        layer.weight.data = (torch.randn(layer.weight.shape, generator=generator) * 0.02).to(torch.bfloat16)
    x = torch.randn(1, HIDDEN, generator=generator)

    def step(run: Any) -> float:
        return statistics.median(interleaved({"layer": run}, DECODE_CALLS, warmup=3)["layer"])

    if case.startswith("onnxruntime"):
        import onnx
        import onnxruntime
        from onnx import TensorProto, helper, numpy_helper
        from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

        nodes, weights, outputs = [], [], []
        for name, layer in linears.items():
            source = "act" if name == "down" else "x"
            weight = layer.weight.detach().float().t().contiguous().numpy()
            weights.append(numpy_helper.from_array(weight, f"w_{name}"))
            nodes.append(helper.make_node("MatMul", [source, f"w_{name}"], [f"y_{name}"]))
            outputs.append(helper.make_tensor_value_info(f"y_{name}", TensorProto.FLOAT, None))
        nodes.append(helper.make_node("Mul", ["y_gate", "y_up"], ["act"]))
        graph = helper.make_graph(
            nodes,
            "decode",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, HIDDEN])],
            outputs,
            weights,
        )
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        quantizer = MatMulNBitsQuantizer(model, bits=4, block_size=128, is_symmetric=False, accuracy_level=4)
        quantizer.process()
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = torch.get_num_threads()
        session = onnxruntime.InferenceSession(
            quantizer.model.model.SerializeToString(), options, providers=["CPUExecutionProvider"]
        )
        assert any(
            n.op_type == "MatMulNBits"
            for n in onnx.load_from_string(quantizer.model.model.SerializeToString()).graph.node
        )
        feed = {"x": x.numpy().astype(numpy.float32)}
        seconds = step(lambda: session.run(None, feed))
    else:
        if case.startswith("slimtorch"):
            import slimtorch

            slimtorch.quantize(linears, "int4-weight", group_size=128)
        else:
            from torchao.prototype.quantization.int4 import PrototypeInt4WeightOnlyConfig
            from torchao.quantization import quantize_

            quantize_(linears, PrototypeInt4WeightOnlyConfig(group_size=128, set_inductor_config=False))
        h = x.to(torch.bfloat16)

        def run() -> None:
            for name in ("q", "k", "v", "o"):
                linears[name](h)
            linears["down"](linears["gate"](h) * linears["up"](h))

        with torch.no_grad():
            seconds = step(run)
    return {"layer_ms": seconds * 1e3, "tokens_per_s_7b": 1 / (DECODE_LAYERS * seconds)}


def bf16_model(config: Any) -> Any:
    """The config's ``LlamaForCausalLM`` with bfloat16 parameters, as the file stores them (the class's
    constructor makes float32 ones whatever the config's dtype says: a load into it doubles the weights)."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)


def quantized_file(folder: Path) -> Path:
    return folder / "int4-mapped.safetensors"


def make_int4(folder: str) -> None:
    """The int4 model file: the bf16 file mapped into a meta-built ``LlamaForCausalLM``, quantized to
    int4-weight (groups of 128, round to nearest after the clipping search, no calibration), saved."""
    from transformers import AutoConfig

    import slimtorch

    config = AutoConfig.from_pretrained(folder)
    source = Path(folder) / "model.safetensors"
    model = slimtorch.load_model(source, lambda: bf16_model(config)).model
    slimtorch.quantize(model, "int4-weight")
    slimtorch.save_model(model, quantized_file(Path(folder)))


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
        quantize = None if scheme == "(lossless)" else scheme
        slimtorch.shrink(source, out + ".safetensors", quantize=quantize)
    elif case == "torchao quantize_ int8":
        torchao_int8(folder)
    elif case in DECODE_CASES:
        emit(decode_layer(case))
    elif case == MAKE_INT4:
        make_int4(folder)
    elif case in GENERATE_CASES:
        emit(generation(case, folder))
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
MAKE_INT4 = "slimtorch quantize int4 (mapped)"
LOAD_RSS_LIMIT = 1.1  # peak RSS of load_model + generate, over the int4 file's size (the largest size run)


def measure(case: str, folder: Path, scratch: Path) -> dict[str, Any]:
    """One fresh process running ``case``: wall and CPU seconds, peak RssAnon (sampled every 10 ms)."""
    out = scratch / "out"
    run = sampled_run(
        child_command(__spec__.name, "--child", case, "--folder", str(folder), "--out", str(out)), every=0.01
    )
    stdout, stderr = run.stdout, run.stderr
    extra = json.loads(stdout.strip().splitlines()[-1]) if stdout.strip().startswith("{") else {}
    for leftover in scratch.iterdir():
        shutil.rmtree(leftover) if leftover.is_dir() else leftover.unlink()
    os.sync()  # untimed: the next case does not pay for this one's writeback
    if run.returncode:
        return {"error": stderr.strip().splitlines()[-1] if stderr.strip() else f"exit {run.returncode}"}
    return {
        "wall_s": run.wall_s,
        "cpu_s": run.usage.ru_utime + run.usage.ru_stime,
        "peak_anon": run.peak_anon,
        **extra,
        "peak_rss": run.usage.ru_maxrss * 1024,
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
            for key in ("ready_s", "first_token_s", "tokens_per_s", "layer_ms", "tokens_per_s_7b")
            if key in good[0]
        },
        **(
            {
                "layer_ms_min": min(r["layer_ms"] for r in good),
                "layer_ms_max": max(r["layer_ms"] for r in good),
            }
            if "layer_ms" in good[0]
            else {}
        ),
    }


def table(size: float, file_bytes: int, rows: dict[str, dict[str, Any]], int4_bytes: int | None) -> None:
    out = rich_table(
        f"Llama-shaped bf16 file of {file_bytes / 1e9:.2f} GB ({size:g} GB asked)",
        ("case", "median s", "spread s", "CPU s", "GB/s", "peak RssAnon", "vs anchor"),
        left={"case"},
    )
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
    show(out, 150)
    generated = {case: row for case, row in rows.items() if "tokens_per_s" in row}
    if generated:
        title = f"int4 generate at batch 1, {GENERATE_PROMPT}-token prompt (medians)"
        if int4_bytes:
            title += f"; slimtorch's int4 file: {int4_bytes / MIB:,.0f} MiB"
        columns = ("case", "ready s", "first token s", "tokens/s", "peak RSS", "RSS / int4", "peak RssAnon")
        gen = rich_table(title, columns, left={"case"})
        for case, row in generated.items():
            gen.add_row(
                case,
                f"{row['ready_s']:.1f}",
                f"{row['first_token_s']:.2f}",
                f"{row['tokens_per_s']:.2f}",
                f"{row['peak_rss'] / MIB:,.0f} MiB",
                f"{row['peak_rss'] / int4_bytes:.2f}x" if int4_bytes else "-",
                f"{row['peak_anon'] / MIB:,.0f} MiB",
            )
        show(gen, 150)


def decode_table(rows: dict[str, dict[str, Any]]) -> None:
    out = rich_table(
        "one Llama-2-7B decoder layer's int4 weight products at batch 1 (medians of fresh processes)",
        ("case", "ms a layer", "spread", "7B tokens/s (products only)", "vs slimtorch"),
        left={"case"},
    )
    ours = rows.get(DECODE_CASES[0], {}).get("layer_ms")
    for case, row in rows.items():
        if "error" in row:
            out.add_row(case, "-", "-", "-", f"failed: {row['error'][:60]}")
            continue
        spread = f"{row['layer_ms_min']:.2f}-{row['layer_ms_max']:.2f}"
        ratio = f"{row['layer_ms'] / ours:.2f}x" if ours else "-"
        out.add_row(case, f"{row['layer_ms']:.2f}", spread, f"{row['tokens_per_s_7b']:.2f}", ratio)
    show(out, 150)


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
    generated = [k for k, r in results.items() if "peak_rss" in r["rows"].get(GENERATE_CASES[0], {})]
    if generated:
        size = max(generated, key=float)
        value = results[size]["rows"][GENERATE_CASES[0]]["peak_rss"] / results[size]["int4_file_bytes"]
        what = f"{size} GB: load_model int4 + generate peak RSS / int4 file"
        found.append({"what": what, "value": value, "limit": LOAD_RSS_LIMIT})
    for check in found:
        check["pass"] = check["value"] <= check["limit"]
    return found


Runs = dict[str, list[dict[str, Any]]]


def rounds(runs: Runs, cases: list[str], count: int, size: float, folder: Path, scratch: Path) -> None:
    """``count`` rounds of ``cases``, each in a fresh process, each round starting one case further down."""
    for round_ in range(count if cases else 0):
        for case in rotated(cases, round_):
            runs.setdefault(case, []).append(measure(case, folder, scratch))
            last = runs[case][-1]
            shown = f"{last['wall_s']:.1f} s" if "wall_s" in last else last["error"][:80]
            print(f"  {size:g} GB, round {round_ + 1}/{count}: {case}: {shown}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1,4", help="file sizes in GB, comma-separated (default 1,4)")
    parser.add_argument("--large", action="store_true", help="add the 16 GB file (int4 shrink and anchors)")
    parser.add_argument("--runs", type=int, default=3, help="rounds of fresh processes (default 3)")
    parser.add_argument("--cases", default="", help="comma-separated substrings of the cases to run")
    parser.add_argument("--dir", default=None, help="where the files go (default: a folder in /tmp, kept)")
    parser.add_argument("--check", action="store_true", help="exit 1 when a target fails")
    parser.add_argument(
        "--generate",
        action="store_true",
        help="also make each size's int4 model file (once) and load it to generate, against torchao",
    )
    parser.add_argument("--generate-runs", type=int, default=0, help="rounds of the generate cases")
    parser.add_argument(
        "--decode",
        action="store_true",
        help="also time one 7B decoder layer's int4 products at batch 1: slimtorch, onnxruntime, torchao",
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
        runs: Runs = {}
        with tempfile.TemporaryDirectory(dir=base) as scratch:
            rounds(runs, cases, args.runs, size, folder, Path(scratch))
            if args.generate:
                if not quantized_file(folder).exists():
                    rounds(runs, [MAKE_INT4], 1, size, folder, Path(scratch))
                generate = GENERATE_CASES if size < 16 else GENERATE_CASES[:1]
                rounds(runs, generate, args.generate_runs or args.runs, size, folder, Path(scratch))
        rows = {case: summarize(r) for case, r in runs.items()}
        results[f"{size:g}"] = {"file_bytes": path.stat().st_size, "layers": layers_for(size), "rows": rows}
        if quantized_file(folder).exists():
            results[f"{size:g}"]["int4_file_bytes"] = quantized_file(folder).stat().st_size
        table(size, path.stat().st_size, rows, results[f"{size:g}"].get("int4_file_bytes"))
    decoded: dict[str, dict[str, Any]] = {}
    if args.decode:
        runs = {}
        with tempfile.TemporaryDirectory(dir=base) as scratch:
            rounds(runs, DECODE_CASES, args.runs, 0, base, Path(scratch))
        decoded = {case: summarize(r) for case, r in runs.items()}
        decode_table(decoded)
    judged = max((k for k in results if float(k) <= JUDGED_SIZE), key=float, default=next(iter(results)))
    found = checks(results, judged)
    for check in found:
        print(f"{verdict(check['pass'])}  {check['what']}: {check['value']:.2f} (target <= {check['limit']})")
    passed = sum(c["pass"] for c in found)
    print(f"{passed} of {len(found)} targets met")
    described = machine(platform=platform.platform(), cpu=platform.processor())
    kept = json.loads(RESULTS.read_text()).get("results", {}) if RESULTS.exists() else {}
    merged = dict(kept)  # sizes and cases not run this time keep their last measurement
    for size, result in results.items():
        rows = {**merged.get(size, {}).get("rows", {}), **result["rows"]}
        merged[size] = {**result, "rows": rows}
    record = {"machine": described, "results": merged, "checks": found}
    record["decode"] = decoded or (
        json.loads(RESULTS.read_text()).get("decode", {}) if RESULTS.exists() else {}
    )
    write_json(RESULTS, record)
    return exit_code(passed == len(found), args.check)


if __name__ == "__main__":
    sys.exit(main())
