"""The wild-model suite's shared set-up: the ``slow`` marker and one working folder per session."""

from __future__ import annotations

from pathlib import Path

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "slow: among the slowest steps of the wild-model suite (they still run in make test)"
    )


@pytest.fixture(scope="session")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where shrunk files and export bundles go."""
    return tmp_path_factory.mktemp("wild")
