"""Wanda and SparseGPT (issue 49): zeros chosen from calibration data, one block of a layer stack at a
time, unstructured or N:M; and the perplexity a causal language model is judged by."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from slimtorch.calibration import blockwise
from slimtorch.calibration.moments import InputMoments
from slimtorch.errors import OptionError, SlimtorchError
from slimtorch.prune import weights
from slimtorch.prune.calibrated import sparsegpt_, wanda_
from slimtorch.recovery import evaluate, open_data
from slimtorch.recovery.text import perplexity
from tests.zoo.transformers_models import gpt2, llama


def correlated_inputs(rows: int = 512, features: int = 64, seed: int = 0) -> torch.Tensor:
    """Inputs like a language model's: correlated features, a few of them large (outlier channels)."""
    generator = torch.Generator().manual_seed(seed)
    mixing = torch.randn(features, features, generator=generator) / math.sqrt(features)
    x = torch.randn(rows, features, generator=generator) @ mixing
    x[:, :4] *= 20  # the outlier features
    return x


def output_error(weight: torch.Tensor, pruned: torch.Tensor, x: torch.Tensor) -> float:
    return float((x @ weight.t() - x @ pruned.t()).norm() / (x @ weight.t()).norm())


def test_wanda_scores_each_weight_by_its_magnitude_times_its_inputs_norm_within_its_row() -> None:
    weight = torch.tensor([[1.0, 2.0, 3.0, 4.0], [4.0, 3.0, 2.0, 1.0]])
    norms = torch.tensor([10.0, 1.0, 1.0, 1.0])  # the first input is large: its small weight matters
    pruned = weight.clone()
    wanda_(pruned, norms, 0.5, None)
    assert pruned.tolist() == [[1.0, 0.0, 0.0, 4.0], [4.0, 3.0, 0.0, 0.0]]  # magnitude: [0, 0, 3, 4] first
    pattern = weight.clone()
    wanda_(pattern, norms, 0.0, (1, 2))  # keep 1 of every 2 inputs
    assert pattern.tolist() == [[1.0, 0.0, 0.0, 4.0], [4.0, 0.0, 2.0, 0.0]]


def test_sparsegpt_and_wanda_keep_a_layers_output_closer_than_magnitude_at_the_same_sparsity() -> None:
    torch.manual_seed(0)
    weight, x = torch.randn(32, 64), correlated_inputs()
    moments = InputMoments({"fc": nn.Linear(64, 32)})
    with moments.recording():
        moments.layers["fc"](x)
    errors = {}
    for method in ("magnitude", "wanda", "sparsegpt"):
        for pattern in (None, (2, 4)):
            pruned = weight.clone()
            if method == "magnitude":
                wanda_(pruned, torch.ones(64), 0.5, pattern)  # the same groups, scored by |w| alone
            elif method == "wanda":
                wanda_(pruned, moments.column_norms("fc"), 0.5, pattern)
            else:
                assert sparsegpt_(pruned, moments.hessian("fc"), 0.5, pattern)
            assert float((pruned == 0).float().mean()) == pytest.approx(0.5, abs=0.01)
            errors[method, pattern] = output_error(weight, pruned, x)
    for pattern in (None, (2, 4)):
        assert errors["sparsegpt", pattern] < errors["wanda", pattern] < errors["magnitude", pattern]
    assert errors["sparsegpt", None] < 0.5 * errors["magnitude", None], errors


def nonzeros_per_group(matrix: torch.Tensor, m: int) -> int:
    return int((matrix != 0).reshape(matrix.shape[0], -1, m).sum(-1).max())


@pytest.mark.parametrize("method", ["wanda", "sparsegpt", "layer_magnitude"])
def test_n_m_holds_along_the_inputs_of_linear_and_of_gpt2s_transposed_conv1d(method) -> None:
    torch.manual_seed(0)
    model = gpt2().eval()
    data = [torch.randint(0, 100, (2, 16)) for _ in range(2)]
    report = weights(model, method=method, n_m="2:4", data=data if method != "layer_magnitude" else None)
    assert report.method == f"{method}:2:4" and report.sparsity == pytest.approx(0.5)
    attention = model.transformer.h[0].attn.c_attn  # Conv1D: weight stored (inputs, outputs)
    assert nonzeros_per_group(attention.weight.t(), 4) == 2
    assert nonzeros_per_group(model.lm_head.weight, 4) == 2 or "lm_head" in report.skipped


def test_a_language_model_is_calibrated_one_block_at_a_time_on_what_the_blocks_before_give() -> None:
    torch.manual_seed(0)
    model = llama().eval()
    data = [torch.randint(0, 100, (1, 12)) for _ in range(3)]
    layers = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    stages: list[tuple[str, int]] = []
    one_pass = InputMoments(layers)
    with torch.no_grad(), one_pass.recording():
        for ids in data:
            model(ids)

    def unchanged(stage) -> None:  # nothing changed: each block's moments are the one pass's
        stages.append((stage.name, len(stage.layers)))
        for name in stage.layers:
            torch.testing.assert_close(
                stage.moments.hessian(name), one_pass.hessian(name), rtol=1e-4, atol=1e-5
            )

    assert blockwise(model, layers, data, unchanged) == []
    assert stages == [("model.layers.0", 7), ("model.layers.1", 7), ("the rest of the model", 1)]

    seen: dict[str, torch.Tensor] = {}

    def zero_first_block(stage) -> None:  # block 0 changed: block 1 sees what the changed block gives
        for name, layer in stage.layers.items():
            seen[name] = stage.moments.hessian(name)
            if name.startswith("model.layers.0."):
                layer.weight.data.zero_()

    blockwise(copy.deepcopy(model), layers, data, zero_first_block)  # the copy's layers are not these
    blockwise(model, layers, data, zero_first_block)
    assert not torch.allclose(
        seen["model.layers.1.self_attn.q_proj"], one_pass.hessian("model.layers.1.self_attn.q_proj")
    )


class Parallel(nn.Module):
    """Blocks of one class that each read the input (not a chain): block-by-block would be wrong."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(block(x) for block in self.blocks)


def test_a_stack_whose_blocks_do_not_chain_is_calibrated_in_one_pass_and_says_so() -> None:
    model = Parallel()
    layers = dict(model.named_modules())
    layers = {n: m for n, m in layers.items() if isinstance(m, nn.Linear)}
    seen = []
    notes = blockwise(model, layers, [torch.randn(4, 8)], lambda stage: seen.append(stage.name))
    assert seen == ["the model"] and "one pass" in notes[0] and "blocks.0" in notes[0]


def test_wanda_prunes_convolutions_by_magnitude_and_says_so() -> None:
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.Flatten(), nn.Linear(8 * 6 * 6, 10))
    report = weights(model, 0.5, method="wanda", data=[torch.randn(2, 3, 8, 8)])
    assert list(report.by_magnitude) == ["0"] and "magnitude" in report.by_magnitude["0"]
    assert report.model is model
    assert report.layers == {"0": pytest.approx(0.5, abs=0.01), "2": 0.5}


def test_an_output_head_tied_to_the_embeddings_stays_dense_with_the_reason() -> None:
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, vocab_size=50,
        tie_word_embeddings=True,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config).eval()
    report = weights(model, 0.5, method="wanda", data=[torch.randint(0, 50, (1, 8))])
    assert "lm_head" in report.skipped and "model.embed_tokens" in report.skipped["lm_head"]
    assert int((model.model.embed_tokens.weight == 0).sum()) == 0


@pytest.mark.parametrize(
    ("options", "data", "says"),
    [
        ({"amount": 0.5, "method": "wanda"}, None, "calibration data"),
        ({"amount": 0.5, "method": "layer_magnitude"}, [torch.randn(1, 4)], "wanda and sparsegpt only"),
        ({"amount": 0.5, "method": "n:m", "n_m": "2:4"}, None, "n and m"),
        ({"amount": 0.5, "method": "wanda", "n_m": "4:2"}, [torch.randn(1, 4)], "0 < N < M"),
        ({"amount": 0.5, "method": "wandaa"}, [torch.randn(1, 4)], "method must be one of"),
    ],
)
def test_a_calibrated_option_that_cannot_work_is_one_error(options, data, says) -> None:
    with pytest.raises(OptionError, match=says):
        weights(nn.Linear(4, 4), data=data, **options)


class Oracle(nn.Module):
    """Logits that put all weight on the next id of a known sequence (perplexity 1), or on none."""

    def __init__(self, vocabulary: int, sure: bool) -> None:
        super().__init__()
        self.vocabulary, self.sure = vocabulary, sure
        self.anchor = nn.Parameter(torch.zeros(1))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        logits = torch.zeros(*ids.shape, self.vocabulary)
        if self.sure:
            logits.scatter_(2, ((ids + 1) % self.vocabulary).unsqueeze(-1), 100.0)
        return logits + self.anchor


def test_perplexity_is_one_for_a_model_that_knows_and_the_vocabulary_for_one_that_guesses() -> None:
    ids = torch.arange(40).reshape(2, 20) % 10  # each next id is the id + 1, modulo 10
    assert perplexity(Oracle(10, sure=True), [ids]) == pytest.approx(1.0)
    assert perplexity(Oracle(10, sure=False), [(ids, ids)]) == pytest.approx(10.0)
    with pytest.raises(SlimtorchError, match="logits"):
        perplexity(nn.Flatten(0), [ids])


def test_a_text_file_is_cut_into_sequences_with_its_tail_held_out(tmp_path) -> None:
    text = tmp_path / "notes.txt"
    text.write_text("".join(chr(ord("a") + i % 26) for i in range(1000)) + "\n")
    data = open_data(
        str(text),
        tokenizer=lambda s: [ord(c) - ord("a") for c in s if c != "\n"],
        length=50,
        sequences=10,
        batch=3,
    )
    assert (
        data.metric == "perplexity"
        and "8 to calibrate" in data.notes[0]
        and "last 2 held out" in data.notes[0]
    )
    train = torch.cat([ids for ids, _ in data.train])
    held = torch.cat([ids for ids, _ in data.eval])
    assert train.shape == (8, 50) and held.shape == (2, 50)
    assert held[0, 0] == 400 % 26  # the held-out part is the tail, in order
    assert evaluate(Oracle(26, sure=True), data) == pytest.approx(1.0, abs=1e-3)
    with pytest.raises(SlimtorchError, match="tokenizer"):
        open_data(str(text))
    with pytest.raises(SlimtorchError, match="fewer than two sequences"):
        open_data(str(text), tokenizer=lambda s: [1] * 10, length=50)


def test_slim_refuses_perplexity_data_rather_than_read_it_as_higher_is_better(tmp_path) -> None:
    import slimtorch

    with pytest.raises(SlimtorchError, match="does not steer by a language model's perplexity"):
        slimtorch.slim(
            "tests.zoo.models:MLP", str(tmp_path / "text.txt"), goal="size=0.5x", work=tmp_path / "w"
        )
