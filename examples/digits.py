"""Prune, recover and save a CNN on scikit-learn's bundled digits (8x8 images, 1,797 samples, no download).

    .venv/bin/python examples/digits.py

1. Train a small CNN (the dense model).
2. (a) Zero 90% of its weights (global magnitude), fine-tune with the zeros held at zero, save with the
   sparse and int8 codecs.
3. (b) Remove 50% of its channels (structured), distil from the dense model, save.
4. Print accuracy, file size, parameters, MACs and CPU latency of all three, and check the targets:
   (a) within 1.0 point of dense in a file <= 0.10x the dense fp32 file; (b) within 1.5 points with
   >= 1.8x fewer MACs.

Everything is seeded: the split is fixed (``random_state=0``), and so is every initialisation and batch order.
"""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import safetensors.torch
import torch
from rich.table import Table
from torch import nn

import slimtorch
from slimtorch.cli.views.inspect_view import output_console
from slimtorch.graph.macs import count_macs
from slimtorch.inspection.measure import measure_latency
from slimtorch.recovery import RecoverOptions

EPOCHS, RECOVER_EPOCHS, BATCH = 30, 10, 64


class DigitsCNN(nn.Module):
    def __init__(self, width: int = 48) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, width, 3, padding=1),
            nn.BatchNorm2d(width),
            nn.ReLU(),
            nn.Conv2d(width, 2 * width, 3, padding=1),
            nn.BatchNorm2d(2 * width),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(2 * width, 2 * width, 3, padding=1),
            nn.BatchNorm2d(2 * width),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
        )
        self.classifier = nn.Linear(2 * width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.features(x), 1))


@dataclass
class Data:
    train: list[tuple[torch.Tensor, torch.Tensor]]
    test_x: torch.Tensor
    test_y: torch.Tensor


def load_data(seed: int = 0) -> Data:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target)
    train_x, test_x, train_y, test_y = train_test_split(x, y, test_size=0.25, random_state=0, stratify=y)
    order = torch.randperm(len(train_x), generator=torch.Generator().manual_seed(seed))
    train_x, train_y = train_x[order], train_y[order]
    batches = [(train_x[i : i + BATCH], train_y[i : i + BATCH]) for i in range(0, len(train_x), BATCH)]
    return Data(batches, test_x, test_y)


def accuracy(model: nn.Module, data: Data) -> float:
    model.eval()
    with torch.no_grad():
        return float((model(data.test_x).argmax(1) == data.test_y).float().mean()) * 100


@dataclass
class Row:
    name: str
    accuracy: float
    file_bytes: int
    params: int
    macs: int
    latency_ms: float


def describe(name: str, model: nn.Module, path: Path, data: Data) -> Row:
    example = data.test_x[:1]
    return Row(
        name,
        accuracy(model, data),
        path.stat().st_size,
        sum(p.numel() for p in model.parameters()),
        count_macs(model, example),
        measure_latency(model, (data.test_x,), runs=20) * 1e3,
    )


def train_dense(data: Data, epochs: int = EPOCHS) -> DigitsCNN:
    dense = DigitsCNN()
    slimtorch.recover(dense, data.train, epochs=epochs, lr=3e-3, weight_decay=1e-4, recalibrate_bn=False)
    return dense


def save_dense(path: Path) -> None:
    """The dense model trained exactly as :func:`run` trains it, its weights written to ``path``."""
    torch.manual_seed(0)
    dense = train_dense(load_data())
    safetensors.torch.save_file({k: v.contiguous() for k, v in dense.state_dict().items()}, path)


def run(folder: Path, epochs: int = EPOCHS, recover_epochs: int = RECOVER_EPOCHS) -> dict[str, Row]:
    torch.manual_seed(0)
    data = load_data()
    evaluate = lambda model: accuracy(model, data)  # noqa: E731

    dense = train_dense(data, epochs)
    dense_file = folder / "dense.safetensors"
    safetensors.torch.save_file({k: v.contiguous() for k, v in dense.state_dict().items()}, dense_file)

    tuning = RecoverOptions(epochs=recover_epochs, lr=1e-3)  # (a) and (b) recover the same way

    # (a) 90% of the weights zeroed, fine-tuned with the zeros kept, saved sparse + int8
    sparse = copy.deepcopy(dense)
    slimtorch.prune.weights(sparse, 0.9)
    slimtorch.recover(sparse, data.train, tuning, eval_fn=evaluate)
    sparse_file = folder / "sparse-int8.safetensors"
    slimtorch.save(sparse.state_dict(), sparse_file, quantize="int8-weight")
    sparse_loaded = slimtorch.load_model(sparse_file, DigitsCNN).model

    # (b) half the channels removed, distilled from the dense model, saved with its structural delta
    narrow = copy.deepcopy(dense)
    slimtorch.prune.channels(narrow, data.test_x[:2], ratio=0.5)
    slimtorch.recover(narrow, data.train, tuning, teacher=dense, eval_fn=evaluate)
    narrow_file = folder / "channels-half.safetensors"
    slimtorch.save_model(narrow, narrow_file)
    narrow_loaded = slimtorch.load_model(narrow_file, DigitsCNN).model

    return {
        "dense": describe("dense fp32", dense, dense_file, data),
        "sparse": describe("(a) 90% sparse, fine-tuned, sparse+int8", sparse_loaded, sparse_file, data),
        "narrow": describe("(b) 50% channels, distilled", narrow_loaded, narrow_file, data),
    }


def checks(rows: dict[str, Row]) -> list[tuple[str, bool]]:
    dense, sparse, narrow = rows["dense"], rows["sparse"], rows["narrow"]
    return [
        (f"dense accuracy {dense.accuracy:.2f}% >= 97%", dense.accuracy >= 97),
        (
            f"(a) {dense.accuracy - sparse.accuracy:+.2f} points from dense, within 1.0",
            dense.accuracy - sparse.accuracy <= 1.0,
        ),
        (
            f"(a) file {sparse.file_bytes / dense.file_bytes:.3f}x the dense fp32 file, <= 0.10x",
            sparse.file_bytes <= 0.10 * dense.file_bytes,
        ),
        (
            f"(b) {dense.accuracy - narrow.accuracy:+.2f} points from dense, within 1.5",
            dense.accuracy - narrow.accuracy <= 1.5,
        ),
        (f"(b) {dense.macs / narrow.macs:.2f}x fewer MACs, >= 1.8x", dense.macs >= 1.8 * narrow.macs),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--check", action="store_true", help="exit 1 when a target is missed")
    parser.add_argument("--save-dense", metavar="PATH", help="only train the dense model, save its weights")
    args = parser.parse_args()
    if args.save_dense:
        save_dense(Path(args.save_dense))
        print(f"wrote {args.save_dense}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        rows = run(Path(tmp))
    table = Table(title="Digits (scikit-learn), test split of 450 images")
    for column in (
        "model",
        "accuracy",
        "file",
        "x dense file",
        "params",
        "MACs / image",
        "latency, 450 images",
    ):
        table.add_column(column, justify="left" if column == "model" else "right")
    dense = rows["dense"]
    for row in rows.values():
        table.add_row(
            row.name,
            f"{row.accuracy:.2f}%",
            f"{row.file_bytes / 1024:.1f} KiB",
            f"{row.file_bytes / dense.file_bytes:.3f}",
            f"{row.params:,}",
            f"{row.macs / 1e6:.2f} M",
            f"{row.latency_ms:.1f} ms",
        )
    console = output_console()
    console.print(table)
    results = checks(rows)
    for line, ok in results:
        console.print(f"{'PASS' if ok else 'FAIL'}  {line}", style="green" if ok else "red", highlight=False)
    return 1 if args.check and not all(ok for _, ok in results) else 0


if __name__ == "__main__":
    sys.exit(main())
