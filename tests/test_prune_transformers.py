"""Structured pruning of Hugging Face models built from small configs: what can be pruned is, the rest is
kept whole with the reason named, and the pruned model saves and loads back without pickle."""

from __future__ import annotations

import copy

import pytest
import torch

import slimtorch
from slimtorch.prune import channels
from tests.zoo.transformers_models import TRANSFORMERS, example, main_output

pytest.importorskip("transformers")


@pytest.mark.slow
@pytest.mark.parametrize("name", list(TRANSFORMERS))
def test_ratio_0_changes_nothing(name: str) -> None:
    model = TRANSFORMERS[name]().eval()
    reference = copy.deepcopy(model)
    slimtorch.prune.channels(model, example(name), ratio=0.0)
    assert torch.equal(main_output(model(*example(name))), main_output(reference(*example(name))))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(TRANSFORMERS))
def test_ratio_half_prunes_the_feed_forward_and_keeps_the_output_shape(name: str, tmp_path) -> None:
    model = TRANSFORMERS[name]().eval()
    shape = main_output(model(*example(name))).shape
    before = sum(p.numel() for p in model.parameters())
    with torch.no_grad():
        report = channels(model, example(name), ratio=0.5)
    out = main_output(model(*example(name)))
    assert out.shape == shape and report.pruned_groups >= 2  # one feed-forward group per layer at least
    assert sum(p.numel() for p in model.parameters()) < 0.9 * before
    path = tmp_path / f"{name}.safetensors"
    slimtorch.save_model(model, path)
    loaded = slimtorch.load_model(path, TRANSFORMERS[name]).model.eval()
    assert torch.equal(main_output(loaded(*example(name))), out)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["bert", "vit"])
def test_attention_heads_are_pruned_whole_with_their_count_updated(name: str) -> None:
    model = TRANSFORMERS[name]().eval()
    shape = main_output(model(*example(name))).shape
    slimtorch.prune.channels(model, example(name), ratio=0.5)
    layer = model.encoder.layer[0] if name == "bert" else model.layers[0]
    attention = layer.attention.self if name == "bert" else layer.attention
    projections = [
        getattr(attention, n)
        for n in ("query", "key", "value", "q_proj", "k_proj", "v_proj")
        if hasattr(attention, n)
    ]
    assert {p.out_features for p in projections} == {32}  # 4 heads of 16 -> 2 heads
    assert attention.num_attention_heads == 2
    assert main_output(model(*example(name))).shape == shape


@pytest.mark.slow
def test_grouped_query_attention_loses_whole_key_value_groups() -> None:
    model = TRANSFORMERS["llama"]().eval()  # 4 query heads sharing 2 key/value heads, 16 features each
    shape = main_output(model(*example("llama"))).shape
    slimtorch.prune.channels(model, example("llama"), ratio=0.5)
    attention = model.model.layers[0].self_attn
    assert attention.q_proj.out_features == 32 and attention.o_proj.in_features == 32  # 2 query heads
    assert attention.k_proj.out_features == attention.v_proj.out_features == 16  # 1 key/value head
    assert attention.num_key_value_groups == 2
    assert main_output(model(*example("llama"))).shape == shape


@pytest.mark.slow
def test_gpt2_keeps_its_tied_head_tied_and_prunes_the_hidden_size() -> None:
    model = TRANSFORMERS["gpt2"]().eval()
    slimtorch.prune.channels(model, example("gpt2"), ratio=0.5)
    assert model.lm_head.weight is model.transformer.wte.weight
    assert model.transformer.wte.weight.shape == (100, 32)
    assert model.transformer.h[0].mlp.c_fc.nf == model.transformer.h[0].mlp.c_fc.weight.shape[1] == 128


@pytest.mark.slow
def test_llama_gated_mlp_prunes_gate_and_up_together() -> None:
    model = TRANSFORMERS["llama"]().eval()
    slimtorch.prune.channels(model, example("llama"), ratio=0.5)
    mlp = model.model.layers[0].mlp
    assert mlp.gate_proj.out_features == mlp.up_proj.out_features == mlp.down_proj.in_features == 64


@pytest.mark.slow
def test_gpt2_fused_qkv_loses_whole_heads_and_its_split_size_follows() -> None:
    model = TRANSFORMERS["gpt2"]().eval()
    slimtorch.prune.channels(model, example("gpt2"), ratio=0.5)
    attention = model.transformer.h[0].attn
    assert attention.c_attn.weight.shape[1] == 3 * 32 and attention.c_proj.weight.shape[0] == 32
    assert attention.num_heads == 2 and attention.split_size == 32


def test_removing_dead_heads_changes_no_output() -> None:
    model = TRANSFORMERS["bert"]().eval()
    attention = model.encoder.layer[0].attention
    dead = torch.cat([torch.arange(0, 16), torch.arange(32, 48)])  # heads 0 and 2 of 4, 16 features each
    with torch.no_grad():
        for projection in (attention.self.query, attention.self.key, attention.self.value):
            projection.weight[dead] = 0
            projection.bias[dead] = 0
        attention.output.dense.weight[:, dead] = 0
    reference = main_output(model(*example("bert")))
    heads = {f"encoder.layer.0.attention.self.{name}" for name in ("query", "key", "value")}
    others = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n not in heads]
    slimtorch.prune.channels(model, example("bert"), ratio=0.5, ignore=others)
    assert attention.self.query.out_features == 32 and attention.self.num_attention_heads == 2
    assert model.encoder.layer[1].attention.self.query.out_features == 64  # fenced off by ignore
    assert torch.allclose(main_output(model(*example("bert"))), reference, atol=1e-5)
