"""Reading TorchScript archives (torch.jit.save) without running any TorchScript or Python code from them.

Every archive is written at test time by ``torch.jit.save`` from small scripted or traced modules; the hostile
ones are real archives whose pickle is swapped for hand-assembled opcodes.
"""

from __future__ import annotations

import pickletools
from pathlib import Path

import pytest
import torch
from torch import nn

import slimtorch
from slimtorch.cli.main import main
from tests.hostile import os_system_pickle, rewrite_zip_entry, touch_command

# Recent torch deprecates torch.jit; the archives it writes are what users have, and what we read.
pytestmark = pytest.mark.filterwarnings(r"ignore:`torch\.jit\.\w+` is deprecated:DeprecationWarning")


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4, 2)
        self.register_buffer("scale", torch.arange(1.0, 5.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.bn(self.conv(x)) * self.scale.view(1, -1, 1, 1)
        return self.fc(x.mean((2, 3)))


class AddsConstant(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tensor([1.0, 2.0, 3.0])  # traced, this becomes a tensor constant of the archive


class BumpsOnLoad(nn.Module):
    """Its TorchScript ``__setstate__`` adds 1000 to the buffer: running it on load is visible in the data."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("counter", torch.tensor([1.0, 2.0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.counter

    @torch.jit.export
    def __getstate__(self) -> tuple[torch.Tensor, bool]:
        return (self.counter, self.training)

    @torch.jit.export
    def __setstate__(self, state: tuple[torch.Tensor, bool]) -> None:
        self.counter = state[0] + 1000.0
        self.training = state[1]


def trained_convnet() -> ConvNet:
    torch.manual_seed(0)
    module = ConvNet()
    module.train()
    module(torch.randn(2, 3, 8, 8))  # moves the BatchNorm statistics away from their initial values
    return module.eval()


def assert_same_bits(actual: torch.Tensor, expected: torch.Tensor, name: str) -> None:
    assert actual.dtype == expected.dtype, name
    assert actual.shape == expected.shape, name
    as_bytes = [t.detach().contiguous().reshape(-1).view(torch.uint8) for t in (actual, expected)]
    assert torch.equal(*as_bytes), f"{name}: bytes differ"


@pytest.fixture(scope="module")
def convnet() -> ConvNet:
    return trained_convnet()


@pytest.fixture(scope="module")
def scripted_archive(convnet: ConvNet, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("script") / "convnet.pt"
    torch.jit.save(torch.jit.script(convnet), path)
    return path


@pytest.fixture(scope="module")
def traced_archive(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("trace") / "adds_constant.pt"
    with pytest.warns(torch.jit.TracerWarning):  # torch warns that the tensor becomes a constant
        traced = torch.jit.trace(AddsConstant(), torch.zeros(3))
    torch.jit.save(traced, path)
    return path


# -- scripted modules ---------------------------------------------------------------------------------------


def test_scripted_module_lists_the_same_tensor_names_as_its_state_dict(
    scripted_archive: Path, convnet: ConvNet
):
    source = slimtorch.open(scripted_archive)
    assert source.format == "torchscript"
    assert sorted(source.names()) == sorted(convnet.state_dict())
    assert len(source.names()) == len(convnet.state_dict())
    assert sorted(source.names()) == sorted(torch.jit.load(scripted_archive).state_dict())


def test_scripted_module_marks_parameters_and_buffers_as_the_module_declares_them(
    scripted_archive: Path, convnet: ConvNet
):
    source = slimtorch.open(scripted_archive)
    roles = {info.name: info.role for info in source.infos()}
    assert {name for name, role in roles.items() if role == "parameter"} == {
        name for name, _ in convnet.named_parameters()
    }
    assert {name for name, role in roles.items() if role == "buffer"} == {
        name for name, _ in convnet.named_buffers()
    }
    assert roles["bn.running_mean"] == roles["bn.num_batches_tracked"] == roles["scale"] == "buffer"


def test_scripted_module_tensors_read_back_bit_for_bit(scripted_archive: Path, convnet: ConvNet):
    source = slimtorch.open(scripted_archive)
    for name, tensor in convnet.state_dict().items():
        info = source.info(name)
        assert (info.dtype, info.shape) == (tensor.dtype, tuple(tensor.shape)), name
        assert_same_bits(source.get(name), tensor, name)
    assert source.get("bn.num_batches_tracked").item() == 1


def linear_stack() -> nn.Module:
    torch.manual_seed(0)
    # The second Linear (no bias) gets a mangled class: __torch__...linear.___torch_mangle_N.Linear.
    return nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2, bias=False))


@pytest.mark.parametrize("build", [trained_convnet, linear_stack], ids=["convnet", "mangled_classes"])
def test_scripted_module_with_frozen_parameters_still_reports_them_as_parameters(tmp_path: Path, build):
    # requires_grad=False (a frozen backbone, or inference prep) must not turn parameters into buffers:
    # the archive's code declares them in each class's __parameters__ list.
    module = build()
    for parameter in module.parameters():
        parameter.requires_grad_(False)
    path = tmp_path / "frozen.pt"
    torch.jit.save(torch.jit.script(module), path)
    roles = {info.name: info.role for info in slimtorch.open(path).infos()}
    assert {name for name, role in roles.items() if role == "parameter"} == {
        name for name, _ in module.named_parameters()
    }
    assert {name for name, role in roles.items() if role == "buffer"} == {
        name for name, _ in module.named_buffers()
    }


def test_inspect_of_a_scripted_module_puts_parameters_and_buffers_in_their_categories(
    scripted_archive: Path, convnet: ConvNet
):
    report = slimtorch.inspect(scripted_archive)
    assert report.format == "torchscript"
    parameters = sum(p.nbytes for p in convnet.parameters())
    buffers = sum(b.nbytes for b in convnet.buffers())
    assert report.category("parameters") == parameters
    assert report.category("buffers") == buffers
    assert report.stored_bytes == parameters + buffers
    assert sum(b.bytes for b in report.categories) == report.file_bytes == scripted_archive.stat().st_size


# -- traced modules -----------------------------------------------------------------------------------------


def test_traced_module_tensor_constant_is_listed_under_constants(traced_archive: Path):
    source = slimtorch.open(traced_archive)
    assert source.format == "torchscript"
    constants = [name for name in source.names() if name.startswith("__constants__.")]
    assert len(constants) == 1
    assert source.names() == constants  # the module has no parameters or buffers of its own
    assert_same_bits(source.get(constants[0]), torch.tensor([1.0, 2.0, 3.0]), constants[0])


def test_inspect_of_a_traced_module_with_a_constant_succeeds(traced_archive: Path, capsys):
    assert main(["inspect", str(traced_archive), "--json"]) == 0
    assert '"__constants__.' in capsys.readouterr().out


# -- no code from the archive runs ---------------------------------------------------------------------------


def test_torchscript_setstate_is_not_run_the_saved_tensor_is_read_as_written(tmp_path: Path):
    path = tmp_path / "bumps.pt"
    torch.jit.save(torch.jit.script(BumpsOnLoad()), path)
    # torch.jit.load runs the archive's __setstate__, which adds 1000 on the way in ...
    assert torch.equal(torch.jit.load(path).counter, torch.tensor([1001.0, 1002.0]))
    # ... slimtorch reads the state exactly as written: the class is an inert stand-in whose code never runs.
    source = slimtorch.open(path)
    assert len(source) == 1
    (name,) = source.names()
    assert_same_bits(source.get(name), torch.tensor([1.0, 2.0]), name)
    assert slimtorch.inspect(path).tensor_bytes == 8


@pytest.mark.parametrize("entry", ["data.pkl", "constants.pkl"])
def test_torchscript_archive_whose_pickle_calls_os_system_is_refused_and_nothing_runs(
    traced_archive: Path, tmp_path: Path, entry: str
):
    marker = tmp_path / "pwned"
    payload = os_system_pickle(touch_command(marker))
    ops = [(op.name, arg) for op, arg, _ in pickletools.genops(payload)]
    assert ("GLOBAL", "os system") in ops and ("REDUCE", None) in ops
    hostile = rewrite_zip_entry(traced_archive, tmp_path / "hostile.pt", entry, lambda _: payload)

    with pytest.raises(slimtorch.UnsafeCheckpointError) as raised:
        slimtorch.open(hostile)
    assert raised.value.global_name == "os.system"
    assert "os.system" in str(raised.value)
    assert str(raised.value).startswith(str(hostile))
    assert not marker.exists()


def test_hostile_torchscript_archive_through_the_cli_exits_2_naming_the_global(
    scripted_archive: Path, tmp_path: Path, capsys
):
    marker = tmp_path / "pwned"
    payload = os_system_pickle(touch_command(marker))
    hostile = rewrite_zip_entry(scripted_archive, tmp_path / "hostile.pt", "data.pkl", lambda _: payload)
    assert main(["inspect", str(hostile)]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1 and err.startswith(f"slimtorch: error: {hostile}")
    assert "os.system" in err and "Traceback" not in err
    assert not marker.exists()
