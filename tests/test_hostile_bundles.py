"""The bundle family of issue 44's hostile corpus: a deployment bundle is verified before anything in it runs
or is installed, and its runner reads inputs within a budget.

Every case copies one real bundle (exported once, an MLP with a dynamic batch) and tampers with it as a
downloaded folder could be tampered with: the runner edited to touch a marker file, code put beside it,
a model byte changed, the manifest given wrong types, missing keys, ``../`` names or huge sizes, the
requirements given pip options, URLs or paths, the sample files made into decompression bombs. An attacker
rewrites the manifest's sha256 to match (``rehash``), so most cases are consistent on their own word.

Two commands meet each one: ``slimtorch footprint`` (run by the corpus harness of ``tests/hostile.py``, in
a forked child) and the bundle's own ``predict.py`` (``--check``, or an input file), run here as a user runs
it, a fresh ``python predict.py`` whose peak memory and time are watched the same way. Each case is a
refusal in one line with exit 2, or a clean accept; never a traceback, never the marker file.
"""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.hostile import (
    Case,
    hostile_jobs,
    run_cases,
)
from tests.support.hostile_bundles import (
    CASES,
    FAMILY,
    MARKER,
    PREDICT_CASES,
    _bundle,
    _edit_manifest,
    _manifest,
    _model_byte,
    _template,
    _touching,
    run_predict_cases,
)

"""a file the tampered code would write in the case's folder: it must never appear"""
"""rows of 64 float32 zeros in a bomb: 3 GiB inflated from about 3 MB"""
"""``tamper(bundle, case folder)``"""


"""Only footprint meets these: whoever runs an edited predict.py runs the edit."""
"""What a user's own use of a bundle leaves in it is no reason to refuse it."""


"""``slimtorch footprint`` on every tampered bundle. The untampered one is accepted in a unit test below:
installing its runtime takes longer than a corpus case may."""


"""``predict.py --check`` on every tampered bundle and on bundles a user has used, and ``predict.py INPUT``
on hostile inputs and on bundles with a tampered manifest."""
"""``predict.py --check`` of an untouched bundle: the runner's own start, which the cases are held to."""


# -- the corpus ---------------------------------------------------------------------------------------------
def _selected(request, cases: list[Case], parameter: str) -> list[Case]:
    chosen = {
        item.callspec.params[parameter].id
        for item in request.session.items
        if item.module is request.module and hasattr(item, "callspec") and parameter in item.callspec.params
    }
    return [case for case in cases if case.id in chosen]


@pytest.fixture(scope="module")
def outcomes(request, tmp_path_factory) -> dict:
    """Run every selected footprint case once, two at a time (the machine's cores), before the first test
    reads."""
    chosen = _selected(request, CASES, "case")
    jobs = hostile_jobs()
    return {o.case.id: o for o in run_cases(chosen, tmp_path_factory.mktemp("hostile"), jobs=jobs)}


@pytest.fixture(scope="module")
def predicted(request, tmp_path_factory) -> dict:
    """Run every selected predict.py case once, one at a time."""
    chosen = _selected(request, PREDICT_CASES, "predict_case")
    return {o.case.id: o for o in run_predict_cases(chosen, tmp_path_factory.mktemp("predict"))}


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_footprint_refuses_a_tampered_bundle_in_one_line_before_anything_in_it_runs(outcomes, case):
    outcome = outcomes[case.id]
    assert outcome.passed, outcome.describe()


@pytest.mark.slow
@pytest.mark.parametrize("predict_case", PREDICT_CASES, ids=[case.id for case in PREDICT_CASES])
def test_predict_py_refuses_in_one_line_or_accepts_cleanly_within_budget(predicted, predict_case):
    outcome = predicted[predict_case.id]
    assert outcome.passed, outcome.describe()


def test_the_corpus_covers_what_issue_44_names_for_bundles():
    ids = {case.id for case in CASES + PREDICT_CASES}
    assert len(ids) == len(CASES) + len(PREDICT_CASES) and {c.family for c in CASES + PREDICT_CASES} == {
        FAMILY
    }
    for name in ("runner-touches-a-marker-rehashed", "module-beside-the-runner", "model-byte-changed"):
        assert f"{FAMILY}/{name}/footprint" in ids
    for name in ("index-url-http-evil-invalid-simple", "e", "git-https-github-com-evil-pkg", "local-whl"):
        assert f"{FAMILY}/requirements-{name}/footprint" in ids
    assert f"{FAMILY}/input-npz-bomb-3-gib/predict.py" in ids
    assert sum(case.expect == "accept" for case in PREDICT_CASES) >= 6


# -- the pieces, one at a time -------------------------------------------------------------------------------
def test_an_exported_bundle_is_verified_as_it_was_written(tmp_path) -> None:
    from slimtorch.deploy import runner
    from slimtorch.deploy.bundle import shipped_runner, verify_bundle

    bundle = _bundle(tmp_path)
    manifest = verify_bundle(bundle)
    assert (bundle / "predict.py").read_bytes() == shipped_runner() == Path(runner.__file__).read_bytes()
    assert manifest["requirements"] and all(
        runner.PINNED.fullmatch(line) for line in manifest["requirements"]
    )
    lines = [
        line for line in (bundle / "requirements.txt").read_text().splitlines() if not line.startswith("#")
    ]
    assert lines == manifest["requirements"]


def test_footprint_installs_nothing_from_a_bundle_that_fails_verification(tmp_path, monkeypatch) -> None:
    from slimtorch.deploy import footprint
    from slimtorch.errors import FormatError

    footprint_module = importlib.import_module("slimtorch.deploy.footprint")

    def no_venv(*args, **kwargs):
        raise AssertionError("a venv was made for a bundle that fails verification")

    monkeypatch.setattr(footprint_module, "create_venv", no_venv)
    bundle = _bundle(tmp_path)
    _model_byte(bundle, tmp_path)
    with pytest.raises(FormatError, match=re.escape(f"{bundle / 'model.onnx'}: checksum does not match")):
        footprint(bundle, baseline=False)


def test_footprint_installs_wheels_only_and_runs_the_sample_isolated(tmp_path, monkeypatch) -> None:
    """The whole pipeline of an accepted bundle, its installs recorded rather than made (the real install is
    ``test_deploy_export``'s ``test_onnx_bundle_runs_in_its_own_venv_without_torch_within_150_mb``)."""
    from slimtorch.deploy import footprint

    footprint_module = importlib.import_module("slimtorch.deploy.footprint")
    installed, ran = [], []
    monkeypatch.setattr(footprint_module, "create_venv", lambda python, venv: venv / "bin" / "python")
    monkeypatch.setattr(footprint_module, "pip_install", lambda python, args, **kw: installed.append(args))
    monkeypatch.setattr(footprint_module, "_weigh", lambda python: ([], 0))

    def call(command, **kwargs):
        ran.append(command)
        return subprocess.CompletedProcess(command, 0, '{"ok": true}\n', "")

    monkeypatch.setattr(footprint_module, "call", call)
    report = footprint(_bundle(tmp_path), baseline=False)
    assert report.sample_ok and report.model_bytes == (tmp_path / "bundle" / "model.onnx").stat().st_size
    assert installed == [["--no-compile", "--only-binary=:all:", "-r", "requirements.txt"]]
    assert ran[0][1:] == ["-I", "predict.py", "--check"]


@pytest.mark.parametrize(
    "line, pinned",
    [
        ("numpy==2.4.6", True),
        ("onnxruntime==1.32.0", True),
        ("typing_extensions==4.12.2", True),
        ("torch==2.5.1rc1", True),
        ("pkg==1.0.post1.dev2", True),
        ("torch==2.5.1+cpu", False),  # a local label: only some index has it
        ("numpy===2.4.6", False),
        ("numpy == 2.4.6", False),
        ("numpy==2.*", False),
        ("numpy~=2.4", False),
        ("-numpy==2.4.6", False),
        ("numpy==2.4.6#x", False),
    ],
)
def test_a_requirement_is_a_pinned_name_and_nothing_else(tmp_path, line, pinned) -> None:
    from slimtorch.deploy.runner import InvalidBundle, check_requirements

    path = tmp_path / "requirements.txt"
    path.write_text(f"# comment\n\n{line}\n")
    if pinned:
        check_requirements(path, [line])
    else:
        with pytest.raises(InvalidBundle, match=r"is not a pinned package|does not hold"):
            check_requirements(path, [line])


@pytest.mark.parametrize(
    "name, plain",
    [
        ("model.onnx", True),
        ("model.onnx.data", True),
        ("tokenizer_config.json", True),
        ("../model.onnx", False),
        ("..", False),
        ("/etc/passwd", False),
        ("sub/model.onnx", False),
        ("sub\\model.onnx", False),
        (".hidden", False),
        ("", False),
        ("model.onnx\n", False),
        ("C:model.onnx", False),
    ],
)
def test_a_file_of_the_manifest_is_a_plain_name_in_the_bundles_folder(tmp_path, name, plain) -> None:
    from slimtorch.deploy.runner import InvalidBundle, check_manifest

    manifest = _manifest(_template())
    manifest["files"][name] = manifest["files"].pop("model.onnx")
    manifest["model"].update(file=name, files=[name])
    if plain:
        check_manifest(manifest)
    else:
        with pytest.raises(InvalidBundle, match="plain file name"):
            check_manifest(manifest)


def test_an_input_is_held_to_the_manifests_shape_and_the_budget_by_its_header(tmp_path) -> None:
    from slimtorch.deploy.runner import InvalidBundle, array_bytes

    spec = [{"name": "x", "dtype": "float32", "shape": ["batch", 64]}]
    np.savez(tmp_path / "a.npz", x=np.zeros((4, 64), np.float32))
    assert array_bytes(tmp_path / "a.npz", spec, 1024) == 1024
    with pytest.raises(InvalidBundle, match="would take 1,024 bytes in memory, more than the 1,023"):
        array_bytes(tmp_path / "a.npz", spec, 1023)
    np.savez(tmp_path / "b.npz", x=np.zeros((4, 64), np.int8))  # read as int8, then made float32
    assert array_bytes(tmp_path / "b.npz", spec, 1 << 20) == 1024
    np.savez(tmp_path / "c.npz", x=np.zeros((4, 64), np.float32), y=np.zeros(1))
    with pytest.raises(InvalidBundle, match="holds 2 arrays; at most 1"):
        array_bytes(tmp_path / "c.npz", spec, 1 << 20)


def test_the_runner_imports_nothing_from_its_own_folder(tmp_path) -> None:
    """A genuine predict.py meets a json.py beside it before any check could run: it never imports it."""
    bundle = _bundle(tmp_path)
    for module in ("json", "argparse", "numpy", "zipfile"):
        (bundle / f"{module}.py").write_text(_touching(tmp_path))
    done = subprocess.run(
        [sys.executable, "predict.py", "--help"], cwd=bundle, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0 and "--check" in done.stdout
    assert not (tmp_path / MARKER).exists()


def test_a_bundle_is_checked_where_a_user_opens_it_from_python(tmp_path) -> None:
    from slimtorch.deploy.runner import Bundle, InvalidBundle

    bundle = _bundle(tmp_path)
    assert Bundle(bundle).check()["ok"]
    _edit_manifest(bundle, lambda m: m["inputs"][0].update(shape="64"))
    with pytest.raises(InvalidBundle, match=re.escape("manifest.json: inputs[0].shape is not")):
        Bundle(bundle)
