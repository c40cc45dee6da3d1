"""Small Hugging Face models built from configs (random init, no download): BERT, GPT-2, Llama with
grouped-query attention, ViT. Each entry gives a factory and an example input."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


def _transformers():
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers


def bert() -> nn.Module:
    t = _transformers()
    config = t.BertConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, vocab_size=100
    )
    return t.BertModel(config)


def gpt2() -> nn.Module:
    t = _transformers()
    return t.GPT2LMHeadModel(t.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=100, n_positions=32))


def llama() -> nn.Module:
    t = _transformers()
    config = t.LlamaConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # grouped-query attention
        intermediate_size=128,
        vocab_size=100,
    )
    return t.LlamaForCausalLM(config)


def vit() -> nn.Module:
    t = _transformers()
    config = t.ViTConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        image_size=32,
        patch_size=8,
    )
    return t.ViTModel(config)


def example(name: str) -> tuple[torch.Tensor]:
    """A batch of two for the named model: token ids, or 32x32 images for ViT."""
    generator = torch.Generator().manual_seed(0)
    if name == "vit":
        return (torch.randn(2, 3, 32, 32, generator=generator),)
    return (torch.randint(0, 100, (2, 8), generator=generator),)


def main_output(output: object) -> torch.Tensor:
    """Logits for language models, the last hidden state for encoders."""
    logits = getattr(output, "logits", None)
    return logits if logits is not None else output.last_hidden_state  # type: ignore[attr-defined]


TRANSFORMERS: dict[str, Callable[[], nn.Module]] = {"bert": bert, "gpt2": gpt2, "llama": llama, "vit": vit}
