"""The models of the fresh-process round trips (:mod:`tests.test_fresh_process`), in a module of their own:
the command line builds them from ``tests/fresh_models.py:Name`` and a reader process imports them as a
user's script imports its own model code, beside ``import slimtorch`` and nothing else of ours."""

from __future__ import annotations

import torch
from torch import nn


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(64, 128), nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


class DigitsNet(nn.Module):
    """8x8 digit images to 10 classes: BatchNorm, a per-channel PReLU, a depthwise convolution."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1),
            nn.BatchNorm2d(16),
            nn.PReLU(16),
            nn.Conv2d(16, 16, 3, padding=1, groups=16),
            nn.Conv2d(16, 32, 1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
        )
        self.classifier = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.features(x), 1))


INPUTS = {"MLP": (4, 64), "DigitsNet": (2, 1, 8, 8)}


def example(name: str) -> torch.Tensor:
    return torch.randn(*INPUTS[name], generator=torch.Generator().manual_seed(7))
