"""Run the 2-rank sharded-load scripts of docs/how-to/distributed.md (``shard.py``: ``load_model(...,
mesh=...)``; ``fill.py``: ``dcp.load`` through ``SlimStorageReader``) N times each under torchrun and
count the clean exits.

Issue 43 reported rank 1 of such a script killed by SIGABRT at exit ("terminate called without an active
exception") after a successful load. ``python -m scripts.fsdp_exit_loop --runs 20``, from the repository's
root, runs the page's blocks once as the block test does (they write the scripts and the checkpoints they
read), then each script N more times, and prints how many runs exited 0 on every rank; exit 1 unless all
did.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.support.doc_blocks import ROOT, run_page

PAGE = ROOT / "docs" / "how-to" / "distributed.md"
SCRIPTS = ("shard.py", "fill.py")
TORCHRUN = Path(sys.executable).with_name("torchrun")


def main() -> int:
    shown = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=shown)
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args()
    failed = False
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        for outcome in run_page(PAGE, folder):
            if not outcome.ok:
                print(f"{outcome.block.where}: {outcome.detail}")
                return 1
        missing = [name for name in SCRIPTS if not (folder / name).is_file()]
        if missing:
            print(f"{PAGE.name} no longer writes {missing}")
            return 1
        for name in SCRIPTS:
            clean = 0
            for _ in range(args.runs):
                run = subprocess.run(
                    [str(TORCHRUN), "--standalone", "--nproc-per-node", "2", name],
                    cwd=folder,
                    capture_output=True,
                    text=True,
                    timeout=300,
                )
                clean += run.returncode == 0
                if run.returncode:
                    print(f"{name}: exit {run.returncode}\n{run.stderr[-1500:]}")
            print(f"{name}: {clean} of {args.runs} runs exited 0 on both ranks")
            failed |= clean != args.runs
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
