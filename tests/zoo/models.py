"""Small models with what checkpoints have in the wild: BatchNorm buffers, tied embeddings, Adam state."""

from __future__ import annotations

import itertools

import torch
from torch import nn


class MLP(nn.Module):
    def __init__(self, sizes: tuple[int, ...] = (64, 128, 128, 10)) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for n_in, n_out in itertools.pairwise(sizes):
            layers += [nn.Linear(n_in, n_out), nn.ReLU()]
        self.layers = nn.Sequential(*layers[:-1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


class SmallCNN(nn.Module):
    """Conv-BN-ReLU twice, then a linear head: has running statistics (buffers) and num_batches_tracked."""

    def __init__(self, channels: int = 16, classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, channels, 3, padding=1),
            nn.BatchNorm2d(channels),
            nn.ReLU(),
            nn.Conv2d(channels, 2 * channels, 3, padding=1),
            nn.BatchNorm2d(2 * channels),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
        )
        self.head = nn.Linear(2 * channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))


class PReLUAttentionCNN(nn.Module):
    """A CNN with per-channel PReLU slopes and a self-attention over its pixels, as audio and vision code
    builds them: pruning its channels resizes ``nn.PReLU(16).num_parameters``."""

    def __init__(self, channels: int = 16, classes: int = 10) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, channels, 3, padding=1)
        self.a1 = nn.PReLU(channels)
        self.c2 = nn.Conv2d(channels, channels, 3, padding=1)
        self.a2 = nn.PReLU()  # one shared slope: nothing to resize
        self.attention = nn.MultiheadAttention(channels, 2, batch_first=True)
        self.head = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.a2(self.c2(self.a1(self.c1(x))))
        tokens = x.flatten(2).transpose(1, 2)
        attended, _ = self.attention(tokens, tokens, tokens, need_weights=False)
        return self.head((tokens + attended).mean(dim=1))


class NormsCNN(nn.Module):
    """Per-channel PReLU slopes and the norms of image and audio code: group norms with one group and with
    one channel per group (their channels can go), one with groups of four channels (kept whole), an
    instance norm with weights, and a transposed convolution that upsamples."""

    def __init__(self, channels: int = 16, classes: int = 10) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, channels, 3, padding=1)
        self.n1 = nn.GroupNorm(1, channels)
        self.a1 = nn.PReLU(channels)
        self.c2 = nn.Conv2d(channels, channels, 3, padding=1)
        self.n2 = nn.GroupNorm(channels, channels)
        self.a2 = nn.PReLU(channels)
        self.up = nn.ConvTranspose2d(channels, channels, 2, stride=2)
        self.n3 = nn.InstanceNorm2d(channels, affine=True)
        self.c3 = nn.Conv2d(channels, channels, 3, padding=1)
        self.n4 = nn.GroupNorm(4, channels)
        self.head = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.a1(self.n1(self.c1(x)))
        x = self.a2(self.n2(self.c2(x)))
        x = torch.relu(self.n3(self.up(x)))
        x = torch.relu(self.n4(self.c3(x)))
        return self.head(x.mean(dim=(2, 3)))


class BagOfWords(nn.Module):
    """A text classifier as torchtext's tutorial builds it: the mean of each text's word vectors
    (``nn.EmbeddingBag``), then two linear layers. Its input is ``(texts, words)`` token ids."""

    def __init__(self, vocabulary: int = 64, dim: int = 16, hidden: int = 16, classes: int = 4) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(vocabulary, dim, mode="mean")
        self.hidden = nn.Linear(dim, hidden)
        self.head = nn.Linear(hidden, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.hidden(self.bag(tokens))))


class TinyGPT(nn.Module):
    """A two-block decoder whose output head shares its weight with the token embedding (a tie)."""

    def __init__(self, vocab: int = 512, dim: int = 64, blocks: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(dim, nhead=4, dim_feedforward=4 * dim, batch_first=True)
            for _ in range(blocks)
        )
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def trained_checkpoint(model: nn.Module, example: torch.Tensor, steps: int = 2) -> dict:
    """A training checkpoint as people save them: model, AdamW state, scheduler, epoch."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10)
    for _ in range(steps):
        optimizer.zero_grad()
        model(example).float().pow(2).mean().backward()
        optimizer.step()
        scheduler.step()
    return {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "lr_scheduler": scheduler.state_dict(),
        "epoch": 3,
    }
