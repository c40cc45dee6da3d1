"""`slimtorch recover`: a pruned model, its data by name, trained back and saved so load_model reads it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import safetensors.torch
import torch

import slimtorch
from slimtorch.cli.main import main
from slimtorch.models.spec import resolve_factory
from slimtorch.recovery import evaluate, open_data

NET = """
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self, width: int = 12) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
            nn.Conv2d(width, 2 * width, 3, padding=1), nn.BatchNorm2d(2 * width), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
        )
        self.classifier = nn.Linear(2 * width, 10)

    def forward(self, x):
        return self.classifier(torch.flatten(self.features(x), 1))


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 4))

    def forward(self, x):
        return self.layers(x)
"""


@pytest.fixture(scope="module")
def digits_models(tmp_path_factory) -> dict[str, Path]:
    """A small CNN trained on digits (the dense original) and half its channels removed by `prune`."""
    pytest.importorskip("sklearn")
    folder = tmp_path_factory.mktemp("recover_cli")
    net = folder / "recover_cli_net.py"
    net.write_text(NET)
    torch.manual_seed(0)
    dense = resolve_factory(f"{net}:Net")()
    slimtorch.recover(dense, open_data("digits").train, epochs=4, lr=3e-3, recalibrate_bn=False)
    weights = folder / "dense.safetensors"
    safetensors.torch.save_file({k: v.contiguous() for k, v in dense.state_dict().items()}, weights)
    pruned = folder / "pruned.safetensors"
    argv = ["prune", f"{net}:Net", "--weights", str(weights), "-o", str(pruned), "--ratio", "0.6"]
    assert main([*argv, "--runs", "0", "--input-shape", "2,1,8,8", "--json"]) == 0
    return {"spec": Path(f"{net}:Net"), "dense": weights, "pruned": pruned, "folder": folder}


def recover_json(capsys, *argv: str) -> dict:
    assert main(["recover", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.slow
def test_recover_raises_a_pruned_models_accuracy_and_load_model_reads_what_it_wrote(
    digits_models, capsys
) -> None:
    spec, out = str(digits_models["spec"]), digits_models["folder"] / "recovered.safetensors"
    report = recover_json(
        capsys,
        spec,
        "--weights",
        str(digits_models["pruned"]),
        "--data",
        "digits",
        "-o",
        str(out),
        "--batch",
        "128",
    )
    assert report["schema"] == "slimtorch.recover/1" and report["metric"] == "accuracy"
    assert report["steps"] == 3 * 11 and report["teacher"] is None
    assert report["after"] > report["before"] + 10
    assert report["file_bytes"] == out.stat().st_size
    loaded = slimtorch.load_model(out, resolve_factory(spec)).model
    assert loaded.features[0].out_channels < 12  # the pruned shapes came back from the file
    assert evaluate(loaded, open_data("digits")) == pytest.approx(report["after"])


@pytest.mark.slow
def test_recover_distils_from_the_teacher_and_stops_at_the_target(digits_models, capsys) -> None:
    spec, out = str(digits_models["spec"]), digits_models["folder"] / "distilled.safetensors"
    pruned, dense = str(digits_models["pruned"]), str(digits_models["dense"])
    argv = [spec, "--weights", pruned, "--teacher", dense, "--data", "digits", "-o", str(out)]
    report = recover_json(capsys, *argv, "--steps", "200", "--target", "40", "--lr", "3e-3")
    assert report["teacher"] == dense and report["after"] >= 40 > report["before"]
    assert report["stopped_early"] and report["steps"] < 200
    assert report["metrics"][-1][1] >= 40


@pytest.mark.slow
def test_a_cosine_task_trains_towards_the_teachers_outputs(tmp_path, capsys) -> None:
    net = tmp_path / "recover_cli_mlp.py"
    net.write_text(NET)
    torch.manual_seed(0)
    original = resolve_factory(f"{net}:Mlp")()
    damaged = {k: v + 0.3 * torch.randn_like(v) for k, v in original.state_dict().items()}
    safetensors.torch.save_file(original.state_dict(), tmp_path / "original.safetensors")
    safetensors.torch.save_file(damaged, tmp_path / "damaged.safetensors")
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "task.npz", x=rng.normal(size=(256, 6)), y=np.zeros((256, 4)))
    argv = [
        f"{net}:Mlp",
        "--weights",
        str(tmp_path / "damaged.safetensors"),
        "--data",
        str(tmp_path / "task.npz"),
    ]
    out = tmp_path / "out.safetensors"
    report = recover_json(
        capsys,
        *argv,
        "--teacher",
        str(tmp_path / "original.safetensors"),
        "-o",
        str(out),
        "--epochs",
        "25",
        "--lr",
        "1e-2",
    )
    assert report["metric"] == "cosine" and report["after"] > report["before"] and report["after"] > 0.9
    assert main(["recover", *argv, "-o", str(out)]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "scored by the output cosine" in error and "--teacher" in error


@pytest.mark.parametrize(
    ("extra", "problem"),
    [
        ([], "recover needs --data DATA"),
        (["--data", "digits", "--input-shape", "1,1,8,8"], "--input-shape does not apply"),
        (["--data", "digits", "--epochs", "0"], "--epochs must be at least 1, not 0"),
        (["--data", "nowhere/at/all"], "data 'nowhere/at/all': no such file or folder"),
    ],
)
def test_bad_recover_input_is_one_line_and_exit_2(tmp_path, capsys, extra, problem) -> None:
    assert main(["recover", "torch.nn:Identity", "-o", str(tmp_path / "o.safetensors"), *extra]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and error.startswith("slimtorch: error: ") and problem in error


def test_epochs_and_steps_together_are_a_usage_error(tmp_path, capsys) -> None:
    with pytest.raises(SystemExit) as usage:
        main(["recover", "m:f", "-o", "o", "--data", "digits", "--epochs", "2", "--steps", "5"])
    assert usage.value.code == 2 and "not allowed with argument" in capsys.readouterr().err
