"""Building a transformers model on meta: its weight initialisation visits only the modules it can change.

transformers runs ``_init_weights`` on every module after construction. With every parameter on meta,
that walk writes nothing for most of them (BERT-base: 228 modules, 3 ms of a 40 ms load), but some models
fill their non-persistent buffers only there: those subtrees must still be initialised.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from slimtorch.loading.construct import build_on_meta

transformers = pytest.importorskip("transformers")


class Table(nn.Module):
    """A buffer made empty by its constructor: only the model's ``_init_weights`` gives it values."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("values", torch.empty(4), persistent=False)


class Block(nn.Module):
    """Parameters of its own and a child holding a buffer that the block's initialiser finishes."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))
        self.table = Table()


class TableConfig(transformers.PretrainedConfig):
    model_type = "slimtorch-table"


class TableModel(transformers.PreTrainedModel):
    config_class = TableConfig
    base_model_prefix = "table_model"

    def __init__(self, config: TableConfig) -> None:
        super().__init__(config)
        self.proj = nn.Linear(4, 4)
        self.block = Block()
        self.post_init()

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, Table):
            module.values.copy_(torch.arange(4.0))
        elif isinstance(module, Block):  # reaches into a child's buffer from its parent
            module.scale.fill_(2.0)
            module.table.values.add_(10)


def _visits(monkeypatch: pytest.MonkeyPatch, cls: type) -> list[nn.Module]:
    seen: list[nn.Module] = []
    original = cls._init_weights

    def recording(self, module):
        seen.append(module)
        return original(self, module)

    monkeypatch.setattr(cls, "_init_weights", recording)
    return seen


def test_a_meta_build_initialises_only_the_subtrees_that_hold_buffers(monkeypatch) -> None:
    config = transformers.BertConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, vocab_size=100
    )
    seen = _visits(monkeypatch, transformers.BertPreTrainedModel)
    model = build_on_meta(lambda: transformers.BertModel(config))
    assert {type(m).__name__ for m in seen} == {"BertModel", "BertEmbeddings"}
    assert torch.equal(model.embeddings.position_ids, torch.arange(512).expand(1, -1))
    assert all(getattr(m, "_is_hf_initialized", False) for m in model.modules())
    seen.clear()
    transformers.BertModel(config)  # built for real: every module is initialised, as transformers does
    assert sum(isinstance(m, nn.Linear) for m in seen) == 2 * 6 + 1


def test_buffers_filled_only_by_init_weights_get_their_values_on_meta() -> None:
    model = build_on_meta(lambda: TableModel(TableConfig()))
    assert model.proj.weight.is_meta and model.block.scale.is_meta
    assert torch.equal(model.block.table.values, torch.arange(4.0) + 10)
    real = TableModel(TableConfig())  # as transformers builds it for real
    assert torch.equal(real.block.table.values, torch.arange(4.0) + 10)


def test_transformers_own_walk_is_restored_after_a_build_even_a_failing_one() -> None:
    original = transformers.PreTrainedModel._initialize_weights
    build_on_meta(lambda: TableModel(TableConfig()))

    def broken() -> nn.Module:
        raise ValueError("bad factory")

    with pytest.raises(ValueError, match="bad factory"):
        build_on_meta(broken)
    assert transformers.PreTrainedModel._initialize_weights is original
