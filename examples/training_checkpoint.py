"""Build a realistic training checkpoint, the kind that is far bigger than the model it holds.

A small decoder-only language model (tied input/output embeddings) is trained for a few steps with AdamW,
its feed-forward layers are pruned with torch.nn.utils.prune mid-training, and everything a training loop
saves goes into one torch.save file: model, optimizer, scheduler, RNG state, epoch and config.

    python examples/training_checkpoint.py demo-out/checkpoint.pt
    slimtorch inspect demo-out/checkpoint.pt
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch import nn
from torch.nn.utils import prune

CONFIG = {"vocab": 8000, "dim": 256, "blocks": 4, "heads": 4, "context": 64}


class TinyLM(nn.Module):
    def __init__(self, vocab: int, dim: int, blocks: int, heads: int, context: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, dim)
        self.positions = nn.Embedding(context, dim)
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, blocks, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.tokens.weight  # tied, as in GPT-2
        self.register_buffer("causal_mask", nn.Transformer.generate_square_subsequent_mask(context))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        n = ids.shape[1]
        x = self.tokens(ids) + self.positions(torch.arange(n))
        x = self.blocks(x, mask=self.causal_mask[:n, :n], is_causal=True)
        return self.lm_head(self.norm(x))


def build_checkpoint(steps: int = 4, seed: int = 0) -> dict:
    torch.manual_seed(seed)
    model = TinyLM(**CONFIG)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=1000)
    data = torch.randint(0, CONFIG["vocab"], (8, CONFIG["context"] + 1))
    for step in range(steps):
        if step == steps // 2:  # prune the feed-forward layers half-way, as a pruning schedule would
            for block in model.blocks.layers:
                prune.l1_unstructured(block.linear1, "weight", amount=0.5)
                prune.l1_unstructured(block.linear2, "weight", amount=0.5)
        logits = model(data[:, :-1])
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), data[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()
    return {
        "epoch": 1,
        "global_step": steps,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "lr_scheduler": scheduler.state_dict(),
        "rng_state": torch.get_rng_state(),
        "config": dict(CONFIG),
        "loss": loss.item(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("out", type=Path, help="where to write the checkpoint (.pt)")
    parser.add_argument("--steps", type=int, default=4, help="training steps (default 4)")
    args = parser.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(build_checkpoint(args.steps), args.out)
    print(f"wrote {args.out} ({args.out.stat().st_size / 2**20:.1f} MiB)")


if __name__ == "__main__":
    main()
