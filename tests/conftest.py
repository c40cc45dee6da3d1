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
    config.addinivalue_line(
        "markers",
        "slow: takes over a second or two (fresh processes, real models, exports, timed searches); "
        "`make fast` leaves these out, `make test` runs them",
    )


WILD = "tests/wild/"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The wild suite reads real checkpoints as their packages ship them, every test of it: slow."""
    for item in items:
        if item.nodeid.startswith(WILD):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True)
def _seeded() -> None:
    torch.manual_seed(0)
