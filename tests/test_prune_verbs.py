"""The pruning verbs in the one shape: options as a frozen dataclass or as keyword overrides of its fields
(the same result either way), values checked when the options are made, an unknown keyword an error that
names the fields, and a report that holds the pruned model and whose JSON its schema describes."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch import nn

from slimtorch.errors import OptionError
from slimtorch.format.progress import Recorder
from slimtorch.prune import (
    ChannelOptions,
    PruneReport,
    ScanOptions,
    SensitivityReport,
    SparsityOptions,
    SparsityReport,
    channels,
    scan,
    weights,
)
from slimtorch.prune.budget import TRIALS

X = torch.randn(4, 3, 16, 16)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv1, self.bn1 = nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16)
        self.conv2 = nn.Conv2d(16, 16, 3, padding=1)
        self.fc = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.conv2(torch.relu(self.bn1(self.conv1(x)))))
        return self.fc(x.mean((2, 3)))


def _json_fits_schema(report) -> dict:
    data = json.loads(json.dumps(report.to_dict()))
    assert set(data) <= set(type(report).json_schema()["properties"])
    assert data["schema"] == type(report).SCHEMA
    return data


# -- channels ------------------------------------------------------------------------------------------------
def test_channel_options_by_dataclass_and_by_override_prune_the_same_channels() -> None:
    by_options, by_keywords = Net().eval(), Net().eval()
    first = channels(by_options, X, ChannelOptions(ratio=0.5, importance="l1", ignore=["conv2"]))
    second = channels(by_keywords, X, ratio=0.5, importance="l1", ignore=["conv2"])
    assert first == second and first.channels_after < first.channels_before
    pairs = zip(by_options.state_dict().values(), by_keywords.state_dict().values(), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)
    third = channels(
        Net().eval(), X, ChannelOptions(ratio=0.9), ratio=0.5, importance="l1", ignore=("conv2",)
    )
    assert third == first  # an override replaces the field of the options given


def test_a_bad_channel_option_fails_when_the_options_are_made_before_any_model_is_touched() -> None:
    with pytest.raises(OptionError, match=r"ratio must be at least 0 and below 1, not 1\.5"):
        ChannelOptions(ratio=1.5)
    with pytest.raises(OptionError, match="unknown importance 'l3'"):
        ChannelOptions(ratio=0.5, importance="l3")
    with pytest.raises(OptionError, match="exactly one of ratio, target_params or target_macs"):
        ChannelOptions(ratio=0.5, target_params=1000)
    model = Net().eval()
    with pytest.raises(OptionError, match="exactly one of ratio, target_params or target_macs"):
        channels(model, X)  # no budget at all: refused by the verb, the defaults alone name none
    assert model.conv1.out_channels == 16


def test_an_unknown_channels_keyword_is_an_option_error_naming_the_fields() -> None:
    with pytest.raises(OptionError, match=r"unknown option 'raito'.*ChannelOptions has: .*ratio.*round_to"):
        channels(Net().eval(), X, raito=0.5)


def test_ignore_given_as_a_list_or_one_name_is_kept_as_a_tuple() -> None:
    assert ChannelOptions(ratio=0.5, ignore=["fc", "conv2"]).ignore == ("fc", "conv2")
    assert ChannelOptions(ratio=0.5, ignore="fc").ignore == ("fc",)  # a name, not its letters


def test_the_prune_report_holds_the_model_and_its_json_fits_the_schema() -> None:
    model = Net().eval()
    report = channels(model, X, ratio=0.5)
    assert isinstance(report, PruneReport) and report.model is model
    data = _json_fits_schema(report)
    assert data["schema"] == "slimtorch.prune/1" and "model" not in data
    assert data["delta"]["shapes"]["conv1.weight"] == [8, 3, 3, 3]


def test_each_stage_of_each_pruning_step_is_told_to_progress() -> None:
    recorder = Recorder()
    channels(Net().eval(), X, ratio=0.5, iterative_steps=3, progress=recorder)
    stages = [
        f"{stage} (step {i} of 3)"
        for i in (1, 2, 3)
        for stage in ("capturing the graph", "removing channels")
    ]
    assert recorder.labels == [*stages, "checking the pruned model runs"]
    assert recorder.events.count(("end",)) == 7 and recorder.events[-1] == ("end",)


def test_the_budget_search_counts_each_pruned_copy_it_measures() -> None:
    budget = Recorder()
    channels(Net().eval(), X, target_params=2000, progress=budget)
    assert budget.labels == [
        "capturing the graph",
        "finding the ratio for the budget",
        "capturing the graph",
        "removing channels",
        "checking the pruned model runs",
    ]
    search = budget.events.index(("begin", "finding the ratio for the budget", TRIALS, "steps"))
    measured = budget.events[search + 1 : budget.events.index(("end",), search)]
    assert measured == [("advance", 1)] * TRIALS  # no pruning, 99%, then every bisection step


# -- weights -------------------------------------------------------------------------------------------------
def test_an_amount_in_the_options_place_is_shorthand_for_sparsity_options() -> None:
    models = [Net() for _ in range(3)]
    reports = [
        weights(models[0], 0.7, method="layer_magnitude"),
        weights(models[1], SparsityOptions(amount=0.7, method="layer_magnitude")),
        weights(models[2], amount=0.7, method="layer_magnitude"),
    ]
    assert reports[0] == reports[1] == reports[2] and reports[0].sparsity == pytest.approx(0.7, abs=0.01)
    assert all(r.model is m for r, m in zip(reports, models, strict=True))
    by_layer = weights(Net(), {"conv*": 0.5})
    assert set(by_layer.layers) == {"conv1", "conv2"}


def test_a_bad_sparsity_option_fails_when_the_options_are_made() -> None:
    with pytest.raises(OptionError, match=r"amount must be at least 0 and below 1, not 1\.0"):
        SparsityOptions(amount={"conv*": 1.0})
    with pytest.raises(OptionError, match="method must be one of"):
        SparsityOptions(0.5, method="random")
    with pytest.raises(OptionError, match="n:m needs 0 < n < m, not 4:4"):
        SparsityOptions(0.5, method="n:m", n=4)
    with pytest.raises(
        OptionError, match=r"unknown option 'amout'.*SparsityOptions has: amount, m, method, n, n_m, skip"
    ):
        weights(Net(), amout=0.5)
    with pytest.raises(OptionError, match="needs an amount"):
        weights(Net())


def test_sparsity_options_keep_their_own_copy_of_a_mapping() -> None:
    plan = {"conv*": 0.5}
    options = SparsityOptions(plan)
    plan["fc"] = 0.9
    assert options.amount == {"conv*": 0.5}


def test_skip_leaves_a_layer_dense_and_the_one_threshold_spans_the_rest() -> None:
    model, twin = Net(), Net()
    report = weights(model, 0.6, skip="conv*")  # one pattern or several
    assert set(report.layers) == {"fc"} and report.sparsity == pytest.approx(0.6, abs=0.01)
    assert bool((model.conv1.weight != 0).all()) and bool((model.conv2.weight != 0).all())
    global_rest = weights(twin, SparsityOptions(0.6, skip=("conv1",)))
    assert set(global_rest.layers) == {"conv2", "fc"}
    assert global_rest.sparsity == pytest.approx(0.6, abs=0.01)  # over conv2 and fc together
    assert global_rest.layers["conv2"] != pytest.approx(global_rest.layers["fc"], abs=0.02)
    with pytest.raises(
        OptionError, match=r"skip: 'cnov1' names no Linear, Conv or recurrent layer \(closest"
    ):
        weights(Net(), 0.5, skip=("cnov1",))


def test_the_sparsity_report_holds_the_model_and_its_json_fits_the_schema() -> None:
    model = Net()
    report = weights(model, 0.5)
    assert isinstance(report, SparsityReport) and report.model is model
    data = _json_fits_schema(report)
    assert data["schema"] == "slimtorch.sparsity/1"
    assert set(data) == {
        "schema",
        "layers",
        "sparsity",
        "skipped",
        "model_sparsity",
        "untouched",
        "method",
    } | {
        "by_magnitude",
        "notes",
    }
    assert data["method"] == "global_magnitude" and data["by_magnitude"] == {} and data["notes"] == []


# -- scan ----------------------------------------------------------------------------------------------------
def _agreement(reference: torch.Tensor):
    return lambda model: float(-(model(X) - reference).abs().mean())


def test_scan_options_by_dataclass_and_by_override_measure_the_same() -> None:
    model = Net().eval()
    metric = _agreement(model(X).detach())
    first = scan(model, metric, ScanOptions(amounts=[0.5, 0.9], layers=["conv2", "fc"]))
    second = scan(model, metric, amounts=(0.5, 0.9), layers=("conv2", "fc"))
    assert first == second and set(first.metrics) == {"conv2", "fc"}
    assert ScanOptions(layers="fc").layers == ("fc",)  # a name, not a substring test on it


def test_a_bad_scan_option_is_an_option_error() -> None:
    with pytest.raises(OptionError, match="amounts must be shares between 0 and 1"):
        ScanOptions(amounts=(0.5, 1.0))
    with pytest.raises(OptionError, match=r"unknown option 'amount'.*ScanOptions has: amounts, layers"):
        scan(Net(), lambda m: 0.0, amount=(0.5,))


def test_the_sensitivity_report_json_fits_the_schema_and_progress_counts_each_measurement() -> None:
    model, recorder = Net().eval(), Recorder()
    before = copy.deepcopy(model.state_dict())
    report = scan(model, _agreement(model(X).detach()), amounts=(0.5, 0.9), progress=recorder)
    assert isinstance(report, SensitivityReport)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # left as it was
    data = _json_fits_schema(report)
    assert data["schema"] == "slimtorch.sensitivity/1" and data["metrics"]["fc"].keys() == {"0.5", "0.9"}
    assert recorder.events[0] == ("begin", "scanning sensitivity", 3 * 2, "steps")
    assert recorder.events.count(("advance", 1)) == 6
