"""The memory verbs in the one verb shape: options as a dataclass or as keywords give the same report, an
unknown keyword names the fields there are, a bad value is an OptionError before any step runs, and each
report is JSON its schema describes."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

import slimtorch
from slimtorch import memory
from slimtorch.format.progress import Recorder
from slimtorch.memory import BatchSizeOptions, FitOptions, StepOptions
from tests.support.models import Blocks

X = torch.randn(8, 256)


def _limited(limit: int):
    """A training step that fits up to ``limit`` samples and runs out of memory, as CUDA says it, above."""

    def step(batch_size: int) -> None:
        if batch_size > limit:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    return step


def _estimate_at_two_sizes() -> memory.MemoryReport:
    return memory.estimate(Blocks(), X, batch_sizes=[64, 128], mode="inference", device="cpu")


@pytest.mark.slow
def test_estimate_and_profile_take_step_options_or_the_same_fields_as_keywords() -> None:
    model = Blocks()
    options = StepOptions(mode="inference", batch_sizes=(8, 16), device="cpu")
    by_keywords = memory.estimate(model, X, mode="inference", batch_sizes=[8, 16], device="cpu")
    assert memory.estimate(model, X, options).to_dict() == by_keywords.to_dict()
    mixed = memory.estimate(model, X, StepOptions(mode="inference"), batch_sizes=[8, 16], device="cpu")
    assert mixed.to_dict() == by_keywords.to_dict()
    measured = [s.peak_bytes for s in memory.profile(model, X, options).steps]
    assert measured == [s.peak_bytes for s in by_keywords.steps]  # the same step, run for real


def test_find_batch_size_takes_batch_size_options_or_the_same_fields_as_keywords() -> None:
    report = _estimate_at_two_sizes()
    budget = report.predict(1000)
    step = _limited(int(0.85 * report.largest_batch(budget)))
    by_options = memory.find_batch_size(step, report, BatchSizeOptions(budget=budget, margin=0.0))
    by_keywords = memory.find_batch_size(step, report, budget=budget, margin=0.0)
    assert by_options.batch_size == by_keywords.batch_size
    assert [(t.batch_size, t.fits) for t in by_options.trials] == [
        (t.batch_size, t.fits) for t in by_keywords.trials
    ]


@pytest.mark.slow
def test_fit_takes_fit_options_or_the_same_fields_as_keywords_and_holds_the_model() -> None:
    model, x = Blocks(), torch.randn(4096, 256)
    every = memory.estimate(model, x, checkpointing="blocks", device="cpu").steps[0].peak_bytes
    budget = int(every * 0.97)
    by_options = memory.fit(model, x, FitOptions(budget=budget, device="cpu"))
    by_options.remove()
    by_keywords = memory.fit(model, x, budget=budget, device="cpu")
    assert by_keywords.model is model and "forward" in vars(model)  # changed in place, and held
    by_keywords.remove()
    assert by_options.to_dict() == by_keywords.to_dict() and by_options.precision == "bf16-mixed"


@pytest.mark.parametrize(
    ("call", "fields"),
    [
        (
            lambda: memory.estimate(Blocks(), X, batch_size=[8]),
            "StepOptions has: accumulation, batch_sizes, checkpointing",
        ),
        (lambda: memory.profile(Blocks(), X, optimiser="sgd"), "StepOptions has: accumulation, batch_sizes"),
        (
            lambda: memory.find_batch_size(_limited(8), _estimate_at_two_sizes(), trials=2),
            "BatchSizeOptions has: budget, device, margin, max_trials",
        ),
        (
            lambda: memory.fit(Blocks(), X, budget=2**30, offload=False),
            "FitOptions has: allow_checkpointing, allow_offload, allow_precision, apply, budget, device, "
            "margin, max_world_size, optimizer, strategies, world_size",
        ),
    ],
    ids=["estimate", "profile", "find_batch_size", "fit"],
)
def test_an_unknown_keyword_is_an_option_error_naming_the_fields(call, fields) -> None:
    with pytest.raises(slimtorch.OptionError, match="unknown option") as refused:
        call()
    assert fields in str(refused.value)


def test_bad_values_are_option_errors_when_the_options_are_made() -> None:
    cases = [
        (lambda: StepOptions(batch_sizes=8), "batch_sizes is a list of batch sizes"),
        (lambda: StepOptions(checkpointing=[3]), "checkpointing takes module names"),
        (lambda: BatchSizeOptions(margin=1.0), "margin must be a share of the budget"),
        (lambda: BatchSizeOptions(max_trials=0), "max_trials must be a positive integer"),
        (lambda: BatchSizeOptions(budget=-1), "budget must be a positive number of bytes"),
        (lambda: FitOptions(optimizer="lion"), "unknown optimizer 'lion'"),
        (lambda: FitOptions(device="mps"), "device must be cpu or cuda"),
        (lambda: FitOptions(allow_offload="no"), "allow_offload must be True or False"),
    ]
    for make, message in cases:
        with pytest.raises(slimtorch.OptionError, match=message):
            make()


def test_options_take_lists_and_the_command_lines_blocks_and_keep_tuples() -> None:
    options = StepOptions(batch_sizes=[8, 16], checkpointing=["blocks"], device=torch.device("cpu"))
    assert options == StepOptions(batch_sizes=(8, 16), checkpointing="blocks", device="cpu")
    assert StepOptions(checkpointing=[]).checkpointing is None
    assert hash(StepOptions(checkpointing=["blocks.0"]))  # frozen and hashable: a recipe can key on it


def test_fit_needs_a_budget_and_says_where_it_goes_now() -> None:
    with pytest.raises(slimtorch.OptionError, match="fit needs a budget"):
        memory.fit(Blocks(), X)
    with pytest.raises(slimtorch.OptionError, match=r"fit\(model, example_inputs, budget=\.\.\.\)"):
        memory.fit(Blocks(), 2**30, X)  # the order before the one verb shape


@pytest.mark.slow
def test_progress_hears_of_each_step() -> None:
    recorder = Recorder()
    memory.estimate(Blocks(), X, batch_sizes=[8, 16], device="cpu", progress=recorder)
    assert recorder.events == [
        ("begin", "estimating memory", 2, "steps"),
        ("advance", 1),
        ("advance", 1),
        ("end",),
    ]
    recorder = Recorder()
    report = _estimate_at_two_sizes()
    found = memory.find_batch_size(_limited(100), report, budget=report.predict(200), progress=recorder)
    assert recorder.labels == ["finding the batch size"]
    assert recorder.events.count(("advance", 1)) == len(found.trials)


def _conforms(value: Any, schema: dict[str, Any]) -> bool:
    """Whether ``value`` has the JSON types ``schema`` asks for (the parts of JSON Schema reports use)."""
    if "anyOf" in schema:
        return any(_conforms(value, option) for option in schema["anyOf"])
    if "const" in schema:
        return value == schema["const"]
    kinds = {
        "integer": int,
        "number": (int, float),
        "string": str,
        "boolean": bool,
        "null": type(None),
        "array": list,
        "object": dict,
    }
    kind = schema.get("type")
    if kind is None:
        return True
    if not isinstance(value, kinds[kind]) or (kind in ("integer", "number") and isinstance(value, bool)):
        return False
    if kind == "array":
        return all(_conforms(item, schema.get("items", {})) for item in value)
    if kind == "object" and "properties" in schema:
        properties = schema["properties"]
        return set(value) == set(properties) and all(_conforms(value[k], properties[k]) for k in value)
    if kind == "object" and "additionalProperties" in schema:
        return all(_conforms(item, schema["additionalProperties"]) for item in value.values())
    return True


@pytest.mark.slow
def test_every_memory_report_is_json_its_schema_describes_key_for_key() -> None:
    report = memory.estimate(Blocks(), X, batch_sizes=[8, 16], checkpointing="blocks", device="cpu")
    searched = _estimate_at_two_sizes()
    found = memory.find_batch_size(_limited(100), searched, budget=searched.predict(200), margin=0.0)
    model, x = Blocks(), torch.randn(512, 256)
    plan = memory.fit(model, x, budget=10**9, device="cpu")
    plan.remove()
    expected = {
        memory.MemoryReport: "slimtorch.memory/1",
        memory.BatchSizeResult: "slimtorch.batch-size/1",
        memory.FitPlan: "slimtorch.fit/1",
    }
    for result in (report, found, plan):
        data = json.loads(json.dumps(result.to_dict()))
        schema = type(result).json_schema()
        assert data["schema"] == schema["title"] == expected[type(result)]
        assert set(data) == set(schema["properties"]), type(result).__name__
        assert _conforms(data, schema), type(result).__name__
    assert "model" not in plan.to_dict() and "fits" in plan.to_dict()
    assert report.to_dict()["peak_bytes"] == report.peak_bytes
