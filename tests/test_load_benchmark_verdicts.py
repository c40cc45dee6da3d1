"""The load benchmark's cold verdicts: a target judged on a floor that swung (or ran under 3 times) says
UNSTEADY and does not pass, and it is judged against the faster of the two sequential floors.

On a virtual machine that hands freed memory back to its host, the same cold read took 0.6 s in one run
and 3 s in the next; a ratio to such a floor passed once by the floor's slowness alone."""

from __future__ import annotations

import importlib
import os

import pytest


@pytest.fixture(scope="module")
def bench():
    """The module ``python -m benchmarks.load`` runs (the tests import from the repository's root)."""
    return importlib.import_module("benchmarks.load")


def _row(*runs: float) -> dict:
    ordered = sorted(runs)
    return {
        "median_s": ordered[len(ordered) // 2],
        "min_s": ordered[0],
        "max_s": ordered[-1],
        "runs_s": list(runs),
        "resident_before_max": 0.0,
    }


def _cold_check(bench, readinto: tuple[float, ...], stream: tuple[float, ...], ours: tuple[float, ...]):
    rows = {
        f"cold: {bench.FLOOR}": _row(*readinto),
        f"cold: {bench.STREAM_FLOOR}": _row(*stream),
        f"cold: {bench.OURS}": _row(*ours),
    }
    return next(c for c in bench.checks("mlp", rows) if "cold sequential read" in c["name"])


def test_a_steady_floor_is_judged_against_the_faster_sequential_read(bench) -> None:
    check = _cold_check(bench, (0.60, 0.61, 0.62), (0.70, 0.71, 0.72), (0.64, 0.65, 0.66))
    assert check["measured"] == pytest.approx(0.65 / 0.61) and bench.verdict(check) == "PASS" and check["ok"]
    slow = _cold_check(bench, (0.60, 0.61, 0.62), (0.70, 0.71, 0.72), (0.70, 0.70, 0.71))
    assert bench.verdict(slow) == "FAIL" and not slow["ok"]  # 1.15x the readinto, though under the 8 MiB read


@pytest.mark.parametrize(
    "readinto, stream",
    [
        ((0.60, 0.62, 3.00), (0.70, 3.00, 3.10)),  # the faster floor by median swung 5x
        ((0.60,), (0.70,)),  # one run each: no spread to see
    ],
)
def test_a_cold_target_on_a_floor_that_swung_or_ran_once_is_unsteady_not_a_pass(
    bench, readinto, stream
) -> None:
    check = _cold_check(bench, readinto, stream, (0.60, 0.61, 0.62))
    assert bench.verdict(check) == "UNSTEADY" and not check["ok"]


def test_the_second_reads_cost_is_two_floors_without_a_loader_and_the_rest_is_the_loaders(bench) -> None:
    """The second read's cost is the two-pass floor over the same mapping summed alone: neither builds a
    model, so neither hides the construction the anchor and slimtorch pay (over ``verify=False``, which
    builds one, the cost read 0.98x in a run where the CRC slowed the sum by a tenth). What the verified
    load takes over the anchor beyond that cost is the loader's own. Only for a large file (the loader's
    threshold): BERT-base's checks are mostly done while its model is built, and its two-pass floor times
    a CRC, not a use."""
    rows = {
        bench.ANCHOR: _row(0.2, 0.2, 0.2),
        bench.SAME_FILE: _row(0.08, 0.08, 0.08),
        bench.ONCE: _row(0.055, 0.055, 0.055),  # builds a model: not the second read's denominator
        bench.SUM_FLOOR: _row(0.05, 0.05, 0.05),
        bench.TWO_PASS_FLOOR: _row(0.06, 0.06, 0.06),
        bench.OURS: _row(0.12, 0.12, 0.12),
    }
    found = dict(bench.measures("mlp", rows, 2 << 30))
    second = next(v for k, v in found.items() if "second read" in k)
    own = next(v for k, v in found.items() if "loader's own" in k)
    assert second == pytest.approx(1.2) and own == pytest.approx(1.5 / 1.2)
    for name, size in (("bert", 418 << 20), ("mlp", 256 << 20)):  # --size-mib 256: not a large file either
        assert not [
            k for k, _ in bench.measures(name, rows, size) if "second read" in k or "loader's own" in k
        ]
    rows.pop(bench.SUM_FLOOR)  # no floor to divide by: neither line
    assert not [
        k for k, _ in bench.measures("mlp", rows, 2 << 30) if "second read" in k or "loader's own" in k
    ]


def test_the_warm_target_is_judged_against_the_anchor_on_the_same_file_and_its_own_is_printed(bench) -> None:
    """The anchor on the slim file reads the pages slimtorch reads; its own file's pages this host may read
    at another speed (0.074 s against 0.109 in one A/B, the other way round minutes later)."""
    rows = {
        bench.ANCHOR: _row(0.2, 0.2, 0.2),
        bench.SAME_FILE: _row(0.10, 0.10, 0.10),
        bench.OURS: _row(0.12, 0.12, 0.12) | {"peak_rss_x_model": 1.0},
    }
    warm = next(c for c in bench.checks("mlp", rows) if c["name"].endswith(", warm"))
    assert bench.SAME_FILE in warm["name"] and warm["measured"] == pytest.approx(1.2) and not warm["ok"]
    own = next(v for k, v in bench.measures("mlp", rows, 2 << 30) if "its own file" in k)
    assert own == pytest.approx(0.6)
    del rows[bench.SAME_FILE]  # an --only run without it: the anchor's own file, as before
    warm = next(c for c in bench.checks("mlp", rows) if c["name"].endswith(", warm"))
    assert warm["measured"] == pytest.approx(0.6) and warm["ok"]


def test_each_round_starts_one_method_further_cold_ones_first_then_the_files_warmed_again(
    bench, monkeypatch, tmp_path
) -> None:
    """A fixed order ran each method after the same one every round; the anchor, second in each, spread
    0.070-0.131 s in one run while slimtorch's unchecked load of the same file spread 0.065-0.067."""
    ran: list[str] = []
    monkeypatch.setattr(bench, "run_child", lambda method, *args: ran.append(method) or {"seconds": 1.0})
    monkeypatch.setattr(bench, "evict", lambda path: ran.append("evict"))
    monkeypatch.setattr(bench, "warm", lambda path: None)
    monkeypatch.setattr(bench, "warm_small", lambda path: None)
    only = ["cold: floor: readinto", "cold: slimtorch verified (before-use)", "load_file + assign"]
    bench.measure("mlp", tmp_path, 1, 2, None, True, only, 1)
    rounds = [ran[i : i + len(ran) // 3] for i in range(0, len(ran), len(ran) // 3)]
    firsts = [[m for m in r if m != "evict"] for r in rounds]
    assert len({r[0] for r in firsts}) == 3  # 3 cold methods (the anchor cold too): a new first each round
    for methods, events in zip(firsts, rounds, strict=True):
        colds = [m for m in methods if m.startswith("cold: ")]
        assert methods[: len(colds)] == colds  # every cold run before the warm ones
        assert events.index("evict") == len(colds)  # the files warmed again right before the first warm one


def test_the_small_pages_target_is_judged_against_the_anchor_on_the_small_pages_copy(bench) -> None:
    """Mapped in small pages the faults cost more than the reads, and the two files' states differ: each
    verified row is judged against the anchor on the same pages."""
    rows = {
        bench.SAME_FILE: _row(0.10, 0.10, 0.10),
        bench.OURS: _row(0.105, 0.105, 0.105) | {"peak_rss_x_model": 1.0},
        bench.SMALL_ANCHOR: _row(0.20, 0.20, 0.20),
        bench.SMALL_OURS: _row(0.24, 0.24, 0.24),
    }
    found = {c["name"]: c for c in bench.checks("mlp", rows)}
    small = found[f"synthetic MLP: verified load / {bench.SMALL_ANCHOR}, warm"]
    assert small["measured"] == pytest.approx(1.2) and not small["ok"]
    assert found[f"synthetic MLP: verified load / {bench.SAME_FILE}, warm"]["ok"]
    assert bench.file_of(bench.SMALL_OURS) == bench.file_of(bench.SMALL_ANCHOR) == "small"
    assert bench.file_of(f"cold: {bench.OURS}") == "slim"


def test_the_small_pages_copy_is_cached_in_small_pages_and_the_others_as_a_read_caches_them(
    bench, monkeypatch, tmp_path
) -> None:
    events: list[tuple[str, str]] = []
    for name in ("evict", "warm", "warm_small"):
        monkeypatch.setattr(bench, name, lambda path, name=name: events.append((name, path.name)))
    paths = bench.files(tmp_path, "mlp")
    bench.cache(paths)
    assert ("warm_small", "mlp-slim-small.safetensors") in events
    assert {name for name, path in events if path == "mlp-slim.safetensors"} == {"evict", "warm"}
    assert [e for e in events if e[0] == "evict"] == [("evict", p.name) for p in paths.values()]


def test_evict_drops_a_file_just_written_and_warm_small_caches_it_whole(bench, tmp_path) -> None:
    """The benchmark copies the slim file and then caches the copy in small pages: an eviction that left
    the copy's dirty pages (the advice drops clean pages only) would leave it in its writer's folios."""
    clean = tmp_path / "clean.bin"
    with open(clean, "wb") as stream:
        stream.write(bytes(4096))
        stream.flush()
        os.fsync(stream.fileno())
    bench.evict(clean)
    if bench.resident_share(clean) > 0.5:
        pytest.skip("this file system keeps its pages (tmpfs)")
    path = tmp_path / "written.bin"
    path.write_bytes(bytes(range(256)) * 9000)  # over 2 MiB, not written back yet
    bench.evict(path)
    assert bench.resident_share(path) < 0.1
    bench.warm_small(path)
    assert bench.resident_share(path) == 1.0
