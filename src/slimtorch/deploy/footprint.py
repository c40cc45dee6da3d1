"""What a deployment bundle's runtime costs on disk, measured in a clean environment, beside torch's.

A bundle is a folder with ``requirements.txt``, a torch-free ``predict.py`` and ``manifest.json``.
:func:`footprint` verifies it first (:func:`~slimtorch.deploy.bundle.verify_bundle`: every file against
the manifest's sha256, ``predict.py`` byte for byte the runner slimtorch ships, the requirements pinned
names only), then installs only those requirements in a fresh virtual environment, wheels only, runs
``predict.py --check`` there (proving the bundle needs nothing else), and weighs each installed
distribution by the files its ``RECORD`` lists. :func:`torch_baseline` weighs ``torch`` the same way,
once per torch version, Python and platform, and keeps the result in a cache.

Example:
    >>> report = footprint("resnet-bundle")  # doctest: +SKIP
    >>> report.sample_ok, report.runtime_bytes, round(report.ratio, 2)  # doctest: +SKIP
    (True, 61234567, 0.07)
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any, ClassVar

from slimtorch.deploy.bundle import verify_bundle
from slimtorch.deploy.venv import (
    call,
    child_env,
    create_venv,
    interpreter,
    last_line,
    pip_install,
    venv_folder,
)
from slimtorch.deploy.venv import weigh as weigh_venv
from slimtorch.errors import CheckpointNotFoundError, FormatError, SlimtorchError
from slimtorch.format.cache import cache_folder
from slimtorch.format.progress import Progress, announcer
from slimtorch.format.untrusted import load_json
from slimtorch.format.verbs import Report, resolve

# Installers, not runtime: every fresh venv has them and a deployment image need not keep them.
BUILD_TOOLS = frozenset({"pip", "setuptools", "wheel"})
SAMPLE_TIMEOUT_S = 600
WHEELS_ONLY = ["--only-binary=:all:"]
"""pip never builds a package from source for a bundle: a source distribution's build runs its code"""
Packages = tuple["PackageBytes", ...]


@dataclass(frozen=True)
class PackageBytes:
    """One installed distribution and the bytes of the files its RECORD lists."""

    name: str
    version: str
    bytes: int
    bytecode: int = 0
    """of ``bytes``, compiled bytecode (``.pyc``): pip writes it by default; ``pip install --no-compile``
    leaves it out, and Python writes it again only for modules it imports, where it may write"""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Baseline:
    """torch's footprint: ``requirement`` alone in a clean venv; ``cached``: read back, not measured now."""

    DERIVED: ClassVar[dict[str, dict[str, Any]]] = {"bytecode_bytes": {"type": "integer"}}

    requirement: str
    packages: Packages
    runtime_bytes: int
    measured_at: str
    cached: bool
    compiled: bool = False
    """installed with every module compiled to bytecode (plain ``pip install``), not ``--no-compile``"""

    @property
    def bytecode_bytes(self) -> int:
        return sum(p.bytecode for p in self.packages)

    def to_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "packages": [p.to_dict() for p in self.packages],
            "bytecode_bytes": self.bytecode_bytes,
        }


@dataclass(frozen=True)
class FootprintOptions:
    """How :func:`footprint` measures a bundle; every field has the CLI's default.

    Example:
        >>> FootprintOptions(baseline=False).compile_bytecode
        False
    """

    baseline: bool = True
    """Measure torch's footprint beside the bundle's (from the cache when it is there)."""
    refresh_baseline: bool = False
    """Measure torch's footprint again, not from the cache (a minute and about 860 MB)."""
    python: str | None = None
    """The interpreter that makes the venvs; None: this one."""
    keep: str | Path | None = None
    """A new or empty folder to make the bundle's venv in and leave there; None: a temporary one."""
    compile_bytecode: bool = False
    """Install as plain ``pip install`` does, every module compiled to bytecode, not ``--no-compile``."""
    allow_packages: tuple[str, ...] = ()
    """Package names the bundle's requirements may pin beyond what its runtime needs (which
    :func:`~slimtorch.deploy.bundle.verify_bundle` refuses by default)."""


@dataclass(frozen=True)
class FootprintReport(Report):
    """A bundle's runtime on disk, its model, whether its sample ran, and torch's footprint to compare.

    ``packages`` (largest first) add up to ``runtime_bytes``; ``excluded``: pip, setuptools and wheel.
    ``site_packages_bytes`` is all of site-packages, a cross-check; ``install_seconds``: venv and pip.
    """

    SCHEMA: ClassVar[str] = "slimtorch.footprint/1"
    DERIVED: ClassVar[dict[str, dict[str, Any]]] = {
        "total_bytes": {"type": "integer"},
        "bytecode_bytes": {"type": "integer"},
        "ratio": {"anyOf": [{"type": "number"}, {"type": "null"}]},
    }

    bundle: str
    packages: Packages
    excluded: Packages
    runtime_bytes: int
    site_packages_bytes: int
    model_bytes: int
    sample_ok: bool
    sample_output: dict[str, Any] | None
    sample_error: str | None
    baseline: Baseline | None
    install_seconds: float

    @property
    def total_bytes(self) -> int:
        """The runtime and the model: what a deployment ships."""
        return self.runtime_bytes + self.model_bytes

    @property
    def bytecode_bytes(self) -> int:
        """Of ``runtime_bytes``, compiled bytecode (see :attr:`PackageBytes.bytecode`)."""
        return sum(p.bytecode for p in self.packages)

    @property
    def ratio(self) -> float | None:
        """The runtime's bytes over torch's (None without a baseline)."""
        torch = self.baseline.runtime_bytes if self.baseline else 0
        return self.runtime_bytes / torch if torch else None


def footprint(
    bundle: str | Path,
    /,
    options: FootprintOptions | None = None,
    *,
    progress: Progress | None = None,
    **overrides: Any,
) -> FootprintReport:
    """Install the bundle's requirements alone in a fresh venv, run its sample check, weigh the install.

    The requirements are installed as a deployment image installs them, ``pip install --no-compile``:
    bytecode for modules that are never imported is dead weight. The sample then runs with bytecode
    writing on, as a deployment runs, and each distribution weighs the files its RECORD lists plus the
    bytecode Python wrote for them. ``compile_bytecode`` installs as plain ``pip install`` does, every
    module compiled (about 12% more for numpy and onnxruntime).

    Nothing from the bundle is installed or run before it is verified
    (:func:`~slimtorch.deploy.bundle.verify_bundle`; a bundle that fails is a :class:`FormatError` naming
    the file); pip then installs wheels only (``--only-binary=:all:``: no package's build code runs), and
    the sample runs with ``python -I``, so nothing in the bundle's folder can stand in for a module.

    ``options`` (:class:`FootprintOptions`, or single fields as keywords: ``baseline=False``,
    ``keep="venv"`` ...) say how. A failing sample is reported (``sample_ok`` False), not raised; what pip
    cannot install raises :class:`SlimtorchError`. ``progress`` is told each stage as it starts
    (:mod:`slimtorch.format.progress`).

    Example:
        >>> report = footprint("resnet-bundle", baseline=False)  # doctest: +SKIP
        >>> [(p.name, p.bytes) for p in report.packages][:2]  # doctest: +SKIP
        [('onnxruntime', 52340123), ('numpy', 38012345)]
    """
    how = resolve(FootprintOptions, options, overrides, "footprint")
    folder = _bundle_folder(bundle)
    manifest = verify_bundle(folder, how.allow_packages)  # before anything in it is installed or run
    model_bytes = sum(manifest["files"][name]["bytes"] for name in manifest["model"]["files"])
    say = announcer(progress)
    python = how.python or sys.executable
    with venv_folder(how.keep) as venv:
        started = time.perf_counter()
        say("creating a virtual environment")
        venv_python = create_venv(python, Path(venv))
        say("installing requirements.txt")
        flags = [
            *([] if how.compile_bytecode else ["--no-compile"]),
            *WHEELS_ONLY,
            *manifest.get("pip_options", []),
        ]
        pip_install(venv_python, [*flags, "-r", "requirements.txt"], cwd=folder, what=str(folder))
        install_seconds = time.perf_counter() - started
        say("running the sample")
        sample_ok, sample_output, sample_error = _run_sample(venv_python, folder)
        say("measuring installed packages")
        packages, site_packages_bytes = _weigh(venv_python)
    runtime, excluded = _split_build_tools(packages)
    torch = None
    if how.baseline:
        torch = torch_baseline(
            refresh=how.refresh_baseline,
            python=python,
            compile_bytecode=how.compile_bytecode,
            progress=progress,
        )
    return FootprintReport(
        bundle=str(folder),
        packages=runtime,
        excluded=excluded,
        runtime_bytes=sum(p.bytes for p in runtime),
        site_packages_bytes=site_packages_bytes,
        model_bytes=model_bytes,
        sample_ok=sample_ok,
        sample_output=sample_output,
        sample_error=sample_error,
        baseline=torch,
        install_seconds=install_seconds,
    )


def torch_baseline(
    *,
    refresh: bool = False,
    python: str | None = None,
    compile_bytecode: bool = False,
    progress: Progress | None = None,
) -> Baseline:
    """torch's footprint, measured as :func:`footprint` measures a bundle, from the cache when it is there.

    The requirement is ``torch==`` this interpreter's torch version without its local label (pip's
    configured indexes pick the build, as they did for this one). Measuring installs about 860 MB and
    takes a minute, so the result is kept in :func:`baseline_cache_path`; ``refresh`` measures again.

    Example:
        >>> base = torch_baseline()  # doctest: +SKIP
        >>> base.requirement, base.runtime_bytes, base.cached  # doctest: +SKIP
        ('torch==2.13.0', 859072735, True)
    """
    python = python or sys.executable
    torch, (version, platform) = metadata.version("torch"), interpreter(python)  # torch not imported
    requirement = f"torch=={torch.split('+')[0]}"
    path = _cache_path(torch, version, platform, compile_bytecode)
    if not refresh:
        cached = _read_baseline(path)
        if cached is not None and cached.requirement == requirement:
            return cached
    runtime, _ = _split_build_tools(_measure_torch(python, requirement, compile_bytecode, progress))
    now = datetime.now(timezone.utc).isoformat(timespec="seconds")
    measured = Baseline(requirement, runtime, sum(p.bytes for p in runtime), now, False, compile_bytecode)
    _write_baseline(path, {"torch": torch, "python": version, "platform": platform, **measured.to_dict()})
    return measured


def baseline_cache_path(python: str | None = None, compile_bytecode: bool = False) -> Path:
    """Where the torch baseline for this torch version, ``python``'s major.minor and platform is cached.

    Under ``$XDG_CACHE_HOME/slimtorch/footprint/`` (``~/.cache/slimtorch/footprint/`` by default).

    Example:
        >>> baseline_cache_path().name  # doctest: +SKIP
        'torch-2.13.0+cpu-py3.11-linux-x86_64.json'
    """
    return _cache_path(metadata.version("torch"), *interpreter(python or sys.executable), compile_bytecode)


def _cache_path(torch: str, python: str, platform: str, compile_bytecode: bool = False) -> Path:
    how = "-compiled" if compile_bytecode else ""
    return cache_folder("footprint", f"torch-{torch}-py{python}-{platform}{how}.json")


def _bundle_folder(bundle: str | Path) -> Path:
    folder = Path(bundle)
    if not folder.is_dir():
        problem = "not a folder" if folder.exists() else "no such folder"
        raise CheckpointNotFoundError(folder, f"{problem}; a bundle is a folder with requirements.txt")
    for name in ("requirements.txt", "predict.py", "manifest.json"):
        if not (folder / name).is_file():
            raise CheckpointNotFoundError(folder, f"not a bundle: it has no {name}")
    return folder.resolve()


def _run_sample(venv_python: Path, folder: Path) -> tuple[bool, dict[str, Any] | None, str | None]:
    """``predict.py --check`` in the venv: passed, its JSON output, and the line that says why it failed."""
    venv = venv_python.parent.parent
    try:
        # -I: nothing from the bundle's folder (nor the environment) on sys.path but the runner itself
        command = [str(venv_python), "-I", "predict.py", "--check"]
        done = call(command, cwd=folder, env=child_env(venv), timeout=SAMPLE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return False, None, f"predict.py --check did not finish in {SAMPLE_TIMEOUT_S} s"
    why = f"{last_line(done.stderr, done.stdout)} (exit code {done.returncode})"
    return done.returncode == 0, _json_object(done.stdout), None if done.returncode == 0 else why


def _weigh(venv_python: Path) -> tuple[list[PackageBytes], int]:
    found, site_packages_bytes = weigh_venv(venv_python)
    return [
        PackageBytes(p["name"], p["version"], p["bytes"], p["bytecode"]) for p in found
    ], site_packages_bytes


def _split_build_tools(packages: list[PackageBytes]) -> tuple[Packages, Packages]:
    ordered = sorted(packages, key=lambda p: (-p.bytes, p.name.lower()))
    tools = {p for p in ordered if re.sub(r"[-_.]+", "-", p.name).lower() in BUILD_TOOLS}
    return tuple(p for p in ordered if p not in tools), tuple(p for p in ordered if p in tools)


def _measure_torch(
    python: str, requirement: str, compile_bytecode: bool, progress: Progress | None
) -> list[PackageBytes]:
    say = announcer(progress)
    with tempfile.TemporaryDirectory(prefix="slimtorch-footprint-torch-") as venv:
        say("measuring torch: creating a virtual environment")
        venv_python = create_venv(python, Path(venv))
        say(f"measuring torch: installing {requirement} (about 860 MB, once; then cached)")
        options = [] if compile_bytecode else ["--no-compile"]
        pip_install(venv_python, [*options, requirement], cwd=None, what="torch baseline")
        say("measuring torch: importing it")
        done = call([str(venv_python), "-I", "-c", "import torch; torch.ones(2) + 1"])
        if done.returncode != 0:
            raise SlimtorchError(f"torch baseline: {requirement} fails to import: {last_line(done.stderr)}")
        say("measuring torch: weighing its packages")
        return _weigh(venv_python)[0]


def _read_baseline(path: Path) -> Baseline | None:
    """The cached baseline, or None when there is none or it cannot be read (it is measured again)."""
    try:
        data = load_json(path, path.read_bytes(), "baseline")
        packages = tuple(
            PackageBytes(p["name"], p["version"], int(p["bytes"]), int(p["bytecode"]))
            for p in data["packages"]
        )
        runtime, when = int(data["runtime_bytes"]), data["measured_at"]
        return Baseline(data["requirement"], packages, runtime, when, True, bool(data["compiled"]))
    except (OSError, ValueError, KeyError, TypeError, FormatError):
        return None


def _write_baseline(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")  # renamed once whole: a reader never sees half a file
    partial.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    partial.replace(path)


def _json_object(text: str) -> dict[str, Any] | None:
    """The runner's report: the last line it printed, when that is a JSON object."""
    try:
        value = json.loads(text.strip().splitlines()[-1])
    except (ValueError, IndexError, RecursionError):  # the bundle's own runner printed it
        return None
    return value if isinstance(value, dict) else None
