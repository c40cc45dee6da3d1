"""Benchmark: the hostile-file corpus of issue 17, counted per family.

Run it with ``.venv/bin/python benchmarks/hostile.py`` (a minute or two on 2 cores once every reader
enforces its budget; each case that still hangs costs its 60 s wall limit). ``--help`` lists the flags.
It prints one row per family: cases, refused cleanly, accepted cleanly, and the failures by kind
(traceback, signal, timeout, memory, wrong: an exit code, message or output not as the case expects,
build: the case's own builder failed), then the worst peak RSS and time of the family, and one line per
failing case. ``--json PATH`` writes every outcome; the exit code is 1 when any case fails.

Method: the cases of ``tests/test_hostile_corpus.py`` build their files (seeded, a few MB at most) in a
temporary folder; each runs ``slimtorch.cli.main.main(argv)`` in a child forked from this process after
torch and slimtorch are imported (``tests.hostile.run_cases``), ``--jobs`` at a time. Peak RSS is the
child's ``ru_maxrss`` beyond what it inherited at the fork, plus the peak RSS of a fresh process that
imported the CLI (what a real ``slimtorch`` run starts from). A case is killed past 60 s, or past its
memory limit (1.5 GB or twice its files' size), and counted as a failure of that kind.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.hostile import WALL_LIMIT, Outcome, fresh_cli_rss, run_cases
from tests.test_hostile_corpus import CASES

FAILURES = ("traceback", "signal", "timeout", "memory", "wrong", "build")
COLUMNS = ("cases", "refused", "accepted", *FAILURES)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=2, help="cases run at once (default 2)")
    parser.add_argument("--only", default="", metavar="TEXT", help="run the cases whose id contains TEXT")
    parser.add_argument("--wall", type=float, default=WALL_LIMIT, help="seconds before a case is killed")
    parser.add_argument("--json", type=Path, metavar="PATH", help="write every outcome as JSON")
    args = parser.parse_args()

    chosen = [case for case in CASES if args.only in case.id]
    print(
        f"{len(chosen)} cases; a fresh CLI process holds {fresh_cli_rss() / 2**20:.0f} MiB after its imports"
    )
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="slimtorch-hostile-") as root:
        outcomes = list(run_cases(chosen, Path(root), jobs=args.jobs, wall=args.wall))
    print(f"ran in {time.monotonic() - started:.0f} s with {args.jobs} jobs\n")
    print_table(outcomes)
    failed = [o for o in outcomes if not o.passed]
    for outcome in failed:
        print("FAIL", outcome.describe())
    if args.json:
        args.json.write_text(json.dumps([as_dict(o) for o in outcomes], indent=1))
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
        "problem": outcome.problem,
        "stderr": outcome.stderr[-2000:],
    }


if __name__ == "__main__":
    sys.exit(main())
