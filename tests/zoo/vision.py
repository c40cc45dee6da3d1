"""Vision models in torchvision's exact layout, written in plain ``torch.nn`` (torchvision cannot load here).

ResNet-18/50 and MobileNetV2 use torchvision's module names, so their ``state_dict`` keys and shapes match
the real checkpoints one for one; structured-pruning and memory tests can then reason about real layouts.
UNet adds the one pattern the classifiers lack: skip connections joined with ``torch.cat``.

Example:
    >>> model = resnet18(num_classes=10)
    >>> model(torch.zeros(1, 3, 64, 64)).shape
    torch.Size([1, 10])
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["UNet", "count_params", "mobilenet_v2", "resnet18", "resnet50"]


def count_params(model: nn.Module) -> int:
    """Number of parameter elements, each shared tensor counted once.

    Example:
        >>> count_params(nn.Linear(3, 2))
        8
    """
    return sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------- ResNet


def _conv3x3(n_in: int, n_out: int, stride: int = 1, groups: int = 1) -> nn.Conv2d:
    return nn.Conv2d(n_in, n_out, 3, stride=stride, padding=1, groups=groups, bias=False)


def _conv1x1(n_in: int, n_out: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(n_in, n_out, 1, stride=stride, bias=False)


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with an identity (or 1x1 projection) shortcut: the ResNet-18/34 block."""

    expansion = 1

    def __init__(self, n_in: int, width: int, stride: int = 1, downsample: nn.Module | None = None) -> None:
        super().__init__()
        self.conv1 = _conv3x3(n_in, width, stride)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = _conv3x3(width, width)
        self.bn2 = nn.BatchNorm2d(width)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shortcut = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + shortcut)


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3, 1x1 expand (x4); the stride sits on the 3x3, as in ResNet v1.5 (torchvision's)."""

    expansion = 4

    def __init__(self, n_in: int, width: int, stride: int = 1, downsample: nn.Module | None = None) -> None:
        super().__init__()
        self.conv1 = _conv1x1(n_in, width)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = _conv3x3(width, width, stride)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = _conv1x1(width, width * self.expansion)
        self.bn3 = nn.BatchNorm2d(width * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shortcut = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + shortcut)


class ResNet(nn.Module):
    """The ResNet stem, four stages of residual blocks, global average pooling and a linear head."""

    def __init__(
        self, block: type[BasicBlock | Bottleneck], blocks_per_stage: list[int], num_classes: int = 1000
    ) -> None:
        super().__init__()
        self.inplanes = 64
        self.conv1 = nn.Conv2d(3, 64, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layer1 = self._make_stage(block, 64, blocks_per_stage[0], stride=1)
        self.layer2 = self._make_stage(block, 128, blocks_per_stage[1], stride=2)
        self.layer3 = self._make_stage(block, 256, blocks_per_stage[2], stride=2)
        self.layer4 = self._make_stage(block, 512, blocks_per_stage[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(512 * block.expansion, num_classes)
        # Same initialisation as torchvision so weight statistics (and pruning importances) look familiar;
        # the Linear head keeps PyTorch's default init, as torchvision's does.
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(module, nn.BatchNorm2d):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)

    def _make_stage(
        self, block: type[BasicBlock | Bottleneck], width: int, n_blocks: int, stride: int
    ) -> nn.Sequential:
        n_out = width * block.expansion
        downsample = None
        if stride != 1 or self.inplanes != n_out:
            downsample = nn.Sequential(_conv1x1(self.inplanes, n_out, stride), nn.BatchNorm2d(n_out))
        layers = [block(self.inplanes, width, stride, downsample)]
        self.inplanes = n_out
        layers += [block(n_out, width) for _ in range(1, n_blocks)]
        return nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        x = torch.flatten(self.avgpool(x), 1)
        return self.fc(x)


def resnet18(num_classes: int = 1000) -> nn.Module:
    """ResNet-18 with torchvision's keys and shapes: 11,689,512 parameters at 1000 classes.

    Example:
        >>> resnet18().state_dict()["layer2.0.downsample.0.weight"].shape
        torch.Size([128, 64, 1, 1])
    """
    return ResNet(BasicBlock, [2, 2, 2, 2], num_classes)


def resnet50(num_classes: int = 1000) -> nn.Module:
    """ResNet-50 (v1.5) with torchvision's keys and shapes: 25,557,032 parameters at 1000 classes.

    Example:
        >>> resnet50().state_dict()["layer1.0.conv3.weight"].shape
        torch.Size([256, 64, 1, 1])
    """
    return ResNet(Bottleneck, [3, 4, 6, 3], num_classes)


# ---------------------------------------------------------------- MobileNetV2

_INVERTED_RESIDUAL_SETTINGS = [  # (expand ratio t, channels c, repeats n, first stride s)
    (1, 16, 1, 1),
    (6, 24, 2, 2),
    (6, 32, 3, 2),
    (6, 64, 4, 2),
    (6, 96, 3, 1),
    (6, 160, 3, 2),
    (6, 320, 1, 1),
]


def _make_divisible(value: float, divisor: int = 8) -> int:
    """Round to the nearest multiple of ``divisor``, never dropping more than 10% below ``value``."""
    rounded = max(divisor, int(value + divisor / 2) // divisor * divisor)
    return rounded + divisor if rounded < 0.9 * value else rounded


def _conv_bn_relu6(
    n_in: int, n_out: int, kernel_size: int = 3, stride: int = 1, groups: int = 1
) -> nn.Sequential:
    # A bare Sequential (not a subclass) keeps the keys at ``features.0.0.weight`` like torchvision's.
    return nn.Sequential(
        nn.Conv2d(n_in, n_out, kernel_size, stride, (kernel_size - 1) // 2, groups=groups, bias=False),
        nn.BatchNorm2d(n_out),
        nn.ReLU6(inplace=True),
    )


class InvertedResidual(nn.Module):
    """Expand (1x1), depthwise 3x3, linear project (1x1); adds the input back when shapes allow."""

    def __init__(self, n_in: int, n_out: int, stride: int, expand_ratio: int) -> None:
        super().__init__()
        hidden = round(n_in * expand_ratio)
        self.use_residual = stride == 1 and n_in == n_out
        layers: list[nn.Module] = []
        if expand_ratio != 1:
            layers.append(_conv_bn_relu6(n_in, hidden, kernel_size=1))
        layers += [
            _conv_bn_relu6(hidden, hidden, stride=stride, groups=hidden),
            nn.Conv2d(hidden, n_out, 1, bias=False),
            nn.BatchNorm2d(n_out),
        ]
        self.conv = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv(x) if self.use_residual else self.conv(x)


class MobileNetV2(nn.Module):
    """MobileNetV2 with torchvision's ``features`` / ``classifier`` layout."""

    def __init__(self, num_classes: int = 1000, width_mult: float = 1.0) -> None:
        super().__init__()
        n_in = _make_divisible(32 * width_mult)
        self.last_channel = _make_divisible(1280 * max(1.0, width_mult))
        features: list[nn.Module] = [_conv_bn_relu6(3, n_in, stride=2)]
        for expand_ratio, channels, repeats, first_stride in _INVERTED_RESIDUAL_SETTINGS:
            n_out = _make_divisible(channels * width_mult)
            for i in range(repeats):
                features.append(InvertedResidual(n_in, n_out, first_stride if i == 0 else 1, expand_ratio))
                n_in = n_out
        features.append(_conv_bn_relu6(n_in, self.last_channel, kernel_size=1))
        self.features = nn.Sequential(*features)
        self.classifier = nn.Sequential(nn.Dropout(p=0.2), nn.Linear(self.last_channel, num_classes))
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out")
            elif isinstance(module, nn.BatchNorm2d):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, 0, 0.01)
                nn.init.zeros_(module.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = nn.functional.adaptive_avg_pool2d(self.features(x), (1, 1))
        return self.classifier(torch.flatten(x, 1))


def mobilenet_v2(num_classes: int = 1000, width_mult: float = 1.0) -> nn.Module:
    """MobileNetV2 with torchvision's keys and shapes: 3,504,872 parameters at 1000 classes, width 1.0.

    Example:
        >>> mobilenet_v2().state_dict()["features.18.0.weight"].shape
        torch.Size([1280, 320, 1, 1])
    """
    return MobileNetV2(num_classes, width_mult)


# ---------------------------------------------------------------- UNet


def _double_conv(n_in: int, n_out: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(n_in, n_out, 3, padding=1, bias=False),
        nn.BatchNorm2d(n_out),
        nn.ReLU(inplace=True),
        nn.Conv2d(n_out, n_out, 3, padding=1, bias=False),
        nn.BatchNorm2d(n_out),
        nn.ReLU(inplace=True),
    )


class UNet(nn.Module):
    """A small U-Net: its skip connections concatenate channels, which pruning must keep aligned.

    Level ``i`` of the encoder has ``base * 2**i`` channels; input height and width must be divisible by
    ``2**depth``, and the output keeps them.

    Example:
        >>> UNet(classes=2)(torch.zeros(1, 3, 32, 32)).shape
        torch.Size([1, 2, 32, 32])
    """

    def __init__(self, in_channels: int = 3, classes: int = 2, base: int = 16, depth: int = 4) -> None:
        super().__init__()
        widths = [base * 2**level for level in range(depth + 1)]
        self.encoders = nn.ModuleList()
        n_in = in_channels
        for width in widths[:-1]:
            self.encoders.append(_double_conv(n_in, width))
            n_in = width
        self.pool = nn.MaxPool2d(2)
        self.bottleneck = _double_conv(widths[-2], widths[-1])
        self.upsamplers = nn.ModuleList()
        self.decoders = nn.ModuleList()
        for level in reversed(range(depth)):
            self.upsamplers.append(nn.ConvTranspose2d(widths[level + 1], widths[level], 2, stride=2))
            self.decoders.append(_double_conv(2 * widths[level], widths[level]))
        self.head = nn.Conv2d(widths[0], classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        for encoder in self.encoders:
            x = encoder(x)
            skips.append(x)
            x = self.pool(x)
        x = self.bottleneck(x)
        for upsample, decoder, skip in zip(self.upsamplers, self.decoders, reversed(skips), strict=True):
            x = decoder(torch.cat([skip, upsample(x)], dim=1))
        return self.head(x)
