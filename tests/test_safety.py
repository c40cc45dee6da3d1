"""No code from a file ever runs: hostile pickles are refused, naming the global they wanted."""

from __future__ import annotations

import pathlib
import pickle
import subprocess
import sys

import pytest
import torch

import slimtorch
from slimtorch.cli.main import main
from tests.hostile import legacy_with_pickle, os_system_pickle, torch_zip_with_pickle, touch_command


def test_the_hostile_pickle_really_runs_code_when_unpickled_naively(tmp_path):
    """The control: without slimtorch, this payload does create the marker file."""
    marker = tmp_path / "pwned"
    pickle.loads(os_system_pickle(touch_command(marker)))  # the point of the test
    assert marker.exists()


@pytest.mark.parametrize(
    "build",
    [
        lambda p, payload: torch_zip_with_pickle(p, payload),
        lambda p, payload: legacy_with_pickle(p, payload),
        lambda p, payload: (p.write_bytes(payload), p)[1],
    ],
    ids=["torch-zip", "torch-legacy", "plain-pickle"],
)
def test_os_system_pickle_is_refused_and_never_runs(tmp_path, build):
    marker = tmp_path / "pwned"
    path = build(tmp_path / "model.pt", os_system_pickle(touch_command(marker)))

    with pytest.raises(slimtorch.UnsafeCheckpointError) as refused:
        slimtorch.open(path)

    assert refused.value.global_name == "os.system"
    assert str(path) in str(refused.value)
    assert not marker.exists()


@pytest.mark.slow
def test_cli_refuses_hostile_pickle_with_exit_2_in_a_fresh_process(tmp_path):
    marker = tmp_path / "pwned"
    path = torch_zip_with_pickle(tmp_path / "model.pt", os_system_pickle(touch_command(marker)))

    done = subprocess.run(
        [sys.executable, "-m", "slimtorch.cli.main", "inspect", str(path)], capture_output=True, text=True
    )

    assert done.returncode == 2
    assert "os.system" in done.stderr and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    assert not marker.exists()


def test_a_whole_pickled_module_opens_as_placeholders_with_its_state_dict_names(tmp_path, capsys):
    path = tmp_path / "whole.pt"
    built = torch.nn.Sequential(torch.nn.Linear(2, 2))
    torch.save(built, path)

    assert main(["inspect", str(path)]) == 0
    err = capsys.readouterr().err
    assert "kept as inert placeholders, never built: torch.nn.modules.container.Sequential" in err
    assert "--allow-global" not in err  # torch's own classes need no building: the tensors are read
    with pytest.warns(slimtorch.PlaceholderWarning):
        report = slimtorch.load_model(path, torch.nn.Sequential(torch.nn.Linear(2, 2)))
    assert torch.equal(report.model[0].weight, built[0].weight)


def test_a_class_off_the_list_is_an_inert_placeholder_unless_allowed(tmp_path):
    path = tmp_path / "with_path.pt"
    torch.save({"w": torch.ones(2), "data_dir": pathlib.PosixPath("/data")}, path)

    with pytest.warns(
        slimtorch.PlaceholderWarning, match=r"1 pickled object.*pathlib\.PosixPath.*--allow-global"
    ):
        source = slimtorch.open(path)
    assert torch.equal(source.get("w"), torch.ones(2))
    assert [(o.name, o.type) for o in source.objects] == [("data_dir", "pathlib.PosixPath (placeholder)")]
    assert slimtorch.load_objects(path)["data_dir"] == {
        "__placeholder__": "pathlib.PosixPath",
        "state": {"args": ["/", "data"]},
    }

    source = slimtorch.open(path, allow_globals=["pathlib.PosixPath"])
    assert [(o.name, o.type, o.summary) for o in source.objects] == [
        ("data_dir", "PosixPath", "PosixPath('/data')")
    ]


def test_allow_global_that_cannot_be_imported_is_a_clear_error(tmp_path, capsys):
    path = tmp_path / "w.pt"
    torch.save({"w": torch.ones(2)}, path)
    assert main(["inspect", str(path), "--allow-global", "nowhere.Nothing"]) == 2
    assert "nowhere.Nothing" in capsys.readouterr().err
