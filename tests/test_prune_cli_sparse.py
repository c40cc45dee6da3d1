"""`slimtorch prune --unstructured SHARE` and `--n-m N:M`: zeros instead of channels, stored sparse."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import slimtorch
from slimtorch.cli.main import main
from slimtorch.models.spec import resolve_factory
from slimtorch.prune.unstructured import sparsity_of

MLP = """
import torch
from torch import nn


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 128), nn.ReLU())
        self.head = nn.Linear(128, 8)

    def forward(self, x):
        return self.head(self.body(x))
"""


@pytest.fixture
def spec(tmp_path: Path) -> str:
    path = tmp_path / "prune_cli_sparse_mlp.py"
    path.write_text(MLP)
    return f"{path}:Mlp"


def prune_json(capsys, spec: str, out: Path, *flags: str) -> dict:
    assert main(["prune", spec, "-o", str(out), *flags, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def dense_file(spec: str, folder: Path) -> int:
    path = folder / "dense.safetensors"
    slimtorch.save_model(resolve_factory(spec)(), path)
    return path.stat().st_size


def test_unstructured_zeroes_90pct_of_the_weights_and_the_file_shrinks_to_under_a_quarter(
    spec, tmp_path, capsys
) -> None:
    out = tmp_path / "sparse.safetensors"
    report = prune_json(capsys, spec, out, "--unstructured", "0.9")
    loaded = slimtorch.load_model(out, resolve_factory(spec)).model
    measured = sparsity_of(loaded)
    assert measured.sparsity == pytest.approx(0.9, abs=0.001) and report["sparsity"] == measured.sparsity
    assert report["schema"] == "slimtorch.sparsity/1" and report["method"] == "global_magnitude"
    assert report["sparsity_before"] == 0.0 and report["file_bytes"] == out.stat().st_size
    assert report["file_bytes_before"] == pytest.approx(dense_file(spec, tmp_path), rel=0.01)
    assert out.stat().st_size < 0.25 * dense_file(spec, tmp_path)


def test_2_4_keeps_at_most_2_non_zeros_in_every_4_inputs_and_the_file_shrinks(spec, tmp_path, capsys) -> None:
    out = tmp_path / "two-four.safetensors"
    report = prune_json(capsys, spec, out, "--n-m", "2:4")
    loaded = slimtorch.load_model(out, resolve_factory(spec)).model
    for layer in (loaded.body[0], loaded.body[2], loaded.head):
        groups = layer.weight.reshape(-1, 4)
        assert int((groups != 0).sum(1).max()) <= 2
    assert report["n_m"] == "2:4" and report["sparsity"] == pytest.approx(0.5)
    assert out.stat().st_size < 0.75 * dense_file(spec, tmp_path)


def test_skip_keeps_a_layer_dense_and_a_pattern_naming_nothing_is_one_line(spec, tmp_path, capsys) -> None:
    out = tmp_path / "sparse.safetensors"
    report = prune_json(capsys, spec, out, "--unstructured", "0.8", "--skip", "head")
    assert set(report["layers"]) == {"body.0", "body.2"}
    loaded = slimtorch.load_model(out, resolve_factory(spec)).model
    assert bool((loaded.head.weight != 0).all()) and sparsity_of(
        loaded, ["body.0", "body.2"]
    ).sparsity == pytest.approx(0.8, abs=1e-4)
    assert main(["prune", spec, "-o", str(out), "--n-m", "2:4", "--skip", "haed"]) == 2
    error = capsys.readouterr().err
    assert (
        error.count("\n") == 1 and "'haed' names no Linear, Conv or recurrent layer (closest: head)" in error
    )


@pytest.mark.parametrize(
    "flags",
    [
        ["--unstructured", "0.9", "--ratio", "0.5"],
        ["--n-m", "2:4", "--unstructured", "0.5"],
        ["--n-m", "2:4", "--target-params", "1000"],
        ["--n-m", "4:2"],
        ["--n-m", "2"],
        ["--unstructured", "1.0"],
    ],
)
def test_sparse_flags_combined_with_a_budget_or_malformed_are_a_usage_error(flags, capsys) -> None:
    with pytest.raises(SystemExit) as usage:
        main(["prune", "m:f", "-o", "o.safetensors", *flags])
    assert usage.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("slimtorch: error: argument")


def test_a_channel_pruning_option_with_unstructured_is_refused(spec, tmp_path, capsys) -> None:
    out = tmp_path / "o.safetensors"
    assert main(["prune", spec, "-o", str(out), "--unstructured", "0.5", "--round-to", "8"]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "--round-to: channel pruning only" in error and not out.exists()


def test_the_table_shows_zeros_and_the_file_before_and_after(spec, tmp_path, capsys) -> None:
    assert main(["prune", spec, "-o", str(tmp_path / "s.safetensors"), "--unstructured", "0.9"]) == 0
    shown = capsys.readouterr().out
    assert "90% of the weights zeroed" in shown and "zeros, the 3 weight(s) pruned" in shown
    assert "file" in shown and "latency not timed" in shown
