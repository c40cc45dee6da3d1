"""Task data by name (`slimtorch.recovery.open_data`) and the built-in metrics (`evaluate`)."""

from __future__ import annotations

import copy
import importlib.util
import io
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from slimtorch.errors import FormatError, SlimtorchError
from slimtorch.recovery import TaskData, evaluate, open_data

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def digits_example():
    spec = importlib.util.spec_from_file_location("digits", EXAMPLES / "digits.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["digits"] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def stacked(batches) -> tuple[torch.Tensor, torch.Tensor]:
    xs, ys = zip(*batches, strict=True)
    return torch.cat(xs), torch.cat(ys)


def one_hot_arrays(count: int, classes: int = 4) -> tuple[np.ndarray, np.ndarray]:
    """Inputs that are the one-hot of their class: an identity Linear scores 100%."""
    y = np.arange(count) % classes
    return np.eye(classes, dtype=np.float32)[y], y


def test_digits_is_split_exactly_as_examples_digits_splits_it() -> None:
    pytest.importorskip("sklearn")
    data = open_data("digits")
    example = digits_example().load_data()
    train_x, train_y = stacked(data.train)
    eval_x, eval_y = stacked(data.eval)
    assert (len(train_x), len(eval_x), data.metric, data.spec) == (1347, 450, "accuracy", "digits")
    assert torch.equal(train_x, stacked(example.train)[0]) and torch.equal(train_y, stacked(example.train)[1])
    assert torch.equal(eval_x, example.test_x) and torch.equal(eval_y, example.test_y)
    assert len(data.train) == len(example.train) == 22 and tuple(data.example.shape) == (64, 1, 8, 8)
    assert len(list(data.train)) == len(list(data.train)) == 22  # re-iterable: every pass, every batch
    reseeded = open_data("digits", seed=1, batch=100)
    assert torch.equal(stacked(reseeded.eval)[0], eval_x)  # the held-out set never moves
    assert not torch.equal(stacked(reseeded.train)[0], train_x) and len(reseeded.train) == 14


def test_an_npz_folder_keeps_its_split_and_class_ids_mean_accuracy(tmp_path: Path) -> None:
    x, y = one_hot_arrays(40)
    np.savez(tmp_path / "train.npz", x=x[:30], y=y[:30])
    np.savez_compressed(tmp_path / "eval.npz", x=x[30:], y=y[30:])
    data = open_data(str(tmp_path), batch=8)
    assert data.metric == "accuracy" and len(data.train) == 4
    eval_x, eval_y = stacked(data.eval)
    assert torch.equal(eval_x, torch.from_numpy(x[30:])) and eval_y.dtype == torch.int64
    assert sorted(stacked(data.train)[1].tolist()) == sorted(y[:30].tolist())  # shuffled, all there


def test_one_npz_file_is_split_80_20_by_the_seed_and_float_targets_mean_cosine(tmp_path: Path) -> None:
    path = tmp_path / "pairs.npz"
    np.savez(path, x=np.arange(100, dtype=np.float64).reshape(50, 2), y=np.zeros((50, 3)))
    data = open_data(str(path), batch=16)
    assert data.metric == "cosine" and data.example.dtype == torch.float32
    assert (len(stacked(data.train)[0]), len(stacked(data.eval)[0])) == (40, 10)
    again, other = open_data(str(path), batch=16), open_data(str(path), batch=16, seed=3)
    assert torch.equal(stacked(again.eval)[0], stacked(data.eval)[0])
    assert not torch.equal(stacked(other.eval)[0], stacked(data.eval)[0])
    everything = torch.cat([stacked(data.train)[0], stacked(data.eval)[0]])[:, 0].sort().values
    assert torch.equal(everything, torch.arange(0, 100, 2, dtype=torch.float32))


def test_a_folder_of_x_and_y_npy_is_read_too(tmp_path: Path) -> None:
    x, y = one_hot_arrays(10)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", y)
    data = open_data(str(tmp_path))
    assert (len(stacked(data.train)[0]), len(stacked(data.eval)[0]), data.metric) == (8, 2, "accuracy")


FACTORY = """
import torch
from torch.utils.data import DataLoader, TensorDataset

metric = "cosine"
x, y = torch.randn(20, 4), torch.arange(20) % 2

def pair(batch=5):
    return DataLoader(TensorDataset(x[:15], y[:15]), batch_size=batch), [(x[15:], y[15:])]

def as_dict():
    return {"train": [(x, y)], "eval": [(x[:4], y[:4])], "metric": "accuracy"}

def one_loader():
    return DataLoader(TensorDataset(x, y), batch_size=10)

def number():
    return 3

def generator():
    return ((x, y) for _ in range(2))

def not_batches():
    return [x, y, x]

def empty():
    return [], []
"""


@pytest.fixture
def factory_file(tmp_path: Path) -> Path:
    path = tmp_path / "task_data_factory.py"
    path.write_text(FACTORY)
    return path


def test_a_factory_gives_train_and_eval_its_batch_and_its_metric(factory_file: Path) -> None:
    data = open_data(f"{factory_file}:pair", batch=3)
    assert data.metric == "cosine"  # the module's attribute overrides the class ids' default
    assert len(data.train) == 5 and tuple(data.example.shape) == (5, 4) and data.notes == ()
    keyed = open_data(f"{factory_file}:as_dict")
    assert keyed.metric == "accuracy" and tuple(keyed.example.shape) == (4, 4)


def test_a_factorys_one_loader_is_used_for_eval_too_and_says_so(factory_file: Path) -> None:
    data = open_data(f"{factory_file}:one_loader")
    assert data.train is data.eval and len(data.notes) == 1 and "training data" in data.notes[0]


@pytest.mark.parametrize(
    ("name", "problem"),
    [
        ("number", "the factory's train is a int, not batches"),
        ("generator", "is an iterator, read only once"),
        ("not_batches", "a train batch must be (inputs, targets)"),
        ("empty", "yields no batch"),
        ("missing", "has no attribute 'missing'"),
    ],
)
def test_a_bad_factory_is_one_error_naming_the_spec(factory_file: Path, name: str, problem: str) -> None:
    spec = f"{factory_file}:{name}"
    with pytest.raises(SlimtorchError, match=r"^data ") as caught:
        open_data(spec)
    assert spec in str(caught.value) and problem in str(caught.value)


def bad_folder(tmp_path: Path, kind: str) -> Path:
    x, y = one_hot_arrays(10)
    if kind == "empty folder":
        return tmp_path
    if kind == "no y":
        np.savez(tmp_path / "d.npz", x=x)
    elif kind == "lengths differ":
        np.savez(tmp_path / "d.npz", x=x, y=y[:7])
    elif kind == "strings":
        np.savez(tmp_path / "d.npz", x=np.array(["a"] * 10), y=y)
    elif kind == "objects":
        np.savez(tmp_path / "d.npz", x=np.array([{"a": 1}] * 10, dtype=object), y=y)
    elif kind == "not a zip":
        (tmp_path / "d.npz").write_bytes(b"PK\x03\x04 truncated")
    elif kind == "lying header":
        (tmp_path / "d.npz").write_bytes(lying_npz())
    elif kind == "a csv":
        (tmp_path / "d.csv").write_text("1,2\n")
        return tmp_path / "d.csv"
    return tmp_path / "d.npz"


def lying_npz() -> bytes:
    """A stored .npz whose x.npy header claims 8 TB of float64 over 16 bytes of data."""
    member = io.BytesIO()
    np.lib.format.write_array_header_1_0(member, {"descr": "<f8", "fortran_order": False, "shape": (10**12,)})
    member.write(b"\0" * 16)
    packed = io.BytesIO()
    with zipfile.ZipFile(packed, "w", zipfile.ZIP_STORED) as archive:
        archive.writestr("x.npy", member.getvalue())
        archive.writestr("y.npy", member.getvalue())
    return packed.getvalue()


@pytest.mark.parametrize(
    ("kind", "problem", "error"),
    [
        ("empty folder", "neither train.npz + eval.npz nor x.npy + y.npy", SlimtorchError),
        ("no y", "has no array y (it needs x and y)", SlimtorchError),
        ("lengths differ", "lengths differ", SlimtorchError),
        ("strings", "not numbers", SlimtorchError),
        ("objects", "Python objects (a pickle), which are never loaded", FormatError),
        ("not a zip", "not a readable .npz file", FormatError),
        ("lying header", "claims 8,000,000,000,000 bytes, more than the file can hold", FormatError),
        ("a csv", "expected a folder or an .npz file", SlimtorchError),
    ],
)
def test_bad_arrays_are_one_error_naming_the_file(tmp_path: Path, kind: str, problem: str, error) -> None:
    path = bad_folder(tmp_path, kind)
    with pytest.raises(error) as caught:
        open_data(str(path))
    message = str(caught.value)
    assert problem in message and "\n" not in message and str(path) in message


def test_an_unknown_spec_and_digits_without_scikit_learn_say_what_to_do(monkeypatch, tmp_path: Path) -> None:
    with pytest.raises(SlimtorchError, match=r"no such file or folder, and not pkg\.module:factory"):
        open_data(str(tmp_path / "nowhere"))
    with pytest.raises(SlimtorchError, match=r"data 'nope\.py:f': no such file nope\.py"):
        open_data("nope.py:f")
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)
    with pytest.raises(SlimtorchError, match=r"data 'digits' needs scikit-learn: pip install scikit-learn"):
        open_data("digits")


def test_accuracy_is_the_percent_of_argmax_hits_and_training_mode_comes_back(tmp_path: Path) -> None:
    x, y = one_hot_arrays(40)
    np.savez(tmp_path / "d.npz", x=x, y=y)
    data = open_data(str(tmp_path / "d.npz"), batch=3)
    model = nn.Linear(4, 4, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.eye(4))
    model.train()
    assert evaluate(model, data) == 100.0 and model.training
    with torch.no_grad():
        model.weight.copy_(torch.eye(4)[[1, 0, 2, 3]])  # classes 0 and 1 swapped: half the samples wrong
    held = stacked(data.eval)[1]
    assert evaluate(model, data) == pytest.approx(100.0 * float((held >= 2).float().mean()))


def test_cosine_is_1_for_a_copy_of_the_reference_and_less_for_a_perturbed_one(tmp_path: Path) -> None:
    np.savez(tmp_path / "d.npz", x=np.random.default_rng(0).normal(size=(30, 6)), y=np.zeros((30, 2)))
    data = open_data(str(tmp_path / "d.npz"))
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 5))
    twin = copy.deepcopy(reference)
    assert evaluate(twin, data, reference=reference) == pytest.approx(1.0, abs=1e-6)
    with torch.no_grad():
        twin[2].weight.add_(torch.randn_like(twin[2].weight) * 0.1)
    assert 0.5 < evaluate(twin, data, reference=reference) < 0.999
    with pytest.raises(SlimtorchError, match="the cosine metric needs a reference model"):
        evaluate(twin, data)


def test_evaluate_scores_a_hugging_face_style_output_by_its_first_tensor() -> None:
    class Wrapped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.Linear(3, 2)

        def forward(self, x: torch.Tensor) -> dict:
            return {"last_hidden_state": self.inner(x), "extra": None}

    x = torch.randn(6, 3)
    data = TaskData("inline", [(x, torch.zeros(6))], [(x, torch.zeros(6))], "cosine", x)
    model = Wrapped()
    assert evaluate(model, data, reference=model) == pytest.approx(1.0, abs=1e-6)
