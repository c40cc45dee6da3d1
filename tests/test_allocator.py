"""What the CPU allocator adds: a run's RSS growth measured beside the tensor bytes it kept alive."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from slimtorch.errors import OptionError
from slimtorch.memory.allocator import HostMemory, measure_host

MiB = 2**20
ROOT = Path(__file__).resolve().parent.parent

# A fresh process: in this one, earlier tests freed heap that a run would reuse without growing RSS.
MLP_RUN = """
import json, torch
from tests.zoo.models import MLP
from slimtorch.memory.allocator import measure_host

def train():
    torch.manual_seed(0)
    model = MLP((256, 1024, 1024, 10))
    optimizer = torch.optim.AdamW(model.parameters())
    batch = torch.randn(64, 256)
    for _ in range(3):
        optimizer.zero_grad(set_to_none=True)
        model(batch).square().mean().backward()
        optimizer.step()
    return model, optimizer

print(json.dumps(measure_host(train).to_dict()))
"""


@pytest.mark.slow
def test_three_adamw_steps_of_an_mlp_grow_rss_at_least_by_their_live_tensors() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    done = subprocess.run(
        [sys.executable, "-c", MLP_RUN], capture_output=True, text=True, env=env, cwd=ROOT, check=True
    )
    host = json.loads(done.stdout.strip().splitlines()[-1])
    weights = (256 * 1024 + 1024 + 1024 * 1024 + 1024 + 1024 * 10 + 10) * 4
    # weights, gradients and AdamW's two moments alive together, at least
    assert host["live_tensor_peak"] >= 4 * weights
    assert host["rss_growth"] >= host["live_tensor_peak"] - 4 * MiB
    assert math.isfinite(host["ratio"]) and host["ratio"] > 0.5
    assert host["schema"] == "slimtorch.host_memory/1"


# 64 MiB of float32 ones, every page written, measured in a fresh process (``without-psutil``: hidden)
ONES_RUN = """
import json, sys, torch
if sys.argv[1] == "without-psutil":
    sys.modules["psutil"] = None  # import psutil raises ImportError
from slimtorch.memory.allocator import measure_host

print(json.dumps(measure_host(lambda: torch.ones(16 * 2**20)).to_dict()))
"""


def _ones(psutil: str) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    done = subprocess.run(
        [sys.executable, "-c", ONES_RUN, psutil],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_a_kept_64mib_tensor_grows_rss_by_about_64mib() -> None:
    """In a fresh process: in one that ran other tests, a heap with a larger mmap threshold (glibc raises
    it as blocks are freed) held 64 MiB free, and the tensor grew RSS by 4 KiB."""
    host = _ones("with-psutil")
    assert host["live_tensor_peak"] == 64 * MiB
    assert host["rss_growth"] >= 60 * MiB
    assert host["rss_after"] >= host["rss_before"] + 60 * MiB  # kept alive until measured
    assert 0.9 < host["ratio"] < 2.0
    if host["malloc_in_use"] is not None:
        assert host["malloc_in_use"] >= 64 * MiB and host["malloc_held"] >= 64 * MiB


@pytest.mark.slow
def test_a_run_that_allocates_nothing_grows_rss_by_almost_nothing() -> None:
    host = measure_host(lambda: sum(range(1000)))
    assert host.live_tensor_peak == 0 and host.ratio is None
    assert 0 <= host.rss_growth < 16 * MiB


@pytest.mark.slow
def test_in_place_updates_of_tensors_made_before_the_run_allocate_nothing() -> None:
    weights = torch.zeros(4 * MiB)
    host = measure_host(lambda: weights.add_(1.0).mul_(2.0))
    assert host.live_tensor_peak == 0


@pytest.mark.slow
def test_a_storage_wrapped_in_a_parameter_stays_counted_after_its_first_tensor_dies() -> None:
    host = measure_host(lambda: nn.Linear(1024, 1024))
    assert host.live_tensor_peak >= (1024 * 1024 + 1024) * 4


@pytest.mark.slow
def test_temporaries_count_while_alive_and_the_peak_is_their_most_at_once() -> None:
    def run() -> torch.Tensor:
        kept = torch.ones(MiB)  # 4 MiB
        for _ in range(3):
            torch.ones(2 * MiB).sum()  # 8 MiB, freed before the next
        return kept

    host = measure_host(run)
    assert 12 * MiB <= host.live_tensor_peak < 12 * MiB + 1024  # and the sum's scalar


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs Linux's /proc/self/statm")
def test_without_psutil_rss_is_read_from_proc_and_the_notes_say_so() -> None:
    host = _ones("without-psutil")
    assert any("psutil not installed" in note for note in host["notes"])
    assert host["rss_growth"] >= 60 * MiB


@pytest.mark.slow
def test_the_report_is_json_ready_and_a_bad_interval_is_refused() -> None:
    host = measure_host(lambda: None)
    assert isinstance(host, HostMemory)
    assert set(host.to_dict()) >= {
        "rss_before",
        "rss_peak",
        "rss_growth",
        "live_tensor_peak",
        "ratio",
        "notes",
    }
    json.dumps(host.to_dict())
    with pytest.raises(OptionError, match="interval_s"):
        measure_host(lambda: None, interval_s=0)
