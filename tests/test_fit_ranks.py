"""``fit`` proposes ranks: one device when a plan fits there, else the fewest ranks (then the strategy with
the least communication, then the fewest levers), with the busiest rank's peak as ``rank_memory`` gives it.

The model is ``tests/support/models.py``'s stack of 4 blocks at batch 64 with AdamW on the CPU: one
device needs 136 MiB whatever is pulled (the optimizer step's weights, gradients and moments), FSDP2 on 2
ranks 89.9 MiB per rank, ZeRO-1 on 2 ranks 136 MiB.
"""

from __future__ import annotations

import json

import pytest
import torch

import slimtorch
from slimtorch.errors import OptionError, SlimtorchError
from slimtorch.memory.fitting import OPTIMIZER_CLASSES
from slimtorch.memory.options import OPTIMIZERS
from slimtorch.memory.parallel import parallel_step, rank_memory
from tests.support.models import BATCH, Stack

MIB = 2**20
ONLY_TWO_FSDP_RANKS = 100 * MIB
"""95 MiB usable (5% margin): FSDP2 on 2 ranks (89.9 MiB) fits; one device, DDP, ZeRO-1 (136+ MiB) do not"""


def _fit(budget: int, **options):
    return slimtorch.memory.fit(Stack(), torch.randn(BATCH, 512), budget=budget, device="cpu", **options)


def _rank_peak(plan, optimizer: str = "adamw") -> int:
    """The busiest rank's peak, from ``rank_memory`` on the plan's own step (its checkpointing, precision)."""
    model = Stack()
    step = slimtorch.memory.estimate(
        model,
        torch.randn(BATCH, 512),
        device="cpu",
        optimizer=optimizer,
        precision=plan.precision,
        checkpointing=plan.checkpointed or None,
    )
    return rank_memory(parallel_step(model, step), plan.strategy, plan.world_size).peak_bytes


@pytest.mark.slow
def test_a_budget_only_two_fsdp_ranks_fit_gets_two_fsdp_ranks_at_rank_memorys_peak() -> None:
    plan = _fit(ONLY_TWO_FSDP_RANKS, world_size="auto")
    assert (plan.world_size, plan.strategy, plan.checkpointed, plan.precision) == (2, "fsdp", [], "fp32")
    assert plan.predicted_peak_bytes == plan.per_rank.peak_bytes == _rank_peak(plan)
    assert plan.fits and plan.unmodified_peak_bytes > plan.budget_bytes
    assert plan.launch.startswith(
        "torchrun --nproc-per-node 2 train.py: fully_shard(block) on each of layers.0"
    )
    assert any("global batch is 2 times it" in note for note in plan.notes)
    data = json.loads(json.dumps(plan.to_dict()))
    old = {"checkpointed", "precision", "offload", "predicted_peak_bytes", "unmodified_peak_bytes"}
    assert old | {"budget_bytes", "recompute_share", "device", "notes", "fits"} <= set(data)
    assert data["per_rank"]["strategy"] == "fsdp" and data["world_size"] == 2


def test_a_budget_one_device_fits_gets_no_ranks_even_when_ranks_are_allowed() -> None:
    plan = _fit(300 * MIB, world_size="auto")
    assert (plan.world_size, plan.strategy, plan.per_rank, plan.launch) == (1, None, None, "")
    assert plan.fits and plan.predicted_peak_bytes == plan.unmodified_peak_bytes


@pytest.mark.slow
def test_one_device_by_default_and_its_refusal_names_the_ranks_that_would_fit() -> None:
    with pytest.raises(
        SlimtorchError, match=r"no plan fits .* on 2 ranks with fsdp it fits: world_size='auto'"
    ):
        _fit(ONLY_TWO_FSDP_RANKS)


@pytest.mark.slow
def test_a_budget_nothing_fits_is_an_error_naming_the_least_per_rank_peak() -> None:
    with pytest.raises(SlimtorchError, match="shrink the per-rank batch") as raised:
        _fit(MIB, world_size="auto", max_world_size=16)
    named = str(raised.value).split("least per-rank peak is ")[1].split(" bytes")[0]
    model, x = Stack(), torch.randn(BATCH, 512)
    steps = [
        parallel_step(
            model, slimtorch.memory.estimate(model, x, device="cpu", precision=p, checkpointing="blocks")
        )
        for p in ("fp32", "bf16-mixed")
    ]
    least = min(
        rank_memory(s, name, n).peak_bytes
        for s in steps
        for name in ("ddp", "zero1", "fsdp")
        for n in (2, 16)
    )
    assert named == f"{least:,}"
    with pytest.raises(SlimtorchError, match=r"on 2 ranks \(ddp, zero1, fsdp\)"):
        _fit(60 * MIB, world_size=2)


@pytest.mark.slow
def test_a_fixed_world_size_takes_the_first_strategy_asked_for_that_fits() -> None:
    plan = _fit(2**30, world_size=2, strategies=["zero1", "fsdp"], optimizer="sgd")
    assert (plan.world_size, plan.strategy) == (2, "zero1") and plan.predicted_peak_bytes == _rank_peak(
        plan, "sgd"
    )
    assert "ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.SGD)" in plan.launch
    assert all(hasattr(torch.optim, OPTIMIZER_CLASSES[name]) for name in OPTIMIZERS)


def test_rank_options_are_checked_when_made() -> None:
    for bad in ({"world_size": "two"}, {"world_size": 0}, {"strategies": ["tp"]}, {"max_world_size": 0}):
        with pytest.raises(OptionError):
            slimtorch.memory.FitOptions(budget=2**30, **bad)
    assert slimtorch.memory.FitOptions(strategies="fsdp").strategies == ("fsdp",)


@pytest.mark.slow
def test_cli_fit_prints_the_proposal_and_its_json(capsys) -> None:
    from slimtorch.cli.main import main

    args = ["fit", "tests.support.models:Stack", "--input-shape", f"{BATCH},512", "--device", "cpu"]
    assert main([*args, "--budget", "100MiB", "--world-size", "auto"]) == 0
    out = capsys.readouterr().out
    assert "on 2 ranks (fsdp)" in out and "launch: torchrun --nproc-per-node 2" in out
    assert main([*args, "--budget", "100MiB", "--world-size", "auto", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["world_size"], data["strategy"]) == (2, "fsdp")
    assert main([*args, "--budget", "100MiB"]) == 2
    assert "--world-size auto" in capsys.readouterr().err
