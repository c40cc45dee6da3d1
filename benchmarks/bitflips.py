"""Benchmark: random single-bit flips in slim checkpoints, 1000 per file kind; every one must be found.

Run it with ``.venv/bin/python -m benchmarks.bitflips`` (about a minute; ``--flips`` and ``--seed`` change
the run). For each kind of slim file (lossless raw and sparse, int8, int4, a sharded int8 folder with its
index; tens of KB each) it flips one random bit at a time, half of them in a header or the index, half
anywhere, loads the checkpoint and counts the outcome: detected (a FormatError), harmless (the same names,
dtypes and values as before the flip) or silent (anything else). It exits 1 if any flip is silent.
tests/test_header_integrity.py runs the same with 200 flips per kind.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

from tests.support.header import KINDS, flip_bits, slim_template


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__.splitlines()[0])
    parser.add_argument("--flips", type=int, default=1000, help="flips per file kind (default 1000)")
    parser.add_argument("--seed", default="bitflips", help="seed of the random flips")
    args = parser.parse_args(argv)
    silent = 0
    print(f"{'kind':<10} {'bytes':>7} {'flips':>6} {'detected':>9} {'harmless':>9} {'silent':>7} {'s':>6}")
    with tempfile.TemporaryDirectory() as folder:
        for kind in KINDS:
            path = slim_template(Path(folder), kind)
            size = path.stat().st_size if path.is_file() else sum(p.stat().st_size for p in path.iterdir())
            clock = time.perf_counter()
            counts = flip_bits(path, args.flips, random.Random(f"{args.seed}-{kind}"))
            seconds = time.perf_counter() - clock
            print(
                f"{kind:<10} {size:>7} {args.flips:>6} {counts.detected:>9} {counts.harmless:>9} "
                f"{len(counts.silent):>7} {seconds:>6.1f}"
            )
            for where in counts.silent[:10]:
                print(f"  silent: {where}")
            silent += len(counts.silent)
    return 1 if silent else 0


if __name__ == "__main__":
    sys.exit(main())
