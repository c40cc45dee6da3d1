"""Models and datasets the command-line tests name by spec (``tests.support.specs:two_linears``): the
command imports them as a user's module, so they live here, not in a test module, which no test imports."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset


def recurrent() -> nn.Module:
    return nn.LSTM(40, 16, batch_first=True)


def one_linear() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 3))


def two_linears() -> nn.Module:
    """Two layers, so that pruning has a channel group to cut (one layer alone is refused)."""
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))


def mlp64() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))


def cheap_dataset() -> TensorDataset:
    """In memory and cheap to index: what DataLoader workers only slow down."""
    return TensorDataset(torch.randn(4096, 32), torch.arange(4096))


class Hinted(nn.Module):
    """A model that says which input it takes (``example_input_shape``)."""

    example_input_shape = (3, 5)

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(5, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


class TokenBag(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 8)
        self.head = nn.Linear(8, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids).mean(1))


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = Gate()
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.gate(x))


class Gate(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # control flow on a tensor's value: export cannot keep both branches
            return x * 2
        return x


class OnlyLSTM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(32, 64, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lstm(x)[0]


SCALES = torch.logspace(-3, 1, 16)


class OutlierMLP(nn.Module):
    """Six Linear layers, the first reading raw features whose scales span four decades (as power spectra
    do) through weights that make up for it (up to 10^3): int8 rows keep only its largest weights, so
    its error dominates the model's."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(*(nn.Linear(16 if i == 0 else 64, 64) for i in range(6)))
        with torch.no_grad():
            self.layers[0].weight.div_(SCALES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * SCALES  # the raw features, unnormalised
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x
