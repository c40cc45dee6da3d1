"""Pickled objects slimtorch will not build: inert placeholders, so a checkpoint's tensors always open.

Issue 45: a Lightning checkpoint whose hyper-parameters pickle classes slimtorch does not build (some of
them gone from the library that made them) could not be opened at all, ``--no-objects`` included; a
config holding numpy arrays took rounds of ``--allow-global`` and lost them in ``shrink``. Now numpy's
arrays, scalars and dtypes are data, any other class off the list becomes a placeholder holding its state,
one note names them, and a suggested ``--allow-global`` always names a global that can be imported.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import slimtorch
from slimtorch.cli.main import main
from slimtorch.sources.pickled import Placeholder


class _Gone:
    """A tokenizer class of a library release that no longer has it."""

    def __init__(self) -> None:
        self.vocab = {"[PAD]": 0, "[CLS]": 1}
        self.do_lower_case = True


def _lightning_checkpoint(path: Path) -> nn.Module:
    """A Lightning-style checkpoint: ``state_dict`` under ``model.``, ``hyper_parameters`` holding a
    Namespace, an installed class (PosixPath) and one of a module that is not installed any more."""
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    gone = types.ModuleType("gone_tokenizers.wordpiece")
    sys.modules["gone_tokenizers"] = types.ModuleType("gone_tokenizers")
    sys.modules["gone_tokenizers.wordpiece"] = gone
    _Gone.__module__, _Gone.__qualname__ = "gone_tokenizers.wordpiece", "WordpieceTokenizer"
    gone.WordpieceTokenizer = _Gone
    try:
        torch.save(
            {
                "state_dict": {f"model.{k}": v for k, v in model.state_dict().items()},
                "hyper_parameters": {
                    "args": argparse.Namespace(lr=3e-4, depth=2),
                    "tokenizer": _Gone(),
                    "data_dir": Path("/data/train"),
                },
                "pytorch-lightning_version": "2.1.3",
                "epoch": 7,
            },
            path,
        )
    finally:
        del sys.modules["gone_tokenizers.wordpiece"], sys.modules["gone_tokenizers"]
    return model


def test_a_checkpoint_of_foreign_classes_opens_with_placeholders_and_one_note(tmp_path, capsys) -> None:
    path = tmp_path / "run.ckpt"
    model = _lightning_checkpoint(path)

    assert main(["inspect", str(path)]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("slimtorch: note: ") and "inert placeholders" in err[0]
    assert "gone_tokenizers.wordpiece.WordpieceTokenizer" in err[0]
    # suggested: a global that can be imported here (argparse.Namespace), never the one that is gone
    assert "--allow-global argparse.Namespace" in err[0] and "--allow-global gone_tokenizers" not in err[0]

    with pytest.warns(slimtorch.PlaceholderWarning):
        source = slimtorch.open(path)
    kinds = {o.name: o.type for o in source.objects}
    assert kinds["hyper_parameters.tokenizer"] == "gone_tokenizers.wordpiece.WordpieceTokenizer (placeholder)"
    assert torch.equal(source.get("state_dict.model.0.weight"), model[0].weight)
    tokenizer = source.tree["hyper_parameters"]["tokenizer"]
    assert isinstance(tokenizer, Placeholder) and tokenizer.vocab == {"[PAD]": 0, "[CLS]": 1}

    with pytest.warns(slimtorch.PlaceholderWarning):
        report = slimtorch.load_model(path, nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)))
    assert torch.equal(report.model[2].weight, model[2].weight)


def test_shrink_keeps_their_plain_state_and_no_objects_still_works(tmp_path) -> None:
    path = tmp_path / "run.ckpt"
    _lightning_checkpoint(path)

    for extra in ([], ["--no-objects"]):
        out = tmp_path / f"out{len(extra)}.safetensors"
        assert main(["shrink", str(path), "-o", str(out), *extra]) == 0
        kept = slimtorch.load_objects(out)  # JSON in the output: no pickle left, no placeholder made
        if extra:
            assert kept == {}
            continue
        params = kept["hyper_parameters"]
        assert params["args"] == {"__placeholder__": "argparse.Namespace", "state": {"lr": 3e-4, "depth": 2}}
        assert params["tokenizer"]["state"]["vocab"] == {"[PAD]": 0, "[CLS]": 1}
        assert kept["epoch"] == 7


@pytest.mark.slow
def test_numpy_in_a_config_is_data_and_survives_shrink_in_a_fresh_process(tmp_path) -> None:
    path, out = tmp_path / "potential.pt", tmp_path / "potential.safetensors"
    torch.save(
        {
            "model": {"w": torch.ones(3)},
            "config": {
                "mean": np.array([[1.5, -2.0], [0.25, 4.0]], dtype=np.float32),
                "counts": np.arange(5, dtype=np.int64),
                "cutoff": np.float64(5.0),
                "index_dtype": np.dtype("int32"),
                "names": np.array(["H", "O"]),  # text: left out, and said so
            },
        },
        path,
    )
    # no --allow-global, no placeholder: numpy's arrays are numpy's
    code = (
        "import slimtorch, numpy as np, warnings, json, sys\n"
        "warnings.simplefilter('error')\n"
        f"slimtorch.shrink({str(path)!r}, {str(out)!r})\n"
        f"c = slimtorch.load_objects({str(out)!r})['config']\n"
        "assert c['mean'].dtype == np.float32 and c['mean'].tolist() == [[1.5, -2.0], [0.25, 4.0]]\n"
        "assert c['counts'].dtype == np.int64 and c['counts'].tolist() == [0, 1, 2, 3, 4]\n"
        "assert type(c['cutoff']) is np.float64 and c['cutoff'] == 5.0\n"
        "assert c['index_dtype'] == np.dtype('int32') and 'names' not in c\n"
        "print(json.dumps(sorted(c)))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == ["counts", "cutoff", "index_dtype", "mean"]


def test_a_numpy_array_cannot_claim_more_memory_than_its_bytes(tmp_path) -> None:
    # numpy pickles an array as _reconstruct(ndarray, (0,), ...) then its bytes; a file asking for a
    # terabyte up front is refused, not allocated
    payload = (
        b"\x80\x02}q\x00X\x01\x00\x00\x00aq\x01cnumpy.core.multiarray\n_reconstruct\nq\x02cnumpy\nndarray\n"
        b"q\x03J\x00\x00\x00\x10\x85q\x04c_codecs\nencode\nq\x05X\x01\x00\x00\x00bq\x06X\x06\x00\x00\x00"
        b"latin1q\x07\x86q\x08Rq\x09\x87q\x0aRq\x0bs."
    )
    path = tmp_path / "bomb.pt"
    path.write_bytes(payload)
    with pytest.raises(slimtorch.FormatError, match="shape"):
        slimtorch.open(path)


def test_what_runs_code_is_still_refused_not_kept(tmp_path) -> None:
    path = tmp_path / "evil.pt"
    path.write_bytes(
        b"\x80\x02}q\x00X\x01\x00\x00\x00aq\x01cposix\nsystem\nq\x02X\x04\x00\x00\x00trueq\x03\x85q\x04Rq\x05s."
    )
    with pytest.raises(slimtorch.UnsafeCheckpointError, match=r"posix\.system"):
        slimtorch.open(path)


def test_a_pickle_naming_more_classes_than_a_checkpoint_would_is_refused(tmp_path) -> None:
    # each placeholder is a class on torch's list, which it searches for every object built: 10,001 of
    # them is a hang bomb, not a checkpoint
    globals_ = b"".join(b"cfake_mod\nC%d\n" % i for i in range(10_001))
    payload = b"\x80\x02(" + globals_ + b"l."
    path = tmp_path / "many.pt"
    path.write_bytes(payload)
    with pytest.raises(slimtorch.FormatError, match="more than 10,000 classes"):
        slimtorch.open(path)


def test_restoring_numpy_values_from_a_file_takes_numbers_only() -> None:
    from slimtorch.sources.objects import restore_values

    kept = {
        "mean": {"__numpy_array__": "<f4", "shape": [2], "values": [0.5, 1.0]},
        # a slim file's metadata is hostile too: a gigabyte-wide void per value is not an array to build
        "bomb": {"__numpy_array__": "V1000000000", "shape": [3], "values": [0, 0, 0]},
        "misshapen": {"__numpy_array__": "<f4", "shape": [10**12], "values": [1.0]},
    }
    restored = restore_values(kept)
    assert restored["mean"].dtype == np.float32 and restored["mean"].tolist() == [0.5, 1.0]
    assert restored["bomb"] == kept["bomb"] and restored["misshapen"] == kept["misshapen"]


def test_load_objects_names_a_value_it_leaves_out(tmp_path) -> None:
    """An object built from a class the caller allowed is not plain data: load_objects leaves it out with
    a warning naming it, where it once vanished without a word."""
    path = tmp_path / "ckpt.pt"
    torch.save({"model": {"w": torch.ones(2)}, "args": argparse.Namespace(lr=0.1), "epoch": 3}, path)
    with pytest.warns(UserWarning, match=r"left out: args \(.*Namespace.*\).*slimtorch.open"):
        values = slimtorch.load_objects(path, allow_globals=["argparse.Namespace"])
    assert values == {"epoch": 3}
    with slimtorch.open(path, allow_globals=["argparse.Namespace"]) as source:
        assert source.tree["args"].lr == 0.1
