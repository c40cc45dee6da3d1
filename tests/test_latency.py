"""Latency that means something: two models timed in interleaved rounds with torch.utils.benchmark, the
median with its spread, and "no measurable change" when the spreads overlap."""

from __future__ import annotations

import json
import re
import time

import pytest
import torch
from torch import nn

from slimtorch.cli.main import main
from slimtorch.inspection.measure import MIN_ROUNDS, compare


@pytest.fixture(autouse=True)
def _one_thread():
    """One thread: on a busy machine, threads waiting for each other add more noise than the models."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _layers(count: int) -> nn.Module:
    return nn.Sequential(*[nn.Linear(256, 256) for _ in range(count)]).eval()


INPUTS = (torch.randn(64, 256),)


@pytest.mark.slow
def test_a_model_compared_to_itself_is_reported_unchanged() -> None:
    model = _layers(1)
    result = compare(model, model, INPUTS, budget_s=1.0)
    assert not result.changed and result.verdict() == "no measurable change"
    assert result.threads == 1 and result.before.rounds == 10
    assert result.before.p25_s <= result.before.median_s <= result.before.p75_s
    assert result.before.iqr_s == pytest.approx(result.before.p75_s - result.before.p25_s)


@pytest.mark.slow
def test_a_model_ten_times_heavier_is_reported_slower() -> None:
    result = compare(_layers(1), _layers(10), INPUTS, budget_s=1.0)
    assert result.changed and result.ratio > 1 and result.verdict().endswith("(slower)")


class _Recorder(nn.Module):
    def __init__(self, name: str, calls: list[str]) -> None:
        super().__init__()
        self.name, self.calls = name, calls

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append(self.name)
        return x


def test_rounds_interleave_the_two_models_and_alternate_which_goes_first() -> None:
    calls: list[str] = []
    compare(_Recorder("before", calls), _Recorder("after", calls), INPUTS, rounds=6, budget_s=0.2)
    runs = [calls[0]]  # collapse consecutive calls of one model into one entry
    for name in calls[1:]:
        if name != runs[-1]:
            runs.append(name)
    # warm-up: before, after; then before after | after before | before after ...: each round's second
    # model also opens the next round, so 6 rounds make 7 turns (all before, then all after: 2)
    assert runs == ["before", "after"] + ["before", "after"] * 3 + ["before"]


class _Sleepy(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.05)
        return x


def test_a_model_slower_than_the_budget_gets_fewer_rounds_not_a_longer_wait() -> None:
    result = compare(_Sleepy(), _Sleepy(), INPUTS, rounds=10, budget_s=0.2)
    assert result.before.rounds == result.after.rounds == MIN_ROUNDS


@pytest.mark.slow
def test_cli_quantize_prints_median_iqr_threads_and_json_has_the_comparison(tmp_path, capsys) -> None:
    out = tmp_path / "mlp.safetensors"
    args = ["quantize", "tests.zoo.models:MLP", "-o", str(out), "--input-shape", "8,64", "--runs", "3"]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "+-" in text and "interleaved rounds" in text and "1 thread" in text
    assert main([*args, "--json"]) == 0
    latency = json.loads(capsys.readouterr().out)["latency"]
    assert set(latency) == {"before", "after", "ratio", "changed", "threads"}
    assert latency["before"]["rounds"] == 3 and latency["before"]["iqr_s"] >= 0


@pytest.mark.slow
def test_cli_prune_prints_median_iqr_and_a_verdict_and_runs_0_times_nothing(tmp_path, capsys) -> None:
    out = tmp_path / "mlp.safetensors"
    args = ["prune", "tests.zoo.models:MLP", "-o", str(out), "--ratio", "0.5", "--input-shape", "8,64"]
    assert main(args) == 0
    text = capsys.readouterr().out
    # two copies of one tiny model can differ by their memory layout: the verdict itself is not asserted
    assert re.search(r"(us|ms|s) \+- [\d.]+ .* (no measurable change|\d+\.\d\dx \((faster|slower)\))", text)
    assert "10 interleaved rounds" in text
    assert main([*args, "--runs", "0", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["latency"] is None
