"""A wild text dataset for ``slimtorch dataloader``: real sentences through all-MiniLM-L6-v2's own
tokenizer, one item at a time, as a sentence-embedding training set loads them.

The CLI names it ``tests.wild.datasets:minilm_sentences``. Items are padded to a fixed length, so torch's
default collation stacks them; the tokenizer (Rust, from ``tokenizers``) goes to the workers with the
dataset, which is what a real text pipeline asks of them.
"""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

from tests.wild.classes import MINILM
from tests.wild.inputs import SENTENCES

LENGTH = 32
"""tokens per item, padded or cut: every sentence of :data:`~tests.wild.inputs.SENTENCES` fits"""


class MiniLMSentences(Dataset):
    """``size`` items cycling through the sentences, each ``(input_ids, attention_mask)`` of
    :data:`LENGTH` tokens, tokenized when it is read."""

    def __init__(self, size: int = 2048) -> None:
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(str(MINILM / "tokenizer.json"))
        self.tokenizer.enable_truncation(LENGTH)
        self.tokenizer.enable_padding(length=LENGTH)
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        encoded = self.tokenizer.encode(SENTENCES[index % len(SENTENCES)])
        return torch.tensor(encoded.ids), torch.tensor(encoded.attention_mask)


def minilm_sentences() -> MiniLMSentences:
    return MiniLMSentences()
