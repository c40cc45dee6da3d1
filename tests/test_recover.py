"""recover: fine-tuning and distillation bring a pruned model back, on data it can learn in seconds."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import slimtorch
from slimtorch.errors import OptionError, SlimtorchError
from slimtorch.format.progress import Recorder
from slimtorch.prune import weights
from slimtorch.prune.unstructured import sparsity_of
from slimtorch.recovery import RecoverOptions, RecoverReport
from slimtorch.recovery.training import distillation_loss, recalibrate_batchnorm, recover


def _blobs(seed: int = 0, n: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    """Four Gaussian classes in 16 dimensions: learnable to ~100% by a small MLP."""
    centres = torch.randn(4, 16, generator=torch.Generator().manual_seed(42)) * 3  # the same classes
    generator = torch.Generator().manual_seed(seed)  # different samples
    labels = torch.randint(0, 4, (n,), generator=generator)
    return centres[labels] + torch.randn(n, 16, generator=generator), labels


TRAIN, TEST = _blobs(0), _blobs(1)
BATCHES = [(TRAIN[0][i : i + 64], TRAIN[1][i : i + 64]) for i in range(0, 512, 64)]


def _accuracy(model: nn.Module) -> float:
    return float((model(TEST[0]).argmax(1) == TEST[1]).float().mean())


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 4))


def _trained() -> nn.Module:
    torch.manual_seed(0)
    model = _mlp()
    recover(model, BATCHES, epochs=10, lr=1e-2, recalibrate_bn=False)
    return model.eval()


@pytest.mark.slow
def test_fine_tuning_wins_back_what_unstructured_pruning_lost_and_keeps_the_zeros() -> None:
    model = _trained()
    assert _accuracy(model) > 0.95
    weights(model, 0.9)
    damaged = _accuracy(model)
    assert damaged < 0.8  # 90% of the weights gone hurts
    sparsity = sparsity_of(model).sparsity
    report = recover(model, BATCHES, epochs=5, lr=1e-2, eval_fn=_accuracy)
    assert _accuracy(model) > max(0.9, damaged)
    assert sparsity_of(model).sparsity == sparsity  # keep_sparse held every zero
    assert report.steps == 40 and report.metrics[-1][1] == _accuracy(model)


@pytest.mark.slow
def test_distillation_teaches_a_pruned_student_its_teacher_with_the_hinton_loss() -> None:
    teacher = _trained()
    student = _trained()
    slimtorch.prune.channels(student, TRAIN[0][:4], ratio=0.75)
    assert student[0].out_features == 16
    with torch.no_grad():
        before = float(distillation_loss(student(TRAIN[0]), teacher(TRAIN[0]), 4.0))
    recover(student, BATCHES, teacher=teacher, epochs=5, lr=1e-2, features={"2": "2"})
    with torch.no_grad():
        after = float(distillation_loss(student(TRAIN[0]), teacher(TRAIN[0]), 4.0))
    assert after < before and _accuracy(student) > 0.9


class _HuggingFaceStyle(nn.Module):
    """A classifier answering as transformers' models do: a ``ModelOutput`` whose first field is the
    logits."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor):
        from transformers.modeling_outputs import SequenceClassifierOutput

        return SequenceClassifierOutput(logits=self.inner(x))


def test_a_model_answering_with_a_model_output_trains_and_distils_on_its_logits() -> None:
    teacher = _HuggingFaceStyle(_trained())
    torch.manual_seed(1)
    student = _HuggingFaceStyle(_mlp())
    before = _accuracy(lambda x: student.eval()(x).logits)
    recover(student, BATCHES, teacher=teacher, epochs=5, lr=1e-2)
    assert _accuracy(lambda x: student.eval()(x).logits) > max(0.9, before)


def test_training_stops_once_the_metric_reaches_its_target() -> None:
    model = _mlp()
    report = recover(model, BATCHES, steps=200, lr=1e-2, eval_fn=_accuracy, target=0.9, eval_every=8)
    assert report.stopped_early and report.steps < 200 and report.metrics[-1][1] >= 0.9


def test_batchnorm_statistics_are_re_estimated_from_the_data() -> None:
    model = _mlp()
    shifted = [(x + 5.0, y) for x, y in BATCHES]
    assert recalibrate_batchnorm(model, shifted) == len(BATCHES)
    with torch.no_grad():
        features = model[0](torch.cat([x for x, _ in shifted]))
    assert torch.allclose(model[1].running_mean, features.mean(0), atol=1e-4)
    assert model[1].momentum == 0.1  # put back


def test_distillation_loss_is_zero_for_identical_outputs_and_scaled_by_t_squared() -> None:
    logits = torch.randn(8, 5)
    assert float(distillation_loss(logits, logits, 4.0)) == pytest.approx(0.0, abs=1e-6)
    other = torch.randn(8, 5)
    kl_t1 = float(distillation_loss(logits, other, 1.0))
    assert kl_t1 > 0


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({}, "exactly one of steps or epochs"),
        ({"steps": 3, "epochs": 1}, "exactly one of steps or epochs"),
        ({"steps": 3, "alpha": 2.0}, "alpha"),
        ({"steps": 3, "features": {"0": "0"}}, "needs a teacher"),
    ],
)
def test_bad_arguments_are_clear_errors(kwargs, words) -> None:
    with pytest.raises(SlimtorchError, match=words):
        recover(_mlp(), BATCHES, **kwargs)


def test_recover_options_by_dataclass_and_by_override_train_the_same() -> None:
    reports = []
    for how in ("options", "overrides"):
        torch.manual_seed(0)
        model = _mlp()
        if how == "options":
            reports.append(recover(model, BATCHES, RecoverOptions(steps=12, lr=1e-2), eval_fn=_accuracy))
        else:
            reports.append(recover(model, BATCHES, steps=12, lr=1e-2, eval_fn=_accuracy))
        assert reports[-1].model is model
    assert reports[0] == reports[1] and reports[0].steps == 12


def test_a_bad_recover_option_fails_when_the_options_are_made() -> None:
    with pytest.raises(OptionError, match="exactly one of steps or epochs"):
        RecoverOptions(steps=3, epochs=1)
    with pytest.raises(OptionError, match="temperature positive"):
        RecoverOptions(steps=3, temperature=0)
    with pytest.raises(OptionError, match=r"unknown option 'epoch'.*RecoverOptions has: alpha, epochs"):
        recover(_mlp(), BATCHES, epoch=1)


def test_the_recover_report_holds_the_model_its_json_fits_the_schema_and_progress_counts_steps() -> None:
    model, recorder = _mlp(), Recorder()
    report = recover(model, BATCHES, steps=4, eval_fn=_accuracy, eval_every=2, progress=recorder)
    assert isinstance(report, RecoverReport) and report.model is model
    data = json.loads(json.dumps(report.to_dict()))
    assert set(data) <= set(RecoverReport.json_schema()["properties"])
    assert data == {
        "schema": "slimtorch.recover/1",
        "steps": 4,
        "final_loss": report.final_loss,
        "metrics": [list(pair) for pair in report.metrics],
        "stopped_early": False,
    }
    assert [step for step, _ in report.metrics] == [2, 4]
    assert (
        recorder.events[0] == ("begin", "recovering", 4, "steps")
        and recorder.events.count(("advance", 1)) == 4
    )
