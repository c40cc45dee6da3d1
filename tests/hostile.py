"""Builders of hostile and broken files, written byte by byte the way an attacker or a bad disk would."""

from __future__ import annotations

import contextlib
import faulthandler
import functools
import json
import os
import pickle
import re
import resource
import shlex
import shutil
import signal
import struct
import subprocess
import sys
import time
import traceback
import zipfile
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from slimtorch.sources.torch_legacy import MAGIC_NUMBER, PROTOCOL_VERSION


def os_system_pickle(command: str) -> bytes:
    """A protocol-2 pickle whose loading calls ``os.system(command)``."""
    arg = command.encode()
    return b"\x80\x02cos\nsystem\nX" + len(arg).to_bytes(4, "little") + arg + b"\x85R."


def touch_command(marker: Path) -> str:
    return f"touch {shlex.quote(str(marker))}"


def torch_zip_with_pickle(path: Path, data_pkl: bytes) -> Path:
    """A zip laid out like torch.save's, with the given data.pkl."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as archive:
        archive.writestr("archive/data.pkl", data_pkl)
        archive.writestr("archive/byteorder", "little")
        archive.writestr("archive/version", "3\n")
    return path


def legacy_with_pickle(path: Path, main_pickle: bytes) -> Path:
    """A legacy torch.save file whose main object pickle is ``main_pickle``."""
    header = b"".join(
        pickle.dumps(value, protocol=2)
        for value in (MAGIC_NUMBER, PROTOCOL_VERSION, {"protocol_version": 1001, "little_endian": True})
    )
    path.write_bytes(header + main_pickle + pickle.dumps([], protocol=2))
    return path


def rewrite_zip_entry(source: Path, target: Path, entry_name: str, transform) -> Path:
    """Copy a zip, passing its top-level-folder entry ``entry_name`` through ``transform(bytes) -> bytes``."""
    replaced = 0
    with zipfile.ZipFile(source) as old, zipfile.ZipFile(target, "w", zipfile.ZIP_STORED) as new:
        for info in old.infolist():
            data = old.read(info.filename)
            if info.filename.endswith(f"/{entry_name}") and info.filename.count("/") == 1:
                data = transform(data)
                replaced += 1
            new.writestr(info, data)
    assert replaced == 1, f"{source} has no single */{entry_name}"
    return target


class _StorageClaim:
    """Pickled as a persistent id claiming ``numel`` float32 elements for storage "0"."""

    def __init__(self, numel: int) -> None:
        self.numel = numel


class _TensorClaim:
    def __init__(self, storage: _StorageClaim, shape: tuple[int, ...], stride: tuple[int, ...]) -> None:
        self.args = (storage, 0, shape, stride, False, {})

    def __reduce__(self):
        import torch

        return (torch._utils._rebuild_tensor_v2, self.args)


def torch_zip_with_claims(path: Path, claimed_numel: int, shape: tuple[int, ...], stored_bytes: int) -> Path:
    """A torch zip whose pickle claims ``claimed_numel`` elements and ``shape``, holding ``stored_bytes``."""
    import io

    import torch

    class Pickler(pickle.Pickler):
        def persistent_id(self, obj):
            if isinstance(obj, _StorageClaim):
                return ("storage", torch.FloatStorage, "0", "cpu", obj.numel)
            return None

    stride = tuple(int(torch.tensor(shape[i + 1 :]).prod()) for i in range(len(shape)))
    buffer = io.BytesIO()
    Pickler(buffer, protocol=2).dump({"w": _TensorClaim(_StorageClaim(claimed_numel), shape, stride)})
    torch_zip_with_pickle(path, buffer.getvalue())
    with zipfile.ZipFile(path, "a", zipfile.ZIP_STORED) as archive:
        archive.writestr("archive/data/0", b"\x00" * stored_bytes)
    return path


# -- safetensors headers ---------------------------------------------------------------------------------
def read_safetensors(path: Path) -> tuple[dict, bytes]:
    """(header as a dict, the data bytes after it) of a safetensors file."""
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + length]), raw[8 + length :]


def write_safetensors_raw(path: Path, header: dict, data: bytes, *, reseal: bool = True) -> Path:
    """Write ``header`` (padded to 8 bytes, as safetensors does) and ``data`` as a safetensors file.

    A sealed slim header gets its seal recomputed, as anyone editing it by hand can: what a test damages is
    then judged by the reader's checks behind the seal (``reseal=False`` leaves the old seal, to test it).
    """
    from slimtorch.format.layout import CRC_KEY
    from slimtorch.format.writer import seal_header

    if reseal and CRC_KEY in header.get("__metadata__", {}):
        header = seal_header(header)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


def edit_slim_metadata(path: Path, edit) -> Path:
    """Rewrite the JSON in ``__metadata__["slimtorch"]`` in place via ``edit(body)``; data stays valid."""
    header, data = read_safetensors(path)
    body = json.loads(header["__metadata__"]["slimtorch"])
    edit(body)
    header["__metadata__"]["slimtorch"] = json.dumps(body)
    return write_safetensors_raw(path, header, data)


def data_range(path: Path, key: str) -> tuple[int, int]:
    """Absolute byte range ``[begin, end)`` of physical tensor ``key`` in a safetensors file."""
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    begin, end = json.loads(raw[8 : 8 + length])[key]["data_offsets"]
    return 8 + length + begin, 8 + length + end


def remove_safetensors_entry(path: Path, key: str) -> Path:
    """Drop physical tensor ``key``: its header entry and its bytes, moving later tensors' offsets down."""
    header, data = read_safetensors(path)
    begin, end = header.pop(key)["data_offsets"]
    for name, entry in header.items():
        if name != "__metadata__" and entry["data_offsets"][0] >= end:
            entry["data_offsets"] = [offset - (end - begin) for offset in entry["data_offsets"]]
    return write_safetensors_raw(path, header, data[:begin] + data[end:])


def add_safetensors_entry(path: Path, key: str, dtype: str, shape: list[int], payload: bytes) -> Path:
    """Append a physical tensor ``key`` holding ``payload`` after the existing data."""
    header, data = read_safetensors(path)
    header[key] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(payload)]}
    return write_safetensors_raw(path, header, data + payload)


# -- pickle opcodes ---------------------------------------------------------------------------------------
# Protocol-2 opcodes, written by hand so a file can hold what no Python object graph would pickle to (a
# million-deep tuple, a call of an allowed global with a hostile argument).
PROTO2 = b"\x80\x02"


def p_int(value: int) -> bytes:
    """An integer: BININT1 / BININT, or LONG1 for anything beyond 32 bits."""
    if 0 <= value < 256:
        return b"K" + bytes([value])
    if -(2**31) <= value < 2**31:
        return b"J" + struct.pack("<i", value)
    raw = value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8a" + bytes([len(raw)]) + raw


def p_str(text: str) -> bytes:
    raw = text.encode()
    return b"X" + struct.pack("<I", len(raw)) + raw


def p_global(dotted: str) -> bytes:
    module, _, name = dotted.rpartition(".")
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def p_call(dotted: str, *args: bytes) -> bytes:
    """``dotted(*args)``: GLOBAL, MARK, the arguments, TUPLE, REDUCE."""
    return p_global(dotted) + b"(" + b"".join(args) + b"tR"


def p_put(index: int) -> bytes:
    """LONG_BINPUT: memo indices far above any torch.save writes, so a spliced value never clobbers them."""
    return b"r" + struct.pack("<I", index)


def p_get(index: int) -> bytes:
    return b"j" + struct.pack("<I", index)


def nested_tuple(depth: int) -> bytes:
    """``((((),),),)`` ``depth`` deep: one byte a level (TUPLE1)."""
    return b")" + b"\x85" * depth


def nested_list(depth: int) -> bytes:
    """``[[[[]]]]`` ``depth`` deep: all lists pushed, then each APPENDed into the one below."""
    return b"]" * depth + b"a" * (depth - 1)


def nested_dict(depth: int) -> bytes:
    """``{"k": {"k": ...}}`` ``depth`` deep."""
    return b"}" + (p_str("k") + b"}") * (depth - 1) + b"s" * (depth - 1)


def dict_key_tuple(depth: int) -> bytes:
    """``{nested_tuple(depth): 1}``: hashing the key recurses once per level, in C."""
    return b"}" + nested_tuple(depth) + p_int(1) + b"s"


def memo_fan_out(size: int, references: int) -> bytes:
    """``[set(b), set(b), ...]`` with ``b = bytearray(size)`` stored once: each reference costs ``size``."""
    first = p_global("builtins.set") + p_put(100_001) + p_call("builtins.bytearray", p_int(size))
    again = p_get(100_001) + p_get(100_000) + b"\x85R"
    return b"](" + first + p_put(100_000) + b"\x85R" + again * (references - 1) + b"e"


SPLICE = "@@hostile-value"


def torch_file_with_value(path: Path, value: bytes, legacy: bool = False) -> Path:
    """A torch.save file of ``{"w": a real tensor, "x": <value>}``, ``value`` being raw pickle opcodes that
    push one object. The placeholder it replaces is as long as ``value`` modulo 64, so later zip entries
    keep torch's 64-byte alignment (torch's unpickler knows no no-op opcode to pad with)."""
    import io

    import torch

    fill = (len(value) - len(p_str(SPLICE))) % 64
    placeholder_text = SPLICE + "@" * fill
    buffer = io.BytesIO()
    torch.save(
        {"w": torch.arange(16.0), "x": placeholder_text}, buffer, _use_new_zipfile_serialization=not legacy
    )
    placeholder = p_str(placeholder_text)
    raw = buffer.getvalue()
    if legacy:
        assert raw.count(placeholder) == 1
        path.write_bytes(raw.replace(placeholder, value))
        return path
    source = path.with_name(path.name + ".src")
    source.write_bytes(raw)
    rewrite_zip_entry(source, path, "data.pkl", lambda data: data.replace(placeholder, value))
    source.unlink()
    return path


# -- compressed zip entries ---------------------------------------------------------------------------------
def compress_zip_entry(source: Path, target: Path, entry_name: str, method: int) -> Path:
    """Copy a torch zip with its top-level ``entry_name`` compressed by ``method`` (zipfile.ZIP_*)."""
    with zipfile.ZipFile(source) as old, zipfile.ZipFile(target, "w", zipfile.ZIP_STORED) as new:
        for info in old.infolist():
            data = old.read(info.filename)
            if info.filename.endswith(f"/{entry_name}") and info.filename.count("/") == 1:
                info.compress_type = method
            new.writestr(info, data)
    return target


def deflate_zeros_bomb(prefix: bytes, zeros: int) -> tuple[bytes, int]:
    """(raw deflate stream, CRC-32) of ``prefix`` followed by ``zeros`` zero bytes, without ever holding
    them: a fully flushed MiB of zeros compresses to the same ~1 KB block, so the stream repeats it."""
    mib = bytes(1 << 20)
    head = zlib.compressobj(9, zlib.DEFLATED, -15)
    stream = head.compress(prefix) + head.flush(zlib.Z_FULL_FLUSH)
    block_maker = zlib.compressobj(9, zlib.DEFLATED, -15)
    block = block_maker.compress(mib) + block_maker.flush(zlib.Z_FULL_FLUSH)
    crc = zlib.crc32(prefix)
    for _ in range(zeros >> 20):
        crc = zlib.crc32(mib, crc)
    return stream + block * (zeros >> 20) + b"\x03\x00", crc


def zip_with_raw_entries(path: Path, entries: list[tuple[str, bytes, int, int, int]]) -> Path:
    """A zip written field by field from ``(name, stored bytes, method, CRC-32, declared size)``: the
    declared size and the method are whatever the caller says, as in a crafted archive."""
    local, central, offset = b"", b"", 0
    for name, stored, method, crc, size in entries:
        raw_name = name.encode()
        fields = struct.pack("<HHHHHIII", 20, 0, method, 0, 0x21, crc, len(stored), size)
        header = b"PK\x03\x04" + fields + struct.pack("<HH", len(raw_name), 0) + raw_name
        central += (
            b"PK\x01\x02"
            + struct.pack("<H", 20)
            + fields
            + struct.pack("<HHHHHII", len(raw_name), 0, 0, 0, 0, 0, offset)
            + raw_name
        )
        local += header + stored
        offset += len(header) + len(stored)
    end = b"PK\x05\x06" + struct.pack("<HHHHIIH", 0, 0, len(entries), len(entries), len(central), offset, 0)
    path.write_bytes(local + central + end)
    return path


# -- zstandard frames ---------------------------------------------------------------------------------------
ZSTD_BLOCK = 1 << 17


def zstd_zeros_frame(size: int, stored_at_least: int = 0) -> bytes:
    """A zstandard frame of ``size`` zero bytes, built block by block: raw blocks of zeros until the frame
    holds ``stored_at_least`` bytes (to stay under a per-part ratio limit), then 4-byte RLE blocks."""
    frame = struct.pack("<IB", 0xFD2FB528, 0xE0) + struct.pack("<Q", size)  # single segment, 8-byte size
    left = size
    while left:
        chunk = min(left, ZSTD_BLOCK)
        last = int(chunk == left)
        if len(frame) < stored_at_least:
            frame += (last | 0 << 1 | chunk << 3).to_bytes(3, "little") + bytes(chunk)
        else:
            frame += (last | 1 << 1 | chunk << 3).to_bytes(3, "little") + b"\x00"
        left -= chunk
    return frame


def slim_with_encoded(path: Path, name: str, parts: dict, stages: list, dtype, shape: tuple) -> Path:
    """A slim file written by the real writer (checksums and all) holding one logical tensor made of the
    given parts and stages, beside an ordinary tensor: only the expansion is hostile."""
    import torch

    from slimtorch.format.codecs.chain import Encoded, encode
    from slimtorch.format.writer import SlimWriter

    with SlimWriter(path) as writer:
        writer.add("ok", encode(torch.ones(8)), torch.float32, (8,))
        writer.add(name, Encoded(parts, stages), dtype, shape)
    return path


def zstd_part(size: int, ratio: int = 256):
    """A uint8 tensor holding a zstd frame of ``size`` zeros, just big enough for ``ratio``."""
    import torch

    frame = zstd_zeros_frame(size, stored_at_least=-(-size // ratio) + 64)
    return torch.frombuffer(bytearray(frame), dtype=torch.uint8)


# -- the corpus harness -------------------------------------------------------------------------------------
# Each case builds its files in a folder of its own and names a CLI call; the call runs in a forked child
# (torch and slimtorch already imported, so a case costs milliseconds to start) so that a SIGSEGV, a hang
# or a memory bomb in one case is measured and killed instead of taking the run down.
GB = 10**9
MEMORY_FLOOR = 1.5 * GB
"""Peak RSS allowed to any case: 1.5 GB, or twice the case's files, whichever is larger (issue 17)."""
WALL_LIMIT = 60.0
OUTPUT_LIMIT = 256 << 20
"""No case's output file may exceed this (RLIMIT_FSIZE; the kernel sends SIGXFSZ): an output bomb."""
EXPECTATIONS = ("refuse", "accept", "either")
INPUT_FACTOR = 1.5
SLACK = 16 << 20
"""Measurement noise allowed over a strict case's bound: the allocator's arenas, a page table."""


def strict(cases: Sequence[Case], start: Callable[[Path], Invocation] | None = None) -> list[Case]:
    """``cases`` held to issue 44's memory bound (:attr:`Case.strict`), over ``start``'s peak if given."""
    return [replace(case, strict=True, start=start) for case in cases]


@dataclass(frozen=True)
class Invocation:
    """One CLI call: ``argv`` for ``slimtorch``, text piped to stdin, the working folder (default: the
    case's own), and ``check(stdout, stderr) -> problem or None`` run after it, whatever it exited with."""

    argv: list[str]
    stdin: str = ""
    cwd: Path | None = None
    check: Callable[[str, str], str | None] | None = None
    names_file: bool = True
    """A refusal must name a path inside the case's folder."""


@dataclass(frozen=True)
class Case:
    """A hostile input: ``build(folder) -> Invocation`` writes its files into ``folder``.

    A ``strict`` case (issue 44's) passes only within :data:`INPUT_FACTOR` times its files' bytes, plus
    :data:`SLACK`, over its command's own start: a fresh CLI process after its imports, or, where the
    command does more than read its input (``slim`` trains), the peak of ``start``, a clean run of it."""

    id: str
    family: str
    expect: str
    build: Callable[[Path], Invocation]
    strict: bool = False
    start: Callable[[Path], Invocation] | None = None

    def __post_init__(self) -> None:
        assert self.expect in EXPECTATIONS, self.expect


@dataclass(frozen=True)
class Outcome:
    """What a case did. ``verdict``: refused / accepted (cleanly), or traceback, signal, timeout, memory,
    wrong (exit code, message or output not as expected), build (the builder itself failed)."""

    case: Case
    verdict: str
    code: int | None
    stderr: str
    seconds: float
    peak_rss: int
    limit: int
    problem: str = ""

    @property
    def passed(self) -> bool:
        return (self.verdict == "refused" and self.case.expect != "accept") or (
            self.verdict == "accepted" and self.case.expect != "refuse"
        )

    def describe(self) -> str:
        tail = self.stderr.strip().splitlines()[-1:] or [""]
        return (
            f"{self.case.id} [{self.case.family}, expect {self.case.expect}]: {self.verdict}"
            f"{': ' + self.problem if self.problem else ''} (exit {self.code}, {self.seconds:.1f} s, "
            f"peak {self.peak_rss / 2**20:.0f} MiB of {self.limit / 2**20:.0f}) {tail[0][:300]}"
        )


@dataclass
class _Running:
    case: Case
    invocation: Invocation
    folder: Path
    io: Path
    started: float
    rss_at_fork: int
    limit: int
    inputs: int = 0
    killed: str = ""
    peak_seen: int = 0


def cases_of(*groups: Sequence[Case]) -> list[Case]:
    """The groups' cases in order, one list; their ids must be unique (a test id names one case)."""
    cases = [case for group in groups for case in group]
    ids = [case.id for case in cases]
    assert len(ids) == len(set(ids)), "duplicate case ids"
    return cases


def hostile_jobs() -> int:
    """Hostile cases run at a time: ``SLIMTORCH_HOSTILE_JOBS``, else 2 (the machine's cores), or 1 in a
    pytest-xdist worker (``make test`` runs two: the other worker holds the other core)."""
    default = "1" if os.environ.get("PYTEST_XDIST_WORKER") else "2"
    return int(os.environ.get("SLIMTORCH_HOSTILE_JOBS", default))


def selected_outcomes(
    request, tmp_path_factory, cases: Sequence[Case], before_fork: Callable[[], object] | None = None
) -> dict[str, Outcome]:
    """Run the cases of ``cases`` this pytest session selected in the calling module (a module-scoped
    fixture's ``request``), :func:`hostile_jobs` at a time, before
    the first test reads them; ``before_fork`` imports what every child would otherwise import itself."""
    selected = {
        item.callspec.params["case"].id
        for item in request.session.items
        if item.module is request.module and hasattr(item, "callspec") and "case" in item.callspec.params
    }
    chosen = [case for case in cases if case.id in selected]
    if chosen and before_fork is not None:
        before_fork()
    jobs = hostile_jobs()
    return {o.case.id: o for o in run_cases(chosen, tmp_path_factory.mktemp("hostile"), jobs=jobs)}


def run_cases(
    cases: Sequence[Case], root: Path, jobs: int = 2, wall: float = WALL_LIMIT
) -> Iterator[Outcome]:
    """Build and run ``cases`` under ``root``, ``jobs`` children at a time; yields outcomes as they end.

    Peak RSS is the anonymous memory the child took beyond what it held as it started (:func:`_grown`:
    its own VmHWM less its starting RSS and the file pages it mapped since, as it reports them at exit),
    plus what a fresh ``slimtorch`` process holds after importing torch and the CLI
    (:func:`fresh_cli_rss`), so neither a large test process nor the libraries' code pages count against
    a case.
    """
    import torch  # noqa: F401  (imported before any fork, as the children need it)

    import slimtorch.cli.main  # noqa: F401

    base = fresh_cli_rss()
    starts = _starts(cases, root, wall)
    pending, running = list(reversed(cases)), {}
    try:
        while pending or running:
            while pending and len(running) < jobs:
                started = _start(pending.pop(), root)
                if isinstance(started, Outcome):
                    yield started
                else:
                    running[started[0]] = started[1]
            time.sleep(0.005)
            for pid, job in list(running.items()):
                done, status, usage = os.wait4(pid, os.WNOHANG)
                if not done:
                    _watch(pid, job, base, wall)
                    continue
                del running[pid]
                grown = max(job.peak_seen, _grown(job, usage.ru_maxrss * 1024))
                outcome = _outcome(job, status, grown + base)
                if job.case.strict:
                    outcome = within_inputs(outcome, starts.get(job.case.start, base), job.inputs)
                if outcome.passed:  # a failing case's files stay, to look at
                    shutil.rmtree(job.folder, ignore_errors=True)
                    shutil.rmtree(job.io, ignore_errors=True)
                yield outcome
    finally:  # the caller stopped early (an error, ^C): no child outlives the run
        for pid in running:
            _kill(pid)
            os.waitpid(pid, 0)


def _starts(cases: Sequence[Case], root: Path, wall: float) -> dict[Callable[[Path], Invocation], int]:
    """The peak of each strict case's ``start`` run, a clean run of its command, once per run."""
    found: dict[Callable[[Path], Invocation], int] = {}
    for case in cases:
        if case.strict and case.start is not None and case.start not in found:
            reference = Case(f"start of {case.family}/{len(found)}", case.family, "accept", case.start)
            (outcome,) = run_cases([reference], root / "starts", jobs=1, wall=wall)
            assert outcome.verdict == "accepted", outcome.describe()
            found[case.start] = outcome.peak_rss
    return found


def within_inputs(outcome: Outcome, start: int, inputs: int) -> Outcome:
    """``outcome``, judged "memory" where its peak passed ``start`` plus :data:`INPUT_FACTOR` times its
    ``inputs`` bytes (and :data:`SLACK`): issue 44's bound, on top of the harness's kill limit."""
    bound = start + INPUT_FACTOR * inputs + SLACK
    if not outcome.passed or outcome.peak_rss <= bound:
        return replace(outcome, limit=min(outcome.limit, int(bound)))
    problem = (
        f"peak RSS {outcome.peak_rss / 2**20:.0f} MiB over its command's start {start / 2**20:.0f} MiB "
        f"+ {INPUT_FACTOR}x its {inputs / 2**20:.1f} MiB of inputs"
    )
    return replace(outcome, verdict="memory", problem=problem, limit=int(bound))


def _start(case: Case, root: Path) -> tuple[int, _Running] | Outcome:
    folder = root / f"{re.sub(r'[^A-Za-z0-9_.-]+', '_', case.id)}-{zlib.crc32(case.id.encode()):08x}"
    io_folder = folder.with_name(folder.name + ".io")
    folder.mkdir(parents=True)
    io_folder.mkdir()
    started = time.monotonic()
    try:
        invocation = case.build(folder)
    except Exception as exc:  # a broken builder is reported as the case's failure, not the run's
        return Outcome(
            case, "build", None, "", time.monotonic() - started, 0, 0, f"{type(exc).__name__}: {exc}"
        )
    inputs = tree_bytes(folder)
    limit = int(max(MEMORY_FLOOR, 2 * inputs))
    (io_folder / "stdin").write_text(invocation.stdin)
    rss = _rss(os.getpid())
    pid = os.fork()
    if pid == 0:
        _child(invocation, folder, io_folder)
    with contextlib.suppress(OSError):  # set on both sides of the fork: no race with an early kill
        os.setpgid(pid, pid)
    return pid, _Running(case, invocation, folder, io_folder, time.monotonic(), rss, limit, inputs)


def _child(invocation: Invocation, folder: Path, io_folder: Path) -> None:
    """Run the CLI with stdin, stdout and stderr on files; never returns (``os._exit``), so nothing of the
    parent (pytest's teardown, atexit hooks) runs twice."""
    code = 70
    start = _memory_now()  # what this process holds of the parent's, as it starts
    try:
        os.setpgid(0, 0)  # the parent kills the whole group: anything the CLI started goes too
        resource.setrlimit(resource.RLIMIT_FSIZE, (OUTPUT_LIMIT, OUTPUT_LIMIT))
        for fd, name, flags in ((0, "stdin", os.O_RDONLY), (1, "stdout", _WRITE), (2, "stderr", _WRITE)):
            os.dup2(os.open(io_folder / name, flags, 0o600), fd)
        sys.stdin = open(0, closefd=False)  # noqa: SIM115
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
        faulthandler.enable(sys.stderr)  # a crash's dump goes to the case's stderr, not the parent's
        os.chdir(invocation.cwd or folder)
        import torch

        torch.set_num_threads(1)  # the parent's OpenMP pool did not survive the fork
        from slimtorch.cli.main import main

        code = main(invocation.argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        with contextlib.suppress(Exception):  # the child's own growth, for the parent to read
            (io_folder / "memory").write_text(" ".join(map(str, (*start, *_memory_now()))))
        os._exit(code if isinstance(code, int) else 1)


_WRITE = os.O_WRONLY | os.O_CREAT | os.O_TRUNC


def _watch(pid: int, job: _Running, base: int, wall: float) -> None:
    """Kill a child past the wall limit, or past its memory limit (before it can take the machine)."""
    if job.killed:
        return
    job.peak_seen = max(job.peak_seen, _rss(pid) - job.rss_at_fork)
    if time.monotonic() - job.started > wall:
        job.killed = "timeout"
    elif job.peak_seen + base > job.limit:
        job.killed = "memory"
    if job.killed:
        _kill(pid)


def _kill(pid: int) -> None:
    """SIGKILL a child and its process group (whatever the CLI started)."""
    for kill in (os.killpg, os.kill):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            kill(pid, signal.SIGKILL)


def _outcome(job: _Running, status: int, peak: int) -> Outcome:
    seconds = time.monotonic() - job.started
    stdout = (job.io / "stdout").read_text(errors="replace")
    stderr = (job.io / "stderr").read_text(errors="replace")
    code = os.waitstatus_to_exitcode(status)

    def done(verdict: str, problem: str = "") -> Outcome:
        return Outcome(job.case, verdict, code, stderr, seconds, peak, job.limit, problem)

    if job.killed == "timeout":
        return done("timeout", f"killed after {seconds:.0f} s")
    if job.killed == "memory" or peak > job.limit:
        return done("memory", f"peak RSS {peak / 2**20:.0f} MiB over {job.limit / 2**20:.0f} MiB")
    if code == -signal.SIGXFSZ:
        return done("memory", f"wrote a file over {OUTPUT_LIMIT >> 20} MiB (SIGXFSZ)")
    if code < 0:
        return done("signal", signal.Signals(-code).name)
    if "Traceback" in stderr:
        return done("traceback", (stderr.strip().splitlines() or [""])[-1][:200])
    problem = job.invocation.check(stdout, stderr) if job.invocation.check else None
    if problem:
        return done("wrong", problem)
    if code == 0:
        if job.case.expect == "refuse":
            return done("wrong", "accepted (exit 0) where a refusal was expected")
        return done("accepted")
    return done(*_judge_refusal(job, code, stderr))


def _judge_refusal(job: _Running, code: int, stderr: str) -> tuple[str, str]:
    lines = stderr.strip().splitlines()
    if code != 2:
        return "wrong", f"exit {code}"
    if len(lines) != 1 or not lines[0].startswith("slimtorch: error: "):
        return "wrong", f"{len(lines)} lines on stderr, not one 'slimtorch: error:' line"
    if job.invocation.names_file and str(job.folder) not in lines[0]:
        return "wrong", "the message names no file of the case"
    if job.case.expect == "accept":
        return "wrong", "refused where a clean accept was expected"
    return "refused", ""


def _rss(pid: int) -> int:
    """Resident bytes of a process (0 once it is gone)."""
    return status_bytes(pid, "VmRSS")


def status_bytes(pid: int | str, field: str) -> int:
    """A byte count of ``/proc/PID/status`` (``VmRSS``, ``VmHWM``); 0 once the process is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    found = re.search(rf"^{field}:\s+(\d+) kB", status, re.MULTILINE)
    return int(found.group(1)) * 1024 if found else 0


def _memory_now() -> tuple[int, int, int]:
    """This process's (VmHWM, VmRSS, RssFile + RssShmem), bytes."""
    return (
        status_bytes("self", "VmHWM"),
        status_bytes("self", "VmRSS"),
        status_bytes("self", "RssFile") + status_bytes("self", "RssShmem"),
    )


def _grown(job: _Running, max_rss: int) -> int:
    """The anonymous memory a child took beyond what it held of the parent's as it started, at its peak: its
    own high water (VmHWM) less its RSS then, less the file-backed pages it mapped since (code and data
    of the libraries it ran, shared with the page cache, not memory it took), from what it reported at its
    exit. A forked child does not start with the parent's RSS (file-backed pages are not copied; they
    count once touched), so ``ru_maxrss`` less the parent's RSS misjudges by up to that difference; it is
    the fallback for a child killed before it told."""
    try:
        numbers = (int(n) for n in (job.io / "memory").read_text().split())
        _, start_rss, start_file, high, _, end_file = numbers
    except (OSError, ValueError):
        return max_rss - job.rss_at_fork
    return high - start_rss - max(end_file - start_file, 0)


def tree_bytes(folder: Path) -> int:
    """Bytes of the regular files under ``folder`` (links not followed)."""
    return sum(p.lstat().st_size for p in folder.rglob("*") if p.is_file() and not p.is_symlink())


@functools.cache
def fresh_cli_rss() -> int:
    """Peak RSS of a fresh process that has imported torch and the CLI: what a case's run starts from. Its
    own VmHWM, not ``ru_maxrss``: Linux carries the parent's high water over the exec into that."""
    code = (
        "import re, torch, slimtorch.cli.main; "
        "print(re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read()).group(1))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return int(done.stdout) * 1024


def reseal(path: Path) -> Path:
    """Recompute the header seal of a slim file edited in place, as a deliberate attacker would: the seal
    catches accidents, not intent, so the readers behind it must hold on their own."""
    from slimtorch.format.writer import seal_header

    header, data = read_safetensors(path)
    return write_safetensors_raw(path, seal_header(header), data)
