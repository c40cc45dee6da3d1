"""One record per layer type pruning knows (graph/prunable.py): the channel walk, surgery and the structural
delta's allow-list come from the same records, so what pruning saves, the loader accepts, in a fresh process.

The catalogue below is torch's layers as their own constructors build them, not the records: a layer cut
from 8 channels to 4 must end up as the layer built for 4, and the delta that says so must load. A record
that went missing (PReLU's, once) or an allow-list written out by hand again fails here."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

import slimtorch
from slimtorch.errors import SlimtorchError
from slimtorch.format.delta import StructuralDelta, apply_delta
from slimtorch.graph import channels, prunable
from slimtorch.graph.capture import capture
from slimtorch.graph.channels import channel_groups

ROOT = Path(__file__).resolve().parent.parent
IMAGES = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(0))


@pytest.mark.slow
@pytest.mark.parametrize("model_class", ["PReLUAttentionCNN", "NormsCNN"])
def test_a_pruned_cnn_loads_back_in_a_fresh_process_that_imports_only_slimtorch(
    model_class, tmp_path
) -> None:
    from tests.zoo import models

    torch.manual_seed(0)
    model = getattr(models, model_class)().eval()
    report = slimtorch.prune.channels(model, IMAGES, ratio=0.5)
    assert report.params_after < report.params_before
    assert model.a1.num_parameters == model.a1.weight.numel() < 16  # cut, and its size kept true
    path = tmp_path / "pruned.safetensors"
    slimtorch.save_model(model, path)
    torch.save({"images": IMAGES, "out": model(IMAGES)}, tmp_path / "expected.pt")
    script = (
        "import sys, torch, slimtorch\n"
        f"from tests.zoo.models import {model_class}\n"
        "assert 'slimtorch.prune' not in sys.modules and 'slimtorch.quant' not in sys.modules\n"
        f"expected = torch.load({str(tmp_path / 'expected.pt')!r})\n"
        f"model = slimtorch.load_model({str(path)!r}, {model_class}).model.eval()\n"
        "sys.exit(0 if torch.equal(model(expected['images']), expected['out']) else 1)\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert run.returncode == 0, run.stderr[-3000:]


TEXTS = torch.randint(0, 64, (8, 12), generator=torch.Generator().manual_seed(1))


@pytest.mark.slow
def test_a_bag_of_words_model_prunes_its_embedding_bag_and_loads_back_in_a_fresh_process(tmp_path) -> None:
    from tests.zoo import BagOfWords

    torch.manual_seed(0)
    model = BagOfWords().eval()
    report = slimtorch.prune.channels(model, TEXTS, ratio=0.5)
    assert model.bag.embedding_dim == model.hidden.in_features == 8  # half of the 16 word-vector entries
    assert tuple(model.bag.weight.shape) == (64, 8) and report.params_after < report.params_before
    path = tmp_path / "pruned.safetensors"
    slimtorch.save_model(model, path)
    torch.save({"texts": TEXTS, "out": model(TEXTS)}, tmp_path / "expected.pt")
    script = (
        "import sys, torch, slimtorch\n"
        "from tests.zoo.models import BagOfWords\n"
        f"expected = torch.load({str(tmp_path / 'expected.pt')!r})\n"
        f"model = slimtorch.load_model({str(path)!r}, BagOfWords).model.eval()\n"
        "assert model.bag.embedding_dim == 8, model.bag\n"
        "sys.exit(0 if torch.equal(model(expected['texts']), expected['out']) else 1)\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert run.returncode == 0, run.stderr[-3000:]


class _Bags(nn.Module):
    """Bags given as one flat row of ids and where each bag starts, with a weight per id."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.bag, self.head = nn.EmbeddingBag(32, 12, mode=mode), nn.Linear(12, 3)

    def forward(self, ids: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
        return self.head(self.bag(ids, offsets, per_sample_weights=weights))


@pytest.mark.parametrize(("mode", "weighted"), [("sum", True), ("mean", False), ("max", False)])
def test_an_embedding_bag_s_entries_are_one_group_with_the_columns_that_read_them(mode, weighted) -> None:
    ids, offsets = torch.arange(10) % 32, torch.tensor([0, 3, 7])
    weights = torch.rand(10) if weighted else None
    groups = channel_groups(capture(_Bags(mode).eval(), (ids, offsets, weights)))
    bag = next(g for g in groups if "bag.weight" in g.keys("out"))
    assert bag.reason is None and bag.size == 12
    assert "head.weight" in bag.keys("in")


def test_norms_cnn_prunes_through_its_group_and_instance_norms_and_keeps_groups_of_four_whole() -> None:
    from tests.zoo import NormsCNN

    model = NormsCNN().eval()
    report = slimtorch.prune.channels(model, IMAGES, ratio=0.5)
    assert (model.n1.num_groups, model.n1.num_channels) == (1, 8)  # one group: channels go one by one
    assert model.n2.num_groups == model.n2.num_channels == 8  # one channel per group
    assert model.n3.num_features == model.up.out_channels == 8
    assert (model.n4.num_groups, model.n4.num_channels) == (4, 16)  # groups of four channels stay
    assert any("group norm over groups of several channels (from n4)" in reason for reason in report.frozen)


def _hf_conv1d(n: int) -> nn.Module:
    from transformers.pytorch_utils import Conv1D

    return Conv1D(n, n)


CATALOGUE: dict[str, Callable[[int], nn.Module]] = {
    "Conv2d": lambda n: nn.Conv2d(n, n, 3),
    "Conv1d": lambda n: nn.Conv1d(n, 2 * n, 1),
    "depthwise Conv2d": lambda n: nn.Conv2d(n, n, 3, groups=n),
    "ConvTranspose2d": lambda n: nn.ConvTranspose2d(n, n, 2, stride=2),
    "Linear": lambda n: nn.Linear(n, n),
    "BatchNorm2d": lambda n: nn.BatchNorm2d(n),
    "InstanceNorm2d with weights": lambda n: nn.InstanceNorm2d(n, affine=True),
    "InstanceNorm1d with statistics": lambda n: nn.InstanceNorm1d(n, track_running_stats=True),
    "LayerNorm": lambda n: nn.LayerNorm(n),
    "RMSNorm": lambda n: nn.RMSNorm(n),
    "GroupNorm, one group": lambda n: nn.GroupNorm(1, n),
    "GroupNorm, one channel per group": lambda n: nn.GroupNorm(n, n),
    "GroupNorm, groups of four": lambda n: nn.GroupNorm(n // 4, n),
    "Embedding": lambda n: nn.Embedding(n, n),
    "EmbeddingBag": lambda n: nn.EmbeddingBag(n, n, mode="max"),
    "PReLU, a slope per channel": lambda n: nn.PReLU(n),
    "PReLU, one shared slope": lambda n: nn.PReLU(),
    "Hugging Face Conv1D": _hf_conv1d,
}
"""Layers as torch builds them for ``n`` channels (every dimension pruning can cut is ``n``)."""


def _public(module: nn.Module) -> dict:
    return {
        k: v for k, v in vars(module).items() if not k.startswith("_") and not isinstance(v, torch.Tensor)
    }


def _cut(module: nn.Module, like: nn.Module) -> None:
    """Cut each of ``module``'s tensors to the shape of ``like``'s (the first entries of each dimension)."""
    targets = like.state_dict()
    for store in (module._parameters, module._buffers):
        for name, tensor in store.items():
            if tensor is not None:
                cut = tensor.detach()[tuple(slice(0, s) for s in targets[name].shape)].clone()
                store[name] = (
                    nn.Parameter(cut, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else cut
                )


@pytest.mark.parametrize("layer", list(CATALOGUE))
def test_a_layer_cut_to_4_channels_is_the_layer_built_for_4_and_its_delta_loads(layer: str) -> None:
    torch.manual_seed(0)
    make = CATALOGUE[layer]
    module, built = make(8), make(4)
    _cut(module, built)
    changed = prunable.resize(module)  # what surgery does to every module after a cut
    assert _public(module) == _public(built)
    saved = {
        "shapes": {k: list(v.shape) for k, v in module.state_dict().items()},
        "attributes": {"": changed},
    }
    delta = StructuralDelta.from_json(json.loads(json.dumps(saved)))  # raises if the loader would refuse
    fresh = make(8)
    apply_delta(fresh, delta)  # what load_model does to the class it builds
    assert _public(fresh) == _public(built)


@pytest.mark.parametrize("record", prunable.RECORDS, ids=lambda r: r.name)
def test_every_record_has_a_layer_in_the_catalogue(record: prunable.LayerRecord) -> None:
    assert any(prunable.record_of(make(8)) is record for make in CATALOGUE.values()), record.name


def test_the_allow_list_is_the_records_and_nothing_else() -> None:
    from slimtorch.format import delta

    assert delta.SIZE_ATTRIBUTES is prunable.SIZE_ATTRIBUTES
    assert delta.SHAPE_ATTRIBUTES is prunable.SHAPE_ATTRIBUTES


def test_the_walk_follows_each_layer_type_s_ops_by_its_record_s_rules() -> None:
    records = (*prunable.RECORDS, prunable.ATTENTION)
    for record in records:
        assert record.ops, record.name
        for op, rule in record.channels.items():
            assert channels.HANDLERS[op] is rule, (record.name, op)
    named = [op for record in records for op in record.ops]
    assert len(named) == len(set(named))  # no op has two records' rules
    assert set(channels.HANDLERS) - set(named) == set(channels._MOVES)  # the rest only move channels


def test_attention_heads_follow_the_query_rows() -> None:
    from transformers import BertConfig
    from transformers.models.bert.modeling_bert import BertSelfAttention

    attention = BertSelfAttention(BertConfig(hidden_size=64, num_attention_heads=4))
    attention.query = nn.Linear(64, 32)  # half the heads cut
    assert prunable.resize(attention) == {"num_attention_heads": 2, "all_head_size": 32}


def test_a_record_that_sets_what_it_does_not_name_fails_at_pruning_not_at_loading(monkeypatch) -> None:
    linear = prunable.record_of(nn.Linear(2, 2))

    def sets_more(module: nn.Module) -> None:
        linear.resize(module)
        module.extra_size = 3

    sloppy = prunable.LayerRecord("linear", linear.matches, linear.sizes, sets_more, linear.channels)
    monkeypatch.setattr(prunable, "RECORDS", (sloppy,))
    with pytest.raises(SlimtorchError, match=r"extra_size.*no record"):
        prunable.resize(nn.Linear(2, 2))


@pytest.mark.parametrize(
    "attributes",
    [
        {"m": {"forward": 3}},
        {"m": {"training": 1}},
        {"m": {"padding_idx": 0}},  # an int, but no record sets it
        {"m": {"num_parameters": "8"}},
        {"m": {"in_features": -1}},
        {"m": {"in_features": [3]}},  # a size given as a shape
        {"m": {"normalized_shape": 8}},  # a shape given as a size
    ],
)
def test_the_delta_still_refuses_what_no_record_sets(attributes: dict) -> None:
    with pytest.raises(SlimtorchError, match="not a size"):
        StructuralDelta.from_json({"attributes": attributes})


@pytest.mark.parametrize(
    ("norm", "reason"),
    [
        (nn.GroupNorm(4, 16), "group norm over groups of several channels"),
        (nn.GroupNorm(16, 16, affine=False), "group norm without weights"),
        (nn.InstanceNorm2d(16), "instance norm without weights or statistics"),
    ],
)
def test_a_norm_whose_size_could_not_follow_its_channels_keeps_them(norm: nn.Module, reason: str) -> None:
    model = nn.Sequential(nn.Conv2d(3, 16, 3), norm, nn.Conv2d(16, 4, 3)).eval()
    groups = channel_groups(capture(model, (IMAGES,)))
    conv = next(g for g in groups if "0.weight" in g.keys("out"))
    assert conv.reason is not None and reason in conv.reason


class _ReadsItsWeight(nn.Module):
    """A linear layer whose weight another op reads too (a penalty computed in the forward)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.out = nn.Linear(8, 8), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.fc(x))) + torch.mv(self.fc.weight, x[0]).sum()


class _Bilinear(nn.Module):
    """A layer type no record knows (``nn.Bilinear``: its op has no channel rule) between two linears."""

    def __init__(self) -> None:
        super().__init__()
        self.pre, self.bil, self.out = nn.Linear(8, 8), nn.Bilinear(8, 8, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.pre(x))
        return self.out(self.bil(h, h))


def test_a_weight_an_op_without_a_rule_reads_keeps_its_channels() -> None:
    """Cutting fc's rows would change what ``mv`` computes from them, in a way no rule says."""
    groups = channel_groups(capture(_ReadsItsWeight().eval(), (torch.randn(3, 8),)))
    fc = next(g for g in groups if "fc.weight" in g.keys("out"))
    assert fc.reason == "op mv (from the top module)"
    with pytest.raises(SlimtorchError, match=r"1 by op mv \(from the top module\)"):
        slimtorch.prune.channels(_ReadsItsWeight().eval(), torch.randn(3, 8), ratio=0.5)


def test_a_layer_whose_op_has_no_rule_is_named_in_the_report_not_left_out() -> None:
    model = _Bilinear().eval()
    groups = channel_groups(capture(model, (torch.randn(3, 8),)))
    # its own 4 output channels, a group of no slice: nothing of it may be cut, and the report says why
    assert any(g.reason == "op bilinear (from bil)" and g.size == 4 and not g.slices for g in groups)
    with pytest.raises(SlimtorchError, match=r"2 by op bilinear \(from bil\)"):  # what it reads and makes
        slimtorch.prune.channels(model, torch.randn(3, 8), ratio=0.5)
    assert model.bil.weight.shape == (4, 8, 8)
