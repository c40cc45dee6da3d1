"""Model definitions shared by tests and benchmarks: small, deterministic, built in code (no downloads)."""

from tests.zoo.models import MLP, SmallCNN, TinyGPT, trained_checkpoint

__all__ = ["MLP", "SmallCNN", "TinyGPT", "trained_checkpoint"]
