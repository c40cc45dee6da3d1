"""The facts ``slimtorch slim`` plans with and reports, each measured: a saved file's bytes by category and
its parameters, load time, latency, and the memory of one training step."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

CATEGORIES = ("weights", "biases", "norms", "embeddings", "other")
BUFFER_LEAVES = ("running_mean", "running_var", "num_batches_tracked")
LOAD_RUNS = 5
_NORMS = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm, getattr(nn, "RMSNorm", nn.LayerNorm))


def file_bytes(path: Path) -> int:
    """Bytes on disk of a file, or of every file in a folder (a Hugging Face folder)."""
    if path.is_dir():
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    return path.stat().st_size


def module_kinds(model: nn.Module) -> dict[str, str]:
    """The category of each module's tensors, by module name: what ``bytes_by_category`` sorts by (taken
    from the original model, whose names a pruned or quantized one keeps)."""
    kinds = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.Embedding):
            kinds[name] = "embeddings"
        elif isinstance(module, _NORMS):
            kinds[name] = "norms"
    return kinds


def saved_facts(path: Path, kinds: dict[str, str]) -> dict[str, Any]:
    """``file_bytes``, ``params`` (elements of the stored weights, a quantized weight by its float shape,
    running statistics left out) and ``bytes_by_category`` of a saved model; the file's header and
    metadata count as ``other``, so the categories add up to the file."""
    from slimtorch.sources import open_checkpoint

    categories = dict.fromkeys(CATEGORIES, 0)
    params = 0
    source = open_checkpoint(path)
    for info in source.infos():
        module, _, leaf = info.name.rpartition(".")
        stored = info.stored_nbytes if info.stored_nbytes is not None else info.nbytes
        categories[_category(kinds.get(module), leaf)] += stored
        if leaf not in BUFFER_LEAVES:
            params += info.numel
    total = file_bytes(path)
    categories["other"] += max(0, total - sum(categories.values()))
    return {"file_bytes": total, "params": params, "bytes_by_category": categories}


def _category(kind: str | None, leaf: str) -> str:
    if kind is not None:
        return kind
    if leaf == "bias":
        return "biases"
    return "weights" if leaf == "weight" else "other"


def layer_params(path: Path) -> dict[str, int]:
    """Stored weight elements by module name (a quantized weight by its float shape)."""
    from slimtorch.sources import open_checkpoint

    counts: dict[str, int] = {}
    for info in open_checkpoint(path).infos():
        module, _, leaf = info.name.rpartition(".")
        if leaf not in BUFFER_LEAVES:
            counts[module] = counts.get(module, 0) + info.numel
    return counts


def load_times(load: Callable[[], object], runs: int = LOAD_RUNS) -> dict[str, Any]:
    """Seconds ``load()`` takes, ``runs`` times: the median and quartiles."""
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        load()
        times.append(time.perf_counter() - started)
    q1, median, q3 = _quartiles(times)
    return {"median_s": median, "q1_s": q1, "q3_s": q3, "runs": runs}


def latency_pair(before: nn.Module, after: nn.Module, example: torch.Tensor) -> dict[str, Any]:
    """Both models timed on one sample in interleaved rounds (``inspection.measure.compare``), with
    one thread: milliseconds, the median and quartiles of each."""
    from slimtorch.inspection.measure import compare

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        timed = compare(before, after, (example[:1],))
    finally:
        torch.set_num_threads(threads)

    def side(latency: Any) -> dict[str, Any]:
        return {
            "median_ms": latency.median_s * 1e3,
            "q1_ms": latency.p25_s * 1e3,
            "q3_ms": latency.p75_s * 1e3,
            "runs": latency.blocks,
        }

    return {"batch": 1, "threads": 1, "before": side(timed.before), "after": side(timed.after)}


def training_step_memory(model: nn.Module, example: torch.Tensor) -> dict[str, Any]:
    """One training step of ``model`` on ``example`` (forward, backward, AdamW step; the steady step, its
    optimizer state alive), measured on the CPU: the peak and the live bytes after each event."""
    from slimtorch.memory import profile

    step = profile(model, example, device="cpu").steps[0]
    return {"peak_bytes": step.peak_bytes, "curve": [[i, nbytes] for i, (_, nbytes) in enumerate(step.curve)]}


def _quartiles(values: list[float]) -> tuple[float, float, float]:
    if len(values) == 1:
        return values[0], values[0], values[0]
    q1, median, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, median, q3
