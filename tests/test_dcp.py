"""torch.distributed.checkpoint: DCP folders read without running their pickle; ``dcp.load`` from slim files.

The distributed checks run on CPU with gloo in ``torch.multiprocessing.spawn`` workers that meet through a
file in tmp_path (no ports). Starting a rank costs seconds on a small machine, so every check of one world
size runs in one spawn; each rank writes what it saw to a JSON file and the test asserts on those.
"""

from __future__ import annotations

import pickle
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import slimtorch
from slimtorch.cli.main import main
from slimtorch.errors import FormatError, UnsafeCheckpointError
from slimtorch.sources.dcp import dcp_globals
from slimtorch.sources.pickle_protocol import downgrade_pickle
from slimtorch.sources.pickled import unpickle
from tests.ranks import run_ranks as run_on_ranks

dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("this torch has no torch.distributed", allow_module_level=True)
import torch.distributed.checkpoint as dcp  # noqa: E402

BATCH = torch.randn(3, 128, generator=torch.Generator().manual_seed(7))


def saved_model() -> nn.Module:
    """What the ranks save with dcp.save: uneven rows (7 on 2 ranks), BatchNorm buffers saved once."""
    return nn.Sequential(nn.Linear(16, 7), nn.BatchNorm1d(7), nn.Linear(7, 5))


def mlp() -> nn.Module:
    """What dcp.load fills: its last layer has 6 rows, so on 4 ranks one rank holds none of them."""
    return nn.Sequential(nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 6))


def tp_mlp() -> nn.Module:
    """The first two layers of :func:`mlp`, split column-wise then row-wise (sizes divisible by 2)."""
    return nn.Sequential(nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 64))


# -- the tasks -------------------------------------------------------------------------------------------
def _save_fsdp(root: Path, mesh) -> dict:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = saved_model()
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    state = {**model.state_dict(), "extra": {"step": 3, "name": "run-1"}}
    dcp.save(state, checkpoint_id=root / "dcp")
    return {}


def _fill_fsdp(checkpoint: Path, mesh) -> dict:
    from torch.distributed.fsdp import fully_shard

    from slimtorch.loading.dcp_reader import SlimStorageReader

    with torch.device("meta"):
        model = mlp()
    for layer in (model[0], model[2], model[4]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    reader = SlimStorageReader(checkpoint)
    dcp.load(model.state_dict(), storage_reader=reader)
    expected = slimtorch.load_model(checkpoint, mlp).model(BATCH)  # one process, no sharding
    with torch.no_grad():
        out = model(BATCH)
    rows = {name: p.to_local().shape[0] for name, p in model.named_parameters()}
    return {"equal": torch.equal(out, expected), "rows": rows, **reader.stats.to_dict()}


def _fill_tp(checkpoint: Path, mesh) -> dict:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from slimtorch.loading.dcp_reader import SlimStorageReader

    with torch.device("meta"):
        model = tp_mlp()
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    model.to_empty(device="cpu")
    reader = SlimStorageReader(checkpoint)
    dcp.load(model.state_dict(), storage_reader=reader)
    full = slimtorch.load_model(checkpoint, mlp).model
    expected = full[2](full[1](full[0](BATCH)))
    with torch.no_grad():
        out = model(BATCH)
    out = out.wait() if hasattr(out, "wait") else out
    return {"max_diff": (out - expected).abs().max().item(), **reader.stats.to_dict()}


def _reread_fsdp(root: Path, mesh) -> dict:
    """The folder ``_save_fsdp`` wrote, loaded back by dcp.load through slimtorch's safe reader."""
    from torch.distributed.fsdp import fully_shard

    from slimtorch.loading.dcp_reader import SlimStorageReader

    with torch.device("meta"):
        model = saved_model()
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    dcp.load(model.state_dict(), storage_reader=SlimStorageReader(root / "dcp"))
    torch.manual_seed(0)
    expected = saved_model().eval()(BATCH[:, :16])
    with torch.no_grad():
        return {"equal": torch.equal(model.eval()(BATCH[:, :16]), expected)}


TASKS = {
    "save": _save_fsdp,
    "reread": _reread_fsdp,
    "int8": lambda root, mesh: _fill_fsdp(root / "int8.safetensors", mesh),
    "int4": lambda root, mesh: _fill_fsdp(root / "int4.safetensors", mesh),
    "tp": lambda root, mesh: _fill_tp(root / "int8.safetensors", mesh),
}


def run_ranks(world: int, root: Path, *tasks: str) -> list[dict]:
    return run_on_ranks(__name__, world, root, tasks)


def slim_files(root: Path) -> tuple[int, dict[str, int]]:
    """The mlp saved as slim int8 and int4 files: the bytes of its float tensors, and of each file's."""
    torch.manual_seed(1)
    state = mlp().state_dict()
    stored = {}
    for kind in ("int8", "int4"):
        slimtorch.save(state, root / f"{kind}.safetensors", quantize=f"{kind}-weight", quantize_all=True)
        with slimtorch.open(root / f"{kind}.safetensors") as source:
            assert source.codec("0.weight") == kind and source.codec("2.weight") == kind
            stored[kind] = sum(info.stored_nbytes or info.nbytes for info in source.infos())
    return sum(t.numel() * t.element_size() for t in state.values()), stored


# -- two and four ranks ----------------------------------------------------------------------------------
@pytest.mark.slow
def test_two_ranks_save_a_dcp_folder_slimtorch_reads_and_fill_fsdp2_and_tp_models_from_slim_files(
    tmp_path, capsys
) -> None:
    floats, stored = slim_files(tmp_path)
    ranks = run_ranks(2, tmp_path, "save", "reread", "int8", "int4", "tp")

    torch.manual_seed(0)
    full = {**saved_model().state_dict()}
    with slimtorch.open(tmp_path / "dcp") as source:
        assert sorted(source.names()) == sorted(full)
        for name, tensor in full.items():
            assert torch.equal(source.get(name), tensor), name
            if tensor.dim():
                assert torch.equal(source.get_rows(name, 3, 6), tensor[3:6]), name
        assert {o.name: o.summary for o in source.objects} == {"extra.step": "3", "extra.name": "'run-1'"}
        assert source.format.startswith("dcp (9 tensors in 15 chunks")  # weights and biases in 2 chunks
    assert main(["inspect", str(tmp_path / "dcp")]) == 0
    assert main(["shrink", str(tmp_path / "dcp"), "-o", str(tmp_path / "x.safetensors")]) == 0
    assert slimtorch.load_objects(tmp_path / "x.safetensors") == {"extra.step": 3, "extra.name": "run-1"}
    assert all(rank["reread"]["equal"] for rank in ranks)  # dcp.load of the folder, its pickle never run
    assert torch.equal(slimtorch.load(tmp_path / "x.safetensors").tensors["0.weight"], full["0.weight"])
    capsys.readouterr()

    for kind in ("int8", "int4"):
        assert all(rank[kind]["equal"] for rank in ranks), kind
        assert [rank[kind]["rows"]["4.weight"] for rank in ranks] == [3, 3]
        # each rank reads and decodes its own rows only: together, every stored byte once
        assert sum(rank[kind]["bytes_decoded"] for rank in ranks) == floats
        assert sum(rank[kind]["bytes_read"] for rank in ranks) == stored[kind]
        # and checks the whole CRC chunks its rows fall in: here every part is one chunk
        assert all(rank[kind]["bytes_verified"] == stored[kind] for rank in ranks)
    assert all(rank["tp"]["max_diff"] < 1e-6 for rank in ranks)  # row-parallel sums add in another order


@pytest.mark.slow
def test_four_ranks_fill_an_fsdp2_model_from_a_slim_int8_file_one_rank_holding_no_rows(tmp_path) -> None:
    floats, stored = slim_files(tmp_path)
    ranks = run_ranks(4, tmp_path, "int8")
    assert all(rank["int8"]["equal"] for rank in ranks)
    assert [rank["int8"]["rows"]["4.weight"] for rank in ranks] == [2, 2, 2, 0]
    assert sum(rank["int8"]["bytes_decoded"] for rank in ranks) == floats
    assert sum(rank["int8"]["bytes_read"] for rank in ranks) == stored["int8"]


# -- hostile .metadata: one line, exit 2, nothing run --------------------------------------------------------
@pytest.fixture
def dcp_folder(tmp_path) -> Path:
    """A one-process DCP save: a tensor in 1 chunk and a non-tensor value."""
    folder = tmp_path / "dcp"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save({"w": torch.arange(12.0).reshape(3, 4), "extra": {"step": 3}}, checkpoint_id=folder)
    return folder


def test_a_dcp_metadata_pickle_downgrades_to_the_object_pickle_itself_reads(dcp_folder) -> None:
    data = (dcp_folder / ".metadata").read_bytes()
    assert data[:2] == b"\x80\x04"  # protocol 4: FRAME, MEMOIZE, STACK_GLOBAL
    read = unpickle("m", downgrade_pickle(data, "m"), trusted=dcp_globals())
    assert read == pickle.loads(data)
    with slimtorch.open(dcp_folder) as source:
        assert torch.equal(source.get("w"), torch.arange(12.0).reshape(3, 4)) and source.tree == {
            "extra.step": 3
        }


def refused_by_cli(folder: Path, capsys) -> str:
    assert main(["inspect", str(folder)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("slimtorch: error: "), err
    return err[0]


def rewrite_metadata(folder: Path, change) -> None:
    """Our own file, so pickle may read it here: change it, write it back as DCP does (protocol 4)."""
    path = folder / ".metadata"
    metadata = pickle.loads(path.read_bytes())
    change(metadata)
    path.write_bytes(pickle.dumps(metadata, protocol=4))


def test_a_metadata_calling_os_system_through_stack_global_is_refused_and_runs_nothing(
    dcp_folder, tmp_path, capsys
) -> None:
    marker = tmp_path / "ran"
    command = f"touch {marker}".encode()
    payload = b"\x80\x04\x8c\x02os\x8c\x06system\x93\x8c" + bytes([len(command)]) + command + b"\x85R."
    (dcp_folder / ".metadata").write_bytes(payload)
    line = refused_by_cli(dcp_folder, capsys)
    assert "os.system" in line and "--allow-global" not in line
    with pytest.raises(UnsafeCheckpointError):
        slimtorch.open(dcp_folder)
    assert not marker.exists()


@pytest.mark.parametrize(
    ("opcode", "named"),
    [(b"\x96\x00\x00\x00\x00\x00\x00\x00\x00", "BYTEARRAY8"), (b"\xff", "unknown")],
)
def test_a_metadata_with_an_opcode_protocol_2_lacks_is_refused_naming_it(
    dcp_folder, capsys, opcode, named
) -> None:
    (dcp_folder / ".metadata").write_bytes(b"\x80\x05" + opcode + b".")
    line = refused_by_cli(dcp_folder, capsys)
    assert named in line and ("byte 2" in line or "position 2" in line)


def _transform(metadata) -> None:
    for info in metadata.storage_data.values():
        info.transform_descriptors = ["zstd"]


def _beyond(metadata) -> None:
    for info in metadata.storage_data.values():
        info.offset += 10**6


def _escape(metadata) -> None:
    for info in metadata.storage_data.values():
        info.relative_path = "../elsewhere.distcp"


def _missing_chunk(metadata) -> None:
    entry = metadata.state_dict_metadata["w"]
    entry.size = torch.Size([6, 4])  # one chunk of 3 rows where 6 were saved: the other rank's file lost


def _overlap(metadata) -> None:
    for info in metadata.storage_data.values():
        info.offset = 0


@pytest.mark.parametrize(
    ("change", "said"),
    [
        (_transform, "stream transforms"),
        (_beyond, "at offset 1,"),
        (_escape, "outside the folder"),
        (_missing_chunk, "chunks hold 12 of its 24 elements"),
        (_overlap, "share bytes"),
    ],
)
def test_a_metadata_that_lies_about_its_items_is_refused_in_one_line(
    dcp_folder, capsys, change, said
) -> None:
    rewrite_metadata(dcp_folder, change)
    assert said in refused_by_cli(dcp_folder, capsys)


def test_a_truncated_metadata_is_refused_in_one_line(dcp_folder, capsys) -> None:
    path = dcp_folder / ".metadata"
    path.write_bytes(path.read_bytes()[:-40])
    line = refused_by_cli(dcp_folder, capsys)
    assert ".metadata" in line and ("truncated" in line or "corrupt" in line)


def test_a_distcp_file_linked_from_outside_the_folder_is_refused(dcp_folder, tmp_path, capsys) -> None:
    outside = tmp_path / "outside.distcp"
    shutil.move(dcp_folder / "__0_0.distcp", outside)
    (dcp_folder / "__0_0.distcp").symlink_to(outside)
    with pytest.raises(FormatError, match="links out of the folder"):
        slimtorch.open(dcp_folder)
