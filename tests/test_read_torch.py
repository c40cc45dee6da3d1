"""Reading torch.save files: zip and legacy, flat and nested, lazily and exactly."""

from __future__ import annotations

import pytest
import torch
from torch.nn.utils import prune

import slimtorch
from tests.zoo import SmallCNN, TinyGPT, trained_checkpoint


def _assert_same_tensors(source: slimtorch.TensorSource, expected: dict[str, torch.Tensor]) -> None:
    assert source.names() == list(expected)
    for name, tensor in expected.items():
        info = source.info(name)
        assert (info.dtype, info.shape) == (tensor.dtype, tuple(tensor.shape))
        assert torch.equal(source.get(name), tensor), name


@pytest.mark.parametrize("zip_format", [True, False], ids=["zip", "legacy"])
def test_state_dict_is_listed_in_order_and_read_back_bit_for_bit(tmp_path, zip_format):
    state = SmallCNN().state_dict()
    path = tmp_path / "cnn.pt"
    torch.save(state, path, _use_new_zipfile_serialization=zip_format)

    with slimtorch.open(path) as source:
        assert source.format == ("torch-zip" if zip_format else "torch-legacy")
        _assert_same_tensors(source, state)


@pytest.mark.parametrize("suffix", [".pt", ".pth", ".bin", ".ckpt", ".weights"])
def test_format_is_told_by_content_not_by_extension(tmp_path, suffix):
    path = tmp_path / f"model{suffix}"
    torch.save({"w": torch.ones(3)}, path)
    assert slimtorch.open(path).format == "torch-zip"


@pytest.mark.parametrize("zip_format", [True, False], ids=["zip", "legacy"])
def test_nested_training_checkpoint_names_tensors_by_their_path(tmp_path, zip_format):
    model = SmallCNN()
    checkpoint = trained_checkpoint(model, torch.randn(2, 1, 8, 8))
    path = tmp_path / "train.pt"
    torch.save(checkpoint, path, _use_new_zipfile_serialization=zip_format)

    source = slimtorch.open(path)

    assert "model.features.0.weight" in source
    assert "optimizer.state.0.exp_avg" in source and "optimizer.state.0.exp_avg_sq" in source
    assert torch.equal(
        source.get("optimizer.state.0.exp_avg"), checkpoint["optimizer"]["state"][0]["exp_avg"]
    )
    objects = {o.name: o.summary for o in source.objects}
    assert objects["epoch"] == "3"
    assert objects["optimizer.param_groups.0.lr"].startswith("0.001")


def test_lightning_style_checkpoint_with_state_dict_and_optimizer_states(tmp_path):
    model = SmallCNN()
    plain = trained_checkpoint(model, torch.randn(2, 1, 8, 8))
    lightning = {
        "epoch": 1,
        "global_step": 10,
        "pytorch-lightning_version": "2.5.0",
        "state_dict": {f"model.{k}": v for k, v in plain["model"].items()},
        "optimizer_states": [plain["optimizer"]],
        "lr_schedulers": [plain["lr_scheduler"]],
        "hyper_parameters": {"lr": 1e-3, "channels": 16},
    }
    path = tmp_path / "last.ckpt"
    torch.save(lightning, path)

    report = slimtorch.inspect(path)

    categories = {t.name: t.category for t in report.tensors}
    assert categories["state_dict.model.features.0.weight"] == "parameters"
    assert categories["optimizer_states.0.state.0.exp_avg"] == "optimizer_state"
    assert categories["state_dict.model.features.1.running_mean"] == "buffers"


def test_tied_weights_share_one_storage_and_views_read_correctly(tmp_path):
    model = TinyGPT()
    base = torch.arange(100, dtype=torch.float32)
    path = tmp_path / "tied.pt"
    torch.save({"model": model.state_dict(), "window": base[10:20], "strided": base.view(10, 10)[:, 3]}, path)

    source = slimtorch.open(path)

    assert source.info("model.embed.weight").storage == source.info("model.head.weight").storage
    assert torch.equal(source.get("window"), base[10:20])
    assert torch.equal(source.get("strided"), base.view(10, 10)[:, 3])


@pytest.mark.parametrize(
    "dtype",
    [
        torch.float16,
        torch.bfloat16,
        torch.float64,
        torch.int8,
        torch.uint8,
        torch.int64,
        torch.bool,
        torch.complex64,
        torch.float8_e4m3fn,
        torch.uint16,
    ],
)
@pytest.mark.parametrize("zip_format", [True, False], ids=["zip", "legacy"])
def test_every_dtype_round_trips(tmp_path, dtype, zip_format):
    values = (torch.randn(7, 5) * 4).to(dtype) if dtype != torch.bool else torch.rand(7, 5) > 0.5
    path = tmp_path / "dtype.pt"
    torch.save({"x": values}, path, _use_new_zipfile_serialization=zip_format)

    got = slimtorch.open(path).get("x")

    assert got.dtype == dtype
    assert torch.equal(got.view(torch.uint8), values.view(torch.uint8))


def test_pickled_parameters_are_marked_as_parameters(tmp_path):
    path = tmp_path / "params.pt"
    torch.save({"p": torch.nn.Parameter(torch.ones(3)), "t": torch.ones(3)}, path)
    source = slimtorch.open(path)
    assert (source.info("p").role, source.info("t").role) == ("parameter", None)


def test_open_reads_no_tensor_data(tmp_path, monkeypatch):
    path = tmp_path / "big.pt"
    torch.save({"w": torch.randn(256, 256)}, path)

    def refuse(*args, **kwargs):
        raise AssertionError("tensor data was mapped while only listing")

    monkeypatch.setattr(torch.UntypedStorage, "from_file", refuse)
    source = slimtorch.open(path)
    assert source.info("w").shape == (256, 256)
    assert slimtorch.inspect(path, scan=False).tensor_bytes == 256 * 256 * 4
    with pytest.raises(AssertionError, match="mapped"):
        source.get("w")


def test_tensors_returned_never_write_back_to_the_file(tmp_path):
    path = tmp_path / "w.pt"
    torch.save({"w": torch.zeros(1000)}, path)
    before = path.read_bytes()

    slimtorch.open(path).get("w").fill_(7.0)

    assert path.read_bytes() == before


def test_pruned_model_keeps_orig_and_mask_tensors(tmp_path):
    model = SmallCNN()
    prune.l1_unstructured(model.head, "weight", amount=0.5)
    path = tmp_path / "pruned.pt"
    torch.save(model.state_dict(), path)

    source = slimtorch.open(path)

    assert {"head.weight_orig", "head.weight_mask"} <= set(source.names())
    assert "head.weight" not in source
