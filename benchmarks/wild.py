"""Benchmark: the wild-model suite's matrix, every real checkpoint through every command, as a table.

Run it with ``.venv/bin/python -m benchmarks.wild`` (about 4 minutes on 2 cores; ``--models`` and
``--commands`` pick a few). It runs exactly what ``tests/wild`` asserts (``tests.wild.matrix``): each
checkpoint as its package ships it, through inspect, shrink (lossless, int8, int4), load_model into its
real class, int8-dynamic quantization, structured pruning at a quarter of the channels, the memory
estimate against the measured step, and ONNX export, each compared with the checkpoint as its own package
loads it, on realistic inputs. It prints a markdown table (a cell marked ✗ misses the issue's bar), the
file sizes, and why each ✗ misses; and writes everything to ``benchmarks/results/wild.json``.
"""

from __future__ import annotations

import argparse
import platform
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
from tests.wild.matrix import COMMANDS, Outcome, run, verdict
from tests.wild.models import BY_NAME, WildModel

from benchmarks._harness import machine, results_file, write_json

RESULTS = results_file("wild")
REFUSAL_CHARS = 70


def short(outcome: Outcome) -> str:
    """The outcome in a table cell: what was measured, or the start of the refusal."""
    if outcome.status == "file-only":
        return "— (file only)"
    if outcome.status in ("refused", "crashed"):
        text = outcome.message.split(": ", 1)[-1] if outcome.message.startswith("/") else outcome.message
        return f"{outcome.status}: {_cut(text)}"
    if outcome.command in ("prune", "export") or outcome.status == "mismatch":
        return f"{outcome.status}: {_cut(outcome.message)}"
    if outcome.command == "memory":
        gap = outcome.max_abs or 0.0
        return f"{outcome.status}, estimate = real step" if gap == 0 else f"{outcome.status}, {gap:.2%} off"
    ratio = ""
    if outcome.size_before and outcome.size_after and outcome.command != "inspect":
        ratio = f", {outcome.size_after / outcome.size_before:.3f}x"
    if outcome.status == "agrees" and outcome.cosine is not None:
        return f"cos {outcome.cosine:.4f}{ratio}"
    return f"{outcome.status}{ratio}"


def _cut(text: str, chars: int = REFUSAL_CHARS) -> str:
    return text[:chars] + "…" if len(text) > chars else text


def table(models: list[WildModel], commands: list[str], outcomes: dict[tuple[str, str], Outcome]) -> str:
    lines = ["| checkpoint | " + " | ".join(commands) + " |", "|---" * (len(commands) + 1) + "|"]
    for model in models:
        cells = []
        for command in commands:
            outcome = outcomes[model.name, command]
            mark = "" if verdict(model, outcome) is None else "✗ "
            cells.append(mark + short(outcome).replace("|", "/"))
        lines.append(f"| {model.name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def sizes(models: list[WildModel], outcomes: dict[tuple[str, str], Outcome]) -> str:
    lines = [
        "| checkpoint | package | what | on disk | lossless | int8 | int4 |",
        "|---|---|---|---|---|---|---|",
    ]
    for model in models:
        cells = []
        for command in ("shrink-lossless", "shrink-int8", "shrink-int4"):
            outcome = outcomes.get((model.name, command))
            cells.append(_mib(outcome.size_after) if outcome and outcome.size_after else "-")
        before = outcomes.get((model.name, "shrink-lossless"))
        disk = _mib(before.size_before) if before and before.size_before else "-"
        lines.append(
            f"| {model.name} | {model.package} | {model.what} | {disk} | " + " | ".join(cells) + " |"
        )
    return "\n".join(lines)


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def main() -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=list(BY_NAME), default=list(BY_NAME))
    parser.add_argument("--commands", nargs="+", choices=COMMANDS, default=list(COMMANDS))
    parser.add_argument("--json", type=Path, default=RESULTS, help=f"where to write the results ({RESULTS})")
    args = parser.parse_args()
    models = [BY_NAME[name] for name in args.models]
    warnings.simplefilter("ignore")  # the packages' own deprecation warnings are not the table's business
    outcomes: dict[tuple[str, str], Outcome] = {}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as work:
        for model in models:
            for command in args.commands:
                try:
                    outcome = run(model, command, Path(work))
                except Exception as exc:  # a crash is a result too: the table says where
                    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
                    outcome = Outcome(
                        model.name, command, "crashed", message=f"{type(exc).__name__}: {first}"
                    )
                outcomes[model.name, command] = outcome
                print(
                    f"{model.name:16} {command:16} {outcome.seconds:6.1f}s  {short(outcome)}", file=sys.stderr
                )
    elapsed = time.perf_counter() - started
    misses = [
        (m, o, verdict(m, o)) for m in models for c in args.commands if verdict(m, o := outcomes[m.name, c])
    ]
    print(table(models, args.commands, outcomes))
    print()
    print(sizes(models, outcomes))
    print()
    ran = [o for o in outcomes.values() if o.status != "file-only"]
    not_run = len(outcomes) - len(ran)
    print(
        f"{len(ran) - len(misses)} of {len(ran)} pairs meet the bar"
        + (f"; {not_run} not run (model commands on file-only checkpoints)" if not_run else "")
        + f" ({elapsed:.0f} s, torch {torch.__version__})."
    )
    for model, outcome, why in misses:
        print(f"- {model.name} x {outcome.command}: {_cut(why, 240)}")
    record = {
        "schema": "slimtorch.bench-wild/1",
        "machine": machine(cpu=platform.processor() or platform.machine()),
        "seconds": round(elapsed, 1),
        "models": {
            m.name: {"package": m.package, "what": m.what, "origin": m.origin, "path": str(m.path)}
            for m in models
        },
        "outcomes": [
            {**o.to_dict(), "meets_bar": verdict(BY_NAME[o.model], o) is None} for o in outcomes.values()
        ],
    }
    write_json(args.json, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
