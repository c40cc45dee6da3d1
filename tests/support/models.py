"""Small models the tests of several files build (never a test module: issue 47)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class Blocks(nn.Module):
    """Four residual MLP blocks in an nn.ModuleList (what checkpointing="blocks" finds), and a head."""

    def __init__(self, width: int = 256, hidden: int = 1024) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width)) for _ in range(4)
        )
        self.head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


BATCH = 64


class Stack(nn.Module):
    """Blocks in an ``nn.ModuleList``, the way transformers hold their layers."""

    def __init__(self, blocks: int = 4, width: int = 512, hidden: int = 2048) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(width, hidden), nn.ReLU(), nn.Linear(hidden, width))
            for _ in range(blocks)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class TokenMLP(nn.Module):
    """An embedding, a 2-layer MLP over 256 features, a head: what quantize swaps, in one small model."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(300, 256)
        self.up = nn.Linear(256, 512)
        self.down = nn.Linear(512, 256)
        self.head = nn.Linear(256, 10, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        return self.head(h + self.down(F.gelu(self.up(h))))


def token_ids(batch: int = 4, seq: int = 16) -> torch.Tensor:
    return torch.randint(0, 300, (batch, seq), generator=torch.Generator().manual_seed(1))


class VoiceEncoder(nn.Module):
    """resemblyzer's speaker encoder, with the similarity parameters its training checkpoint also holds.
    Like the original, the constructor moves the model to a device."""

    def __init__(self, rnn_name: str = "lstm") -> None:
        super().__init__()
        setattr(self, rnn_name, nn.LSTM(40, 256, 3, batch_first=True))
        self.rnn_name = rnn_name
        self.linear = nn.Linear(256, 256)
        self.similarity_weight = nn.Parameter(torch.tensor([10.0]))
        self.similarity_bias = nn.Parameter(torch.tensor([-5.0]))
        self.to(torch.device("cpu"))

    def forward(self, mels: torch.Tensor) -> torch.Tensor:
        _, (hidden, _) = getattr(self, self.rnn_name)(mels)
        return torch.relu(self.linear(hidden[-1]))
