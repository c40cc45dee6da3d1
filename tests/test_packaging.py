"""What we publish: a wheel that carries its types and license, and an sdist whose own tests run.

The sdist and the wheel are built from this tree as a release builds them (``python -m build``, the wheel
from the sdist), with the venv's setuptools (``--no-isolation``: a test never downloads), then the sdist is
unpacked and a few of its tests run against its own ``src``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from slimtorch.cli.arguments import DOCS_URL

ROOT = Path(__file__).resolve().parents[1]
SDIST_NEEDS = (
    "LICENSE",
    "README.md",
    "CHANGELOG.md",  # README links to it
    "CONTRIBUTING.md",
    "SECURITY.md",
    "mkdocs.yml",  # make docs
    "docs/getting-started.md",  # the pages whose blocks the tests run
    "Makefile",
    "constraints.txt",
    "pyproject.toml",
    "src/slimtorch/py.typed",
    "tests/conftest.py",
    "tests/zoo/__init__.py",
    "tests/wild/requirements.txt",  # a prerequisite of the Makefile's set-up
    "examples/training_checkpoint.py",
    "benchmarks/prune.py",  # make bench and make lint name the folder
    "benchmarks/__init__.py",  # make bench runs each as python -m benchmarks.NAME
    "benchmarks/_harness.py",  # ... and each imports it
    "docs/ARCHITECTURE.md",
    "scripts/ensure_chromium.sh",  # the Makefile's set-up runs it
)
SDIST_TESTS = ("tests/test_layers.py", "tests/test_inspect.py")


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The sdist and the wheel of this tree. setuptools leaves its ``egg-info`` in ``src``; a copy there
    would be a second ``slimtorch`` distribution on the editable install's path, so it goes again."""
    out = tmp_path_factory.mktemp("dist")
    egg_info = ROOT / "src" / "slimtorch.egg-info"
    had_egg_info = egg_info.exists()
    try:
        command = [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(ROOT)]
        done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=300)
    finally:
        if not had_egg_info:
            shutil.rmtree(egg_info, ignore_errors=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (sdist,), (wheel,) = out.glob("*.tar.gz"), out.glob("*.whl")
    return sdist, wheel


@pytest.mark.slow
def test_the_wheel_ships_py_typed_and_the_license(built: tuple[Path, Path]) -> None:
    names = zipfile.ZipFile(built[1]).namelist()
    assert "slimtorch/py.typed" in names
    assert any(name.endswith(".dist-info/licenses/LICENSE") for name in names)
    assert not any(name.startswith("tests/") for name in names)


def test_the_wheel_metadata_has_the_license_urls_and_classifiers(built: tuple[Path, Path]) -> None:
    archive = zipfile.ZipFile(built[1])
    metadata = archive.read(next(n for n in archive.namelist() if n.endswith("METADATA"))).decode()
    assert "License-Expression: Apache-2.0" in metadata
    for url in ("Homepage", "Issues"):
        assert f"Project-URL: {url}, https://github.com/slimtorch/slimtorch" in metadata
    assert f"Project-URL: Documentation, {DOCS_URL}" in metadata  # the site, which --help links to
    assert "Classifier: Typing :: Typed" in metadata


def test_the_license_is_the_apache_2_text_the_metadata_declares() -> None:
    text = (ROOT / "LICENSE").read_text()
    assert '\nlicense = "Apache-2.0"\n' in (ROOT / "pyproject.toml").read_text()
    assert "Apache License\n                           Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text and len(text.splitlines()) == 202


def test_the_sdist_holds_what_its_tests_and_makefile_need(built: tuple[Path, Path]) -> None:
    with tarfile.open(built[0]) as sdist:
        names = {name.partition("/")[2] for name in sdist.getnames()}
    missing = [path for path in SDIST_NEEDS if path not in names]
    assert not missing, f"the sdist lacks {missing}"
    assert not [n for n in names if "__pycache__" in n or n.startswith("benchmarks/results")]


@pytest.mark.slow
def test_the_unpacked_sdist_runs_its_own_tests(built: tuple[Path, Path], tmp_path: Path) -> None:
    with tarfile.open(built[0]) as sdist:
        sdist.extractall(tmp_path, filter="data")
    (tree,) = tmp_path.iterdir()
    env = {**os.environ, "PYTHONPATH": str(tree / "src"), "HF_HUB_OFFLINE": "1"}
    which = subprocess.run(
        [sys.executable, "-c", "import slimtorch; print(slimtorch.__file__)"],
        capture_output=True,
        text=True,
        cwd=tree,
        env=env,
        check=True,
    )
    assert Path(which.stdout.strip()).is_relative_to(tree), "the tests would run this tree's slimtorch"
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *SDIST_TESTS]
    done = subprocess.run(command, capture_output=True, text=True, cwd=tree, env=env, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert " passed" in done.stdout and "error" not in done.stdout.splitlines()[-1]
