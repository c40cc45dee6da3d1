"""Benchmark: the DataLoader settings ``slimtorch.data.tune`` picks, against ``num_workers=0`` and the
settings a user would guess, on a dataset whose items cost CPU time and on one that is cheap and in memory.

Run it with ``.venv/bin/python -m benchmarks.dataloader`` (about a minute and a half on 2 cores; ``--runs 1``
for a quick look; ``--check`` exits 1 when the issue's bar is missed: tune's pick under 1.5x
``num_workers=0`` on the CPU-heavy set, or anything but ``num_workers=0`` on the cheap one). Two datasets:

* ``images``: 512 RGB images kept as PNG keeps them (each row "Up"-filtered against the one above, then
  deflated with zlib), decoded per item (inflate, undo the filter) and augmented as a training set is:
  a random 128x128 crop, a random flip, brightness and contrast jitter, a 5-tap Gaussian blur, normalised
  to float32 CHW. About 1.5 ms an item here; batch 16.
* ``tensors``: a ``TensorDataset`` of 16,384 rows of 32 floats and their labels, in memory; batch 64.

For each, ``tune(dataset, batch_size=...)`` runs once with its defaults (20 s budget at most, workers up to
the cores), then every row below is timed ``--runs`` times, each in a fresh ``DataLoader`` over the whole
dataset (one epoch), from ``iter(loader)`` to its last batch, so starting the workers counts as it does in a
training loop's epoch. A row's number is the median of its runs, with the spread ((slowest - fastest) /
median) and the ratio to ``num_workers=0``'s median:

* ``num_workers=0``: torch's default, the baseline;
* ``tune``: ``report.settings`` as ``tune`` returned them;
* ``num_workers=cpu_count``: ``os.cpu_count()`` workers, the common guess;
* ``cpu_count + pin_memory``: the same with ``pin_memory=True`` and ``persistent_workers=True``, what
  tutorials add (pinning needs CUDA; without it torch warns and pins nothing);
* ``Lightning's suggestion``: the ``num_workers`` Lightning's "consider increasing num_workers" warning
  names (``lightning.fabric.utilities.data.suggested_max_num_workers``: the cores - 1, at least 1).

Results go to ``benchmarks/results/dataloader.json``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
import zlib
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

from benchmarks._harness import exit_code, relative_spread, results_file, write_json
from slimtorch.data import TuneReport, tune

RESULTS = results_file("dataloader")
BAR = 1.5
"""the issue's bar: tune's pick at least this many times faster than num_workers=0 on the CPU-heavy set"""
SIDE, CROP = 160, 128
BLUR = np.array([1, 4, 6, 4, 1], dtype=np.float32) / 16


def png_like(seed: int) -> bytes:
    """One synthetic RGB image (smooth stripes and noise), stored as PNG stores it: each row minus the row
    above (the "Up" filter), deflated."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:SIDE, 0:SIDE]
    channels = [np.sin(x / (5 + c + seed % 7)) * np.cos(y / (7 + c)) * 127 + 128 for c in range(3)]
    image = (np.stack(channels, -1) + rng.normal(0, 8, (SIDE, SIDE, 3))).clip(0, 255).astype(np.uint8)
    filtered = np.diff(image, axis=0, prepend=np.zeros((1, SIDE, 3), np.uint8))
    return zlib.compress(filtered.tobytes(), 6)


class AugmentedImages(Dataset):
    """PNG-like bytes in memory, decoded and augmented per item: the CPU work workers can share."""

    def __init__(self, size: int = 512) -> None:
        self.blobs = [png_like(seed) for seed in range(64)]
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> torch.Tensor:
        rng = np.random.default_rng(index)
        raw = np.frombuffer(zlib.decompress(self.blobs[index % len(self.blobs)]), np.uint8)
        image = np.cumsum(raw.reshape(SIDE, SIDE, 3), axis=0, dtype=np.uint8)  # undo "Up": wraps at 256
        top, left = rng.integers(0, SIDE - CROP, 2)
        image = image[top : top + CROP, left : left + CROP].astype(np.float32) / 255
        if rng.random() < 0.5:
            image = image[:, ::-1]
        image = (image - image.mean()) * rng.uniform(0.8, 1.2) + image.mean() + rng.uniform(-0.1, 0.1)
        for axis in (0, 1):
            pad = np.pad(image, [(2, 2) if a == axis else (0, 0) for a in range(3)], mode="reflect")
            image = sum(BLUR[k] * np.take(pad, range(k, k + CROP), axis=axis) for k in range(5))
        return torch.from_numpy(np.ascontiguousarray(((image - 0.5) / 0.25).transpose(2, 0, 1)))


def in_memory() -> TensorDataset:
    return TensorDataset(torch.randn(16_384, 32), torch.arange(16_384))


DATASETS = {"images": (AugmentedImages, 16), "tensors": (in_memory, 64)}


def guesses(report: TuneReport, batch_size: int) -> dict[str, dict[str, Any]]:
    """Each row's DataLoader keywords, the baseline first."""
    cores = os.cpu_count() or 1
    lightning = max(1, usable_cores() - 1)  # Lightning's suggested_max_num_workers(1)
    return {
        "num_workers=0": {"batch_size": batch_size},
        "tune": report.settings,
        f"num_workers={cores} (cpu_count)": {"batch_size": batch_size, "num_workers": cores},
        f"num_workers={cores} pin_memory persistent": {
            "batch_size": batch_size,
            "num_workers": cores,
            "pin_memory": True,
            "persistent_workers": True,
        },
        f"num_workers={lightning} (Lightning's suggestion)": {
            "batch_size": batch_size,
            "num_workers": lightning,
        },
    }


def usable_cores() -> int:
    """The cores this process may run on (its affinity, where the OS has one), as Lightning counts them."""
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity else os.cpu_count() or 1


def epoch_seconds(dataset: Dataset, settings: dict[str, Any]) -> float:
    """Seconds from ``iter()`` of a fresh loader to its last batch; its workers are gone before it returns."""
    loader = DataLoader(dataset, **settings)
    started = time.perf_counter()
    for _ in loader:
        pass
    elapsed = time.perf_counter() - started
    del loader  # persistent workers stop with their loader
    return elapsed


def measured(name: str, runs: int) -> dict[str, Any]:
    """tune once, then every row timed ``runs`` times over one epoch, rows interleaved run by run so a
    noisy moment on the machine lands on all of them alike."""
    make, batch_size = DATASETS[name]
    dataset = make()
    report = tune(dataset, batch_size=batch_size)
    rows = guesses(report, batch_size)
    times: dict[str, list[float]] = {label: [] for label in rows}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*pin_memory.*")  # no CUDA here: said in the table
        for _ in range(runs):
            for label, settings in rows.items():
                times[label].append(epoch_seconds(dataset, settings))
    baseline = statistics.median(times["num_workers=0"])
    return {
        "dataset": name,
        "items": len(dataset),  # type: ignore[arg-type]
        "batch_size": batch_size,
        "tune": {"settings": report.settings, "speedup": report.speedup, "seconds": report.seconds},
        "rows": [
            {
                "label": label,
                "settings": rows[label],
                "samples_per_s": len(dataset) / statistics.median(seconds),  # type: ignore[arg-type]
                "spread": relative_spread(seconds),
                "ratio": baseline / statistics.median(seconds),
                "seconds": seconds,
            }
            for label, seconds in times.items()
        ],
    }


def table(results: list[dict[str, Any]]) -> str:
    lines = ["| dataset | settings | samples/s | spread | vs num_workers=0 |", "|---" * 5 + "|"]
    for result in results:
        for row in result["rows"]:
            label = row["label"]
            if label == "tune":
                label = "tune: " + " ".join(
                    f"{k}={v}" for k, v in row["settings"].items() if k != "batch_size"
                )
            lines.append(
                f"| {result['dataset']} | {label} | {row['samples_per_s']:,.0f} | {row['spread']:.0%} "
                f"| {row['ratio']:.2f}x |"
            )
    return "\n".join(lines)


def failures(results: list[dict[str, Any]]) -> list[str]:
    """The issue's bar, missed: tune's pick under :data:`BAR` on the images, workers on the tensors."""
    found = []
    for result in results:
        pick = next(row for row in result["rows"] if row["label"] == "tune")
        if result["dataset"] == "images" and pick["ratio"] < BAR:
            found.append(f"images: tune's pick is {pick['ratio']:.2f}x num_workers=0, under {BAR}x")
        if result["dataset"] == "tensors" and pick["settings"].get("num_workers", 0) != 0:
            found.append(f"tensors: tune picked num_workers={pick['settings']['num_workers']}, not 0")
    return found


def main() -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="epochs timed per row (median)")
    parser.add_argument("--datasets", nargs="+", choices=sorted(DATASETS), default=list(DATASETS))
    parser.add_argument("--check", action="store_true", help="exit 1 when the issue's bar is missed")
    args = parser.parse_args()
    results = [measured(name, args.runs) for name in args.datasets]
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(
        f"{usable_cores()} cores, load average {load:.1f} (this run included), "
        f"torch {torch.__version__}; medians of {args.runs} epochs in fresh loaders"
    )
    print(table(results))
    write_json(RESULTS, {"load_average": load, "results": results})
    missed = failures(results)
    for line in missed:
        print(f"MISSED {line}")
    return exit_code(not missed, args.check)


if __name__ == "__main__":
    sys.exit(main())
