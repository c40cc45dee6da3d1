"""Structured pruning on checkpoints as shipped: it removes channels for real, or refuses in one line.

facenet-pytorch's MTCNN ONet (PReLU after every convolution), torchfcpe's conformer (a weight-normed output
projection, a tensor kept as a plain attribute) and resemblyzer's LSTM encoder (nothing a channel graph can
remove) are built from their packages' classes and loaded with their packages' weights.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from slimtorch.errors import SlimtorchError
from slimtorch.prune import channels
from tests.wild.models import BY_NAME


def _shipped(name: str) -> tuple[nn.Module, tuple]:
    model = BY_NAME[name]
    return model.original(), model.example()


def _params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_facenet_onet_prunes_through_its_prelus_and_keeps_every_output_shape() -> None:
    net, args = _shipped("facenet-onet")
    shapes = [tuple(o.shape) for o in net(*args)]
    before = _params(net)
    report = channels(net, args, ratio=0.25)
    assert [tuple(o.shape) for o in net(*args)] == shapes
    assert report.pruned_groups >= 4 and _params(net) < 0.8 * before
    pairs = ((net.conv1, net.prelu1), (net.conv2, net.prelu2), (net.conv3, net.prelu3))
    assert [conv.out_channels for conv, _ in pairs] == [24, 48, 48]  # 32, 64, 64 less a quarter
    for conv, prelu in pairs:  # each PReLU lost the slopes of the channels its conv lost
        assert prelu.weight.numel() == prelu.num_parameters == conv.out_channels


def test_a_shared_prelu_slope_passes_the_channels_on_untouched() -> None:
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.PReLU(), nn.Conv2d(8, 4, 3)).eval()
    channels(model, torch.randn(2, 3, 16, 16), ratio=0.5)
    assert model[0].out_channels == model[2].in_channels == 4 and model[1].weight.numel() == 1


@pytest.mark.slow
def test_resemblyzer_lstm_has_nothing_to_prune_and_is_refused_in_one_line() -> None:
    net, args = _shipped("resemblyzer")
    before = {k: v.clone() for k, v in net.state_dict().items()}
    with pytest.raises(SlimtorchError, match=r"no prunable channel group.*LSTM lstm.*prune\.weights") as got:
        channels(net, args, ratio=0.25)
    assert "\n" not in str(got.value)
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())


@pytest.mark.slow
def test_a_budget_no_channel_can_meet_is_refused_the_same_way() -> None:
    net, args = _shipped("resemblyzer")
    with pytest.raises(SlimtorchError, match="no prunable channel group"):
        channels(net, args, target_params=_params(net) // 2)


@pytest.mark.slow
def test_torchfcpe_conformer_prunes_its_residual_stream_and_its_weight_normed_projection() -> None:
    net, args = _shipped("fcpe")
    shape = tuple(net(*args).shape)
    before = _params(net)
    channels(net, args, ratio=0.25)
    assert tuple(net(*args).shape) == shape
    assert (
        net.output_proj.in_features == 384
        and net.output_proj.parametrizations.weight.original1.shape[1] == 384
    )
    assert _params(net) < 0.8 * before
