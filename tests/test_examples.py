"""The example behind `make demo` builds a checkpoint whose report tells its story."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

import slimtorch

EXAMPLE = Path(__file__).parents[1] / "examples" / "training_checkpoint.py"


def _example():
    spec = importlib.util.spec_from_file_location("training_checkpoint", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_demo_checkpoint_is_mostly_optimizer_state_with_masks_and_a_tied_head(tmp_path):
    path = tmp_path / "checkpoint.pt"
    torch.save(_example().build_checkpoint(steps=2), path)

    report = slimtorch.inspect(path)

    assert report.category("optimizer_state") > 0.5 * report.file_bytes
    assert report.category("pruning_leftovers") > 0
    assert report.tied.tensors == 1
    assert report.savings[0].action.startswith("drop optimizer")
    assert report.savings[-1].bytes_after < 0.1 * report.file_bytes
