"""Bad input gets one line naming the file and the problem, exit code 2, never a traceback or a hang."""

from __future__ import annotations

import struct

import pytest
import torch
from safetensors.torch import save_file

import slimtorch
from slimtorch.cli.main import main
from tests.hostile import rewrite_zip_entry, torch_zip_with_claims


def _run_cli(capsys, *args: str) -> str:
    code = main(["inspect", *args])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith("slimtorch: error: ")
    return err


def _saved(tmp_path, kind: str):
    path = tmp_path / f"good.{kind}"
    tensors = {"w": torch.randn(64, 64), "b": torch.randn(64)}
    if kind == "safetensors":
        save_file(tensors, path)
    else:
        torch.save(tensors, path, _use_new_zipfile_serialization=kind == "pt")
    return path


def _broken(tmp_path, name: str) -> tuple:
    """(path, expected words in the message) for each kind of broken input."""
    bad = tmp_path / "bad.bin"
    if name == "missing":
        return tmp_path / "nope.pt", "no such file"
    if name == "empty":
        bad.write_bytes(b"")
        return bad, "empty"
    if name == "random bytes":
        bad.write_bytes(bytes(range(256)) * 4)
        return bad, "not a recognised checkpoint"
    if name == "gguf":
        bad.write_bytes(b"GGUF" + b"\x00" * 100)
        return bad, "GGUF"
    if name == "folder without weights":
        (tmp_path / "empty_model").mkdir()
        (tmp_path / "empty_model" / "config.json").write_text("{}")
        return tmp_path / "empty_model", "without weights"
    if name in ("truncated zip", "truncated legacy", "truncated safetensors"):
        kind = {"truncated zip": "pt", "truncated legacy": "legacy", "truncated safetensors": "safetensors"}[
            name
        ]
        good = _saved(tmp_path, kind)
        bad.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
        return bad, "truncat"
    if name == "corrupt pickle":
        good = _saved(tmp_path, "pt")
        rewrite_zip_entry(good, bad, "data.pkl", lambda data: data[:20] + b"\xff" * 40 + data[60:])
        return bad, "pickle"
    if name == "storage bigger than the file":
        return torch_zip_with_claims(bad, 2**40, (2**40,), stored_bytes=16), "claims"
    if name == "tensor outside its storage":
        return torch_zip_with_claims(bad, 4, (1000, 1000), stored_bytes=16), "needs bytes"
    if name == "absurd safetensors header":
        bad.write_bytes(struct.pack("<Q", 2**60) + b'{"w": {}}')
        return bad, "header claims"
    if name == "safetensors header not json":
        bad.write_bytes(struct.pack("<Q", 10) + b"{not json}")
        return bad, "not valid JSON"
    if name == "safetensors offsets disagree with shape":
        header = b'{"w":{"dtype":"F32","shape":[1000000],"data_offsets":[0,16]}}'
        bad.write_bytes(struct.pack("<Q", len(header)) + header + b"\x00" * 16)
        return bad, "needs 4000000 bytes"
    raise AssertionError(name)


BROKEN = [
    "missing",
    "empty",
    "random bytes",
    "gguf",
    "folder without weights",
    "truncated zip",
    "truncated legacy",
    "truncated safetensors",
    "corrupt pickle",
    "storage bigger than the file",
    "tensor outside its storage",
    "absurd safetensors header",
    "safetensors header not json",
    "safetensors offsets disagree with shape",
]


@pytest.mark.parametrize("name", BROKEN)
def test_broken_input_is_one_line_naming_file_and_problem_with_exit_2(tmp_path, capsys, name):
    path, words = _broken(tmp_path, name)
    err = _run_cli(capsys, str(path))
    assert str(path) in err
    assert words.lower() in err.lower()


@pytest.mark.parametrize("name", BROKEN)
def test_broken_input_raises_a_slimtorch_error_from_the_api(tmp_path, name):
    path, _ = _broken(tmp_path, name)
    with pytest.raises(slimtorch.SlimtorchError):
        slimtorch.inspect(path)


def test_debug_flag_shows_the_traceback(tmp_path, capsys):
    path, _ = _broken(tmp_path, "corrupt pickle")
    assert main(["inspect", str(path), "--debug"]) == 2
    assert "Traceback" in capsys.readouterr().err


def test_bad_option_values_are_usage_errors(tmp_path, capsys):
    with pytest.raises(SystemExit) as usage:
        main(["inspect", str(tmp_path), "--depth", "0"])
    assert usage.value.code == 2
