"""Model definitions shared by tests and benchmarks: small, deterministic, built in code (no downloads)."""

from tests.zoo.models import (
    MLP,
    BagOfWords,
    NormsCNN,
    PReLUAttentionCNN,
    SmallCNN,
    TinyGPT,
    trained_checkpoint,
)
from tests.zoo.vision import UNet, count_params, mobilenet_v2, resnet18, resnet50

__all__ = [
    "MLP",
    "BagOfWords",
    "NormsCNN",
    "PReLUAttentionCNN",
    "SmallCNN",
    "TinyGPT",
    "UNet",
    "count_params",
    "mobilenet_v2",
    "resnet18",
    "resnet50",
    "trained_checkpoint",
]
