"""A quantized layer loaded from a file holds one copy of its weight: once a kernel packs its own copy of
the codes, the codes' mapped pages are given back (an int4 Llama loaded and generating held both, twice
the file). Run in fresh processes, where the file's pages are this process's own mapping."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import slimtorch
from slimtorch.format import pages
from slimtorch.quant import kernels

WIDTH = 1024

CHILD = """
import json, sys, torch
from torch import nn
import slimtorch

def factory():
    return nn.Sequential(*[nn.Linear({width}, {width}) for _ in range(4)])

path, kernel = sys.argv[1], sys.argv[2]
model = slimtorch.load_model(path, factory).model.eval()
layers = [m for m in model.modules() if hasattr(m, "qweight")]
for layer in layers:
    layer.kernel = None if kernel == "chosen" else kernel

def mapped_rss():
    total, inside = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()
            if "-" in head[0] and len(head) >= 5:
                inside = line.rstrip().endswith(path)
            elif inside and head[0] == "Rss:":
                total += int(head[1]) * 1024
    return total

x = torch.randn(1, {width}, generator=torch.Generator().manual_seed(0))
with torch.no_grad():
    first = model(x)
    after = mapped_rss()
    again = model(x)
    dequantized = [layer.dequantized(torch.float32) for layer in layers]
print(json.dumps({{
    "codes": sum(layer.qweight.nbytes for layer in layers),
    "mapped_rss": after,
    "same": bool(torch.equal(first, again)),
    "out": first.tolist(),
    "dequantized": [d.sum().item() for d in dequantized],
    "kernels": sorted({{str(layer.kernel) for layer in layers}}),
}}))
"""


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, nn.Module]:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(4)]).eval()
    slimtorch.quantize(model, "int4-weight")
    path = tmp_path_factory.mktemp("pages") / "int4.safetensors"
    slimtorch.save_model(model, path)
    return path, model


def _child(path: Path, kernel: str) -> dict:
    script = CHILD.format(width=WIDTH)
    run = subprocess.run(
        [sys.executable, "-c", script, str(path), kernel], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(pages.RELEASE == "none", reason="pages are given back with Linux's madvise only")
def test_packed_codes_leave_the_file_pages_and_read_back_the_same(saved) -> None:
    path, model = saved
    packed = _child(path, "int4pack")
    plain = _child(path, "dequantize")
    x = torch.randn(1, WIDTH, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(x)
        dequantized = [m.dequantized(torch.float32).sum().item() for m in model if hasattr(m, "qweight")]
    # the packed kernel's layers keep no more than a page or two of their mapped codes
    assert packed["mapped_rss"] < 0.1 * packed["codes"], packed
    # the float path reads the codes every call: they stay mapped in
    assert plain["mapped_rss"] >= 0.9 * plain["codes"], plain
    for run in (packed, plain):
        assert run["same"]
        assert run["dequantized"] == pytest.approx(dequantized, rel=1e-6)
        assert torch.allclose(torch.tensor(run["out"]), expected, rtol=1e-2, atol=1e-2)


def test_codes_in_memory_are_never_given_back(saved) -> None:
    """A layer quantized in this process holds its codes in memory: releasing them would zero them."""
    _, model = saved
    layer = model[0]
    before = layer.qweight.clone()
    layer.kernel = "int4pack"
    with torch.no_grad():
        model(torch.randn(2, WIDTH))
    assert pages.release_pages([layer.qweight], fresh=True) == 0
    assert torch.equal(layer.qweight, before)


@pytest.mark.skipif(pages.RELEASE == "none", reason="pages are given back with Linux's madvise only")
def test_a_written_page_of_a_private_mapping_is_told_apart_and_kept(tmp_path) -> None:
    """A page written through a private mapping is the process's own copy: :func:`pages.written` says so,
    and a layer keeps such codes (given back, the write would be silently undone)."""
    import mmap

    path = tmp_path / "bytes"
    path.write_bytes(bytes(range(256)) * 64)
    with path.open("rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    tensor = torch.frombuffer(mapped, dtype=torch.uint8)
    assert int(tensor.sum()) == 255 * 128 * 64  # read: every page in, none written
    assert pages.written(tensor) is False
    tensor[5000] = 0
    assert pages.written(tensor) is True
    assert pages.written(torch.ones(10_000, dtype=torch.uint8)) is True  # memory of our own


@pytest.mark.parametrize("scheme", ["int4-weight", "int8-weight"])
def test_the_float_path_of_a_large_layer_dequantizes_a_block_of_channels_at_a_time(
    monkeypatch, scheme
) -> None:
    """A weight-only layer larger than ``PRODUCT_BLOCK`` values multiplies by its weight dequantized a
    block of output channels at a time (a Llama head dequantized whole took 512 MiB a call), with the same
    output, bit for bit, as the whole weight dequantized."""
    from slimtorch.quant import modules

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 3000)).eval()
    slimtorch.quantize(model, scheme)
    layer = model[0]
    layer.kernel = "dequantize"
    x = torch.randn(3, 512)
    whole = torch.nn.functional.linear(x, layer.dequantized(torch.float32)) + layer.bias
    blocks: list[int] = []
    original = modules.decoded_blocks

    def counted(*args, **kwargs):
        for rows, weight in original(*args, **kwargs):
            blocks.append(weight.numel())
            yield rows, weight

    monkeypatch.setattr(modules, "PRODUCT_BLOCK", 512 * 700)
    monkeypatch.setattr(modules, "decoded_blocks", counted)
    with torch.no_grad():
        got = model(x)
    assert torch.equal(got, whole)
    assert len(blocks) == 5 and max(blocks) <= 512 * 700


def test_codes_are_packed_for_the_fused_kernel_a_block_of_rows_at_a_time_as_they_are_whole(monkeypatch):
    """The fused int4 kernel's layout packs each 64 rows on their own: converted a block of rows at a time
    (its int32 input is 4 bytes a code), the packed weight is the whole conversion's, byte for byte."""

    codes = torch.randint(
        0, 256, (64 * 7 + 16, 256), dtype=torch.uint8, generator=torch.Generator().manual_seed(3)
    )
    whole = kernels.int4pack_weight(codes, 512)
    monkeypatch.setattr(kernels, "PACK_BLOCK", 512 * 128)  # 128 rows a block: four blocks and a tail
    assert torch.equal(kernels.int4pack_weight(codes, 512), whole)


@pytest.mark.skipif(pages.RELEASE == "none", reason="pages are given back with Linux's madvise only")
@pytest.mark.skipif(not kernels.onednn_available(), reason="torch has no oneDNN int8 kernels here")
def test_onednns_opaque_packed_weight_counts_as_a_copy_and_gives_the_mapped_codes_back(tmp_path) -> None:
    """oneDNN packs an int8-dynamic layer's weight into an opaque tensor, which has no storage to compare
    with the codes': it is a copy, and the codes' mapped pages are given back (packing it, not running
    it: its product is only right on CPUs with VNNI)."""
    script = """
import sys, torch
from torch import nn
import slimtorch
from slimtorch.format import pages

def factory():
    return nn.Sequential(nn.Linear(1024, 1024))

torch.manual_seed(0)
model = factory().eval()
slimtorch.quantize(model, "int8-dynamic")
slimtorch.save_model(model, sys.argv[1])
layer = slimtorch.load_model(sys.argv[1], factory).model[0]
packed = layer.packed("onednn", layer._onednn_pack)
assert packed.layout != torch.strided and "onednn" in layer._copied
assert not pages.written(layer.qweight)
runner = layer.packed("onednn-u7", layer._onednn_u7_state)  # a call holding its packed weight
assert callable(runner) and "onednn-u7" in layer._copied
print(pages.release_pages([layer.qweight], fresh=True))
"""
    run = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "int8.safetensors")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
