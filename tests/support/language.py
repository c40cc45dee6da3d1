"""A tiny causal language model folder with a tokenizer of its own, and English text to read with it: what
the text paths of ``--data`` need (random weights: perplexities mean nothing, shapes and files do)."""

from __future__ import annotations

from pathlib import Path

import torch


def english(path: Path) -> Path:
    """The Python language reference ``help()`` shows (English every Python has), written to ``path``."""
    from pydoc_data.topics import topics

    path.write_text("\n\n".join(topics[key] for key in sorted(topics)), encoding="utf-8")
    return path


def tiny_lm(folder: Path, text: Path, *, tied: bool = False) -> Path:
    """A 2-layer Llama (hidden 64) saved as a Hugging Face folder with a word-level ``tokenizer.json`` of
    ``text``'s first 999 words."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = sorted(set(text.read_text(encoding="utf-8").split()))[:999]
    tokenizer = Tokenizer(
        models.WordLevel({w: i for i, w in enumerate(["[UNK]", *words])}, unk_token="[UNK]")
    )
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    transformers.logging.set_verbosity_error()
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=1000,
        tie_word_embeddings=tied,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder
