"""Pruned models saved without pickle: the slim file holds the weights and the structural delta, and
load_model rebuilds the original class, reshapes it by the delta and fills it."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

import slimtorch
from slimtorch.cli.main import main
from tests.hostile import edit_slim_metadata
from tests.zoo import UNet, mobilenet_v2, resnet18, resnet50

SMALL = torch.randn(2, 3, 64, 64)
ZOO = {"resnet18": resnet18, "resnet50": resnet50, "mobilenet_v2": mobilenet_v2, "unet": UNet}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(ZOO))
def test_pruned_model_saves_and_loads_back_with_identical_outputs(name, tmp_path) -> None:
    model = ZOO[name]().eval()
    slimtorch.prune.channels(model, SMALL, ratio=0.5)
    path = tmp_path / "pruned.safetensors"
    slimtorch.save_model(model, path)
    loaded = slimtorch.load_model(path, ZOO[name]).model.eval()
    assert torch.equal(loaded(SMALL), model(SMALL))
    assert {k: v.shape for k, v in loaded.state_dict().items()} == {
        k: v.shape for k, v in model.state_dict().items()
    }
    with safe_open(path, "pt") as f:  # a plain safetensors file, the delta in its metadata
        delta = json.loads(f.metadata()["slimtorch"])["delta"]
    assert delta["shapes"] and delta["attributes"]


@pytest.mark.slow
def test_pruning_twice_saves_both_changes(tmp_path) -> None:
    model = resnet18().eval()
    slimtorch.prune.channels(model, SMALL, ratio=0.3)
    slimtorch.prune.channels(model, SMALL, ratio=0.3)
    path = tmp_path / "twice.safetensors"
    slimtorch.save_model(model, path, quantize="int8-weight")
    loaded = slimtorch.load_model(path, resnet18).model.eval()
    assert loaded.layer1[0].conv1.out_channels == model.layer1[0].conv1.out_channels < 40
    expected, got = model(SMALL).flatten(), loaded(SMALL).flatten()
    assert torch.nn.functional.cosine_similarity(expected, got, dim=0) > 0.99


def test_unpruned_model_saves_no_delta(tmp_path) -> None:
    path = tmp_path / "plain.safetensors"
    slimtorch.save_model(resnet18(), path)
    with safe_open(path, "pt") as f:
        assert json.loads(f.metadata()["slimtorch"])["delta"] is None


@pytest.mark.slow
@pytest.mark.parametrize(
    ("edit", "words"),
    [
        (lambda d: d["attributes"].update({"fc": {"forward": 3}}), "not a size"),
        (lambda d: d["attributes"].update({"fc": {"in_features": "__import__('os')"}}), "not a size"),
        (lambda d: d["attributes"].update({"nowhere": {"in_features": 3}}), "module 'nowhere'"),
        (lambda d: d["shapes"].update({"fc.weight": [-1]}), "not lists of sizes"),
        (lambda d: d["shapes"].update({"ghost.weight": [3]}), "'ghost.weight'"),
    ],
)
def test_a_tampered_delta_is_refused_with_the_file_named(tmp_path, capsys, edit, words) -> None:
    model = resnet18().eval()
    slimtorch.prune.channels(model, SMALL, ratio=0.5)
    path = tmp_path / "pruned.safetensors"
    slimtorch.save_model(model, path)

    def tamper(body: dict) -> None:
        edit(body["delta"])

    edit_slim_metadata(path, tamper)
    with pytest.raises(slimtorch.FormatError, match=words):
        slimtorch.load_model(path, resnet18)
    (tmp_path / "zoo_models.py").write_text("from tests.zoo import resnet18\n")
    assert main(["load", str(path), "--model", f"{tmp_path / 'zoo_models.py'}:resnet18"]) == 2
    assert str(path) in capsys.readouterr().err


@pytest.mark.slow
def test_cli_prune_prints_the_gain_and_writes_a_file_load_model_reads(tmp_path, capsys) -> None:
    factory_file = tmp_path / "zoo_models.py"
    factory_file.write_text("from tests.zoo import resnet18\n")
    out = tmp_path / "r18-half.safetensors"
    spec = f"{factory_file}:resnet18"
    args = ["prune", spec, "-o", str(out), "--ratio", "0.5", "--input-shape", "1,3,64,64", "--runs", "1"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "parameters" in printed and "11,689,512" in printed and "3,055,880" in printed
    assert "MACs" in printed and "latency, batch 1" in printed
    loaded = slimtorch.load_model(out, resnet18).model
    assert sum(p.numel() for p in loaded.parameters()) == 3_055_880
    assert main([*args, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["after"]["params"] == 3_055_880 and report["before"]["macs"] > 3.5 * report["after"]["macs"]


@pytest.mark.slow
def test_cli_prune_with_weights_prunes_the_trained_model(tmp_path, capsys) -> None:
    factory_file = tmp_path / "zoo_models.py"
    factory_file.write_text("from tests.zoo import resnet18\n")
    trained = resnet18().eval()
    slimtorch.save_model(trained, tmp_path / "trained.safetensors")
    out = tmp_path / "pruned.safetensors"
    args = ["prune", f"{factory_file}:resnet18", "--weights", str(tmp_path / "trained.safetensors")]
    assert main([*args, "-o", str(out), "--ratio", "0", "--input-shape", "1,3,32,32", "--runs", "1"]) == 0
    assert torch.equal(slimtorch.load_model(out, resnet18).model.eval()(SMALL), trained(SMALL))


@pytest.mark.parametrize(
    ("extra", "words"),
    [(["--ratio", "1"], "below 1"), (["--ratio", "0.5", "--input-shape", "1,x"], "not a comma-separated")],
)
def test_cli_prune_bad_arguments_are_usage_errors(tmp_path, capsys, extra, words) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["prune", "tests.zoo:resnet18", "-o", str(tmp_path / "o.safetensors"), *extra])
    assert exit_info.value.code == 2 and words in capsys.readouterr().err


@pytest.mark.slow
def test_cli_prune_to_a_parameter_budget(tmp_path, capsys) -> None:
    factory_file = tmp_path / "zoo_models.py"
    factory_file.write_text("from tests.zoo import resnet18\n")
    out = tmp_path / "r18.safetensors"
    args = ["prune", f"{factory_file}:resnet18", "-o", str(out), "--target-params", "5e6"]
    assert main([*args, "--input-shape", "1,3,32,32", "--runs", "1", "--steps", "2"]) == 0
    assert "at most 5,000,000 parameters" in capsys.readouterr().out
    loaded = slimtorch.load_model(out, resnet18).model
    assert 4_500_000 < sum(p.numel() for p in loaded.parameters()) <= 5_000_000
