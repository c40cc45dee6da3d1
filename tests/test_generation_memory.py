"""Inference memory of a causal LM (issue 46): weights plus the KV cache ``generate`` keeps, predicted from
the config and checked against a real ``generate`` on the CPU at two context lengths."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from slimtorch.errors import OptionError
from slimtorch.memory.generation import cache_shape, generation_memory, weights_bytes

transformers = pytest.importorskip("transformers")


def _llama(**overrides):
    config = transformers.LlamaConfig(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=2,  # grouped-query attention: the cache holds 2 heads, not 8
        vocab_size=1000,
        max_position_embeddings=4096,
        **overrides,
    )
    return transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()


def _measured(model, prompt: int, new: int) -> tuple[int, int]:
    """(weights, KV cache) of a real generate: the parameters' bytes and the cache's tensors after it."""
    ids = torch.randint(0, 1000, (1, prompt))
    with torch.no_grad():
        out = model.generate(
            ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, return_dict_in_generate=True
        )
    cache = out.past_key_values
    held = sum(t.nbytes for layer in cache.layers for t in (layer.keys, layer.values))
    params = sum(p.nbytes for p in model.parameters()) + sum(b.nbytes for b in model.buffers())
    return params, held


@pytest.mark.slow
@pytest.mark.parametrize("prompt", [64, 700])
def test_weights_and_kv_cache_are_within_5_percent_of_a_real_generate(prompt):
    model = _llama()
    new = 9
    params, held = _measured(model, prompt, new)

    report = generation_memory(model, [prompt + new - 1], dtype=torch.bfloat16)

    row = report.contexts[0]
    assert row.kv_cache_bytes == held  # the same tensors, counted from the config
    assert abs(row.total_bytes - (params + held)) <= 0.05 * (params + held)
    assert report.weights_bytes == params


def test_a_meta_model_gives_the_same_answer_and_the_longest_context_fits_the_budget():
    config = transformers.LlamaConfig(num_hidden_layers=32, num_key_value_heads=8)  # Llama-3-8B's cache
    with torch.device("meta"):
        llama = transformers.LlamaForCausalLM(config)

    report = generation_memory(llama, [8192], dtype=torch.bfloat16, budget=24 * 2**30)

    assert report.contexts[0].kv_cache_bytes == 32 * 2 * 8 * 128 * 8192 * 2  # 1 GiB
    room = 24 * 2**30 - report.weights_bytes
    per_token = report.kv_bytes_per_token
    assert report.largest_context == room // per_token


def test_a_sliding_window_caps_the_cache_of_its_layers():
    config = transformers.MistralConfig(num_hidden_layers=2, sliding_window=128, num_key_value_heads=2)
    shape = cache_shape(config, torch.bfloat16)
    assert shape.bytes(1, 4096) == shape.bytes(1, 128)


def test_a_model_without_a_config_is_refused_in_one_line():
    with pytest.raises(OptionError, match="transformers model"):
        generation_memory(torch.nn.Linear(4, 4), [16])


def test_tied_weights_count_once():
    model = _llama(tie_word_embeddings=True)
    assert weights_bytes(model) == sum(p.nbytes for p in model.parameters()) + sum(
        b.nbytes for b in model.buffers()
    )


@pytest.mark.slow
def test_memory_cli_generate_prints_the_cache_and_the_longest_context(tmp_path):
    model = _llama()
    model.save_pretrained(tmp_path / "llama")
    command = [sys.executable, "-m", "slimtorch", "memory", str(tmp_path / "llama"), "--mode", "generate"]
    command += ["--precision", "bf16", "--context", "1024", "4096", "--budget", "64MB", "--json"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert [row["context"] for row in report["contexts"]] == [1024, 4096]
    assert report["kv_bytes_per_token"] == 3 * 2 * 2 * 32 * 2
    assert report["largest_context"] == (64_000_000 - report["weights_bytes"]) // report["kv_bytes_per_token"]
    refused = subprocess.run(
        [*command[:7], "--precision", "bf16-mixed"], capture_output=True, text=True, timeout=300
    )
    assert refused.returncode == 2 and "--precision fp32, bf16 or fp16" in refused.stderr
