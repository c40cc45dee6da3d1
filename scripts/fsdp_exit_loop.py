"""Run the README's 2-rank sharded-load scripts (``shard.py``: ``load_model(..., mesh=...)``; ``fill.py``:
``dcp.load`` through ``SlimStorageReader``) N times each under torchrun and count the clean exits.

Issue 43 reported rank 1 of such a script killed by SIGABRT at exit ("terminate called without an active
exception") after a successful load. ``python scripts/fsdp_exit_loop.py --runs 20`` prints, per script,
how many of the runs exited 0 on every rank; exit 1 unless all did. Each script is taken from README.md
as written, with the checkpoint its comment says to make.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TORCHRUN = Path(sys.executable).with_name("torchrun")


def readme_scripts() -> dict[str, str]:
    text = (ROOT / "README.md").read_text()
    return {
        match.group(2): match.group(1)
        for match in re.finditer(r"```python\n(# (shard\.py|fill\.py):.*?)```", text, re.S)
    }


CHECKPOINTS = {  # the files each script reads, made from its own build() as its comment says
    "shard.py": 'slimtorch.save(build().state_dict(), "mlp.safetensors", quantize="int8-weight")',
    "fill.py": 'slimtorch.save(build().state_dict(), "model-int8.safetensors", quantize="int8-weight")',
}


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args()
    scripts = readme_scripts()
    if set(scripts) != set(CHECKPOINTS):
        print(f"README.md's scripts changed: found {sorted(scripts)}")
        return 1
    failed = False
    with tempfile.TemporaryDirectory() as folder:
        for name, code in scripts.items():
            (Path(folder) / name).write_text(code)
            build = re.search(r"def build\(\):\n(?:    .*\n)+", code)  # fill.py runs its ranks on import
            if build is None:
                print(f"{name}: no build() in README.md's script")
                return 1
            make = f"import torch\nimport slimtorch\n{build.group(0)}{CHECKPOINTS[name]}\n"
            subprocess.run([sys.executable, "-c", make], cwd=folder, check=True, timeout=300)
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
