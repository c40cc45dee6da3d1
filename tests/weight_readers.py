"""Models whose forward reads a layer's weight itself, as real audio and vision code does (a module of its
own so that a fresh process, or the command line, can import them: ``tests/weight_readers.py:KeyReader``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class KeyReader(nn.Module):
    """Self-attention whose keys are ``x @ self.key.weight.T``."""

    def __init__(self) -> None:
        super().__init__()
        self.query, self.key, self.out = nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        keys = x @ self.key.weight.T
        scores = self.query(x) @ keys.transpose(-1, -2) / 32**0.5
        return self.out(torch.softmax(scores, dim=-1) @ x)


class FunctionalProjection(nn.Module):
    """``F.linear(x, self.proj.weight, self.proj.bias)`` instead of calling the layer."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.proj = nn.Linear(32, 64), nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(torch.relu(self.up(x)), self.proj.weight, self.proj.bias)


class TiedHead(nn.Module):
    """Tokens in, logits out through the embedding's own table (tied by hand, not by parameter sharing)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.mix = nn.Embedding(100, 32), nn.Linear(32, 32)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.mix(self.embed(ids))) @ self.embed.weight.t()
