"""A BERT-base-sized text embedder from its config (random weights, seeded) and token data for it: what
`slimtorch slim` works on in `make demo`, scored by the cosine of its embeddings to the original's.

    slimtorch slim examples/bert_base.py:bert_base --data examples/bert_base.py:tokens \\
        --goal size=0.3x --max-drop 0.01 --work bert-work

No download: the model is built from ``BertConfig()`` (BERT-base's sizes: 12 layers, hidden 768, 110M
parameters) and the tokens are random ids, so the run measures what slimming does to the model's outputs,
not to a task. ``bert_base`` seeds its initialisation, so every call builds the same weights.
"""

from __future__ import annotations

import torch
from torch import nn

SEQUENCE, BATCH, TRAIN_BATCHES, EVAL_BATCHES = 32, 8, 4, 2
metric = "cosine"  # no labels: the slimmed model is scored by its embeddings' cosine to the original's


class BertEmbedder(nn.Module):
    """BERT-base from its config; ``forward(input_ids)`` gives one embedding per sequence (mean of the
    last hidden states)."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import BertConfig, BertModel

        self.bert = BertModel(BertConfig(), add_pooling_layer=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.bert(input_ids=input_ids).last_hidden_state.mean(dim=1)


def bert_base() -> BertEmbedder:
    """BERT-base with seeded random weights (the same on every call)."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return BertEmbedder().eval()


def tokens(batch: int = BATCH, seed: int = 0) -> dict[str, object]:
    """Random token ids in BERT's vocabulary: training and held-out batches, no labels (zeros)."""
    generator = torch.Generator().manual_seed(seed)

    def batches(count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        made = []
        for _ in range(count):
            ids = torch.randint(1000, 30000, (min(batch, BATCH), SEQUENCE), generator=generator)
            made.append((ids, torch.zeros(len(ids))))
        return made

    return {"train": batches(TRAIN_BATCHES), "eval": batches(EVAL_BATCHES), "metric": metric}
