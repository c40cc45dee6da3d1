"""The vision zoo matches torchvision's layouts and behaves like an ordinary, traceable model."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import fx, nn

from tests.zoo import UNet, count_params, mobilenet_v2, resnet18, resnet50

CLASSES = 10
IMAGES = (2, 3, 64, 64)

BUILDERS: dict[str, Callable[[], nn.Module]] = {
    "resnet18": lambda: resnet18(num_classes=CLASSES),
    "resnet50": lambda: resnet50(num_classes=CLASSES),
    "mobilenet_v2": lambda: mobilenet_v2(num_classes=CLASSES),
    "unet": lambda: UNet(in_channels=3, classes=CLASSES),
}
EXPECTED_OUTPUT = {
    "resnet18": (2, CLASSES),
    "resnet50": (2, CLASSES),
    "mobilenet_v2": (2, CLASSES),
    "unet": (2, CLASSES, 64, 64),
}


def _shapes(model: nn.Module) -> dict[str, list[int]]:
    return {name: list(tensor.shape) for name, tensor in model.state_dict().items()}


def test_resnet18_has_torchvisions_11_689_512_parameters_and_key_names() -> None:
    model = resnet18()
    shapes = _shapes(model)
    assert count_params(model) == 11_689_512
    assert shapes["conv1.weight"] == [64, 3, 7, 7]
    assert "conv1.bias" not in shapes
    assert shapes["layer2.0.downsample.0.weight"] == [128, 64, 1, 1]
    assert shapes["layer2.0.downsample.1.running_var"] == [128]
    assert shapes["layer4.1.bn2.num_batches_tracked"] == []
    assert shapes["fc.weight"] == [1000, 512]
    assert "layer1.0.downsample.0.weight" not in shapes
    assert isinstance(model.avgpool, nn.AdaptiveAvgPool2d)


@pytest.mark.slow
def test_resnet50_has_torchvisions_25_557_032_parameters_and_key_names() -> None:
    model = resnet50()
    shapes = _shapes(model)
    assert count_params(model) == 25_557_032
    assert shapes["layer1.0.conv3.weight"] == [256, 64, 1, 1]
    assert shapes["layer1.0.downsample.0.weight"] == [256, 64, 1, 1]
    assert shapes["layer3.5.bn3.weight"] == [1024]
    assert shapes["fc.weight"] == [1000, 2048]
    assert len(model.layer3) == 6


@pytest.mark.slow
def test_resnet50_strides_on_the_3x3_conv_as_in_v1_5() -> None:
    first_block = resnet50().layer2[0]
    assert first_block.conv1.stride == (1, 1)
    assert first_block.conv2.stride == (2, 2)


def test_mobilenet_v2_has_torchvisions_3_504_872_parameters_and_key_names() -> None:
    model = mobilenet_v2()
    shapes = _shapes(model)
    assert count_params(model) == 3_504_872
    assert shapes["features.0.0.weight"] == [32, 3, 3, 3]
    assert shapes["features.0.1.running_mean"] == [32]
    assert shapes["features.1.conv.0.0.weight"] == [32, 1, 3, 3]
    assert shapes["features.2.conv.1.0.weight"] == [96, 1, 3, 3]
    assert shapes["features.17.conv.2.weight"] == [320, 960, 1, 1]
    assert shapes["features.18.0.weight"] == [1280, 320, 1, 1]
    assert shapes["classifier.1.weight"] == [1000, 1280]
    assert isinstance(model.classifier[0], nn.Dropout)


def test_mobilenet_v2_width_mult_rounds_channels_to_multiples_of_8() -> None:
    shapes = _shapes(mobilenet_v2(width_mult=0.5))
    assert shapes["features.0.0.weight"] == [16, 3, 3, 3]
    assert shapes["features.18.0.weight"] == [1280, 160, 1, 1]


def test_mobilenet_v2_adds_the_residual_only_when_stride_1_and_channels_match() -> None:
    features = mobilenet_v2().features
    assert not features[1].use_residual  # 32 -> 16
    assert not features[2].use_residual  # stride 2
    assert features[3].use_residual  # 24 -> 24, stride 1


@pytest.mark.slow
@pytest.mark.parametrize("name", BUILDERS)
def test_model_maps_a_small_image_batch_to_the_expected_output_shape(name: str) -> None:
    model = BUILDERS[name]()
    assert model(torch.randn(IMAGES)).shape == EXPECTED_OUTPUT[name]


@pytest.mark.slow
def test_unet_keeps_the_input_size_and_concatenates_skip_connections() -> None:
    model = UNet(in_channels=3, classes=2)
    assert model(torch.randn(IMAGES)).shape == (2, 2, 64, 64)
    graph = fx.symbolic_trace(model).graph
    cat_calls = [node for node in graph.nodes if node.op == "call_function" and node.target is torch.cat]
    assert len(cat_calls) == 4  # one per decoder level (depth 4)


def test_unet_channels_double_per_level() -> None:
    shapes = _shapes(UNet(in_channels=1, classes=3, base=8, depth=3))
    assert shapes["encoders.0.0.weight"] == [8, 1, 3, 3]
    assert shapes["encoders.2.0.weight"] == [32, 16, 3, 3]
    assert shapes["bottleneck.0.weight"] == [64, 32, 3, 3]
    assert shapes["decoders.0.0.weight"] == [32, 64, 3, 3]
    assert shapes["head.weight"] == [3, 8, 1, 1]


@pytest.mark.slow
@pytest.mark.parametrize("name", BUILDERS)
def test_model_is_deterministic_under_manual_seed(name: str) -> None:
    torch.manual_seed(123)
    first = BUILDERS[name]().state_dict()
    torch.manual_seed(123)
    second = BUILDERS[name]().state_dict()
    assert first.keys() == second.keys()
    assert all(torch.equal(first[key], second[key]) for key in first)


@pytest.mark.slow
@pytest.mark.parametrize("name", BUILDERS)
def test_model_runs_in_eval_mode_without_grad_and_repeats_its_output(name: str) -> None:
    model = BUILDERS[name]().eval()
    images = torch.randn(IMAGES)
    with torch.no_grad():
        first = model(images)
        second = model(images)
    assert not first.requires_grad
    assert torch.isfinite(first).all()
    assert torch.equal(first, second)


@pytest.mark.slow
@pytest.mark.parametrize("name", BUILDERS)
def test_model_traces_with_fx_and_the_trace_gives_the_same_outputs(name: str) -> None:
    model = BUILDERS[name]().eval()
    traced = fx.symbolic_trace(model)
    images = torch.randn(IMAGES)
    with torch.no_grad():
        torch.testing.assert_close(traced(images), model(images), rtol=0, atol=0)
