"""Shared fixtures: every checkpoint is written at test time by the real writers."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _seeded() -> None:
    torch.manual_seed(0)
