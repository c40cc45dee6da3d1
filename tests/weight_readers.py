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


class RowLookup(nn.Module):
    """Rows taken from the embedding's table by indexing it, ``self.emb.weight[ids]``."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.mix = nn.Embedding(100, 32), nn.Linear(32, 32)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.mix(self.emb.weight[ids])


class RecurrentCast(nn.Module):
    """Casts its input to the LSTM's dtype by reading ``self.lstm.weight_ih_l0.dtype``."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm, self.head = nn.LSTM(32, 32, batch_first=True), nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(x.to(self.lstm.weight_ih_l0.dtype))
        return self.head(out)


class FusedEncoder(nn.Module):
    """torch's own encoder layers: in eval mode their forward checks (and runs) a fused path that reads
    ``linear1.weight`` and ``linear2.weight`` itself, unless some module in the layer has a hook."""

    def __init__(self) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(32, 4, 64, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x))


class ForwardCaller(nn.Module):
    """Calls its layer's ``forward`` by name, not the layer: its weight is read inside its own forward."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.proj = nn.Linear(32, 64), nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj.forward(torch.relu(self.up(x)))
