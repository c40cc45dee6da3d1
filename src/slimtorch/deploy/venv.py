"""Clean virtual environments for measuring what a set of requirements installs: made, filled by pip,
run in, and weighed, each in a child process with an environment that leaks nothing in."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

from slimtorch.errors import SlimtorchError

# Runs inside the measured venv, so it needs only the standard library. A file is counted once (by device
# and inode) even when RECORDs share it or link to it; a file a RECORD lists but that is gone is skipped.
WEIGH = r"""
import json, os, sys, sysconfig
from importlib import metadata
from importlib.util import cache_from_source

seen = set()

def size(path):
    st = os.stat(path) if os.path.isfile(path) else None
    if st is None or (st.st_dev, st.st_ino) in seen:
        return 0
    seen.add((st.st_dev, st.st_ino))
    return st.st_size

def weigh(d):
    total = bytecode = 0
    for f in d.files or ():
        path = str(d.locate_file(f))
        n = size(path)
        total += n
        bytecode += n if path.endswith(".pyc") else 0
        if path.endswith(".py"):  # bytecode Python wrote when the module was imported (not in RECORD)
            n = size(cache_from_source(path))
            total, bytecode = total + n, bytecode + n
    return dict(name=d.metadata["Name"], version=d.version, bytes=total, bytecode=bytecode)

packages = [weigh(d) for d in metadata.distributions()]
seen.clear()
tops = {sysconfig.get_paths()[key] for key in ("purelib", "platlib")}
whole = sum(size(os.path.join(root, n)) for top in tops for root, _, names in os.walk(top) for n in names)
json.dump({"packages": packages, "site_packages_bytes": whole}, sys.stdout)
"""


def venv_folder(keep: str | Path | None) -> AbstractContextManager[str]:
    """An empty folder for the venv: a temporary one, removed after, or ``keep``, left in place."""
    if keep is None:
        return tempfile.TemporaryDirectory(prefix="slimtorch-footprint-")
    # A venv made over an old one would count what the old one held: the measure needs a clean start.
    if Path(keep).exists() and (not Path(keep).is_dir() or any(Path(keep).iterdir())):
        raise SlimtorchError(f"{keep}: to keep the environment, give a new or empty folder")
    return nullcontext(str(keep))


def child_env(venv: Path | None = None) -> dict[str, str]:
    """The caller's environment (pip's index and proxy settings apply) less what leaks other packages in,
    and less a setting that would stop the sample writing its bytecode as a deployment does."""
    leaks = {"PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "PIP_USER", "PIP_TARGET", "PIP_PREFIX"}
    leaks |= {"PYTHONDONTWRITEBYTECODE", "PIP_NO_COMPILE"}
    env = {key: value for key, value in os.environ.items() if key not in leaks}
    env.update(PIP_DISABLE_PIP_VERSION_CHECK="1", PYTHONNOUSERSITE="1")
    if venv is not None:  # as if activated: a runner that starts `python` gets the venv's
        bin_folder = str(venv_python(venv).parent)
        env.update(VIRTUAL_ENV=str(venv), PATH=bin_folder + os.pathsep + env.get("PATH", ""))
    return env


def venv_python(venv: Path) -> Path:
    return venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def create_venv(python: str, venv: Path) -> Path:
    done = call([python, "-m", "venv", str(venv)])
    if done.returncode != 0:
        raise SlimtorchError(f"{python} -m venv {venv} failed: {last_line(done.stderr, done.stdout)}")
    return venv_python(venv)


def pip_install(venv_python: Path, arguments: list[str], *, cwd: Path | None, what: str) -> None:
    done = call([str(venv_python), "-m", "pip", "install", "--no-input", *arguments], cwd=cwd)
    if done.returncode != 0:
        line = last_line(done.stderr, done.stdout, prefer="ERROR:")
        raise SlimtorchError(f"{what}: pip install {' '.join(arguments)} failed: {line}")


def weigh(venv_python: Path) -> tuple[list[dict[str, Any]], int]:
    """Each distribution in the venv: name, version, bytes and bytecode; and all of site-packages."""
    # -I: only the venv's own site-packages, whatever the caller's environment says.
    done = call([str(venv_python), "-I", "-c", WEIGH])
    if done.returncode != 0:
        raise SlimtorchError(f"measuring {venv_python.parent.parent} failed: {last_line(done.stderr)}")
    found = json.loads(done.stdout)
    return found["packages"], found["site_packages_bytes"]


def interpreter(python: str) -> tuple[str, str]:
    """``python``'s major.minor and ``sysconfig.get_platform()``, as it says (it may not be this one)."""
    script = "import sys, sysconfig; print('%d.%d' % sys.version_info[:2], sysconfig.get_platform())"
    done = call([python, "-I", "-c", script])
    if done.returncode != 0:
        raise SlimtorchError(f"{python}: not a Python interpreter that runs: {last_line(done.stderr)}")
    version, platform = done.stdout.split()[:2]
    return version, platform


def call(command: list[str], **options: Any) -> subprocess.CompletedProcess[str]:
    """``command``'s result and output, in :func:`child_env` unless ``options`` give ``env``."""
    options = {"env": child_env(), "capture_output": True, "text": True, "errors": "replace", **options}
    try:
        return subprocess.run(command, **options)
    except FileNotFoundError:
        raise SlimtorchError(f"{command[0]}: no such program") from None


def last_line(*texts: str, prefer: str | None = None) -> str:
    """The line that says what went wrong: the last starting with ``prefer``, else the last non-empty."""
    for text in texts:
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        if lines:
            return ([line for line in lines if prefer and line.startswith(prefer)] or lines)[-1]
    return "no output"
