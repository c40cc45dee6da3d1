"""The hostile-file corpus of issue 17: every case is refused with one line and exit 2 (or accepted cleanly),
with no traceback, no signal, within 60 s and 1.5 GB (or twice its files) of peak RSS.

Each case builds its files at test time (seeded, a few MB at most) and runs the CLI in a forked child
(:func:`tests.hostile.run_cases`). ``python -m benchmarks.hostile`` runs the same corpus, with counts per
family.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest

from tests.hostile import (
    Case,
    Invocation,
    run_cases,
    selected_outcomes,
)
from tests.support.hostile_corpus import CASES


@pytest.fixture(scope="module")
def outcomes(request, tmp_path_factory) -> dict:
    """Every selected case run once, before the first test reads (:func:`tests.hostile.selected_outcomes`)."""
    return selected_outcomes(request, tmp_path_factory, CASES)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_hostile_input_is_refused_in_one_line_or_accepted_cleanly_within_budget(outcomes, case):
    outcome = outcomes[case.id]
    assert outcome.passed, outcome.describe()


def test_the_corpus_covers_every_family_of_issue_17_with_over_120_cases():
    families = {case.family for case in CASES}
    assert families == {
        "memory",
        "nesting",
        "cpu",
        "parser",
        "integrity",
        "remote-code",
        "allow-global",
        "paths",
    }
    assert len(CASES) > 120


@pytest.mark.slow
def test_the_harness_sees_a_crash_a_hang_and_a_memory_bomb(tmp_path, monkeypatch):
    """The controls: without them a harness that reports everything as clean would pass the corpus."""
    import slimtorch.cli.main as cli

    behaviours = {
        "crash": lambda argv: os.kill(os.getpid(), 11),
        "hang": lambda argv: __import__("time").sleep(30),
        "bomb": lambda argv: len(b"\x01" * (2 * 10**9)),
        "traceback": lambda argv: 1 / 0,
    }
    monkeypatch.setattr(cli, "main", lambda argv: behaviours[argv[0]](argv))

    def control(name: str) -> Case:
        return Case(f"control/{name}", "control", "either", lambda folder: Invocation([name]))

    verdicts = {o.case.id: o.verdict for o in run_cases([control("hang")], tmp_path / "hang", wall=2.0)}
    others = [control(name) for name in ("crash", "bomb", "traceback")]
    verdicts.update({o.case.id: o.verdict for o in run_cases(others, tmp_path / "others", wall=30.0)})
    assert verdicts == {
        "control/crash": "signal",
        "control/hang": "timeout",
        "control/bomb": "memory",
        "control/traceback": "traceback",
    }


def test_a_strict_case_is_held_to_its_commands_start_plus_one_and_a_half_times_its_inputs(
    tmp_path, monkeypatch
):
    """Issue 44's bound: a clean exit that took 100 MiB beyond the CLI's start on 1 MiB of files is a
    "memory" failure, where the harness's kill limit (1.5 GB) would have let it pass; 4 MiB on 8 MiB is
    within it. And a ``start`` run sets the start the others are held to."""
    import slimtorch.cli.main as cli

    held: list[bytes] = []
    monkeypatch.setattr(cli, "main", lambda argv: held.append(b"\x01" * (int(argv[0]) << 20)) or 0)

    def case(name: str, mib: int, files: int) -> Case:
        def build(folder: Path) -> Invocation:
            (folder / "input.bin").write_bytes(b"\0" * (files << 20))
            return Invocation([str(mib)])

        return Case(f"control/{name}", "control", "accept", build, strict=True)

    outcomes = {o.case.id: o for o in run_cases([case("amplifies", 100, 1), case("within", 4, 8)], tmp_path)}
    assert outcomes["control/amplifies"].verdict == "memory"
    assert "over its command's start" in outcomes["control/amplifies"].problem
    assert outcomes["control/within"].verdict == "accepted"
    started = [replace(case("after-a-heavy-start", 100, 1), start=lambda folder: Invocation(["150"]))]
    assert [o.verdict for o in run_cases(started, tmp_path / "started")] == ["accepted"]
