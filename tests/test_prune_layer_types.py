"""One record per layer type pruning resizes (graph/resizing.py): surgery and the structural delta's
allow-list come from the same records, so what pruning saves, the loader accepts, in a fresh process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import slimtorch
from slimtorch.errors import SlimtorchError
from slimtorch.format.delta import StructuralDelta
from slimtorch.graph import resizing
from slimtorch.graph.channels import _HANDLERS
from tests.zoo import PReLUAttentionCNN

ROOT = Path(__file__).resolve().parent.parent
IMAGES = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(0))


def test_a_cnn_with_prelu_and_attention_pruned_loads_back_in_a_fresh_process(tmp_path) -> None:
    torch.manual_seed(0)
    model = PReLUAttentionCNN().eval()
    report = slimtorch.prune.channels(model, IMAGES, ratio=0.5)
    assert report.params_after < report.params_before
    assert model.a1.num_parameters == model.a1.weight.numel() < 16  # cut, and its size kept true
    path = tmp_path / "pruned.safetensors"
    slimtorch.save_model(model, path)
    torch.save({"images": IMAGES, "out": model(IMAGES)}, tmp_path / "expected.pt")
    script = (
        "import sys, torch, slimtorch\n"
        "from tests.zoo.models import PReLUAttentionCNN\n"
        "assert 'slimtorch.prune' not in sys.modules and 'slimtorch.quant' not in sys.modules\n"
        f"expected = torch.load({str(tmp_path / 'expected.pt')!r})\n"
        f"model = slimtorch.load_model({str(path)!r}, PReLUAttentionCNN).model.eval()\n"
        "sys.exit(0 if torch.equal(model(expected['images']), expected['out']) else 1)\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert run.returncode == 0, run.stderr[-3000:]


def _pruned_instance(record: resizing.LayerRecord) -> nn.Module:
    """A module of the record's type with every tensor cut to half its size along each dimension that
    pruning can cut."""
    modules = {
        "convolution": nn.Conv2d(8, 8, 3),
        "linear": nn.Linear(8, 8),
        "batch or instance norm": nn.BatchNorm2d(8),
        "layer norm": nn.LayerNorm(8),
        "embedding": nn.Embedding(8, 8),
        "PReLU": nn.PReLU(8),
        "Hugging Face Conv1D": _hf_conv1d(),
    }
    module = modules[record.name]
    for name, tensor in list(module.named_parameters()) + list(module.named_buffers()):
        if tensor.dim():
            cut = tensor.detach()[tuple(slice(0, max(1, s // 2)) for s in tensor.shape)].clone()
            setattr(module, name, nn.Parameter(cut) if isinstance(tensor, nn.Parameter) else cut)
    return module


def _hf_conv1d() -> nn.Module:
    from transformers.pytorch_utils import Conv1D

    return Conv1D(8, 8)


@pytest.mark.parametrize("record", resizing.RECORDS, ids=lambda r: r.name)
def test_every_attribute_a_record_sets_is_one_the_loader_accepts(record: resizing.LayerRecord) -> None:
    module = _pruned_instance(record)
    assert record.matches(module) and resizing.record_of(module) is record
    changed = resizing.resize(module)
    assert changed and set(changed) <= set(record.sizes)
    delta = StructuralDelta.from_json(json.loads(json.dumps({"attributes": {"m": changed}})))
    assert delta.attributes == {"m": changed}


def test_the_allow_list_is_the_records_and_nothing_else() -> None:
    from slimtorch.format import delta

    assert delta.SIZE_ATTRIBUTES is resizing.SIZE_ATTRIBUTES
    assert "num_parameters" in delta.SIZE_ATTRIBUTES  # PReLU's: the attribute the loader once refused
    for record in (*resizing.RECORDS, resizing.ATTENTION):
        assert set(record.sizes) <= delta.SIZE_ATTRIBUTES
        assert set(record.ops) <= set(_HANDLERS), (record.name, set(record.ops) - set(_HANDLERS))


def test_attention_heads_follow_the_query_rows() -> None:
    from transformers import BertConfig
    from transformers.models.bert.modeling_bert import BertSelfAttention

    attention = BertSelfAttention(BertConfig(hidden_size=64, num_attention_heads=4))
    attention.query = nn.Linear(64, 32)  # half the heads cut
    assert resizing.resize(attention) == {"num_attention_heads": 2, "all_head_size": 32}


@pytest.mark.parametrize(
    "attributes",
    [
        {"m": {"forward": 3}},
        {"m": {"training": 1}},
        {"m": {"num_parameters": "8"}},
        {"m": {"in_features": -1}},
    ],
)
def test_the_delta_still_refuses_what_no_record_sets(attributes: dict) -> None:
    with pytest.raises(SlimtorchError, match="not a size"):
        StructuralDelta.from_json({"attributes": attributes})
