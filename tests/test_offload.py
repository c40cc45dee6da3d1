"""Offload: a model larger than its memory budget runs its forward with the units past the budget left
in the checkpoint, brought in by each forward and given back after it.

Every file is written at test time. Outputs must equal the model loaded whole (bit for bit: offload only
changes where the bytes wait), the offloaded tensors' pages must leave memory after their unit's forward
(read from ``/proc/self/pagemap``, Linux), and what offload cannot do safely is refused in one line.
"""

from __future__ import annotations

import mmap
import struct
import sys

import pytest
import safetensors.torch
import torch
from torch import nn

import slimtorch
from slimtorch.cli.main import main
from slimtorch.errors import OptionError, SlimtorchError
from slimtorch.loading.offload import plan_offload
from slimtorch.loading.options import LoadOptions

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="page release is Linux's madvise")


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Decoder(nn.Module):
    """Six blocks of 2 MiB (float32) and an embedding tied to the output head."""

    def __init__(self, vocab: int = 500, dim: int = 256, blocks: int = 6) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(blocks))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


TOKENS = torch.tensor([[3, 141, 59, 26]])
BUDGET = {"cpu": "3MB"}  # the embedding and one block fit; five blocks and the norm do not


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("offload")
    torch.manual_seed(0)
    model = Decoder().eval()
    state = {k: v for k, v in model.state_dict().items() if k != "head.weight"}
    paths = {
        "safetensors": folder / "model.safetensors",
        "slim": folder / "slim.safetensors",
        "slim-int8": folder / "int8.safetensors",
    }
    safetensors.torch.save_file(state, paths["safetensors"])
    slimtorch.save(model.state_dict(), paths["slim"])
    slimtorch.save(model.state_dict(), paths["slim-int8"], quantize="int8-weight")
    return paths


def _outputs(model: nn.Module, times: int = 2) -> list[torch.Tensor]:
    with torch.inference_mode():
        return [model(TOKENS) for _ in range(times)]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["safetensors", "slim", "slim-int8"])
def test_offloaded_model_gives_the_whole_models_outputs_bit_for_bit(files, kind) -> None:
    whole = slimtorch.load_model(files[kind], Decoder).model.eval()
    report = slimtorch.load_model(files[kind], Decoder, max_memory=BUDGET, offload="disk")
    assert report.offloaded == ["blocks.1", "blocks.2", "blocks.3", "blocks.4", "blocks.5", "norm"]
    assert report.resident_bytes <= 3_000_000 and report.max_memory == {"cpu": 3_000_000}
    expected = _outputs(whole, 1)[0]
    for out in _outputs(report.model.eval()):  # twice: the second forward reads the released pages again
        assert torch.equal(out, expected)


def test_int8_tensors_wait_on_meta_and_exist_only_during_their_units_forward(files) -> None:
    model = slimtorch.load_model(files["slim-int8"], Decoder, max_memory=BUDGET, offload="disk").model
    seen = []
    model.blocks[3].register_forward_pre_hook(lambda m, a: seen.append(m.up.weight.is_meta))
    assert model.blocks[3].up.weight.is_meta and not model.blocks[0].up.weight.is_meta
    _outputs(model, 1)
    assert seen == [False] and model.blocks[3].up.weight.is_meta


@pytest.mark.slow
def test_a_quantized_models_codes_stay_mapped_and_give_the_same_outputs(tmp_path) -> None:
    torch.manual_seed(0)
    model = slimtorch.quantize(Decoder().eval(), "int8-weight").model
    slimtorch.save_model(model, tmp_path / "q.safetensors")
    whole = slimtorch.load_model(tmp_path / "q.safetensors", Decoder).model.eval()
    report = slimtorch.load_model(tmp_path / "q.safetensors", Decoder, max_memory="cpu=1MB", offload="disk")
    assert "blocks.5" in report.offloaded
    codes = report.model.blocks[5].up.qweight
    assert codes.dtype == torch.int8 and not codes.is_meta  # the mapped codes, not decoded floats
    assert torch.equal(_outputs(report.model.eval(), 2)[1], _outputs(whole, 1)[0])
    if sys.platform.startswith("linux"):
        assert _present_pages(codes) == 0


def _page_range(tensor: torch.Tensor) -> tuple[int, int]:
    start, end = tensor.data_ptr(), tensor.data_ptr() + tensor.numel() * tensor.element_size()
    return -(-start // mmap.PAGESIZE), end // mmap.PAGESIZE


def _whole_pages(tensor: torch.Tensor) -> int:
    first, last = _page_range(tensor)
    return last - first


def _present_pages(tensor: torch.Tensor) -> int:
    """Pages wholly inside ``tensor`` that are in this process's memory now (pagemap's bit 63)."""
    first, last = _page_range(tensor)
    with open("/proc/self/pagemap", "rb") as pagemap:
        pagemap.seek(first * 8)
        entries = struct.unpack(f"{last - first}Q", pagemap.read((last - first) * 8))
    return sum(entry >> 63 for entry in entries)


@linux
def test_an_offloaded_units_pages_leave_memory_after_its_forward(files) -> None:
    whole = slimtorch.load_model(files["safetensors"], Decoder).model.eval()
    model = slimtorch.load_model(files["safetensors"], Decoder, max_memory=BUDGET, offload="disk").model
    weight = model.blocks[4].up.weight  # 1 MiB: 256 pages
    during = []
    model.blocks[4].down.register_forward_hook(lambda *a: during.append(_present_pages(weight)))
    _outputs(whole, 1)
    _outputs(model, 1)
    assert during == [_whole_pages(weight)]  # all in while the unit runs
    assert _present_pages(weight) == 0  # given back after it
    assert _present_pages(whole.blocks[4].up.weight) == during[0]  # without offload they stay
    assert _present_pages(model.blocks[0].up.weight) == during[0]  # a resident unit keeps them


def test_tied_weights_stay_resident_and_tied(files) -> None:
    report = slimtorch.load_model(files["slim-int8"], Decoder, max_memory=BUDGET, offload="disk")
    model = report.model
    assert model.head.weight is model.embed.weight and not model.embed.weight.is_meta
    assert "head" not in report.offloaded and "embed" not in report.offloaded
    assert report.resident_bytes >= model.embed.weight.numel() * 4


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ({"cpu": "4GB"}, (("cpu", 4_000_000_000),)),
        ("cpu=512MiB", (("cpu", 512 * 2**20),)),
        ([("cpu", 1024)], (("cpu", 1024),)),
        ((), ()),
    ],
)
def test_max_memory_is_read_from_a_mapping_pairs_or_text(given, expected) -> None:
    assert LoadOptions(max_memory=given).max_memory == expected


@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({"max_memory": {"cuda:0": "8GB"}}, "only 'cpu'"),
        ({"max_memory": {"cpu": "0GB"}}, "positive"),
        ({"max_memory": {"cpu": "4 parsecs"}}, "not a size"),
        ({"max_memory": {"cpu": 1.5}}, "positive size"),
        ({"offload": "disk"}, "needs a budget"),
        ({"offload": "tape", "max_memory": {"cpu": "1GB"}}, "offload takes"),
    ],
)
def test_bad_budgets_are_refused_in_one_line(options, words) -> None:
    with pytest.raises(OptionError, match=words):
        LoadOptions(**options)


def test_a_model_over_the_budget_without_offload_is_refused(files) -> None:
    with pytest.raises(OptionError, match="offload='disk'"):
        slimtorch.load_model(files["safetensors"], Decoder, max_memory=BUDGET)
    fits = slimtorch.load_model(files["safetensors"], Decoder, max_memory={"cpu": "1GB"})
    assert fits.offloaded == [] and fits.resident_bytes > 0


def test_load_without_a_model_refuses_a_budget(files) -> None:
    with pytest.raises(OptionError, match="max_memory"):
        slimtorch.load(files["safetensors"], max_memory=BUDGET)


def test_offload_to_another_device_is_refused(files) -> None:
    with slimtorch.open(files["safetensors"]) as source, torch.device("meta"):
        model = Decoder()
    with pytest.raises(OptionError, match="not built yet"):
        plan_offload(model, [], source, LoadOptions(max_memory=BUDGET), torch.device("cuda"))


def test_a_model_with_memory_already_is_refused(files) -> None:
    with pytest.raises(OptionError, match="meta device"):
        slimtorch.load_model(files["slim-int8"], Decoder(), max_memory=BUDGET, offload="disk")


def test_a_forward_autograd_would_record_is_refused(files) -> None:
    model = slimtorch.load_model(files["safetensors"], Decoder, max_memory=BUDGET, offload="disk").model
    with pytest.raises(SlimtorchError, match="inference_mode"):
        model(TOKENS)
    with torch.no_grad():
        model(TOKENS)


@linux
def test_a_write_into_an_offloaded_tensor_is_refused_not_undone(files) -> None:
    model = slimtorch.load_model(files["safetensors"], Decoder, max_memory=BUDGET, offload="disk").model
    with torch.no_grad():
        model.blocks[2].up.weight.mul_(2)
        with pytest.raises(SlimtorchError, match="written in place"):
            model(TOKENS)


def test_cli_load_with_a_budget_says_what_it_offloaded(files, capsys) -> None:
    spec = f"{__file__}:Decoder"
    code = main(
        ["load", str(files["slim-int8"]), "--model", spec, "--max-memory", "cpu=3MB", "--offload", "disk"]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "6 units left in the file (blocks.1, blocks.2, blocks.3 ...)" in out
