"""When load_model verifies a slim file's checksums: before it returns (``verify="eager"``), before each
module's forward uses its tensors (``"before-use"``, opt in), or never (``False``).

Each test flips one byte of a saved file, so a check that was skipped, or waited for in the wrong place,
lets a corrupt tensor through and the test fails.
"""

from __future__ import annotations

import copy
import json
import pickle
from pathlib import Path

import pytest
import torch

import slimtorch
from slimtorch.cli import choices
from slimtorch.cli.main import main
from slimtorch.format import layout
from slimtorch.loading.options import VERIFY_MODES, LoadOptions
from slimtorch.loading.verification import Verification
from slimtorch.sources import slim
from tests.hostile import data_range
from tests.zoo import MLP

MISMATCH = r"mlp\.safetensors: tensor 'layers\.2\.weight': checksum mismatch"


def _saved(tmp_path: Path, *, corrupt: str | None = None, **save: object) -> Path:
    path = tmp_path / "mlp.safetensors"
    torch.manual_seed(0)
    slimtorch.save(MLP().state_dict(), path, **save)  # type: ignore[arg-type]
    if corrupt is not None:
        start, _ = data_range(path, corrupt)
        data = bytearray(path.read_bytes())
        data[start + 5] ^= 0xFF
        path.write_bytes(bytes(data))
    return path


def _hooks(model: torch.nn.Module) -> int:
    return sum(len(module._forward_pre_hooks) for module in model.modules())


def test_before_use_raises_in_the_forward_of_the_module_holding_the_corrupt_tensor(tmp_path) -> None:
    report = slimtorch.load_model(_saved(tmp_path, corrupt="layers.2.weight"), MLP, verify="before-use")
    assert report.verify == "before-use"
    model = report.model
    hidden = model.layers[0](torch.randn(2, 64))  # its own tensors are intact: it runs
    with pytest.raises(slimtorch.FormatError, match=MISMATCH):
        model(torch.randn(2, 64))
    with pytest.raises(slimtorch.FormatError, match=MISMATCH):
        model.layers[2](model.layers[1](hidden))  # and keeps raising there
    with pytest.raises(slimtorch.FormatError, match=MISMATCH):
        report.wait()


def test_eager_raises_in_load_model_and_before_use_does_not(tmp_path) -> None:
    path = _saved(tmp_path, corrupt="layers.2.weight")
    with pytest.raises(slimtorch.FormatError, match=MISMATCH):
        slimtorch.load_model(path, MLP, verify="eager")
    assert slimtorch.load_model(path, MLP, verify="before-use").model is not None  # the forward would raise


def test_hooks_remove_themselves_once_every_check_passed(tmp_path) -> None:
    path = _saved(tmp_path)
    report = slimtorch.load_model(path, MLP, verify="before-use")
    report.wait()
    assert _hooks(report.model) == 0 and report.verify_wall_s > 0
    assert report.verified_bytes == sum(t.numel() * t.element_size() for t in MLP().state_dict().values())
    expected = MLP()
    expected.load_state_dict(slimtorch.load(path).tensors)
    x = torch.randn(3, 64)
    assert torch.equal(report.model(x), expected(x))
    assert _hooks(slimtorch.load_model(path, MLP, verify="eager").model) == 0


def test_our_steps_that_read_weights_without_a_forward_wait_for_the_checks(tmp_path) -> None:
    path = _saved(tmp_path, corrupt="layers.2.weight")
    out = tmp_path / "out.safetensors"
    model = slimtorch.load_model(path, MLP, verify="before-use").model
    with pytest.raises(slimtorch.FormatError, match=MISMATCH):
        slimtorch.save_model(model, out)
    with pytest.raises(slimtorch.FormatError, match=MISMATCH):
        slimtorch.save(model.state_dict(), out)  # found by address: a state dict waits as its model
    with pytest.raises(slimtorch.FormatError, match=MISMATCH):
        slimtorch.quantize(model, "int8-dynamic")
    with pytest.raises(slimtorch.FormatError, match=MISMATCH):
        slimtorch.prune.weights(model, amount=0.5)
    assert not out.exists()
    slimtorch.save_model(MLP(), out)  # a model no load is verifying does not wait


def test_verify_false_skips_the_checks(tmp_path) -> None:
    report = slimtorch.load_model(_saved(tmp_path, corrupt="layers.2.weight"), MLP, verify=False)
    assert report.verify == "off" and report.checks is None and _hooks(report.model) == 0
    report.model(torch.randn(2, 64))
    report.wait()


def test_decoded_tensors_are_checked_before_decoding_whatever_the_mode(tmp_path) -> None:
    path = _saved(tmp_path, corrupt="layers.2.weight::q", quantize="int8-weight")
    for mode in VERIFY_MODES:
        with pytest.raises(slimtorch.FormatError, match=r"'layers\.2\.weight': checksum mismatch"):
            slimtorch.load_model(path, MLP, verify=mode)


def test_every_chunk_of_a_part_is_checked_on_the_verifying_threads(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(layout, "CHECKSUM_CHUNK", 1024)  # the writer's chunk: the 128x64 weight has 32
    monkeypatch.setattr(slim, "CHECKSUM_CHUNK", 1024)
    path = _saved(tmp_path)
    start, end = data_range(path, "layers.2.weight")
    data = bytearray(path.read_bytes())
    data[end - 3] ^= 0x01  # in its last chunk
    path.write_bytes(bytes(data))
    report = slimtorch.load_model(path, MLP, threads=3, verify="before-use")
    with pytest.raises(
        slimtorch.FormatError, match=rf"checksum mismatch .*\(bytes {end - start - 1024}\.\.\)"
    ):
        report.wait()


@pytest.mark.parametrize("value", ["lazy", 1, None, "EAGER"])
def test_a_bad_verify_value_is_refused_in_one_line(value) -> None:
    with pytest.raises(slimtorch.OptionError) as caught:
        LoadOptions(verify=value)
    assert str(caught.value).count("\n") == 0 and "'eager', 'before-use', True or False" in str(caught.value)


def test_verify_true_is_the_default_mode_and_the_cli_offers_the_same_modes() -> None:
    assert LoadOptions(verify=True).verify == LoadOptions().verify == "eager"
    assert choices.VERIFY_MODES == VERIFY_MODES


def test_cli_load_waits_for_every_check_and_says_what_they_cost(tmp_path, capsys) -> None:
    path = _saved(tmp_path)
    assert main(["load", str(path), "--model", "tests.zoo:MLP", "--profile"]) == 0
    out = capsys.readouterr().out
    assert "checksums:" in out and "verify" in out
    assert main(["load", str(path), "--model", "tests.zoo:MLP", "--verify", "eager", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["verify"] == "eager" and shown["verified_bytes"] > 0
    corrupt = _saved(tmp_path, corrupt="layers.2.weight")
    assert main(["load", str(corrupt), "--model", "tests.zoo:MLP", "--verify", "before-use"]) == 2  # it waits
    assert "checksum mismatch" in capsys.readouterr().err
    assert main(["load", str(corrupt), "--model", "tests.zoo:MLP", "--no-verify"]) == 0
    with pytest.raises(SystemExit) as refused:
        main(["load", str(path), "--verify", "lazy"])
    assert refused.value.code == 2 and "invalid choice: 'lazy'" in capsys.readouterr().err


def test_the_default_checks_everything_before_returning(tmp_path) -> None:
    path = _saved(tmp_path, corrupt="layers.2.weight")
    with pytest.raises(slimtorch.FormatError, match=MISMATCH):
        slimtorch.load_model(path, MLP)
    report = slimtorch.load_model(_saved(tmp_path), MLP)
    assert report.verify == "eager" and _hooks(report.model) == 0 and report.verified_bytes > 0


def test_copying_or_pickling_a_model_under_check_is_refused_until_its_checks_are_done(
    tmp_path, monkeypatch
) -> None:
    """A copy made of bytes nobody checked yet would escape the checks (its own forwards have no hook)."""
    monkeypatch.setattr(Verification, "_work", lambda self: None)  # no thread runs them
    report = slimtorch.load_model(_saved(tmp_path), MLP, verify="before-use")
    with pytest.raises(slimtorch.SlimtorchError, match=r"still being verified.*wait\(\)"):
        copy.deepcopy(report.model)
    with pytest.raises(slimtorch.SlimtorchError, match=r"still being verified"):
        pickle.dumps(report.model)
    report.wait()  # runs them on this thread
    x = torch.randn(2, 64)
    assert torch.equal(copy.deepcopy(report.model)(x), report.model(x))
    assert torch.equal(pickle.loads(pickle.dumps(report.model))(x), report.model(x))


def test_a_sparse_tensor_saved_while_a_load_is_verified_gets_the_dense_refusal(tmp_path, monkeypatch) -> None:
    """Waiting for pending checks asks each tensor's address; a sparse one has none (it raised a raw
    RuntimeError whenever any before-use load was still pending in the process)."""
    monkeypatch.setattr(Verification, "_work", lambda self: None)  # its checks stay pending
    report = slimtorch.load_model(_saved(tmp_path), MLP, verify="before-use")
    with pytest.raises(slimtorch.SlimtorchError, match="save takes dense tensors"):
        slimtorch.save({"w": torch.eye(3).to_sparse()}, tmp_path / "out.safetensors")
    report.wait()
