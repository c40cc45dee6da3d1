"""Issue 44's data and number families: arrays, examples and numbers we did not write, each refused in one
line (exit 2) or accepted cleanly, within the hostile corpus's memory and time.

- **data**: ``.npz`` / ``.npy`` given to ``export --example`` and ``--data`` (deflate bombs, lying headers,
  thousands of members), ``--data`` arrays that do not fit the model (a wrong width, class ids out of
  range, token ids given to a float model, float targets where accuracy needs class ids) and JSON examples
  of strings, objects, booleans, null, ragged or too-deep lists, and numbers past int64;
- **numbers**: numeric options out of bounds, NaN, inf, negative or zero, refused where they are parsed.

The unit tests pin the rules (the budget of :mod:`slimtorch.format.numpy_files`, the ``type=`` functions
of :mod:`slimtorch.cli.arguments`); the corpus runs the CLI in forked children through
:func:`tests.hostile.run_cases`, as ``tests/test_hostile_corpus.py`` does.
"""

from __future__ import annotations

import argparse
import json
import zipfile
from pathlib import Path

import numpy as np
import pytest
from torch import nn

import slimtorch.deploy  # imported before the fork, as the CLI is: a case's time is its own work
import slimtorch.loading  # noqa: F401
from slimtorch.cli.arguments import MAX_BATCH, MAX_COUNT, integer, real, size
from slimtorch.cli.example_files import read_example
from slimtorch.cli.main import main
from slimtorch.cli.model_input import MAX_DIMS, shape
from slimtorch.errors import FormatError, SlimtorchError
from slimtorch.format.numpy_files import MAX_MEMBERS, read_npy, read_npz
from slimtorch.recovery import evaluate, open_data
from tests.hostile import (
    selected_outcomes,
)
from tests.support.hostile_inputs import (
    CASES,
    NET,
    arrays,
    classes,
    features,
    lying_npy,
    many_members,
    npz_bomb,
)

"""zeros deflated into a member: about 3 MiB of file for 3 GiB of array, twice the corpus's memory floor"""


# -- unit tests: the budget -------------------------------------------------------------------------------
def test_an_npz_reads_back_what_numpy_wrote_compressed_or_not(tmp_path: Path) -> None:
    x, y = features(), classes()
    np.savez(tmp_path / "plain.npz", x=x, y=y, z=np.zeros(3))
    np.savez_compressed(tmp_path / "packed.npz", x=x, y=y)
    for name in ("plain.npz", "packed.npz"):
        found = read_npz(tmp_path / name, ("x", "y"))
        assert sorted(found) == ["x", "y"] and np.array_equal(found["x"], x) and np.array_equal(found["y"], y)
    assert sorted(read_npz(tmp_path / "plain.npz")) == ["x", "y", "z"]
    np.save(tmp_path / "x.npy", x)
    assert np.array_equal(read_npy(tmp_path / "x.npy"), x)


@pytest.mark.slow
def test_a_deflate_bomb_is_refused_before_it_is_decompressed(tmp_path: Path) -> None:
    path = npz_bomb(tmp_path / "bomb.npz", {"x": ("<f4", (1 << 28,))})  # 1 GiB from about 1 MiB
    with pytest.raises(FormatError, match=r"member 'x\.npy' would decode 1,073,741,\d+ bytes from") as caught:
        read_npz(path)
    assert str(path) in str(caught.value) and "SLIMTORCH_MAX_EXPANSION" in str(caught.value)


@pytest.mark.slow
def test_a_member_claiming_more_than_its_declared_size_is_refused(tmp_path: Path) -> None:
    path = npz_bomb(tmp_path / "lying.npz", {"x": ("<f4", (1 << 28,))}, lying=True)
    with pytest.raises(FormatError, match=r"member 'x\.npy' claims 1,073,741,824 bytes, more than the file"):
        read_npz(path)


def test_members_past_the_count_are_refused_before_zipfile_parses_them(tmp_path: Path) -> None:
    path = many_members(tmp_path / "many.npz", MAX_MEMBERS + 1)
    with pytest.raises(FormatError, match=f"lists {MAX_MEMBERS + 1:,} members"):
        read_npz(path, ("x", "y"))


def test_pickles_and_members_that_are_not_arrays_are_refused(tmp_path: Path) -> None:
    np.savez(tmp_path / "objects.npz", x=np.array([{"a": 1}], dtype=object))
    with pytest.raises(FormatError, match="Python objects"):
        read_npz(tmp_path / "objects.npz")
    with zipfile.ZipFile(tmp_path / "text.npz", "w") as archive:
        archive.writestr("notes.txt", "hello")
    with pytest.raises(FormatError, match=r"member 'notes\.txt' is not an \.npy array"):
        read_npz(tmp_path / "text.npz")


def test_an_npy_header_claiming_more_than_the_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(FormatError, match="claims 24,000,000,000,000 bytes, more than the file can hold"):
        read_npy(lying_npy(tmp_path / "x.npy"))


# -- unit tests: data and examples that do not fit --------------------------------------------------------
def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 4))


@pytest.mark.parametrize(
    ("x", "y", "problem"),
    [
        (features(width=5), classes(), "the model does not accept its inputs, float32 of shape"),
        (features(), classes(high=9), "class ids run from 0 to 8, but the model has 4 outputs"),
        (features(), classes(low=-3, high=0), "class ids run from -3 to -1"),
        (np.ones((40, 6), np.int64), classes(), "the model does not accept its inputs, int64"),
    ],
    ids=["wrong width", "class ids out of range", "negative class ids", "token ids to a float model"],
)
def test_data_that_does_not_fit_the_model_is_one_line_naming_it(tmp_path: Path, x, y, problem: str) -> None:
    data = open_data(str(arrays(tmp_path / "d.npz", x, y)))
    with pytest.raises(SlimtorchError) as caught:
        evaluate(_mlp(), data)
    message = str(caught.value)
    assert problem in message and str(tmp_path / "d.npz") in message and "\n" not in message


def test_class_ids_out_of_range_in_the_training_part_are_found_before_training(tmp_path: Path) -> None:
    y = classes()
    y[0] = 7  # wherever the seeded split puts it
    data = open_data(str(arrays(tmp_path / "d.npz", features(), y)))
    with pytest.raises(SlimtorchError, match="class ids run from 0 to 7"):
        evaluate(_mlp(), data)


def test_a_factory_saying_accuracy_over_float_targets_is_refused(tmp_path: Path) -> None:
    (tmp_path / "net_data.py").write_text(NET)
    with pytest.raises(SlimtorchError, match="the accuracy metric needs class ids"):
        open_data(f"{tmp_path / 'net_data.py'}:float_classes")


@pytest.mark.parametrize(
    ("document", "problem"),
    [
        ({"x": [["a", "b"]]}, "example 'x' holds a string ('a')"),
        ({"x": {"nested": 1}}, "example 'x' holds an object"),
        ({"x": [[True, False]]}, "example 'x' holds a boolean (true)"),
        ({"x": [[1.0, None]]}, "example 'x' holds null"),
        ({"x": [[1, 2], [3]]}, "example 'x' is not rectangular"),
        ({"x": [[10**30]]}, "beyond a 64-bit integer"),
        ("hello", "expected an object of inputs"),
    ],
    ids=["strings", "objects", "booleans", "null", "ragged", "huge int", "a string"],
)
def test_a_json_example_holds_numbers_or_lists_of_them(tmp_path: Path, document, problem: str) -> None:
    path = tmp_path / "example.json"
    path.write_text(json.dumps(document))
    with pytest.raises(FormatError) as caught:
        read_example([str(path)], ["x"])
    assert problem in str(caught.value) and str(path) in str(caught.value)


def test_a_json_list_fills_the_inputs_in_order_and_arrays_come_native(tmp_path: Path) -> None:
    path = tmp_path / "example.json"
    path.write_text(json.dumps([[[1.5, 2.0]], [[3, 4]]]))
    found = read_example([str(path)], ["a", "b"])
    assert found["a"].dtype == np.float64 and found["b"].dtype == np.int64
    np.save(tmp_path / "big_endian.npy", np.ones((2, 3), dtype=">f4"))
    assert read_example([str(tmp_path / "big_endian.npy")], ["x"])["x"].dtype == np.dtype("<f4")
    np.save(tmp_path / "words.npy", np.array(["a", "b"]))
    with pytest.raises(FormatError, match="holds <U1, not numbers"):
        read_example([str(tmp_path / "words.npy")], ["x"])


# -- unit tests: numbers on the command line --------------------------------------------------------------
@pytest.mark.parametrize("text", ["0", "-1", "65537", "1e3", "1.5", "nan", "", "9" * 5000])
def test_a_whole_number_out_of_its_bounds_says_them(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=f"must be a whole number from 1 to {MAX_BATCH:,}"):
        integer(1, MAX_BATCH)(text)


def test_numbers_within_bounds_pass_and_equal_bounds_make_equal_types() -> None:
    assert integer(0, 10)("10") == 10 and integer(0)("0") == 0
    assert real(0, 1, below=True)("0.25") == 0.25 and real(0, above=True)("1e-9") == 1e-9
    assert integer(1, MAX_BATCH) == integer(1, MAX_BATCH)  # two commands' --batch agree
    bounds = f"from 0 to {MAX_COUNT:,}"
    with pytest.raises(argparse.ArgumentTypeError, match=f"must be a whole number {bounds}, not '-1'"):
        integer(0, MAX_COUNT)("-1")


@pytest.mark.parametrize("text", ["nan", "inf", "-inf", "-0.1", "1", "x"])
def test_a_real_number_is_finite_and_within_its_bounds(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="must be a finite number, at least 0 and below 1"):
        real(0, 1, below=True)(text)


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("1099511627776,4", "elements; this machine's memory holds at most"),
        ("0,4", "sizes must be positive"),
        ("-1,4", "sizes must be positive"),
        (",".join(["1"] * (MAX_DIMS + 1)), f"at most {MAX_DIMS} dimensions"),
        ("2,x", "not a comma-separated shape"),
    ],
)
def test_an_input_shape_is_positive_and_fits_this_machine(text: str, problem: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=problem):
        shape(text)


@pytest.mark.parametrize("text", ["inf", "nan", "-1GB", "0", "2EB0"])
def test_a_size_is_positive_finite_and_at_most_an_exbibyte(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        size(text)
    assert size("24GB") == 24 * 10**9


def test_a_bad_number_is_one_line_naming_the_option_before_anything_loads(capsys) -> None:
    with pytest.raises(SystemExit) as usage:
        main(["memory", "never.py:Net", "--batch", "1099511627776"])
    err = capsys.readouterr().err
    assert usage.value.code == 2 and err.count("\n") == 1
    assert err == (
        f"slimtorch: error: argument --batch: must be a whole number from 1 to {MAX_BATCH:,}, "
        "not '1099511627776'\n"
    )
    with pytest.raises(SystemExit) as usage:
        main(["memory"])  # a command without what it needs keeps argparse's usage
    assert usage.value.code == 2 and "usage: slimtorch memory" in capsys.readouterr().err


@pytest.fixture(scope="module")
def outcomes(request, tmp_path_factory) -> dict:
    """Every selected case run once, before the first test reads (:func:`tests.hostile.selected_outcomes`)."""
    return selected_outcomes(request, tmp_path_factory, CASES)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_hostile_input_is_refused_in_one_line_or_accepted_cleanly_within_budget(outcomes, case):
    outcome = outcomes[case.id]
    assert outcome.passed, outcome.describe()


def test_the_corpus_covers_the_data_and_number_families() -> None:
    assert {case.family for case in CASES} == {"data", "numbers"}
    assert sum(case.family == "numbers" for case in CASES) > 50
