"""Structured pruning: whole channels leave every tensor that carries them, and the model still runs.

The zoo's vision models (torchvision layouts) are pruned for real: ratio 0 changes nothing, ratio 0.5 keeps
the output shape and removes the share of parameters that halving every group's width implies, and ResNet-18
lands on Torch-Pruning's published figures. Exactness is checked where it can be: channels whose every
weight is zero are removed without changing a single output value.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from slimtorch.errors import OptionError, SlimtorchError
from slimtorch.graph.capture import capture
from slimtorch.graph.channels import channel_groups
from slimtorch.graph.macs import count_macs
from slimtorch.prune import channels
from tests.zoo import UNet, count_params, mobilenet_v2, resnet18, resnet50

SMALL = torch.randn(2, 3, 64, 64)
ZOO = {"resnet18": resnet18, "resnet50": resnet50, "mobilenet_v2": mobilenet_v2, "unet": UNet}


class ConvNet(nn.Module):
    """conv-bn-relu x2, global pooling, a classifier: every kind of slice in a few tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16)
        self.conv2, self.bn2 = nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32)
        self.fc = nn.Linear(32 * 4 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn1(self.conv1(x)))
        x = torch.relu(self.bn2(self.conv2(x)))
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 4), 1))


def _sizes_agree_with_tensors(model: nn.Module) -> None:
    for name, module in model.named_modules():
        if isinstance(module, nn.Conv2d):
            assert module.weight.shape[0] == module.out_channels, name
            assert module.weight.shape[1] * module.groups == module.in_channels, name
        elif isinstance(module, nn.BatchNorm2d):
            assert module.weight.shape[0] == module.num_features == module.running_var.shape[0], name
        elif isinstance(module, nn.Linear):
            assert tuple(module.weight.shape) == (module.out_features, module.in_features), name


@pytest.mark.slow
def test_pruned_resnet18_loses_74pct_params_and_macs_like_torch_pruning() -> None:
    model = resnet18().eval()
    image = torch.randn(1, 3, 224, 224)
    assert count_params(model) == 11_689_512
    assert count_macs(model, image) == pytest.approx(1.82e9, rel=0.01)
    channels(model, SMALL, ratio=0.5)
    # Torch-Pruning's published ResNet-18 figures at 50% channel sparsity: 3.06M params, 0.49G MACs.
    assert count_params(model) == pytest.approx(3.06e6, rel=0.03)
    assert count_macs(model, image) == pytest.approx(0.49e9, rel=0.03)
    assert model(image).shape == (1, 1000)
    _sizes_agree_with_tensors(model)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(ZOO))
def test_ratio_0_changes_nothing(name: str) -> None:
    model = ZOO[name]().eval()
    reference = copy.deepcopy(model)
    channels(model, SMALL, ratio=0.0)
    assert count_params(model) == count_params(reference)
    assert torch.equal(model(SMALL), reference(SMALL))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(ZOO))
def test_ratio_half_keeps_the_output_shape_and_removes_about_three_quarters(name: str) -> None:
    model = ZOO[name]().eval()
    before, out = count_params(model), model(SMALL).shape
    with torch.no_grad():  # no autograd needed: the graph comes from torch.export
        report = channels(model, SMALL, ratio=0.5)
        pruned = report.model
    assert pruned is model and model(SMALL).shape == out
    # Halving both sides of most weights leaves about a quarter; the classifier and stem keep one side.
    assert 0.22 < count_params(model) / before < 0.36
    assert report.params_after == count_params(model) and report.pruned_groups >= 4
    assert set(report.frozen) == {"the model's input", "the model's output"}
    _sizes_agree_with_tensors(model)
    model.train()(SMALL).sum().backward()  # still trainable


def test_removing_all_zero_channels_changes_no_output() -> None:
    model = ConvNet().eval()
    with torch.no_grad():
        model.bn1.running_mean.uniform_(-1, 1)
        dead = torch.arange(0, 16, 2)  # every second channel of conv1: no weight reads or writes it
        model.conv1.weight[dead] = 0
        model.conv1.bias[dead] = 0
        model.bn1.weight[dead] = 0
        model.bn1.bias[dead] = 0
        model.conv2.weight[:, dead] = 0
    reference = model(SMALL)
    channels(model, SMALL, ratio=0.5, importance="l1", ignore=["conv2"])  # only conv1's group
    assert model.conv1.out_channels == 8 and model.conv2.in_channels == 8 and model.conv2.out_channels == 32
    assert torch.allclose(model(SMALL), reference, atol=1e-6)


def test_flatten_maps_each_removed_channel_to_its_run_of_features() -> None:
    model = ConvNet().eval()
    scores = {}

    def last_channels_first(group, tensors):  # removes the lowest-numbered channels of each group
        scores[group.size] = torch.arange(group.size, dtype=torch.float64)
        return scores[group.size]

    fc_before = model.fc.weight.detach().clone()
    channels(model, SMALL, ratio=0.25, importance=last_channels_first)
    assert model.conv2.out_channels == 24 and model.fc.in_features == 24 * 16
    assert torch.equal(model.fc.weight, fc_before[:, 8 * 16 :])  # channels 8..31, 16 features each


@pytest.mark.slow
def test_depthwise_convolution_keeps_one_filter_per_remaining_channel() -> None:
    model = mobilenet_v2().eval()
    channels(model, SMALL, ratio=0.5)
    depthwise = model.features[2].conv[1][0]
    assert depthwise.groups == depthwise.in_channels == depthwise.out_channels == depthwise.weight.shape[0]
    assert depthwise.weight.shape[1] == 1


def test_ignore_keeps_a_modules_output_channels() -> None:
    model = ConvNet().eval()
    channels(model, SMALL, ratio=0.5, ignore=[model.conv1])
    assert model.conv1.out_channels == 16 and model.conv2.out_channels == 16
    other = ConvNet().eval()
    channels(other, SMALL, ratio=0.5, ignore=["conv2"])
    assert other.conv1.out_channels == 8 and other.conv2.out_channels == 32
    by_pattern = ConvNet().eval()  # a pattern (fnmatch) fences off the modules it names
    channels(by_pattern, SMALL, ratio=0.5, ignore=["conv[2-9]"])
    assert by_pattern.conv1.out_channels == 8 and by_pattern.conv2.out_channels == 32


def test_an_ignore_that_names_no_module_is_refused_before_anything_is_pruned() -> None:
    model = ConvNet().eval()
    with pytest.raises(OptionError, match=r"'conv3' names no module of the model \(closest: conv2, conv1"):
        channels(model, SMALL, ratio=0.5, ignore=["conv3"])
    assert model.conv1.out_channels == 16 and model.conv2.out_channels == 32


def test_round_to_keeps_multiples() -> None:
    model = ConvNet().eval()
    channels(model, SMALL, ratio=0.6, round_to=8)
    assert model.conv1.out_channels == 8 and model.conv2.out_channels == 16


def test_global_scope_removes_the_ratio_of_all_channels_where_they_matter_least() -> None:
    model = ConvNet().eval()
    with torch.no_grad():
        model.conv2.weight.mul_(0.01)  # conv2's channels matter less than conv1's, relatively the same
    report = channels(model, SMALL, ratio=0.5, scope="global")
    assert report.channels_before == 48
    assert abs(report.channels_after - 24) <= 2
    assert model(SMALL).shape == (2, 10)


def test_an_op_of_unknown_channel_semantics_freezes_its_group_and_is_named() -> None:
    class Shuffle(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv1, self.conv2 = nn.Conv2d(3, 8, 1), nn.Conv2d(8, 8, 1)

        def forward(self, x):
            x = self.conv1(x)
            return self.conv2(torch.roll(x, 1, dims=1))  # moves channels around: no group survives it

    model = Shuffle().eval()
    groups = channel_groups(capture(model, (SMALL,)))
    conv1 = next(g for g in groups if "conv1.weight" in g.keys("out"))
    assert conv1.reason is not None and "roll" in conv1.reason
    with pytest.raises(SlimtorchError, match=r"no prunable channel group.*roll") as refusal:
        channels(model, SMALL, ratio=0.5)  # nothing else can go: a refusal, not a 1.0x success
    assert "\n" not in str(refusal.value)
    assert model.conv1.out_channels == 8


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"ratio": 1.0}, "ratio must be"),
        ({"ratio": 0.5, "scope": "model"}, "scope must be"),
        ({"ratio": 0.5, "importance": "taylor2"}, "unknown importance"),
        ({"ratio": 0.5, "round_to": 0}, "round_to"),
        ({"ratio": 0.5, "ignore": [nn.Linear(2, 2)]}, "not part of the model"),
    ],
)
def test_bad_arguments_are_clear_errors(kwargs, words) -> None:
    with pytest.raises(SlimtorchError, match=words):
        channels(ConvNet(), SMALL, **kwargs)


def test_a_model_export_cannot_trace_is_a_clear_error() -> None:
    class DataDependent(nn.Module):
        def forward(self, x):
            return x if x.sum() > 0 else -x  # Python control flow on a value

    with pytest.raises(SlimtorchError, match="cannot capture the model's graph"):
        channels(DataDependent(), SMALL, ratio=0.5)


def test_multihead_attention_keeps_its_embedding_width_and_the_rest_is_pruned() -> None:
    from tests.zoo import TinyGPT

    model = TinyGPT().eval()
    tokens = torch.randint(0, 512, (2, 16))
    report = channels(model, tokens, ratio=0.5)
    assert any("MultiheadAttention" in reason and "embed_dim" in reason for reason in report.frozen)
    assert model.blocks[0].linear1.out_features == 128  # the feed-forward, 256 -> 128
    assert model(tokens).shape == (2, 16, 512)


def test_a_size_hidden_in_python_code_fails_loudly_right_after_pruning() -> None:
    class Reshaper(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.channels = 16  # kept here, used in forward: nothing in the graph says it is a size

        def forward(self, x):
            return x.view(x.shape[0], self.channels, -1).mean(-1)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 16, 3)
            self.reshape = Reshaper()
            self.fc = nn.Linear(16, 4)

        def forward(self, x):
            return self.fc(self.reshape(self.conv(x)))

    with pytest.raises(SlimtorchError, match=r"no longer runs.*ignore"):
        channels(Net().eval(), SMALL, ratio=0.5)
    fenced = Net().eval()  # fencing conv off leaves nothing to prune here: refused, the model untouched
    with pytest.raises(SlimtorchError, match=r"no prunable channel group.*ignored: conv"):
        channels(fenced, SMALL, ratio=0.5, ignore=["conv"])
    assert fenced.conv.out_channels == 16 and fenced(SMALL).shape == (2, 4)
