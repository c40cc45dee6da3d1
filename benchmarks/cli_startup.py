"""Benchmark: how long `slimtorch --help`, `--version` and `inspect --help` take in a fresh process.

Requirement checked: each answers in under 0.3 s (median), because none of them imports torch.

Method:
* Every run is a fresh process (``python -m slimtorch ...`` from this venv's interpreter, so PATH plays no
  part), its wall time taken by the parent from spawn to exit, output discarded.
* The cases run interleaved, round by round, so a noisy neighbour hits them all alike; medians over
  --runs rounds (default 10), after one untimed round that warms the page cache.
* Beside them: ``python -c pass`` (the interpreter's own start, the floor), and ``hf version``
  (huggingface_hub's CLI, a comparable Python tool) when it is installed next to this interpreter.
* ``--check`` exits 1 when a slimtorch case's median is 0.3 s or more.

Run: ``python -m benchmarks.cli_startup [--runs 10] [--check] [--json]``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
from functools import partial
from pathlib import Path

from benchmarks._harness import exit_code, interleaved

LIMIT_S = 0.3
SLIMTORCH = {
    "slimtorch --help": ["-m", "slimtorch", "--help"],
    "slimtorch --version": ["-m", "slimtorch", "--version"],
    "slimtorch inspect --help": ["-m", "slimtorch", "inspect", "--help"],
}


def cases() -> dict[str, list[str]]:
    """Every command timed, as argv; the baselines first."""
    found = {"python -c pass": [sys.executable, "-c", "pass"]}
    found |= {name: [sys.executable, *args] for name, args in SLIMTORCH.items()}
    hf = Path(sys.executable).with_name("hf")
    hf_path = str(hf) if hf.exists() else shutil.which("hf")
    if hf_path:
        found["hf version"] = [hf_path, "version"]
    return found


def run_quietly(argv: list[str]) -> None:
    """One fresh process to its exit, output discarded; a failing command is an error, not a time."""
    subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)


def measure(runs: int) -> dict[str, float]:
    """The median seconds of each case over ``runs`` interleaved rounds (after one warm-up round)."""
    calls = {name: partial(run_quietly, argv) for name, argv in cases().items()}
    times = interleaved(calls, runs, warmup=1)
    return {name: statistics.median(values) for name, values in times.items()}


def main() -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=10, help="rounds (default 10)")
    parser.add_argument("--check", action="store_true", help=f"exit 1 if a slimtorch median >= {LIMIT_S} s")
    parser.add_argument("--json", action="store_true", help="print the medians as JSON")
    args = parser.parse_args()
    medians = measure(args.runs)
    slow = [name for name in SLIMTORCH if medians[name] >= LIMIT_S]
    if args.json:
        result = {"runs": args.runs, "limit_s": LIMIT_S, "median_s": medians, "slow": slow}
        print(json.dumps(result, indent=2))
    else:
        print(f"median wall time of a fresh process, {args.runs} rounds")
        for name, seconds in medians.items():
            print(f"  {name:<28} {seconds:6.3f} s")
        print(f"over {LIMIT_S} s: {', '.join(slow) or 'none'}")
    return exit_code(not slow, args.check)


if __name__ == "__main__":
    sys.exit(main())
