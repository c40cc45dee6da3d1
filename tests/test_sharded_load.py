"""Sharded loads: every rank of an FSDP2 or tensor-parallel model reads only its own rows or columns.

The distributed checks run on CPU with gloo in ``torch.multiprocessing.spawn`` workers that meet through a
file in tmp_path (no ports). Starting a rank costs seconds here, so every check of one world size runs in
one spawn; each rank writes what it saw to a JSON file and the tests assert on those.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import zlib
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import slimtorch
from slimtorch.errors import FormatError, OptionError
from slimtorch.format import layout
from slimtorch.sources import open_checkpoint
from tests.ranks import run_ranks as run_on_ranks

pytestmark = pytest.mark.slow  # ranks are processes, and the files they share are written once for the module

dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("this torch has no torch.distributed", allow_module_level=True)

TOKENS = torch.randn(2, 4, 64, generator=torch.Generator().manual_seed(3))
IMAGES = torch.randn(2, 3, 12, 12, generator=torch.Generator().manual_seed(4))


class Block(nn.Module):
    """A pre-norm MLP block: 64 -> 128 -> 64 (sizes divisible by 2 and 4, as tensor parallel needs)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(64), nn.Linear(64, 128), nn.Linear(128, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Transformer(nn.Module):
    """Blocks between an input projection and a head of 3 rows: on 4 ranks one rank holds none of them."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(64, 64)
        self.layers = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(64, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def cnn() -> nn.Module:
    """Convolutions with BatchNorm (its running statistics are buffers: read whole by every rank)."""
    return nn.Sequential(
        nn.Conv2d(3, 10, 3),
        nn.BatchNorm2d(10),
        nn.ReLU(),
        nn.Conv2d(10, 6, 3),
        nn.Flatten(),
        nn.Linear(384, 5),
    )


TP_PLAN = {"layers.*.up": "colwise", "layers.*.down": "rowwise"}


# -- the files, made once per test in the parent ------------------------------------------------------------
def _state(factory) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = factory()
    for module in model.modules():
        if isinstance(module, nn.BatchNorm2d):  # statistics worth loading
            module.running_mean.uniform_(-1, 1)
            module.running_var.uniform_(0.5, 2)
    return {k: v.contiguous() for k, v in model.state_dict().items()}


def _files(root: Path) -> None:
    """Checkpoints of both models in every form a sharded load reads, and each unsharded load's output."""
    state, cnn_state = _state(Transformer), _state(cnn)
    slimtorch.save(state, root / "raw.safetensors")
    slimtorch.save(state, root / "int8.safetensors", quantize="int8-weight", quantize_all=True)
    slimtorch.save(state, root / "int4.safetensors", quantize="int4-weight", quantize_all=True)
    slimtorch.save(cnn_state, root / "cnn.safetensors")
    save_file(state, root / "plain.safetensors")
    folder = root / "hf"
    folder.mkdir()
    names = sorted(state)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in halves.items():
        save_file({k: state[k] for k in keys}, folder / file)
    index = {"metadata": {}, "weight_map": {k: f for f, keys in halves.items() for k in keys}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    corrupt = root / "corrupt.safetensors"
    shutil.copy(root / "raw.safetensors", corrupt)
    source = open_checkpoint(corrupt)
    location = source.locations[source.info("layers.1.up.weight").storage]
    with open(corrupt, "r+b") as f:  # a byte in row 100 of 128: one rank's rows on 2 or 4 ranks
        f.seek(location.offset + 100 * 64 * 4 + 5)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x10]))
    references = {}
    with torch.no_grad():
        for name in ("raw", "int8", "int4", "plain", "hf"):
            path = root / name if name == "hf" else root / f"{name}.safetensors"
            references[name] = slimtorch.load_model(path, Transformer).model(TOKENS)
        references["cnn"] = slimtorch.load_model(root / "cnn.safetensors", cnn).model.eval()(IMAGES)
    torch.save(references, root / "references.pt")


# -- the tasks -------------------------------------------------------------------------------------------
@functools.cache
def _references(root: Path) -> dict[str, torch.Tensor]:
    """The unsharded outputs :func:`_files` saved, read once per rank."""
    return torch.load(root / "references.pt")


def _seen(report, inputs: torch.Tensor, reference: torch.Tensor) -> dict:
    """What a test asserts on: the per-rank counts, and how the output compares with the unsharded one."""
    head = getattr(report.model, "head", None)  # before the forward: FSDP2 keeps the root unsharded after
    head_rows = (
        head.weight.to_local().shape[0]
        if hasattr(head, "weight") and hasattr(head.weight, "to_local")
        else -1
    )
    with torch.no_grad():
        out = report.model.eval()(inputs)
    out = out.full_tensor() if hasattr(out, "full_tensor") else out
    out = out.wait() if hasattr(out, "wait") else out
    return {
        "equal": bool(torch.equal(out, reference)),
        "close": bool(torch.allclose(out, reference, atol=1e-5)),
        "bytes_read": report.bytes_read,
        "share_bytes": report.share_bytes,
        "rank": report.rank,
        "world_size": report.world_size,
        "verified_with": report.verified_with,
        "notes": report.notes,
        "head_rows": head_rows,
    }


def _fsdp(kind: str):
    def task(root: Path, mesh) -> dict:
        path = root / kind if kind == "hf" else root / f"{kind}.safetensors"
        report = slimtorch.load_model(path, Transformer, mesh=mesh)
        return _seen(report, TOKENS, _references(root)[kind])

    return task


def _tp(root: Path, mesh) -> dict:
    report = slimtorch.load_model(root / "int8.safetensors", Transformer, mesh=mesh, placements=TP_PLAN)
    return _seen(report, TOKENS, _references(root)["int8"])


def _tp_int4(root: Path, mesh) -> dict:
    report = slimtorch.load_model(root / "int4.safetensors", Transformer, mesh=mesh, placements=TP_PLAN)
    return _seen(report, TOKENS, _references(root)["int4"])


def _cnn(root: Path, mesh) -> dict:
    report = slimtorch.load_model(root / "cnn.safetensors", cnn, mesh=mesh)
    return _seen(report, IMAGES, _references(root)["cnn"])


def _sharded_by_caller(root: Path, mesh) -> dict:
    """A model the caller sharded (on meta, fully_shard): given as is, its DTensors are filled."""
    from torch.distributed.fsdp import fully_shard

    with torch.device("meta"):
        model = Transformer()
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    report = slimtorch.load_model(root / "raw.safetensors", model)
    return _seen(report, TOKENS, _references(root)["raw"])


def _corrupt(root: Path, mesh) -> dict:
    try:
        slimtorch.load_model(root / "corrupt.safetensors", Transformer, mesh=mesh)
    except FormatError as exc:
        return {"error": str(exc)}
    return {"error": None}


TASKS = {
    "fsdp_raw": _fsdp("raw"),
    "fsdp_int8": _fsdp("int8"),
    "fsdp_int4": _fsdp("int4"),
    "fsdp_plain": _fsdp("plain"),
    "fsdp_hf": _fsdp("hf"),
    "tp_int8": _tp,
    "tp_int4": _tp_int4,
    "cnn": _cnn,
    "by_caller": _sharded_by_caller,
    "corrupt": _corrupt,
}


def _run(tmp_path: Path, world: int, tasks: tuple[str, ...]) -> list[dict]:
    _files(tmp_path)
    return run_on_ranks(__name__, world, tmp_path, tasks)


# -- two ranks -----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> list[dict]:
    tasks = ("fsdp_raw", "fsdp_int8", "fsdp_int4", "fsdp_hf", "tp_int8", "tp_int4", "cnn", "corrupt")
    return _run(tmp_path_factory.mktemp("two"), 2, tasks)


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory) -> list[dict]:
    return _run(
        tmp_path_factory.mktemp("four"), 4, ("fsdp_raw", "fsdp_int8", "fsdp_plain", "by_caller", "tp_int8")
    )


@pytest.mark.parametrize("kind", ["fsdp_raw", "fsdp_int8", "fsdp_int4", "fsdp_hf", "cnn"])
def test_fsdp2_on_two_ranks_gives_the_unsharded_output_bit_for_bit(two_ranks, kind):
    assert [seen[kind]["equal"] for seen in two_ranks] == [True, True]
    assert [seen[kind]["rank"] for seen in two_ranks] == [0, 1]


def test_fsdp2_ranks_read_no_more_than_their_share_and_check_checksums_together(two_ranks, four_ranks):
    for ranks in (two_ranks, four_ranks):
        for seen in ranks:
            # the slim file stores the LayerNorms' equal ones and zeros once (copies, sparse): less to read
            assert 0 < seen["fsdp_raw"]["bytes_read"] <= seen["fsdp_raw"]["share_bytes"]
            assert seen["fsdp_raw"]["verified_with"] == "ranks"
    assert all(seen["fsdp_plain"]["bytes_read"] == seen["fsdp_plain"]["share_bytes"] for seen in four_ranks)
    assert all(seen["fsdp_hf"]["bytes_read"] == seen["fsdp_hf"]["share_bytes"] for seen in two_ranks)
    shares = [seen["fsdp_raw"]["share_bytes"] for seen in four_ranks]
    assert sum(shares) < 1.1 * 4 * min(shares)  # a quarter each, give or take the unsharded norms


def test_tensor_parallel_colwise_rowwise_matches_the_unsharded_model(two_ranks, four_ranks):
    for seen in [*two_ranks, *four_ranks]:
        assert seen["tp_int8"]["close"], seen["tp_int8"]
    assert all(seen["tp_int4"]["close"] for seen in two_ranks)


def test_a_corrupt_byte_that_one_rank_reads_raises_on_every_rank_naming_the_tensor(two_ranks):
    errors = [seen["corrupt"]["error"] for seen in two_ranks]
    assert all(error and "'layers.1.up.weight'" in error and "checksum mismatch" in error for error in errors)


def test_four_ranks_fill_uneven_rows_a_rank_without_rows_and_a_model_sharded_by_the_caller(four_ranks):
    assert [seen["fsdp_raw"]["head_rows"] for seen in four_ranks] == [1, 1, 1, 0]
    for kind in ("fsdp_raw", "fsdp_int8", "fsdp_plain", "by_caller"):
        assert all(seen[kind]["equal"] for seen in four_ranks), kind
    assert all(seen["fsdp_plain"]["verified_with"] == "none" for seen in four_ranks)


# -- one process -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("length", [0, 1, 3, 1000, 3 << 20])
def test_crc32_combine_matches_zlib_over_the_joined_bytes(length):
    first, second = os.urandom(777), os.urandom(length)
    whole = zlib.crc32(first + second)
    assert layout.crc32_combine(zlib.crc32(first), zlib.crc32(second), length) == whole
    by_math = layout._times_mod_p(layout._x_to_8n(length), zlib.crc32(first)) ^ zlib.crc32(second)
    assert by_math == whole  # the fallback written from the math, whether or not isal is installed


@pytest.mark.parametrize("kind", ["raw", "int8", "int4", "plain"])
def test_read_into_reads_rows_and_columns_equal_to_the_whole_tensor_sliced(tmp_path, kind):
    state = {"w": torch.randn(40, 128), "conv": torch.randn(6, 4, 3, 3), "b": torch.randn(7)}
    path = tmp_path / "m.safetensors"
    quantize = {"int8": "int8-weight", "int4": "int4-weight"}.get(kind)
    if kind == "plain":
        save_file(state, path)
    else:
        slimtorch.save(state, path, quantize=quantize, quantize_all=quantize is not None)
    source = open_checkpoint(path)
    whole = source.get("w")
    for rows, cols in [((3, 29), None), ((0, 40), (32, 96)), ((1, 40), (5, 70)), ((40, 40), None)]:
        out = torch.empty((rows[1] - rows[0], (cols[1] - cols[0]) if cols else 128))
        done = source.read_into("w", out, rows=rows, cols=cols)
        assert torch.equal(out, whole[slice(*rows), slice(*cols) if cols else slice(None)])
        assert done.note is None and (done.pieces or kind == "plain" or not out.numel())
    conv = torch.empty(6, 2, 3, 3, dtype=torch.float64)  # columns of a 4-d tensor, converted on the way
    source.read_into("conv", conv, cols=(1, 3))
    assert torch.equal(conv, source.get("conv")[:, 1:3].double())


def test_int4_columns_off_group_boundaries_read_the_covering_groups_only(tmp_path):
    path = tmp_path / "m.safetensors"
    slimtorch.save({"w": torch.randn(64, 256)}, path, quantize="int4-weight", quantize_all=True)
    source = open_checkpoint(path)
    assert source.codec("w") == "int4"
    out = torch.empty(64, 30)
    done = source.read_into("w", out, cols=(40, 70))  # groups 1 and 2 of 8 (32 columns each)
    assert torch.equal(out, source.get("w")[:, 40:70])
    side = source.physical["w::scale"].itemsize + source.physical["w::zero"].itemsize
    assert done.bytes_read == 64 * (2 * 32 // 2 + 2 * side)  # two groups' codes, scales and zeros a row


def test_int8_with_scales_per_group_reads_the_covering_groups_codes_and_scales(tmp_path):
    from slimtorch.format.codecs import encode
    from slimtorch.format.writer import SlimWriter

    weight = torch.randn(40, 100) * torch.linspace(0.01, 3, 100)  # groups of 24: the last of a row holds 4
    path = tmp_path / "m.safetensors"
    with SlimWriter(path) as writer:
        writer.add("w", encode(weight, [("int8", {"group_size": 24})]), torch.float32, (40, 100))
        writer.add(
            "conv",
            encode(torch.randn(6, 4, 3, 3), [("int8", {"group_size": 5})]),
            torch.float32,
            (6, 4, 3, 3),
        )
    source = open_checkpoint(path)
    whole = source.get("w")
    assert source.codec("w") == "int8" and tuple(source.physical["w::scale"].shape) == (40, 5)
    for rows, cols in [
        ((3, 29), None),
        ((0, 40), (30, 50)),
        ((1, 40), (5, 70)),
        ((2, 9), (90, 100)),
        ((40, 40), None),
    ]:
        out = torch.empty((rows[1] - rows[0], (cols[1] - cols[0]) if cols else 100))
        done = source.read_into("w", out, rows=rows, cols=cols)
        assert torch.equal(out, whole[slice(*rows), slice(*cols) if cols else slice(None)]), (rows, cols)
        assert done.note is None and (done.pieces or not out.numel())
    done = source.read_into("w", torch.empty(40, 20), cols=(30, 50))  # group 1 (24:48) and group 2 (48:72)
    assert done.bytes_read == 40 * (48 + 2 * 4)  # their codes and their two scales a row, no more
    done = source.read_into("w", torch.empty(40, 3), cols=(97, 100))  # in the short last group (96:100)
    assert done.bytes_read == 40 * (4 + 4)
    assert torch.equal(source.get_rows("w", 5, 17), whole[5:17])
    conv = torch.empty(6, 2, 3, 3)  # groups run over the flattened columns: decoded whole, then cut
    source.read_into("conv", conv, cols=(1, 3))
    assert torch.equal(conv, source.get("conv")[:, 1:3])


def test_sharded_load_options_are_refused_with_one_line_when_unsupported():
    class Mesh2D:
        ndim = 2

    with pytest.raises(OptionError, match="1-D DeviceMesh"):
        slimtorch.LoadOptions(mesh=Mesh2D())
    with pytest.raises(OptionError, match="needs mesh="):
        slimtorch.LoadOptions(placements={"fc": "colwise"})
    with pytest.raises(OptionError, match="not a \\(pattern"):
        slimtorch.LoadOptions(mesh=type("Mesh", (), {"ndim": 1})(), placements={"fc": "diagonal"})
    with pytest.raises(OptionError, match="'mesh'"):
        slimtorch.load("x.safetensors", mesh=type("Mesh", (), {"ndim": 1})())
