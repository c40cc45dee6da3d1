"""AWQ (issue 49): each Linear's input channels scaled by their calibration size before int4 rounding, the
inverse folded into the norm or Linear before, so the float model computes the same function; GPTQ can be
turned off to compare AWQ with rounding to nearest."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import slimtorch
from slimtorch.errors import OptionError
from slimtorch.quant.awq import awq_scale, fake_int4
from tests.zoo.transformers_models import llama


def test_awq_folds_its_scales_so_the_float_model_is_unchanged_and_says_what_it_could_not_fold() -> None:
    torch.manual_seed(0)
    model = llama().eval()
    ids = torch.randint(0, 100, (2, 16))
    with torch.no_grad():
        before = model(ids).logits
    layers = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear) and n != "lm_head"}
    q_before = model.model.layers[0].self_attn.q_proj.weight.clone()
    notes = awq_scale(model, layers, [ids[:1], ids[1:]], group_size=32)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, before, rtol=1e-4, atol=1e-5)
    norm = model.model.layers[0].input_layernorm.weight
    assert not torch.allclose(norm, torch.ones_like(norm))  # the inverse went into the norm
    assert not torch.equal(model.model.layers[0].self_attn.q_proj.weight, q_before)
    # grouped-query attention: v_proj's 32 outputs are not o_proj's 64 inputs, so o_proj keeps its inputs
    assert notes[-1] == (
        "AWQ scaled the inputs of 12 of 14 Linear layers; 2 have no known place to fold the scales "
        "(rounded to nearest)"
    )


def test_fake_int4_rounds_groups_to_16_levels_between_their_extremes() -> None:
    weight = torch.linspace(-1, 1, 64).reshape(2, 32)
    rounded = fake_int4(weight, 16)
    for row in rounded.reshape(-1, 16):
        assert len(torch.unique(row)) <= 16
    step = float(weight.reshape(-1, 16).diff().max()) * 15 / 15
    assert float((rounded - weight).abs().max()) <= step  # within a step of the 16-level grid
    assert torch.equal(fake_int4(rounded, 16), rounded)  # already on the grid: unchanged


def test_awq_without_gptq_chooses_other_codes_than_round_to_nearest_and_lowers_the_error() -> None:
    torch.manual_seed(0)
    model = llama().eval()
    with torch.no_grad():  # a few outlier channels, as trained language models have
        for layer in model.model.layers:
            layer.input_layernorm.weight[:4] = 20.0
            layer.post_attention_layernorm.weight[:4] = 20.0
    ids = torch.randint(0, 100, (4, 16))
    samples = [ids[i : i + 1] for i in range(4)]
    with torch.no_grad():
        want = model(ids).logits
    errors = {}
    for name, extra in {"rtn": {}, "awq": {"awq": True, "gptq": False, "calibration": samples}}.items():
        quantized = copy.deepcopy(model)
        report = slimtorch.quantize(quantized, "int4-weight", group_size=32, keep_sensitive=False, **extra)
        with torch.no_grad():
            errors[name] = float((quantized(ids).logits - want).norm() / want.norm())
        if name == "awq":
            assert any("AWQ scaled" in note for note in report.notes)
    assert errors["awq"] < 0.9 * errors["rtn"], errors  # 0.183 against 0.230


@pytest.mark.parametrize(
    ("options", "says"),
    [
        ({"scheme": "int8-weight", "awq": True}, "int4 weights"),
        ({"scheme": "int4-weight", "awq": True}, "calibration inputs"),
    ],
)
def test_awq_where_it_cannot_work_is_one_error(options, says) -> None:
    with pytest.raises(OptionError, match=says):
        slimtorch.quantize(nn.Sequential(nn.Linear(64, 64)), **options)
