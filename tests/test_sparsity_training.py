"""Sparsity that holds: zeros stay zero through every optimizer's steps (gradual pruning, keep_sparse,
recover), recurrent layers are pruned too, and the report's numbers are the model's own."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

import slimtorch
from slimtorch.prune import GradualPruner, keep_sparse, weights
from slimtorch.prune.unstructured import prunable_weights, sparsity_of
from slimtorch.recovery.training import recover

RESEMBLYZER = Path(__file__).parents[1] / ".venv/lib/python3.11/site-packages/resemblyzer/pretrained.pt"

OPTIMIZERS: dict[str, Callable[[list[nn.Parameter]], torch.optim.Optimizer]] = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01),
    "sgd-momentum": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=1e-4),
    "adam-weight-decay": lambda params: torch.optim.Adam(params, lr=1e-2, weight_decay=1e-4),
}


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 4))


def _train_step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    inputs, labels = torch.randn(32, 32), torch.randint(0, 4, (32,))
    optimizer.zero_grad()
    nn.functional.cross_entropy(model(inputs), labels).backward()
    optimizer.step()


def _zeros(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: weight.detach() == 0 for name, weight in prunable_weights(model).items()}


@pytest.mark.slow
@pytest.mark.parametrize("which", list(OPTIMIZERS))
def test_gradual_pruning_to_80pct_ends_at_80pct_and_zeros_hold_after_every_optimizer_step(which) -> None:
    model = _mlp()
    optimizer = OPTIMIZERS[which](list(model.parameters()))
    pruner = GradualPruner(model, 0.8, start=0, end=50, every=5)
    reached, held = 0.0, 0.0
    for _ in range(80):
        _train_step(model, optimizer)
        assert sparsity_of(model).sparsity >= held  # the optimizer revived no zero since the last pruning
        share = pruner.step()
        reached = share if share is not None else reached
        held = sparsity_of(model).sparsity
        assert held == pytest.approx(reached, abs=1e-3)
    assert reached == pytest.approx(0.8)
    assert sparsity_of(model).sparsity == pytest.approx(0.8, abs=0.01)
    pruner.remove()
    _train_step(model, optimizer)  # the control: without the pruner's hooks, the moments revive the zeros
    assert sparsity_of(model).sparsity < 0.7


@pytest.mark.slow
@pytest.mark.parametrize("which", ["adamw", "sgd-momentum"])
def test_recover_keeps_every_zero_with_adamw_and_sgd_momentum(which) -> None:
    model = _mlp()
    weights(model, 0.8)
    zeros = _zeros(model)
    before = [w.detach().clone() for w in prunable_weights(model).values()]
    batches = [(torch.randn(32, 32), torch.randint(0, 4, (32,))) for _ in range(5)]
    recover(model, batches, steps=30, optimizer=OPTIMIZERS[which], recalibrate_bn=False)
    after = _zeros(model)
    assert all(torch.equal(after[name], zeros[name]) for name in zeros)
    moved = [w.detach() for w in prunable_weights(model).values()]
    assert all(not torch.equal(a, b) for a, b in zip(moved, before, strict=True))  # it did train


def test_keep_sparse_holds_zeros_an_optimizer_with_momentum_from_before_pruning_would_revive() -> None:
    model = _mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for _ in range(3):
        _train_step(model, optimizer)  # momentum gathered while the weights were dense
    weights(model, 0.8)
    zeros = _zeros(model)
    with keep_sparse(model):
        for _ in range(3):
            _train_step(model, optimizer)
            assert all(torch.equal(w.detach() == 0, zeros[k]) for k, w in prunable_weights(model).items())
    _train_step(model, optimizer)  # the control: the same momentum, no hooks
    assert sparsity_of(model).sparsity < 0.5


def test_two_forwards_before_one_backward_still_work_under_keep_sparse() -> None:
    model = _mlp()
    weights(model, 0.5)
    with keep_sparse(model):
        loss = model(torch.randn(4, 32)).sum() + model(torch.randn(4, 32)).sum()  # a siamese-style loss
        loss.backward()  # the pre-forward check wrote nothing, so the first graph is intact
    assert sparsity_of(model).sparsity == pytest.approx(0.5, abs=1e-3)


class SpeakerEncoder(nn.Module):
    """resemblyzer's voice encoder: a 3-layer LSTM 40 -> 256, a Linear 256 -> 256, two scalars."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(40, 256, 3, batch_first=True)
        self.linear = nn.Linear(256, 256)
        self.similarity_weight = nn.Parameter(torch.tensor([10.0]))
        self.similarity_bias = nn.Parameter(torch.tensor([-5.0]))

    def forward(self, mels: torch.Tensor) -> torch.Tensor:
        _, (hidden, _) = self.lstm(mels)
        return nn.functional.normalize(torch.relu(self.linear(hidden[-1])), dim=1)


def _all_zeros(model: nn.Module) -> float:
    params = list(model.parameters())
    return sum(int((p == 0).sum()) for p in params) / sum(p.numel() for p in params)


@pytest.mark.slow
@pytest.mark.skipif(not RESEMBLYZER.is_file(), reason="resemblyzer's checkpoint is not installed")
def test_resemblyzers_real_lstm_checkpoint_really_gets_90pct_zeros_and_the_report_is_the_models() -> None:
    state = slimtorch.load(RESEMBLYZER).tensors
    model = SpeakerEncoder()
    prefix = "model_state."
    model.load_state_dict({k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)})
    mels = torch.randn(2, 10, 40)
    dense = model(mels).detach()
    report = weights(model, 0.9)
    assert report.sparsity == pytest.approx(0.9, abs=1e-4)
    assert report.model_sparsity == pytest.approx(_all_zeros(model), abs=1e-9)  # counted, not assumed
    assert report.model_sparsity > 0.88  # was 4.2% when only the Linear was pruned
    assert {"lstm.weight_ih_l0", "lstm.weight_hh_l2", "linear"} <= set(report.layers)
    assert set(report.untouched) == {"LSTM", "Linear", "SpeakerEncoder"}  # biases and the two scalars
    assert report.untouched["LSTM"] == pytest.approx(
        6 * 1024 / sum(p.numel() for p in model.parameters()), abs=1e-4
    )
    assert "in the whole model" in report.summary and "LSTM" in report.summary
    cosine = nn.functional.cosine_similarity(model(mels), dense).min()
    assert torch.isfinite(cosine)  # the pruned LSTM still runs


def test_gru_matrices_are_pruned_and_held_through_training() -> None:
    model = nn.Sequential(nn.GRU(16, 32, 2), nn.Linear(32, 4))
    report = weights(model, 0.7)
    assert set(report.layers) == {"0.weight_ih_l0", "0.weight_hh_l0", "0.weight_ih_l1", "0.weight_hh_l1", "1"}
    zeros = _zeros(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    with keep_sparse(model):
        for _ in range(3):
            optimizer.zero_grad()
            output, _ = model[0](torch.randn(5, 3, 16))
            model[1](output).pow(2).mean().backward()
            optimizer.step()
    assert all(torch.equal(w.detach() == 0, zeros[k]) for k, w in prunable_weights(model).items())


def test_layers_pruning_does_not_support_are_named_with_their_share_of_the_model() -> None:
    model = nn.Sequential(nn.Embedding(1000, 64), nn.LayerNorm(64), nn.Linear(64, 64, bias=False))
    report = weights(model, 0.9)
    total = 1000 * 64 + 2 * 64 + 64 * 64
    assert report.untouched == pytest.approx({"Embedding": 64000 / total, "LayerNorm": 128 / total}, abs=1e-4)
    assert report.sparsity == pytest.approx(0.9, abs=1e-3)
    assert report.model_sparsity == pytest.approx(0.9 * 64 * 64 / total, abs=1e-3)
    assert "Embedding (93.8%)" in report.summary


def test_patterns_select_a_recurrent_layer_by_its_name_or_a_matrix_by_its_own() -> None:
    model = nn.Sequential(nn.LSTM(8, 16), nn.Linear(16, 4))
    assert set(weights(model, {"0": 0.5}).layers) == {"0.weight_ih_l0", "0.weight_hh_l0"}
    assert set(weights(model, {"0.weight_hh_*": 0.5}).layers) == {"0.weight_hh_l0"}
