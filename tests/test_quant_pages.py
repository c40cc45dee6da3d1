"""A quantized layer loaded from a file holds one copy of its weight: once a kernel packs its own copy of
the codes, the codes' mapped pages are given back (an int4 Llama loaded and generating held both, twice
the file). Run in fresh processes, where the file's pages are this process's own mapping."""

from __future__ import annotations

import json
import os
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
    return _run_child(CHILD.format(width=WIDTH), str(path), kernel)


def _run_child(script: str, *args: str, cpu: str | None = None) -> dict:
    """``script`` in a fresh process (``tests.support`` importable; with ATen's ``cpu`` kernels if given,
    ``"native"``: the best this CPU runs); the JSON of its last line."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    if cpu is not None:
        env.pop("ATEN_CPU_CAPABILITY", None)
        env.update({} if cpu == "native" else {"ATEN_CPU_CAPABILITY": cpu})
    run = subprocess.run(
        [sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=300, env=env
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.slow
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


@pytest.mark.slow
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


LAYOUT_CHILD = """
import json, torch
from slimtorch.quant import kernels
found = {"layout": kernels.int4pack_layout(), "capability": torch.backends.cpu.get_cpu_capability()}
generator = torch.Generator().manual_seed(5)
agree = []
for rows, columns in [(4096, 1024), (11008 // 4, 512), (96, 256), (64 * 7 + 16, 512)]:
    packed = torch.randint(0, 256, (rows, columns // 2), dtype=torch.uint8, generator=generator)
    codes = torch.stack((packed & 15, packed >> 4), dim=2).reshape(rows, columns).to(torch.int32)
    agree.append(torch.equal(kernels.int4pack_weight(packed, columns),
                             torch._convert_weight_to_int4pack_for_cpu(codes, 1)))
found["agree"] = agree
print(json.dumps(found))
"""
EXPECTED_LAYOUTS = {"DEFAULT": "pairs-32", "AVX2": "halves-32"}


@pytest.mark.slow
@pytest.mark.parametrize("capability", ["default", "avx2", "native"])
def test_codes_are_packed_byte_for_byte_as_torchs_conversion_on_each_cpu_build(capability) -> None:
    """The fused int4 kernel's layout differs by CPU build (ATen's default and AVX2 kernels pair different
    rows in a byte): in a fresh process on each build this machine runs, the packing finds the layout its
    kernel uses and writes the same bytes as torch's own conversion (the fast path, not the fallback: the
    builds seen here have a known layout), rows that are no multiple of a block included."""
    found = _run_child(LAYOUT_CHILD, cpu=capability)
    if capability != "native" and found["capability"] != capability.upper():
        pytest.skip(f"this CPU does not run ATen's {capability} kernels")
    assert all(found["agree"]), found
    if found["capability"] in EXPECTED_LAYOUTS:
        assert found["layout"] == EXPECTED_LAYOUTS[found["capability"]], found


def test_a_layout_matching_none_leaves_the_packing_to_torchs_conversion(monkeypatch) -> None:
    """On a CPU build whose layout is none of the known ones, the probe finds nothing and the codes go
    through torch's conversion: the same bytes, never a guessed layout."""
    monkeypatch.setattr(kernels, "INT4PACK_LAYOUTS", {"halves-16": (16, True), "pairs-64": (64, False)})
    kernels.int4pack_layout.cache_clear()
    try:
        assert kernels.int4pack_layout() is None
        generator = torch.Generator().manual_seed(6)
        packed = torch.randint(0, 256, (256, 128), dtype=torch.uint8, generator=generator)
        codes = torch.stack((packed & 15, packed >> 4), dim=2).reshape(256, 256).to(torch.int32)
        expected = torch._convert_weight_to_int4pack_for_cpu(codes, 1)
        assert torch.equal(kernels.int4pack_weight(packed, 256), expected)
    finally:
        kernels.int4pack_layout.cache_clear()


FLOAT_PATH_CHILD = """
import json, sys, torch
from torch import nn
import slimtorch
from slimtorch.quant import modules
from tests.support.pages import resident

modules.PRODUCT_BLOCK = 1024 * 512  # four blocks of this 4096x1024 layer
layer = slimtorch.load_model(sys.argv[1], lambda: nn.Sequential(nn.Linear(1024, 4096))).model[0]
x = torch.randn(2, 1024, generator=torch.Generator().manual_seed(0))
with torch.no_grad():
    packed = layer._fused(x, torch.float32)  # the packed copy made: the codes' pages given back
    before = resident(layer.qweight)
    plain = layer._dequantized_product(x, torch.float32)
    after = resident(layer.qweight)
    layer._copied.clear()  # as if no kernel had copied the codes
    layer._dequantized_product(x, torch.float32)
    kept = resident(layer.qweight)
print(json.dumps({"before": before, "after": after, "kept": kept,
                  "close": bool(torch.allclose(packed, plain, rtol=2e-2, atol=2e-2))}))
"""


@pytest.mark.slow
@pytest.mark.skipif(pages.RELEASE == "none", reason="pages are given back with Linux's madvise only")
def test_the_float_path_gives_back_each_block_it_read_once_a_packed_copy_exists(tmp_path) -> None:
    """With the fused kernel's copy of the codes made (or while the kernels are timed), the float path
    gives back the codes' pages block by block as it goes: a kernel choice timing it beside the packed
    kernel read the Llama head's 62 MiB back in. Without a copy, the float path is the weight's only
    reader, and its pages stay."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 4096)).eval()
    slimtorch.quantize(model, "int4-weight")
    slimtorch.save_model(model, tmp_path / "wide.safetensors")
    found = _run_child(FLOAT_PATH_CHILD, str(tmp_path / "wide.safetensors"))
    assert found["before"] < 0.05 and found["after"] < 0.05, found
    assert found["kept"] > 0.95, found
    assert found["close"], found


def test_lookup_tables_are_the_embeddings_no_other_layer_holds() -> None:
    """An embedding's table is given back after the load, unless a head tied to it reads every row; a
    quantized embedding's parts count as its table."""
    from slimtorch.loading.loader import lookup_tables

    torch.manual_seed(0)
    tied = nn.Sequential(nn.Embedding(64, 16), nn.Linear(16, 64, bias=False))
    tied[1].weight = tied[0].weight
    assert lookup_tables(tied) == []
    untied = nn.Sequential(nn.Embedding(64, 16), nn.Linear(16, 64))
    assert [t.data_ptr() for t in lookup_tables(untied)] == [untied[0].weight.data_ptr()]
    quantized = nn.Sequential(nn.Embedding(256, 64), nn.Linear(64, 8)).eval()
    slimtorch.quantize(quantized, "int4-weight")
    table = quantized[0]
    assert type(table).ROWS_LOOKED_UP
    assert {t.data_ptr() for t in lookup_tables(quantized)} == {
        t.data_ptr() for t in table.buffers(recurse=False)
    }


LOOKUP_CHILD = """
import json, sys, torch
from torch import nn
import slimtorch
from tests.support.pages import resident

def factory():
    return nn.Sequential(nn.Embedding(16384, 256), nn.Linear(256, 16))

path, verify = sys.argv[1], sys.argv[2]
report = slimtorch.load_model(path, factory, verify=verify)
model = report.model
if verify == "before-use":
    report.wait()
table = [t for t in model[0].buffers()] or [model[0].weight]
loaded = sum(resident(t) * t.nbytes for t in table) / sum(t.nbytes for t in table)
ids = torch.tensor([[3, 16000, 77]])
with torch.no_grad():
    rows, out = model[0](ids), model(ids)
kind = type(model[0]).__name__
print(json.dumps({"loaded": loaded, "rows": rows.tolist(), "out": out.tolist(), "kind": kind}))
"""


@pytest.mark.slow
@pytest.mark.skipif(pages.RELEASE == "none", reason="pages are given back with Linux's madvise only")
@pytest.mark.parametrize("scheme", ["float", "int4-weight"])
@pytest.mark.parametrize("verify", ["eager", "before-use"])
def test_an_embeddings_table_leaves_memory_once_loaded_and_checked(tmp_path, scheme, verify) -> None:
    """The checks of a load read every mapped byte in; an embedding's table is then given back, for a
    forward reads only the rows of its tokens (a Llama-3-8B's bfloat16 embedding is 1 GiB). In a fresh
    process: under 5% of the table's pages are in memory once the load (and its checks) are done, and
    the rows looked up afterwards are the saved ones, bit for bit. (The Linear after the table may choose
    a bfloat16 kernel in one process and not the other, by timing: its output agrees to bfloat16's 1%.)"""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(16384, 256), nn.Linear(256, 16)).eval()
    if scheme != "float":
        slimtorch.quantize(model, scheme)
    path = tmp_path / "table.safetensors"
    slimtorch.save_model(model, path)
    ids = torch.tensor([[3, 16000, 77]])
    with torch.no_grad():
        rows, expected = model[0](ids), model(ids)
    found = _run_child(LOOKUP_CHILD, str(path), verify)
    assert found["kind"] == ("Embedding" if scheme == "float" else "Int4Embedding"), found
    assert found["loaded"] < 0.05, found
    assert torch.equal(torch.tensor(found["rows"]), rows), found
    agreement = kernels.BF16_AGREEMENT
    torch.testing.assert_close(torch.tensor(found["out"]), expected, rtol=agreement, atol=agreement)
