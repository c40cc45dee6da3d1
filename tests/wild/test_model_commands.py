"""The model commands on every wild checkpoint's real class: load_model gives what the package's own
loading gives, bit for bit; quantize, prune, memory and export do their job with the output compared to
the original, or refuse in one line where the architecture does not allow it (``WildModel.refusals``); the
steady-state estimate matches a real three-step training loop."""

from __future__ import annotations

import pytest

from tests.wild.matrix import run, verdict
from tests.wild.models import MODEL_ONLY, WildModel

every_model = pytest.mark.parametrize("model", MODEL_ONLY, ids=str)  # file-only ones have no class


@every_model
def test_load_model_fills_the_real_class_exactly_as_its_package_does(model: WildModel, workdir) -> None:
    outcome = run(model, "load_model", workdir)
    assert verdict(model, outcome) is None, verdict(model, outcome)


@every_model
def test_int8_dynamic_quantization_keeps_cosine_099_or_refuses_in_one_line(model: WildModel, workdir) -> None:
    outcome = run(model, "quantize", workdir)
    assert verdict(model, outcome) is None, verdict(model, outcome)
    if outcome.status != "refused":
        assert outcome.size_after < outcome.size_before


@every_model
def test_grouped_int8_weights_keep_cosine_099_through_a_saved_file(model: WildModel, workdir) -> None:
    """Issue 47's scheme added as one row on the real checkpoints: quantized, saved, loaded back."""
    outcome = run(model, "quantize-grouped", workdir)
    assert verdict(model, outcome) is None, verdict(model, outcome)


@every_model
def test_structured_pruning_removes_channels_and_runs_or_refuses_in_one_line(
    model: WildModel, workdir
) -> None:
    outcome = run(model, "prune", workdir)
    assert verdict(model, outcome) is None, verdict(model, outcome)
    if outcome.status != "refused":
        assert outcome.size_after < outcome.size_before  # parameters


@pytest.mark.slow
@every_model
def test_memory_estimate_on_fake_tensors_equals_the_real_step(model: WildModel, workdir) -> None:
    outcome = run(model, "memory", workdir)
    assert verdict(model, outcome) is None, verdict(model, outcome)


@pytest.mark.slow
@every_model
def test_steady_state_estimate_is_within_5pct_of_a_real_three_step_loop(model: WildModel, workdir) -> None:
    """Issue 20 on the real checkpoints: the estimate against :mod:`tests.wild.training_loop`'s tracker. A
    model whose step cannot run on fake tensors is skipped with slimtorch's one-line reason, not passed."""
    outcome = run(model, "steady-state", workdir)
    assert verdict(model, outcome) is None, verdict(model, outcome)
    if outcome.status == "refused":
        pytest.skip(f"{model}: {outcome.message}")


@pytest.mark.slow
@every_model
def test_onnx_export_agrees_with_eager_or_refuses_in_one_line(model: WildModel, workdir) -> None:
    outcome = run(model, "export", workdir)
    assert verdict(model, outcome) is None, verdict(model, outcome)
