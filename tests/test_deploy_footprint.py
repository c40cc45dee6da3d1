"""slimtorch.deploy.footprint: a bundle's runtime is measured in a fresh venv that holds its requirements and
nothing else (no torch), its packages add up to the total with pip and setuptools aside, its sample is run
there, and torch's footprint comes from a cache keyed by torch version, Python and platform.

The bundles here need only numpy, which pip installs from its cache or local index in seconds; torch is
never installed (the baseline is read from a cache file the tests write, or measured by a stand-in). Their
runner is a stand-in too (it needs numpy only, where slimtorch's needs onnxruntime), taken for the one
slimtorch ships (:func:`_stand_in`); the rest of the bundle's verification holds for them as for an
exported bundle (``tests/test_hostile_bundles.py`` tests the verification itself)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import importlib
import json
import os
import re
import subprocess
import sys
import sysconfig
from importlib import metadata
from pathlib import Path

import numpy as np
import pytest

from slimtorch.cli import footprint_cmd
from slimtorch.deploy import bundle as bundle_module
from slimtorch.deploy.footprint import (
    FootprintOptions,
    FootprintReport,
    PackageBytes,
    baseline_cache_path,
    footprint,
    torch_baseline,
)
from slimtorch.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    FormatError,
    OptionError,
    SlimtorchError,
)
from slimtorch.format.progress import Recorder

pytestmark = pytest.mark.slow  # each test installs a bundle's runtime into a fresh venv

# The module, even where slimtorch.deploy re-exports the function under the same name.
footprint_module = importlib.import_module("slimtorch.deploy.footprint")

PASSING = """\
import json, sys
import numpy
print("checking one sample")
print(json.dumps({"ok": True, "numpy": numpy.__version__}))
sys.exit(0 if "--check" in sys.argv else 2)
"""
FAILING = """\
import json, sys
import numpy
print(json.dumps({"ok": False}))
print("sample 0: expected class 3, got 5", file=sys.stderr)
sys.exit(1)
"""
TORCH = metadata.version("torch")
REQUIREMENT = "torch==" + TORCH.split("+")[0]
CACHED = {
    "requirement": REQUIREMENT,
    "packages": [
        {"name": "torch", "version": TORCH, "bytes": 700_000_000, "bytecode": 90_000_000},
        {"name": "sympy", "version": "1.14.0", "bytes": 70_000_000, "bytecode": 20_000_000},
    ],
    "runtime_bytes": 770_000_000,
    "measured_at": "2026-01-02T03:04:05+00:00",
    "compiled": False,
}


NUMPY = [f"numpy=={metadata.version('numpy')}"]


def _bundle(
    folder: Path,
    predict: str,
    requirements: list[str] = NUMPY,
    model: tuple[str, ...] = ("model.onnx", "model.onnx.data"),
) -> Path:
    """A bundle as the exporter lays one out (files, samples, a manifest with every sha256) around a
    stand-in runner and a model of filler bytes; ``model``: the files the manifest says are the model's."""
    folder.mkdir(parents=True)
    (folder / "requirements.txt").write_text("# pinned\n" + "".join(f"{line}\n" for line in requirements))
    (folder / "predict.py").write_text(predict)
    (folder / "model.onnx").write_bytes(b"\1" * 1234)
    (folder / "model.onnx.data").write_bytes(b"\2" * 5000)
    (folder / "model.extra.bin").write_bytes(b"\3" * 777)
    np.savez(folder / "sample_inputs.npz", x=np.zeros((1, 2), np.float32))
    np.savez(folder / "expected_outputs.npz", y=np.zeros((1, 2), np.float32))
    files = {
        p.name: {"bytes": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
        for p in sorted(folder.iterdir())
    }
    manifest = {
        "format": "slimtorch-bundle",
        "version": 1,
        "model": {"file": model[0], "files": list(model), "format": "onnx"},
        "inputs": [{"name": "x", "dtype": "float32", "shape": [1, 2]}],
        "outputs": [{"name": "y", "dtype": "float32", "shape": [1, 2]}],
        "tolerance": {"atol": 0.0, "rtol": 0.0},
        "sample": {"inputs": "sample_inputs.npz", "outputs": "expected_outputs.npz"},
        "requirements": requirements,
        "files": files,
    }
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return folder


@contextlib.contextmanager
def _stand_in(runner: str):
    """``runner`` taken for the runner slimtorch ships: a stand-in that needs only numpy."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(bundle_module, "shipped_runner", lambda: runner.encode())
        yield


def _measure(bundle: Path, runner: str, *options, **overrides) -> FootprintReport:
    with _stand_in(runner):
        return footprint(bundle, *options, **overrides)


def _must_not_install(*args, **kwargs):
    raise AssertionError("torch was about to be installed, but the baseline is in the cache")


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> tuple[FootprintReport, Path, list[str]]:
    """The passing bundle measured once, its venv kept, torch's footprint read from a cache file."""
    root = tmp_path_factory.mktemp("footprint")
    bundle = _bundle(root / "bundle", PASSING, model=("model.onnx", "model.extra.bin"))
    stages = Recorder()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_CACHE_HOME", str(root / "cache"))
        patch.setattr(footprint_module, "_measure_torch", _must_not_install)
        cache = baseline_cache_path()
        cache.parent.mkdir(parents=True)
        cache.write_text(json.dumps(CACHED))
        report = _measure(bundle, PASSING, keep=root / "venv", progress=stages)
    return report, root / "venv", stages.labels


@pytest.fixture(scope="module")
def failed(tmp_path_factory) -> FootprintReport:
    """A bundle whose runner exits 1, measured without a baseline."""
    bundle = _bundle(tmp_path_factory.mktemp("failing") / "bundle", FAILING)
    return _measure(bundle, FAILING, baseline=False)


def test_runtime_total_is_the_sum_of_its_packages_with_numpy_in_and_pip_setuptools_aside(measured) -> None:
    report = measured[0]
    names = [p.name for p in report.packages]
    assert "numpy" in names and not {"pip", "setuptools", "wheel"} & set(names)
    assert {p.name for p in report.excluded} >= {"pip"}
    assert report.runtime_bytes == sum(p.bytes for p in report.packages)
    numpy = next(p for p in report.packages if p.name == "numpy")
    assert 10_000_000 < numpy.bytes < 200_000_000  # numpy's wheel unpacks to some tens of MB
    assert [p.bytes for p in report.packages] == sorted((p.bytes for p in report.packages), reverse=True)


def test_bytecode_is_counted_apart_and_matches_the_pyc_files_on_disk(measured) -> None:
    report, venv = measured[0], measured[1]
    numpy = next(p for p in report.packages if p.name == "numpy")
    pyc = sum(f.stat().st_size for f in venv.glob("lib/python*/site-packages/numpy/**/*.pyc"))
    assert numpy.bytecode == pyc and 0 < pyc < numpy.bytes
    assert report.bytecode_bytes == sum(p.bytecode for p in report.packages)
    site = next(venv.glob("lib/python*/site-packages"))
    assert next(site.glob("numpy/__pycache__/__init__.*.pyc"))  # written when the sample imported numpy
    assert not list(site.glob("numpy/_core/tests/__pycache__/*.pyc"))  # installed --no-compile


def test_compile_bytecode_installs_as_plain_pip_does(measured, tmp_path) -> None:
    bundle = _bundle(tmp_path / "bundle", PASSING)
    compiled = _measure(bundle, PASSING, baseline=False, compile_bytecode=True)
    plain = next(p for p in measured[0].packages if p.name == "numpy")
    every = next(p for p in compiled.packages if p.name == "numpy")
    assert every.bytecode > 2 * plain.bytecode  # every module, not only those the sample imported
    assert abs((every.bytes - every.bytecode) - (plain.bytes - plain.bytecode)) < 0.01 * plain.bytes


def test_records_add_up_to_site_packages_within_5_percent(measured) -> None:
    report = measured[0]
    recorded = report.runtime_bytes + sum(p.bytes for p in report.excluded)
    assert abs(recorded - report.site_packages_bytes) < 0.05 * report.site_packages_bytes


def test_the_venv_holds_only_the_bundles_requirements_so_torch_cannot_be_imported(measured) -> None:
    venv = measured[1]
    python = venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    torch = subprocess.run([python, "-c", "import torch"], capture_output=True, text=True, env=env)
    assert torch.returncode != 0 and "No module named 'torch'" in torch.stderr
    assert subprocess.run([python, "-c", "import numpy"], env=env).returncode == 0
    assert "torch" not in {p.name for p in measured[0].packages}


def test_model_bytes_are_the_files_the_manifest_lists(measured, failed) -> None:
    assert measured[0].model_bytes == 1234 + 777  # model.onnx.data is not the model's there, so not counted
    assert failed.model_bytes == 1234 + 5000


def test_a_passing_sample_is_reported_with_its_json_line(measured) -> None:
    report = measured[0]
    assert report.sample_ok and report.sample_error is None
    numpy = next(p for p in report.packages if p.name == "numpy")
    assert report.sample_output == {"ok": True, "numpy": numpy.version}  # its last line, not "checking ..."


def test_a_failing_sample_is_reported_not_raised_with_the_runners_last_line(failed) -> None:
    assert not failed.sample_ok
    assert failed.sample_error == "sample 0: expected class 3, got 5 (exit code 1)"
    assert failed.sample_output == {"ok": False}
    assert "numpy" in {p.name for p in failed.packages}  # still measured
    assert failed.baseline is None and failed.ratio is None


def test_each_stage_is_announced_and_a_cached_baseline_installs_nothing(measured) -> None:
    assert measured[2] == [
        "creating a virtual environment",
        "installing requirements.txt",
        "running the sample",
        "measuring installed packages",
    ]


def test_the_baseline_comes_from_the_cache_and_sets_the_ratio(measured) -> None:
    report = measured[0]
    assert report.baseline is not None and report.baseline.cached
    assert report.baseline.requirement == REQUIREMENT
    assert report.baseline.runtime_bytes == 770_000_000
    assert report.baseline.measured_at == CACHED["measured_at"]
    assert report.ratio == report.runtime_bytes / 770_000_000


def test_the_cache_is_keyed_by_torch_python_and_platform_under_xdg_cache_home(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    expected = f"torch-{TORCH}-py{python}-{sysconfig.get_platform()}.json"
    assert baseline_cache_path() == tmp_path / "slimtorch" / "footprint" / expected
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert baseline_cache_path() == tmp_path / "home" / ".cache" / "slimtorch" / "footprint" / expected


def test_a_measured_baseline_is_cached_with_its_date_and_refresh_measures_again(
    tmp_path, monkeypatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    calls: list[str] = []

    def measure(python: str, requirement: str, compiled: bool, progress) -> list[PackageBytes]:
        calls.append(requirement)
        return [
            PackageBytes("torch", TORCH, 900),
            PackageBytes("pip", "24.0", 50),
            PackageBytes("sympy", "1", 90),
        ]

    monkeypatch.setattr(footprint_module, "_measure_torch", measure)
    first = torch_baseline()
    assert calls == [REQUIREMENT] and not first.cached
    assert [p.name for p in first.packages] == ["torch", "sympy"] and first.runtime_bytes == 990  # no pip
    assert json.loads(baseline_cache_path().read_text())["measured_at"] == first.measured_at
    again = torch_baseline()
    assert again.cached and calls == [REQUIREMENT] and again.runtime_bytes == 990
    assert not torch_baseline(refresh=True).cached and len(calls) == 2


def test_an_unreadable_cache_is_measured_again(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(footprint_module, "_measure_torch", lambda *a: [PackageBytes("torch", TORCH, 5)])
    baseline_cache_path().parent.mkdir(parents=True)
    baseline_cache_path().write_text('{"requirement": "torch==2.13.0", "packa')
    assert torch_baseline().runtime_bytes == 5
    assert torch_baseline().cached


def test_a_cache_from_before_bytecode_was_counted_is_measured_again(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(footprint_module, "_measure_torch", lambda *a: [PackageBytes("torch", TORCH, 5, 1)])
    old = {
        **CACHED,
        "packages": [{k: v for k, v in p.items() if k != "bytecode"} for p in CACHED["packages"]],
    }
    baseline_cache_path().parent.mkdir(parents=True)
    baseline_cache_path().write_text(json.dumps(old))
    assert torch_baseline().bytecode_bytes == 1


def test_options_by_dataclass_and_by_override_give_the_same_report(failed, tmp_path) -> None:
    bundle = _bundle(tmp_path / "bundle", FAILING)  # as the failed fixture's, measured with an override
    given = _measure(bundle, FAILING, FootprintOptions(baseline=False)).to_dict()
    overridden = failed.to_dict()
    for data in (given, overridden):
        del data["bundle"], data["install_seconds"]
    assert given == overridden and given["baseline"] is None


def test_an_unknown_option_names_the_fields_before_any_install(tmp_path) -> None:
    fields = (
        "FootprintOptions has: allow_packages, baseline, compile_bytecode, keep, python, refresh_baseline"
    )
    with pytest.raises(OptionError, match=f"footprint: unknown option 'no_baseline'; {fields}"):
        footprint(tmp_path / "nowhere", no_baseline=True)  # the option is checked before the folder


def test_the_report_as_json_fits_its_schema_with_the_baseline(measured) -> None:
    data = json.loads(json.dumps(measured[0].to_dict()))
    schema = FootprintReport.json_schema()["properties"]
    assert set(data) == set(schema) and data["schema"] == "slimtorch.footprint/1"
    baseline = next(s for s in schema["baseline"]["anyOf"] if s.get("type") == "object")
    assert set(data["baseline"]) == set(baseline["properties"])
    assert set(data["packages"][0]) == set(schema["packages"]["items"]["properties"])


def test_a_missing_folder_is_a_clear_error(tmp_path) -> None:
    with pytest.raises(CheckpointNotFoundError, match="no such folder"):
        footprint(tmp_path / "nowhere", baseline=False)


def test_a_file_is_not_a_bundle(tmp_path) -> None:
    (tmp_path / "model.onnx").write_bytes(b"x")
    with pytest.raises(CheckpointNotFoundError, match=re.escape(f"{tmp_path / 'model.onnx'}: not a folder")):
        footprint(tmp_path / "model.onnx", baseline=False)


@pytest.mark.parametrize("missing", ["requirements.txt", "predict.py", "manifest.json"])
def test_a_folder_without_requirements_or_runner_is_not_a_bundle(tmp_path, missing) -> None:
    bundle = _bundle(tmp_path / "bundle", PASSING)
    (bundle / missing).unlink()
    with pytest.raises(CheckpointNotFoundError, match=f"bundle: not a bundle: it has no {missing}"):
        footprint(bundle, baseline=False)


def test_a_manifest_naming_a_missing_model_file_is_a_clear_error(tmp_path) -> None:
    bundle = _bundle(tmp_path / "bundle", PASSING)
    (bundle / "model.onnx.data").unlink()
    with pytest.raises(
        CheckpointError, match=re.escape("model.onnx.data: is missing (the manifest lists it)")
    ):
        _measure(bundle, PASSING, baseline=False)


def test_keep_refuses_a_folder_that_is_not_empty(tmp_path) -> None:
    bundle = _bundle(tmp_path / "bundle", PASSING)
    with pytest.raises(SlimtorchError, match="new or empty folder"):
        _measure(bundle, PASSING, keep=bundle, baseline=False)


def test_a_requirement_pip_cannot_install_names_the_bundle_and_pips_error(tmp_path, monkeypatch) -> None:
    # PIP_NO_INDEX: pip looks only at the local find-links, so the test needs no network (a bundle's
    # requirements.txt may not say --no-index itself: it holds pinned names only)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    bundle = _bundle(tmp_path / "bundle", PASSING, requirements=["slimtorch-no-such-package==1.0"])
    with pytest.raises(SlimtorchError) as error:
        _measure(bundle, PASSING, baseline=False, allow_packages=("Slimtorch_No.Such-Package",))
    message = str(error.value)
    flags = "--no-compile --only-binary=:all:"
    assert message.startswith(f"{bundle}: pip install {flags} -r requirements.txt failed: ERROR:")
    assert "slimtorch-no-such-package" in message


def test_a_requirement_no_bundle_runtime_needs_is_refused_before_pip_unless_allowed(
    tmp_path, monkeypatch
) -> None:
    """A pinned name is whatever the index serves under it: only the runtime's packages are installed."""
    monkeypatch.setattr(footprint_module, "pip_install", _must_not_install)
    bundle = _bundle(tmp_path / "bundle", PASSING, requirements=["numpy==2.0.0", "evil-package==1.0"])
    with pytest.raises(
        FormatError, match=r"requirements\.txt: names 'evil-package', a package no slimtorch "
    ):
        _measure(bundle, PASSING, baseline=False)
    with pytest.raises(FormatError, match="--allow-package evil-package if you trust it"):
        _measure(bundle, PASSING, baseline=False, allow_packages=("other",))


def _cli(argv: list[str]) -> int:
    """The command parsed as ``slimtorch.cli.main`` parses it, with only this command registered."""
    common = argparse.ArgumentParser(add_help=False)
    parser = argparse.ArgumentParser(prog="slimtorch", parents=[common])
    footprint_cmd.register(parser.add_subparsers(dest="command", required=True), common)
    args = parser.parse_args(argv)
    return args.run(args)


def test_cli_json_has_every_field_and_passes_the_options_on(measured, monkeypatch, capsys) -> None:
    given: dict = {}

    def recorded(bundle, options, **kw):
        given.update(kw, options=options)
        return measured[0]

    monkeypatch.setattr(footprint_module, "footprint", recorded)
    argv = ["footprint", "b", "--json", "--no-baseline", "--python", "/usr/bin/python3", "--keep-venv", "v"]
    assert _cli(argv) == 0
    data = json.loads(capsys.readouterr().out)
    assert set(data) >= {
        "bundle", "packages", "excluded", "runtime_bytes", "site_packages_bytes", "model_bytes",
        "total_bytes", "sample_ok", "sample_output", "sample_error", "baseline", "ratio", "install_seconds",
    }  # fmt: skip
    assert data["baseline"]["cached"] is True and data["runtime_bytes"] == measured[0].runtime_bytes
    assert not given.pop("progress").enabled  # no spinner into a pipe
    assert given == {"options": FootprintOptions(baseline=False, python="/usr/bin/python3", keep="v")}


def test_cli_table_shows_packages_totals_baseline_and_the_sample(measured, monkeypatch, capsys) -> None:
    monkeypatch.setattr(footprint_module, "footprint", lambda bundle, options, **kw: measured[0])
    assert _cli(["footprint", "b"]) == 0
    out = capsys.readouterr().out
    for text in ("numpy", "runtime + model", REQUIREMENT, "cached", f"{measured[0].ratio:.3f}x"):
        assert text in out
    assert "sample check passed" in out and "left out" in out and "pip" in out


def test_cli_says_how_far_slimtorchs_runner_found_each_output(measured, monkeypatch, capsys) -> None:
    errors = {"logits": {"max_abs": 3.2e-07, "max_rel": 1e-07, "scale": 3.0}}
    report = dataclasses.replace(measured[0], sample_output={"ok": True, "tolerance": {}, "outputs": errors})
    monkeypatch.setattr(footprint_module, "footprint", lambda bundle, options, **kw: report)
    assert _cli(["footprint", "b"]) == 0
    assert "sample check passed: logits largest difference 3.2e-07" in capsys.readouterr().out


def test_cli_exits_1_when_the_sample_fails(failed, monkeypatch, capsys) -> None:
    monkeypatch.setattr(footprint_module, "footprint", lambda bundle, options, **kw: failed)
    assert _cli(["footprint", "b"]) == 1
    assert "sample check FAILED: sample 0: expected class 3, got 5" in capsys.readouterr().out
    assert _cli(["footprint", "b", "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["sample_ok"] is False
