"""Shared fixtures: every checkpoint is written at test time by the real writers."""

from __future__ import annotations

import pytest
import torch


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "alone: needs the machine's cores to itself (real timing on free cores); make test runs these after "
        "the parallel workers, on their own",
    )


@pytest.fixture(autouse=True)
def _seeded() -> None:
    torch.manual_seed(0)
