"""What the benchmarks share: where their results go and the machine they came from, the PASS/FAIL lines and
exit code of ``--check``, medians and spreads, interleaved timing, runs in fresh processes, rich tables.

Every benchmark runs as a module from the repository's root, ``python -m benchmarks.NAME``, with slimtorch
installed (``make`` installs it editable): ``benchmarks``, ``tests`` and ``examples`` then import as they
are, and no benchmark touches the import path (``tests/test_layers.py`` checks it). A benchmark's child
runs the same way (:func:`child_command`), in its parent's working directory, so paths given on the
command line mean the same to both.

Nothing here imports torch or rich until asked: ``inspect_speed`` keeps torch out of its parent, and
``cli_startup`` times fresh processes.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = ROOT / "benchmarks" / "results"


# -- results -------------------------------------------------------------------------------------------------
def results_file(name: str) -> Path:
    """``benchmarks/results/<name>.json``: where a benchmark writes every measurement (not committed)."""
    return RESULTS_DIR / f"{name}.json"


def write_json(
    path: Path, record: Any, *, indent: int = 2, default: Callable[[Any], Any] | None = None
) -> Path:
    """``record`` as JSON in ``path`` (its folder made first), a newline at the end; returns ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=indent, default=default) + "\n")
    return path


def memory_gib() -> float:
    """This machine's physical memory in GiB."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 30)


def machine(**extra: Any) -> dict[str, Any]:
    """The machine a result comes from: Python, CPUs, memory, and torch's version where this process has
    imported torch (a parent that keeps torch out is not made to import it); ``extra`` added last."""
    found: dict[str, Any] = {
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "mem_gib": round(memory_gib(), 1),
    }
    torch = sys.modules.get("torch")
    if torch is not None:
        found["torch"] = torch.__version__
    return found | extra


def load_average() -> str:
    """``load average 1.02, 0.98, 0.87``: the machine's load over 1, 5 and 15 minutes."""
    return "load average " + ", ".join(f"{v:.2f}" for v in os.getloadavg())


# -- verdicts ------------------------------------------------------------------------------------------------
Check = tuple[str, bool, str]
"""One target: what it asks, whether it was met, the measured value as printed."""


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def print_checks(checks: Iterable[Check]) -> bool:
    """One ``PASS  what: value`` (or ``FAIL ...``) line per target, ``: value`` left out when empty;
    whether every target was met."""
    met = True
    for label, ok, value in checks:
        print(f"{verdict(ok)}  {label}{': ' + value if value else ''}")
        met = met and ok
    return met


def exit_code(passed: bool, check: bool) -> int:
    """A benchmark's exit code: 1 when ``--check`` was given and a target failed, 0 otherwise (without
    ``--check`` a benchmark is a report)."""
    return 1 if check and not passed else 0


# -- statistics ----------------------------------------------------------------------------------------------
def summary(values: Iterable[float]) -> dict[str, float]:
    """The median, min and max of ``values``."""
    values = list(values)
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def spread(values: Sequence[float] | Mapping[str, float], digits: int = 2) -> str:
    """``median [min..max]`` of ``values``, or of a :func:`summary` of them."""
    s = values if isinstance(values, Mapping) else summary(values)
    return f"{s['median']:.{digits}f} [{s['min']:.{digits}f}..{s['max']:.{digits}f}]"


def relative_spread(values: Sequence[float]) -> float:
    """(slowest - fastest) / median."""
    return (max(values) - min(values)) / statistics.median(values)


def paired_ratio(values: Sequence[float], reference: Sequence[float]) -> float:
    """The median of the rounds' ratios ``values[i] / reference[i]``: both timed in the same round, so a
    slow spell of a shared machine slows both sides of a pair and the ratio survives it."""
    return statistics.median(v / r for v, r in zip(values, reference, strict=True))


# -- timing --------------------------------------------------------------------------------------------------
def seconds(call: Callable[..., Any], *args: Any) -> float:
    """Wall seconds of one ``call(*args)``."""
    start = time.perf_counter()
    call(*args)
    return time.perf_counter() - start


def rotated(items: list[str], by: int) -> list[str]:
    """``items`` starting at index ``by`` (modulo their count), the ones before it moved to the end."""
    at = by % len(items) if items else 0
    return items[at:] + items[:at]


def interleaved(
    calls: Mapping[str, Callable[[], Any]], rounds: int, *, warmup: int = 0, rotate: bool = False
) -> dict[str, list[float]]:
    """Each call's wall seconds in ``rounds`` rounds, every call once a round in turns, so a noisy moment of
    the machine lands on all of them alike; after ``warmup`` untimed rounds. ``rotate``: each round starts
    one call further down the list, so no call always runs after the same one."""
    names = list(calls)
    for _ in range(warmup):
        for call in calls.values():
            call()
    times: dict[str, list[float]] = {name: [] for name in names}
    for index in range(rounds):
        for name in rotated(names, index) if rotate else names:
            times[name].append(seconds(calls[name]))
    return times


# -- processes -----------------------------------------------------------------------------------------------
def proc_status(pid: int | str = "self") -> dict[str, int]:
    """The kB fields of /proc/<pid>/status (RssAnon, VmHWM, ...) in KiB; empty once the process is gone."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return {}
    fields = (line.split(":", 1) for line in text.splitlines() if line.endswith(" kB"))
    return {key: int(value.split()[0]) for key, value in fields}


def status_bytes(field: str, pid: int | str = "self") -> int:
    """One field of /proc/<pid>/status (``VmRSS``, ``VmHWM``, ``RssFile`` ...) in bytes; KeyError if none."""
    return proc_status(pid)[field] * 1024


def child_command(module: str, *args: str) -> list[str]:
    """The command that runs ``module`` (a benchmark's ``__spec__.name``) in a fresh interpreter, this one."""
    return [sys.executable, "-m", module, *args]


def emit(record: Any) -> None:
    """A child's answer to its parent: one JSON line on stdout (the parent reads the last one)."""
    print(json.dumps(record), flush=True)


def last_json(stdout: str) -> Any:
    """The JSON of the last line a child printed (:func:`emit`)."""
    return json.loads(stdout.strip().splitlines()[-1])


class ChildFailed(RuntimeError):
    """A child exited with an error; the message ends with the end of its stderr."""


def child_json(
    command: list[str], *, what: str, env: Mapping[str, str] | None = None, timeout: float | None = None
) -> Any:
    """Run ``command`` (a :func:`child_command`) to its end, its output captured, and return the JSON of its
    last line; :class:`ChildFailed` (``<what> failed:`` and its stderr's last 3000 characters) if it fails."""
    done = subprocess.run(command, capture_output=True, text=True, check=False, env=env, timeout=timeout)
    if done.returncode:
        raise ChildFailed(f"{what} failed:\n{done.stderr[-3000:]}")
    return last_json(done.stdout)


@dataclass
class Sampled:
    """A child run by :func:`sampled_run`."""

    returncode: int
    wall_s: float
    """from its spawn to its exit, as this process saw them"""
    peak_anon: int
    """the highest RssAnon sampled (its anonymous resident memory: no page cache, no mapped file), bytes"""
    usage: Any
    """its ``resource.struct_rusage`` (``ru_maxrss``: its VmHWM in KiB; ``ru_utime``, ``ru_stime``)"""
    stdout: str
    stderr: str


def sampled_run(command: list[str], *, every: float, capture: bool = True) -> Sampled:
    """Run ``command`` to its end, its RssAnon sampled from a thread every ``every`` seconds. Its output goes
    to files, read once it ended (a pipe would fill, a library's warnings are enough, and block the child
    while this process waits for it); ``capture=False`` discards its stdout."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        started = time.perf_counter()
        child = subprocess.Popen(
            command, stdout=out if capture else subprocess.DEVNULL, stderr=err, text=True
        )
        peak, done = 0, threading.Event()

        def sample() -> None:
            nonlocal peak
            while not done.is_set():
                peak = max(peak, proc_status(child.pid).get("RssAnon", 0) * 1024)
                done.wait(every)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        _, status, usage = os.wait4(child.pid, 0)
        wall = time.perf_counter() - started
        done.set()
        sampler.join()
        child.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        return Sampled(child.returncode, wall, peak, usage, out.read(), err.read())


# -- tables --------------------------------------------------------------------------------------------------
def rich_table(title: str, headers: Iterable[str], left: Collection[str] = ()) -> Table:
    """A rich table with these columns: the ones named in ``left`` left-aligned (names, notes), the others
    right-aligned (numbers)."""
    from rich.table import Table

    table = Table(title=title)
    for header in headers:
        table.add_column(header, justify="left" if header in left else "right")
    return table


def show(table: Table, width: int) -> None:
    """Print ``table`` at ``width`` columns whatever the terminal's (a file or a pipe gets the same)."""
    from rich.console import Console

    Console(width=width).print(table)
