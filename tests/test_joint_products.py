"""Int8-dynamic layers that read one input run as one product (:mod:`slimtorch.quant.sharing`): the same
outputs as each layer alone, one oneDNN call for query, key and value, and a group parted (never a wrong
output) when its layers stop reading one input."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import slimtorch
from slimtorch.quant import sharing
from slimtorch.quant.modules import PACKED, Int8DynamicLinear, int8_dynamic_kernels

JOINT = [name for name in int8_dynamic_kernels(torch.device("cpu")) if name in PACKED]
pytestmark = pytest.mark.skipif(not JOINT, reason="no oneDNN int8 kernel runs right on this CPU")


def _forced(model: nn.Module, kernel: str) -> nn.Module:
    for layer in model.modules():
        if isinstance(layer, Int8DynamicLinear):
            layer.kernel = kernel
    return model


def _products(run) -> int:
    """How many oneDNN int8 products ``run()`` makes."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        run()
    return sum(event.count for event in profile.key_averages() if event.key == "onednn::qlinear_pointwise")


def _tiny(kind: str) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    if kind == "bert":
        config = transformers.BertConfig(
            vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64
        )
        return transformers.BertModel(config, add_pooling_layer=False).eval()
    config = transformers.LlamaConfig(
        vocab_size=99,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # key and value narrower than the query: groups of unequal widths
    )
    return transformers.LlamaForCausalLM(config).eval()


def _parted(model: nn.Module) -> nn.Module:
    """``model`` with every learned group parted: each layer runs alone."""
    for module in model.modules():
        siblings = sharing._SIBLINGS.get(module)
        if siblings is not None:
            for group in set(siblings.group_of.values()):
                siblings.part(group)
    return model


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["bert", "llama"])
@pytest.mark.parametrize("kernel", JOINT)
@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_joint_products_give_the_outputs_of_each_layer_alone(kind: str, kernel: str, mode: str) -> None:
    model = _forced(slimtorch.quantize(_tiny(kind), "int8-dynamic").model, kernel)
    alone = copy.deepcopy(model)  # a copy learns anew: its groups are parted below
    ids = torch.randint(0, 99, (2, 9))
    grad_mode = torch.no_grad if mode == "no_grad" else torch.inference_mode
    with grad_mode():
        for _ in range(3):  # two calls to learn the groups, the third runs them jointly
            model(ids), alone(ids)
        _parted(alone)
        joint, single = model(ids), alone(ids)
    adopted = [siblings.group_of for siblings in sharing._SIBLINGS.values() if siblings.group_of]
    assert adopted, "no group was learned"
    first = joint[0] if kind == "bert" else joint.logits
    second = single[0] if kind == "bert" else single.logits
    assert torch.equal(first, second)


def test_query_key_and_value_run_as_one_product_once_learned() -> None:
    model = _forced(slimtorch.quantize(_tiny("bert"), "int8-dynamic").model, JOINT[0])
    ids = torch.randint(0, 99, (1, 7))
    with torch.inference_mode():
        model(ids), model(ids)  # chosen, then learned
        products = _products(lambda: model(ids))
    # per layer: query/key/value as one, attention output, intermediate, output
    assert products == 2 * 4
    attention = model.encoder.layer[0].attention.self
    group = sharing._SIBLINGS[attention].group_of[attention.query]
    assert group == (attention.query, attention.key, attention.value)
    assert all(("onednn" not in k[0]) for layer in group for k in layer._prepared), "own packs let go"


class Crossing(nn.Module):
    """Query and value read ``x``, key reads ``y`` (cross-attention's shape); ``skip`` leaves value out."""

    def __init__(self) -> None:
        super().__init__()
        self.query, self.key, self.value = nn.Linear(16, 8), nn.Linear(16, 8), nn.Linear(16, 12)
        self.skip = False

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        q, k = self.query(x), self.key(y)
        if self.skip:
            return torch.cat([q, k], dim=-1)
        return torch.cat([q, k, self.value(x)], dim=-1)


def _crossing(monkeypatch) -> tuple[Crossing, Crossing]:
    monkeypatch.setattr(
        sharing, "SHARING_PARENTS", sharing.SHARING_PARENTS | {f"{__name__}.{Crossing.__qualname__}"}
    )
    torch.manual_seed(0)
    model = Crossing()
    reference = copy.deepcopy(model)
    quantized = _forced(slimtorch.quantize(model, "int8-dynamic").model, JOINT[0])
    assert sharing.share_input_codes(quantized) == 1
    return quantized, reference


def test_only_the_layers_seen_reading_one_input_are_grouped(monkeypatch) -> None:
    model, _ = _crossing(monkeypatch)
    x, y = torch.randn(5, 16), torch.randn(5, 16)
    with torch.no_grad():
        expected = [model(x, y) for _ in range(2)][-1]  # learned over these two calls
        got = model(x, y)
    assert set(sharing._SIBLINGS[model].group_of) == {model.query, model.value}
    assert torch.equal(got, expected)


def test_a_group_whose_layers_stop_reading_one_input_is_parted_and_stays_right(monkeypatch) -> None:
    model, _ = _crossing(monkeypatch)
    x, y = torch.randn(5, 16), torch.randn(5, 16)
    with torch.no_grad():
        for _ in range(3):
            model(x, y)
        assert sharing._SIBLINGS[model].group_of
        model.skip = True  # value is not called: the joint output made for it is left over
        first = model(x, y)
        assert not sharing._SIBLINGS[model].group_of
        model.skip = False
        again = model(x, y)  # each layer alone from now on
    alone_q, alone_k = model.query(x), model.key(y)
    assert torch.equal(first, torch.cat([alone_q, alone_k], dim=-1))
    assert torch.equal(again[:, :16], first)


def test_layers_on_different_kernels_are_not_run_jointly(monkeypatch) -> None:
    model, _ = _crossing(monkeypatch)
    model.value.kernel = "reference"
    x, y = torch.randn(5, 16), torch.randn(5, 16)
    with torch.no_grad():
        for _ in range(3):
            out = model(x, y)
        products = _products(lambda: model(x, y))
        again = model(x, y)
    assert products == 2  # query and key, each alone: value runs the reference kernel
    assert torch.equal(out, again)


def test_a_joint_product_follows_weights_changed_in_place(monkeypatch) -> None:
    model, _ = _crossing(monkeypatch)
    x, y = torch.randn(5, 16), torch.randn(5, 16)
    with torch.no_grad():
        for _ in range(3):
            model(x, y)
        model.value.qweight.neg_()  # a load into the layer's buffers, in place
        got = model(x, y)
        _parted(model)
        expected = model(x, y)
    assert torch.equal(got, expected)
