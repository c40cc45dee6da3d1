"""`slimtorch slim`'s work folder and recipes are verified, never trusted (issue 44).

A resume trusts a stage only when its ``done.json`` fits its schema, was made from this run's inputs (the
model's tensors, the data, the options, the plan, the stage before it) and its files still hash to what it
recorded; anything else is redone, one line saying why, and every later stage with it. Recipe numbers have
bounds: a recipe out of them is one line naming the file and the field, exit 2.

The corpus runs the way the hostile-file corpus does (:func:`tests.hostile.run_cases`): two finished runs of
a tiny CNN on digits (seeds 0 and 1) are made once, then each case copies the first, tampers with it (a stage
swapped in from the second run, a byte flipped, a marker with wrong types ...) and resumes it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import pytest

from slimtorch._version import __version__
from slimtorch.errors import OptionError
from slimtorch.slimming import SlimOptions, markers, read_recipe
from slimtorch.slimming.markers import MARKER, Inputs, digest, file_sha256, read_marker, verify
from slimtorch.slimming.schema import Invalid, items, number, record, table, text
from slimtorch.slimming.workdir import WorkFolder
from tests.hostile import selected_outcomes
from tests.support.hostile_workfolder import CASES, _recipe_text

"""The stage folders of the reference run: its plan prunes half the channels and quantizes to int8."""


# -- the checks, one by one -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("value", "problem"),
    [
        (True, "not True"),
        ("3", "not '3'"),
        (math.nan, "not nan"),
        (math.inf, "not inf"),
        (1001, "from 0 to 1000"),
        (-1, "from 0 to 1000"),
        (2.5, "an integer"),
    ],
)
def test_a_number_must_be_a_finite_number_of_its_kind_within_its_bounds(value, problem: str) -> None:
    with pytest.raises(Invalid, match=f"epochs must be .*{problem}"):
        number(0, 1000, integer=True)(value, "epochs")
    number(0, 1000, integer=True)(1000, "epochs")


def test_records_refuse_unknown_and_missing_keys_and_tables_bound_their_size() -> None:
    check = record({"a": text(8)}, {"b": items(number(), 2)})
    check({"a": "x", "b": [1.0, 2]}, "r")
    with pytest.raises(Invalid, match="r: unknown key 'c'"):
        check({"a": "x", "c": 1}, "r")
    with pytest.raises(Invalid, match="r: missing key 'a'"):
        check({"b": []}, "r")
    with pytest.raises(Invalid, match=r"r.b holds 3 entries"):
        check({"a": "x", "b": [1, 2, 3]}, "r")
    with pytest.raises(Invalid, match="more than the 2 allowed"):
        table(number(), 2)({"x": 1, "y": 2, "z": 3}, "t")
    with pytest.raises(Invalid, match=r"\\x1b"):  # a key from a file is shown escaped
        table(text(), 2)({"\x1b[2J": 1}, "t")


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("recover_epochs", 1_000_000_000),
        ("recover_epochs", -1),
        ("recover_epochs", 1.5),
        ("recover_epochs", True),
        ("ratios", (-0.5,)),
        ("ratios", ("0.5",)),
        ("ratios", (math.nan,)),
        ("ratios", (0.5,) * 17),
        ("sparsities", (1.0,)),
        ("probe", 0.0),
        ("lr", math.nan),
        ("lr", 0.0),
        ("lr", 2.0),
        ("max_drop", math.inf),
        ("max_drop", -1.0),
        ("max_drop", True),
        ("batch", 0),
        ("batch", 10**12),
        ("seed", -1),
        ("seed", 2**64),
        ("attempts", 10**9),
        ("export", "yes"),
        ("timings", 1),
        ("goal", 5),
        ("stages", ("prune", "distil")),
    ],
)
def test_every_option_out_of_its_type_or_bounds_is_an_option_error_naming_it(field: str, value) -> None:
    with pytest.raises(OptionError, match=field) as caught:
        SlimOptions(**{field: value})
    assert "\n" not in str(caught.value)


def test_options_at_their_bounds_and_numbers_of_other_types_are_accepted() -> None:
    np = pytest.importorskip("numpy")
    options = SlimOptions(recover_epochs=np.int64(1000), lr=1.0, max_drop=100, batch=65536, ratios=[0.999])
    assert options.recover_epochs == 1000 and type(options.recover_epochs) is int
    assert options.max_drop == 100.0 and options.ratios == (0.999,)


@pytest.mark.parametrize(
    ("where", "change", "named"),
    [
        ("options", {"recover_epochs": "1000000000"}, "recover_epochs"),
        ("options", {"lr": "nan"}, "lr"),
        ("options", {"epochs": "3"}, "unknown key 'epochs'"),
        ("inputs", {"evil": '"x"'}, "unknown key 'evil'"),
        ("inputs", {"data": "5"}, r"\[inputs\].data"),
        ("plan", {"ratios": '["x"]'}, r"\[plan\].ratios\[0\]"),
        ("plan", {"chosen": "7"}, "chosen"),
        ("plan", {"sparsities": None}, "one entry per attempt"),
    ],
)
def test_a_recipe_out_of_bounds_is_one_option_error_naming_the_file_and_the_field(
    tmp_path: Path, where: str, change: dict, named: str
) -> None:
    path = tmp_path / "recipe.toml"
    path.write_text(_recipe_text(str(tmp_path / "tiny.py"), **{where: change}))
    with pytest.raises(OptionError, match=named) as caught:
        read_recipe(path)
    assert str(caught.value).startswith(f"recipe {path}: ") and "\n" not in str(caught.value)


def _finished(tmp_path: Path) -> tuple[WorkFolder, Inputs, Path]:
    """A work folder whose stage 02-prune wrote one file and finished."""
    work = WorkFolder(tmp_path / "work")
    folder = work.redo("02-prune")
    (folder / "model.safetensors").write_bytes(b"\x01" * 100)
    inputs = Inputs(digest("recipe"), digest("step"), digest("baseline"))
    result = {
        "reason": "removed half",
        "metric": 90.0,
        "output": "02-prune/model.safetensors",
        "file_bytes": 100,
        "params": 10,
        "bytes_by_category": {"weights": 100, "biases": 0, "norms": 0, "embeddings": 0, "other": 0},
        "seconds": 0.5,
    }
    work.finish("02-prune", "prune", inputs, result)
    return work, inputs, folder


def test_a_finished_stage_verifies_and_records_its_files_inputs_and_version(tmp_path: Path) -> None:
    work, inputs, _ = _finished(tmp_path)
    marker, why = work.verified("02-prune", "prune", inputs, "01-baseline")
    assert why == "" and marker is not None and marker["result"]["metric"] == 90.0
    assert marker["version"] == __version__ and marker["inputs"]["after"] == inputs.after
    assert marker["files"]["model.safetensors"]["bytes"] == 100


@pytest.mark.parametrize(
    ("damage", "why"),
    [
        (
            lambda f: (f / "model.safetensors").write_bytes(b"\x01" * 99 + b"\x02"),
            "does not match the sha256",
        ),
        (lambda f: (f / "model.safetensors").write_bytes(b"\x01" * 50), "is 50 bytes"),
        (lambda f: (f / "model.safetensors").unlink(), "is missing"),
        (
            lambda f: (f / "predict.py").write_text("print('hi')"),
            "'predict.py', which done.json does not list",
        ),
        (lambda f: (f / "link").symlink_to(f / "model.safetensors"), "'link' is a link"),
        (lambda f: (f / MARKER).write_text("{"), "not valid JSON"),
        (lambda f: (f / MARKER).write_text("[]"), "not a slimtorch.slim-stage/1 marker"),
    ],
)
def test_a_stage_whose_files_or_marker_changed_is_not_trusted_and_says_why(
    tmp_path: Path, damage: Callable[[Path], object], why: str
) -> None:
    work, inputs, folder = _finished(tmp_path)
    damage(folder)
    marker, problem = work.verified("02-prune", "prune", inputs, "01-baseline")
    assert marker is None and why in problem and "\n" not in problem


@pytest.mark.parametrize(
    ("field", "why"),
    [
        ("recipe", "made from other inputs"),
        ("step", "made for another plan"),
        ("after", "made from another 01-baseline"),
    ],
)
def test_a_stage_made_from_other_inputs_is_not_trusted(tmp_path: Path, field: str, why: str) -> None:
    _, inputs, folder = _finished(tmp_path)
    other = Inputs(**{**inputs.__dict__, field: digest("another")})
    with pytest.raises(Invalid, match=why):
        verify(folder, read_marker(folder / MARKER), "prune", other, "01-baseline")
    with pytest.raises(Invalid, match="a prune stage's, not a recover stage's"):
        verify(folder, read_marker(folder / MARKER), "recover", inputs, "01-baseline")


def test_a_marker_of_another_version_or_with_wrong_types_is_not_trusted(tmp_path: Path) -> None:
    work, inputs, folder = _finished(tmp_path)
    marker = json.loads((folder / MARKER).read_text())
    for edit, why in (
        ({"version": "0.0.1"}, "written by slimtorch '0.0.1'"),
        ({"result": {**marker["result"], "metric": "90"}}, "result.metric must be a finite number"),
        (
            {"result": {**marker["result"], "output": "../../etc/passwd"}},
            "result.output is '../../etc/passwd'",
        ),
        ({"files": None}, "files must be a table"),
    ):
        (folder / MARKER).write_text(json.dumps({**marker, **edit}))
        assert why in work.verified("02-prune", "prune", inputs, "01-baseline")[1]


def test_a_forged_marker_whose_hashes_match_its_files_is_not_trusted_without_this_users_signature(
    tmp_path: Path,
) -> None:
    """A forger rewrites a stage's model and its marker to match (sizes, hashes, a better metric): every
    check but the signature passes, and the signature is made with a key the work folder does not hold."""
    work, inputs, folder = _finished(tmp_path)
    (folder / "model.safetensors").write_bytes(b"\x07" * 80)
    marker = json.loads((folder / MARKER).read_text())
    marker["files"]["model.safetensors"] = {"sha256": file_sha256(folder / "model.safetensors"), "bytes": 80}
    marker["result"].update(file_bytes=80, metric=99.9)
    for forged in (marker["signature"], "", "0" * 64, markers.signature(marker, b"\x00" * 32)):
        (folder / MARKER).write_text(json.dumps({**marker, "signature": forged}))
        assert work.verified("02-prune", "prune", inputs, "01-baseline") == (
            None,
            "done.json was not signed by slimtorch for this user on this machine",
        )
    (folder / MARKER).write_text(
        json.dumps({**marker, "signature": markers.signature(marker, markers.signing_key())})
    )
    assert work.verified("02-prune", "prune", inputs, "01-baseline")[1] == ""  # the key's holder can sign


def test_the_signing_key_is_made_once_private_and_refused_when_others_can_read_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    markers.signing_key.cache_clear()
    try:
        key = markers.signing_key()
        path = tmp_path / "cache" / "slimtorch" / "marker.key"
        assert key is not None and len(key) == 32 and path.read_bytes() == key
        assert path.stat().st_mode & 0o777 == 0o600
        markers.signing_key.cache_clear()
        assert markers.signing_key() == key  # read back, not made again
        path.chmod(0o644)
        markers.signing_key.cache_clear()
        assert markers.signing_key() is None  # a key others can read signs nothing
        work, inputs, _ = _finished(tmp_path)
        assert "no key to check done.json's signature" in work.verified("02-prune", "prune", inputs, "")[1]
    finally:
        markers.signing_key.cache_clear()


def test_redoing_a_stage_that_is_a_link_removes_the_link_not_what_it_points_to(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_text("mine")
    work = WorkFolder(tmp_path / "work")
    work.root.mkdir()
    (work.root / "02-prune").symlink_to(elsewhere, target_is_directory=True)
    assert work.verified("02-prune", "prune", Inputs(digest(1), digest(2)), "")[1] == "it is not a folder"
    fresh = work.redo("02-prune")
    assert fresh.is_dir() and not fresh.is_symlink() and not any(fresh.iterdir())
    assert (elsewhere / "keep.txt").read_text() == "mine"


"""The stages tampered with: files and folders in 02-prune (every later stage is redone), markers in
05-quantize (quantize and save are redone: the cheap end of the run)."""


"""(name, how the copy of the first run is tampered with, the first stage that must be redone, an extra
check: "save-metric" for a save redone from this run's file)."""


@pytest.fixture(scope="module")
def outcomes(request, tmp_path_factory) -> dict:
    """Every selected case run once, before the first test reads (:func:`tests.hostile.selected_outcomes`)."""
    return selected_outcomes(request, tmp_path_factory, CASES, before_fork=_imported_before_the_forks)


def _imported_before_the_forks() -> None:
    """What a slim run imports (its stages, scikit-learn's digits, matplotlib), imported once here: each
    case's child then inherits it instead of spending seconds on it (the harness counts only what a
    child grows beyond its parent)."""
    from sklearn.datasets import load_digits  # noqa: F401

    import slimtorch.slimming.pipeline  # noqa: F401
    from slimtorch.slimming.charts import require_pyplot

    require_pyplot()


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_a_tampered_work_folder_or_recipe_is_redone_or_refused_in_one_line(outcomes, case):
    outcome = outcomes[case.id]
    assert outcome.passed, outcome.describe()
