"""Quantize a BERT-base encoder to int8, save it, load it back quantized, and show what it cost and gained.

The encoder is built from ``BertConfig()`` with random weights (nothing is downloaded), so the numbers
speak of speed, size and agreement with the float model, not of task accuracy. Run it with
``.venv/bin/python examples/quantize_bert.py`` (about 20 seconds); ``make demo`` runs it.
"""

from __future__ import annotations

import argparse
import copy
import tempfile
from pathlib import Path

import torch
from torch.nn import functional as F

import slimtorch
from slimtorch.inspection.measure import measure_latency


def build_bert() -> torch.nn.Module:
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    return transformers.BertModel(transformers.BertConfig()).eval()


def tokens(seed: int) -> torch.Tensor:
    return torch.randint(0, 30522, (1, 128), generator=torch.Generator().manual_seed(seed))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, help="where to save the int8 model (default: a temporary folder)")
    parser.add_argument("--scheme", default="int8-dynamic", choices=slimtorch.quant.SCHEMES)
    args = parser.parse_args()
    torch.set_num_threads(1)  # one core: the figure issue 7 asks about

    dense = build_bert()
    ids = tokens(1)
    with torch.no_grad():
        expected = dense(ids).last_hidden_state
    fp32_ms = measure_latency(dense, (ids,), runs=5) * 1e3

    report = slimtorch.quantize(
        copy.deepcopy(dense), args.scheme, calibration=[tokens(100 + i) for i in range(2)]
    )
    quantized = report.model
    int8_ms = measure_latency(quantized, (ids,), runs=5) * 1e3
    with tempfile.TemporaryDirectory() as scratch:
        out = args.out or Path(scratch) / "bert-int8.safetensors"
        out.parent.mkdir(parents=True, exist_ok=True)
        dense_file = Path(scratch) / "bert-fp32.safetensors"
        slimtorch.save_model(dense, dense_file)
        slimtorch.save_model(quantized, out)
        loaded = slimtorch.load_model(out, build_bert).model
        with torch.no_grad():
            got = loaded(ids).last_hidden_state
            same = torch.equal(got, quantized(ids).last_hidden_state)
        ratio = out.stat().st_size / dense_file.stat().st_size
    cosine = float(F.cosine_similarity(got.flatten().double(), expected.flatten().double(), dim=0))

    print(f"BERT-base, {args.scheme}, {len(report.layers)} layers quantized, 1 thread, 1 x 128 tokens")
    print(f"  latency      {fp32_ms:7.1f} ms -> {int8_ms:6.1f} ms   ({fp32_ms / int8_ms:.2f}x faster)")
    print(f"  file         {ratio:.3f}x of the fp32 safetensors file")
    print(f"  agreement    cosine {cosine:.5f} with the fp32 output (on an input calibration never saw)")
    print(f"  round trip   load_model gives {'identical' if same else 'DIFFERENT'} outputs")
    worst = max(report.layers, key=lambda layer: layer.output_error or 0.0)
    print(f"  worst layer  {worst.name}: {worst.output_error:.2%} output error")
    if not same:
        raise SystemExit("the loaded model does not reproduce the saved one")


if __name__ == "__main__":
    main()
