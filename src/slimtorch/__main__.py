"""`python -m slimtorch ...`: the same command line as `slimtorch ...`, for an environment whose scripts
folder is not on PATH (a venv used without activating it, ``pipx run``, a notebook's ``!python -m``)."""

from __future__ import annotations

import sys

from slimtorch.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
