"""Benchmark: the hostile-input corpora of issues 17 and 44, counted per family.

Run it with ``.venv/bin/python -m benchmarks.hostile`` (a minute or two on 2 cores once every reader
enforces its budget; each case that still hangs costs its 60 s wall limit). ``--help`` lists the flags.
It prints one row per family: cases, refused cleanly, accepted cleanly, and the failures by kind
(traceback, signal, timeout, memory, wrong: an exit code, message or output not as the case expects,
build: the case's own builder failed), then the worst peak RSS and time of the family, and one line per
failing case. ``--json PATH`` writes every outcome; the exit code is 1 when any case fails.

Families: issue 17's checkpoints (``tests/test_hostile_corpus.py``) and, beside them, issue 44's other
surfaces: ``terminal`` (escape sequences and markup in names, ``tests/test_hostile_terminal.py``),
``bundles`` (tampered deployment bundles given to ``footprint``; ``predict`` the same bundles and hostile
input files given to the bundle's own ``predict.py``, ``tests/test_hostile_bundles.py``), ``data`` and
``numbers`` (arrays, examples and command-line numbers, ``tests/test_hostile_inputs.py``) and
``workfolder`` (``slimtorch slim`` resuming a tampered work folder or a hostile recipe,
``tests/test_hostile_workfolder.py``). ``--issue 17`` or ``--issue 44`` runs one set.

Method: each case builds its files (seeded, a few MB at most) in a temporary folder; a CLI case runs
``slimtorch.cli.main.main(argv)`` in a child forked from this process after torch and slimtorch are
imported (``tests.hostile.run_cases``), ``--jobs`` at a time. Peak RSS is the anonymous memory the
child took beyond what it held as it started (its own VmHWM less its starting RSS and the file pages it
mapped since, as it reports them at exit), plus the peak RSS (its own VmHWM) of a fresh process that
imported torch and the CLI (what a real ``slimtorch`` run starts from: about 220 MiB here; the 346 MiB
printed before this stop was that process's ``ru_maxrss``, which carries this one's high water over the
exec). A case is killed past 60 s, or past its
memory limit (1.5 GB or twice its files' size), and counted as a failure of that kind. A ``predict`` case
runs the bundle's ``python predict.py`` in a fresh process, one at a time, under the same limits; its
peak is that process's own (its VmHWM, not the high water ``wait4`` carries over from this one).
Issue 44's cases are also held to its bound (``tests.hostile.within_inputs``): their command's own start
plus 1.5 times the case's files plus 16 MiB, the start a fresh CLI process after its imports, a clean
``slimtorch slim`` run of the tiny model for ``workfolder`` (it trains), ``predict.py --check`` of an
untouched bundle for ``predict``; past it is a "memory" failure. ``--json`` gives each case's ``limit``,
the bound it was held to.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from tests.hostile import WALL_LIMIT, Case, Outcome, fresh_cli_rss, run_cases
from tests.support import hostile_bundles, hostile_inputs, hostile_terminal, hostile_workfolder
from tests.support.hostile_corpus import CASES as CHECKPOINT_CASES

from benchmarks._harness import write_json

CLI_CASES = {
    "17": CHECKPOINT_CASES,
    "44": [
        *hostile_terminal.CASES,
        *hostile_bundles.CASES,
        *hostile_inputs.CASES,
        *hostile_workfolder.CASES,
    ],
}
"""The cases run through ``slimtorch``'s CLI in forked children, by issue."""
PREDICT_CASES = {"17": [], "44": hostile_bundles.PREDICT_CASES}
"""The cases run through a bundle's own ``predict.py``, in fresh processes (it runs without slimtorch)."""

FAILURES = ("traceback", "signal", "timeout", "memory", "wrong", "build")
COLUMNS = ("cases", "refused", "accepted", *FAILURES)


def main() -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=2, help="cases run at once (default 2)")
    parser.add_argument("--only", default="", metavar="TEXT", help="run the cases whose id contains TEXT")
    parser.add_argument("--wall", type=float, default=WALL_LIMIT, help="seconds before a case is killed")
    parser.add_argument("--json", type=Path, metavar="PATH", help="write every outcome as JSON")
    parser.add_argument(
        "--issue", choices=("17", "44", "all"), default="all", help="which corpora (default all)"
    )
    args = parser.parse_args()

    issues = ("17", "44") if args.issue == "all" else (args.issue,)
    chosen: list[Case] = [case for issue in issues for case in CLI_CASES[issue] if args.only in case.id]
    predicted = [case for issue in issues for case in PREDICT_CASES[issue] if args.only in case.id]
    print(
        f"{len(chosen) + len(predicted)} cases; a fresh CLI process holds {fresh_cli_rss() / 2**20:.0f} MiB "
        "after its imports"
    )
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="slimtorch-hostile-") as root:
        outcomes = list(run_cases(chosen, Path(root) / "cli", jobs=args.jobs, wall=args.wall))
        outcomes += hostile_bundles.run_predict_cases(predicted, Path(root) / "predict", wall=args.wall)
    print(f"ran in {time.monotonic() - started:.0f} s with {args.jobs} jobs\n")
    print_table(outcomes)
    failed = [o for o in outcomes if not o.passed]
    for outcome in failed:
        print("FAIL", outcome.describe())
    if args.json:
        write_json(args.json, [as_dict(o) for o in outcomes], indent=1)
    return 1 if failed else 0


def print_table(outcomes: list[Outcome]) -> None:
    """Counts per family (a passing case as refused or accepted, a failing one under its failure kind),
    with the family's worst peak RSS and time."""
    rows: dict[str, dict[str, float]] = defaultdict(lambda: dict.fromkeys((*COLUMNS, "rss", "seconds"), 0))
    for outcome in outcomes:
        for key in (outcome.case.family, "all"):
            row = rows[key]
            row["cases"] += 1
            row[outcome.verdict] += 1  # a failing case's verdict is always one of FAILURES
            row["rss"] = max(row["rss"], outcome.peak_rss)
            row["seconds"] = max(row["seconds"], outcome.seconds)
    header = f"{'family':<14}" + "".join(f"{c:>10}" for c in COLUMNS) + f"{'worst RSS':>12}{'worst s':>9}"
    print(header)
    print("-" * len(header))
    for family in sorted(rows, key=lambda f: (f == "all", f)):
        row = rows[family]
        cells = "".join(f"{int(row[c]):>10}" for c in COLUMNS)
        print(f"{family:<14}{cells}{row['rss'] / 2**20:>8.0f} MiB{row['seconds']:>9.1f}")
    print()


def as_dict(outcome: Outcome) -> dict:
    return {
        "id": outcome.case.id,
        "family": outcome.case.family,
        "expect": outcome.case.expect,
        "verdict": outcome.verdict,
        "passed": outcome.passed,
        "exit": outcome.code,
        "seconds": round(outcome.seconds, 3),
        "peak_rss": outcome.peak_rss,
        "limit": outcome.limit,
        "problem": outcome.problem,
        "stderr": outcome.stderr[-2000:],
    }


if __name__ == "__main__":
    sys.exit(main())
