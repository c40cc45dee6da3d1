"""Hostile files get a budget before they get memory or time (issue 17): safetensors byte ranges that alias
or leave gaps, shapes no tensor can have, codec chains that decode to gigabytes from kilobytes, pruning
masks that broadcast, and walks over names that were quadratic. Every file is built here, byte by byte,
and small; each refusal is one line naming the file (exit 2 from the CLI)."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
import zstandard
from safetensors.torch import save_file

import slimtorch
from slimtorch.cli.main import main
from slimtorch.errors import FormatError, SlimtorchError
from slimtorch.format import untrusted
from slimtorch.format.codecs import CodecError, Encoded, decode, encode
from slimtorch.format.delta import StructuralDelta
from slimtorch.format.source import ObjectInfo, TensorInfo, check_tensor_fits, shape_problem
from slimtorch.format.writer import SlimWriter
from slimtorch.inspection.breakdown import _attribute_bytes, _scan_zeros, classify
from slimtorch.prune.unstructured import finalize
from slimtorch.sources import open_checkpoint
from tests.hostile import edit_slim_metadata, write_safetensors_raw


def _refused(capsys, command: str, path, *words: str) -> str:
    """Run the CLI on ``path``: exit 2, one line naming the file, no traceback, with ``words`` in it."""
    extra = ["-o", str(path.parent / "out.safetensors")] if command == "shrink" else []
    code = main([command, str(path), *extra])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert str(path) in err
    for word in words:
        assert word in err, err
    return err


def _f32(shape: list[int], begin: int, end: int) -> dict:
    return {"dtype": "F32", "shape": shape, "data_offsets": [begin, end]}


# -- safetensors byte ranges -------------------------------------------------------------------------------
def test_safetensors_entries_aliasing_one_range_are_refused_not_cloned(tmp_path, capsys):
    header = {f"alias{i}": _f32([4], 0, 16) for i in range(3000)}
    path = write_safetensors_raw(tmp_path / "alias.safetensors", header, b"\0" * 16)
    _refused(capsys, "load", path, "overlaps the tensor before it")


def test_safetensors_entries_leaving_a_gap_are_refused(tmp_path, capsys):
    header = {"a": _f32([4], 0, 16), "b": _f32([4], 32, 48)}
    path = write_safetensors_raw(tmp_path / "gap.safetensors", header, b"\0" * 48)
    _refused(capsys, "inspect", path, "leaves a gap")


def test_safetensors_bytes_after_the_last_tensor_are_refused(tmp_path, capsys):
    path = write_safetensors_raw(tmp_path / "tail.safetensors", {"a": _f32([4], 0, 16)}, b"\0" * 20)
    _refused(capsys, "inspect", path, "4 bytes after the last tensor")


def test_safetensors_empty_tensors_and_any_header_order_still_load(tmp_path):
    header = {"b": _f32([2], 8, 16), "empty": _f32([0, 3], 8, 8), "a": _f32([2], 0, 8)}
    path = write_safetensors_raw(tmp_path / "ok.safetensors", header, np.arange(4, dtype="<f4").tobytes())
    state = slimtorch.load(path).tensors
    assert state["a"].tolist() == [0, 1] and state["b"].tolist() == [2, 3] and state["empty"].shape == (0, 3)


@pytest.mark.parametrize(
    ("header", "words"),
    [
        (b'{"a":' + b"[" * 100_000 + b"]" * 100_000 + b"}", "recursion"),
        (b'{"a":{"dtype":"F32","shape":[' + b"9" * 5000 + b'],"data_offsets":[0,4]}}', "5000 digits"),
        (b'{"a":{"dtype":["F32"],"shape":[1],"data_offsets":[0,4]}}', "unknown dtype"),
    ],
    ids=["deep nesting", "5000-digit integer", "unhashable dtype"],
)
def test_safetensors_header_json_is_parsed_within_bounds(tmp_path, capsys, header, words):
    path = tmp_path / "header.safetensors"
    path.write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 4)
    _refused(capsys, "inspect", path, words)


# -- shapes ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("shape", "words"),
    [
        ([10**30, 0], "beyond int64"),
        ([2**62, 4, 0], "more elements than int64"),
        ([1] * 150_000, "150000 dimensions"),
    ],
    ids=["10**30 x 0", "int64 overflow before a zero", "150k ones"],
)
def test_safetensors_shapes_no_tensor_can_have_are_refused_before_any_product(tmp_path, capsys, shape, words):
    path = write_safetensors_raw(tmp_path / "shape.safetensors", {"a": _f32(shape, 0, 0)}, b"")
    started = time.perf_counter()
    _refused(capsys, "inspect", path, words)
    assert time.perf_counter() - started < 5  # the 150,000 stride products took hours


def test_negative_sizes_are_refused(tmp_path, capsys):
    path = write_safetensors_raw(tmp_path / "neg.safetensors", {"a": _f32([-1, 0], 0, 0)}, b"")
    _refused(capsys, "inspect", path, "non-negative")


def test_check_tensor_fits_bounds_dimensions_before_walking_them():
    ones = (1,) * 150_000
    info = TensorInfo("t", torch.float32, ones, ones, "s", 0, 4)
    with pytest.raises(FormatError, match="150000 dimensions"):
        check_tensor_fits("f.pt", info)


def test_shape_problem_accepts_what_torch_can_build():
    assert (
        shape_problem([2**63 - 1, 0]) is None and shape_problem([3, 4]) is None and shape_problem([]) is None
    )
    assert "int64" in shape_problem([2**40, 2**40])


def test_slim_metadata_shape_of_150000_ones_is_refused(tmp_path, capsys):
    path = tmp_path / "slim.safetensors"
    slimtorch.save({"w": torch.randn(8, 8)}, path)
    edit_slim_metadata(path, lambda body: body["tensors"]["w"].__setitem__("shape", [1] * 150_000))
    _refused(capsys, "load", path, "150000 dimensions")


# -- codec chains ------------------------------------------------------------------------------------------
def _compressible(nbytes: int, seed: int = 0) -> np.ndarray:
    """Mostly zero bytes with random ones scattered in: zstd packs them about 100x, within the 256x a
    single compressed part may claim, so only the chain's total expansion gives the bomb away."""
    rng = np.random.default_rng(seed)
    data = np.zeros(nbytes, dtype=np.uint8)
    where = rng.choice(nbytes, size=nbytes // 400, replace=False)
    data[where] = rng.integers(1, 256, size=where.size, dtype=np.uint8)
    return data


def _zstd_stage(parts: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict]:
    """Every part compressed, as the entropy stage would store it (whatever the expansion)."""
    compressor = zstandard.ZstdCompressor(level=3, write_content_size=True)
    packed, listed = {}, {}
    for role, tensor in parts.items():
        blob = compressor.compress(tensor.contiguous().view(torch.uint8).numpy().tobytes())
        if len(blob) >= tensor.numel() * tensor.element_size():
            packed[role] = tensor  # random values: stored as they are
            continue
        assert len(blob) * 256 >= tensor.numel() * tensor.element_size()  # each part looks sane alone
        packed[role] = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
        listed[role] = {"dtype": str(tensor.dtype).removeprefix("torch."), "shape": list(tensor.shape)}
    return packed, {"codec": "zstd", "parts": listed}


def _write_coded(path, stages: list[dict], parts: dict[str, torch.Tensor], dtype, shape) -> None:
    packed, entropy = _zstd_stage(parts)
    with SlimWriter(path) as writer:
        writer.add("w", Encoded(packed, [*stages, entropy]), dtype, tuple(shape))


def _sparse_float64_bomb(path, numel: int) -> None:
    mask = _compressible(numel // 8)
    kept = int(np.unpackbits(mask).sum())
    stage = {"codec": "sparse", "dtype": "float64", "shape": [numel]}
    values = torch.from_numpy(np.random.default_rng(3).standard_normal(kept))
    parts = {"mask": torch.from_numpy(mask), "values": values}
    _write_coded(path, [stage], parts, torch.float64, [numel])


def test_sparse_float64_under_zstd_is_refused_before_it_decodes(tmp_path, capsys):
    path = tmp_path / "sparse_bomb.safetensors"
    _sparse_float64_bomb(path, 2**24)  # 128 MiB of float64 from a ~150 KB file
    assert path.stat().st_size < 300_000
    _refused(capsys, "load", path, "budget", "SLIMTORCH_MAX_EXPANSION")


def test_the_user_can_raise_the_expansion_budget_for_a_file_they_trust(tmp_path, monkeypatch):
    path = tmp_path / "sparse.safetensors"
    _sparse_float64_bomb(path, 2**20)
    monkeypatch.setattr(untrusted, "EXPANSION_SLACK", 0)
    with pytest.raises(FormatError, match="budget"):
        slimtorch.load(path)
    monkeypatch.setenv("SLIMTORCH_MAX_EXPANSION", "100000")
    assert slimtorch.load(path).tensors["w"].shape == (2**20,)


def test_int4_flat_under_zstd_is_refused_before_it_decodes(tmp_path, capsys):
    numel, group = 2**25, 256  # 128 MiB of float32
    groups = numel // group
    stage = {"codec": "int4", "dtype": "float32", "shape": [numel], "group_size": group, "flat": True}
    side = torch.from_numpy(_compressible(groups * 2, seed=1)).view(torch.float16).reshape(1, groups)
    parts = {
        "q4": torch.from_numpy(_compressible(numel // 2, seed=2)).reshape(1, numel // 2),
        "scale": side,
        "zero": side.clone(),
    }
    path = tmp_path / "int4_bomb.safetensors"
    _write_coded(path, [stage], parts, torch.float32, [numel])
    assert path.stat().st_size < 600_000
    _refused(capsys, "load", path, "budget")


def test_the_entropy_stage_never_writes_what_the_default_budget_refuses(monkeypatch):
    monkeypatch.setattr(untrusted, "EXPANSION_SLACK", 0)  # small tensors, same arithmetic
    mask = torch.from_numpy(_compressible(2**13)).numpy()
    keep = torch.from_numpy(np.unpackbits(mask, bitorder="little").astype(bool))
    x = torch.zeros(keep.numel(), dtype=torch.float64)
    x[keep] = 1.0
    encoded = encode(x, ["sparse", "zstd"])
    assert encoded.stages[-1] == {"codec": "zstd", "parts": {}}  # the 100x mask stays uncompressed
    assert torch.equal(decode(encoded.parts, encoded.stages, x.dtype, x.shape), x)


def test_a_budget_breaking_chain_is_a_codec_error_before_any_part_is_read():
    stages = [
        {"codec": "sparse", "dtype": "float64", "shape": [2**40]},
        {"codec": "zstd", "parts": {"mask": {"dtype": "uint8", "shape": [2**37]}}},
    ]
    parts = {
        "mask": torch.zeros(2**29 // 256, dtype=torch.uint8),
        "values": torch.zeros(0, dtype=torch.float64),
    }
    with pytest.raises(CodecError, match="budget"):
        decode(parts, stages, torch.float64, (2**40,))


def _saved_int8(tmp_path):
    path = tmp_path / "int8.safetensors"
    slimtorch.save({"w": torch.randn(64, 64)}, path, quantize="int8-weight", quantize_all=True)
    return path


@pytest.mark.parametrize(
    ("edit", "words"),
    [
        (lambda s: s.__setitem__("codeb", s.pop("codec")), "unknown codec 'None'"),
        (lambda s: s.__setitem__("codec", "int9"), "unknown codec 'int9'"),
        (lambda s: s.__setitem__("codec", ["int8"]), "unknown codec"),
        (lambda s: s.__setitem__("dtype", {"float32": 1}), "unknown dtype"),
        (lambda s: s.__setitem__("shape", "64"), "not a list"),
        (lambda s: s.__setitem__("shape", [[64], 64]), "not a non-negative integer"),
    ],
    ids=["codec->codeb", "unknown codec", "unhashable codec", "unhashable dtype", "shape string", "nested"],
)
@pytest.mark.parametrize("command", ["load", "inspect", "shrink"])
def test_a_damaged_stage_is_one_line_naming_the_file(tmp_path, capsys, edit, words, command):
    path = _saved_int8(tmp_path)
    edit_slim_metadata(path, lambda body: edit(body["tensors"]["w"]["stages"][0]))
    _refused(capsys, command, path, words)


@pytest.mark.parametrize(
    ("stage", "words"),
    [
        ({"codec": "int4", "group_size": "128", "flat": False}, "group size"),
        ({"codec": "int4", "group_size": 128, "flat": [1]}, "'flat'"),
        ({"codec": "cast", "to": ["float16"]}, "unknown dtype"),
    ],
)
def test_stage_parameters_of_the_wrong_type_are_codec_errors(stage, words):
    x = torch.randn(4, 256)
    good = encode(x, [("int4", {"group_size": 128})] if stage["codec"] == "int4" else [("cast", {})])
    stages = [{**good.stages[0], **stage}]
    with pytest.raises(CodecError, match=words):
        decode(good.parts, stages, x.dtype, x.shape)


def test_int4_flat_decodes_block_by_block_to_the_same_values():
    x = torch.randn(3, 1000)
    flat = encode(x, [("int4", {"group_size": 32, "flat": True})])
    rows = encode(x, [("int4", {"group_size": 32, "flat": False})])
    for enc in (flat, rows):
        assert (decode(enc.parts, enc.stages, x.dtype, x.shape) - x).abs().max() < 0.5


# -- pruning masks, deltas, save ---------------------------------------------------------------------------
def test_a_mask_that_would_broadcast_is_refused_by_shrink(tmp_path, capsys):
    path = tmp_path / "fold.safetensors"
    save_file({"fc.weight_orig": torch.ones(1, 5000), "fc.weight_mask": torch.ones(5000, 1)}, path)
    _refused(capsys, "shrink", path, "differ in shape")


def test_a_mask_that_would_broadcast_is_refused_by_save(tmp_path):
    state = {"fc.weight_orig": torch.ones(1, 5000), "fc.weight_mask": torch.ones(5000, 1)}
    with pytest.raises(SlimtorchError, match="differ in shape"):
        slimtorch.save(state, tmp_path / "out.safetensors")


def test_finalize_refuses_a_mask_of_another_shape():
    layer = torch.nn.Linear(8, 1)
    torch.nn.utils.prune.identity(layer, "weight")
    layer._buffers["weight_mask"] = torch.ones(8, 1)
    with pytest.raises(SlimtorchError, match="does not have the weight's shape"):
        finalize(layer)


@pytest.mark.parametrize(
    "delta",
    [
        {"shapes": {"w": [2**47, 2**47, 2**47]}},
        {"shapes": {"w": [1] * 100_000}},
        {"attributes": {"norm": {"normalized_shape": [2**47] * 3}}},
    ],
    ids=["int64 overflow", "100k dims", "attribute shape"],
)
def test_a_structural_delta_with_unbuildable_shapes_is_refused(delta):
    with pytest.raises(SlimtorchError, match=r"not lists of sizes|not a size"):
        StructuralDelta.from_json(delta)


@pytest.mark.parametrize(
    "tensor",
    [torch.eye(3).to_sparse(), torch.empty(3, device="meta")],
    ids=["sparse COO", "meta"],
)
def test_save_refuses_tensors_without_dense_data(tmp_path, tensor):
    with pytest.raises(SlimtorchError, match="save takes dense tensors"):
        slimtorch.save({"w": tensor}, tmp_path / "out.safetensors")


# -- walks over names --------------------------------------------------------------------------------------
def test_twenty_thousand_names_for_one_tensor_are_attributed_in_linear_time():
    infos = [TensorInfo(f"n{i}", torch.float32, (256,), (1,), "s", 0, 1024) for i in range(20_000)]
    started = time.perf_counter()
    stored, shares_with, unreferenced = _attribute_bytes(infos)
    assert time.perf_counter() - started < 2  # 200 million span comparisons before
    assert stored["n0"] == 1024 and sum(stored.values()) == 1024 and unreferenced == 0
    assert shares_with["n19999"] == "n0" and "n0" not in shares_with


def test_attributed_bytes_match_a_brute_force_count_on_overlapping_views():
    rng = np.random.default_rng(0)
    infos = []
    for i in range(300):
        start, length = int(rng.integers(0, 900)), int(rng.integers(0, 120))
        infos.append(TensorInfo(f"t{i}", torch.uint8, (length,), (1,), "s", start, 1000))
    stored, shares_with, unreferenced = _attribute_bytes(infos)
    used = np.zeros(1000, dtype=bool)
    for info in infos:
        start, end = info.span
        assert stored[info.name] == int((~used[start:end]).sum())
        owner = shares_with.get(info.name)
        if end > start:
            assert (owner is not None) == bool(used[start:end].any())
        if owner is not None:
            other = next(i for i in infos if i.name == owner).span
            assert other[0] < end and start < other[1]  # it does share bytes with its owner
        used[start:end] = True
    assert unreferenced == int((~used).sum())


def test_thousands_of_optimizers_are_classified_in_linear_time():
    count = 10_000
    objects = [ObjectInfo(f"opt{i}.param_groups.0.lr", "float", "0.1") for i in range(count)]
    infos = [
        TensorInfo(f"opt{i}.state.0.exp_avg", torch.float32, (1,), (1,), f"s{i}", 0, 4) for i in range(count)
    ]
    infos.append(TensorInfo("fc.weight", torch.float32, (1,), (1,), "w", 0, 4))
    started = time.perf_counter()
    categories = classify(infos, objects)
    assert time.perf_counter() - started < 2  # 100 million root comparisons before
    assert (
        categories["opt4999.state.0.exp_avg"] == "optimizer_state" and categories["fc.weight"] == "parameters"
    )


def test_aliases_of_one_tensor_are_scanned_once(tmp_path):
    weight = torch.zeros(1000)
    path = tmp_path / "aliases.pt"
    torch.save({f"alias{i}": weight for i in range(200)}, path)
    with open_checkpoint(path) as source:
        reads = []
        get = source.get
        source.get = lambda name: reads.append(name) or get(name)  # type: ignore[method-assign]
        zeros = _scan_zeros(source, source.infos(), lambda n: None)
    assert len(reads) == 1 and set(zeros.values()) == {1000}
