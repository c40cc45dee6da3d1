"""The slim format: a plain safetensors file outside, exact or bounded round trips, loud failures on damage.

Every damaged file or folder is made byte by byte from a good one (tests/hostile.py), the way a bad disk, a
cut-off copy or a careless hand edit would, and must fail with a :class:`slimtorch.FormatError` naming the
tensor, or one line and exit 2 from the command line. Writes are atomic: an interrupted save leaves the
previous checkpoint as it was and no temporary files behind.
"""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch.nn.utils import prune

import slimtorch
from slimtorch.cli.main import main
from slimtorch.format import writer
from tests.hostile import (
    add_safetensors_entry,
    data_range,
    edit_slim_metadata,
    remove_safetensors_entry,
)
from tests.zoo import MLP, SmallCNN, TinyGPT, trained_checkpoint

SHARD = re.compile(r"model-(\d{5})-of-(\d{5})\.safetensors")


def _mixed() -> dict[str, torch.Tensor]:
    """One tensor per storage form: int8 codes, int8 codes stored sparsely, as is, an integer buffer."""
    pruned = torch.randn(128, 64)
    pruned[torch.rand(128, 64) < 0.9] = 0
    return {
        "fc.weight": torch.randn(128, 64),
        "pruned.weight": pruned,
        "norm.weight": torch.randn(64),
        "steps": torch.tensor(3),
    }


def _physical(path) -> list[str]:
    with safe_open(path, "pt") as f:
        return list(f.keys())


def _slim_metadata(path) -> dict:
    with safe_open(path, "pt") as f:
        return json.loads(f.metadata()["slimtorch"])


def _assert_same(loaded: dict[str, torch.Tensor], original: dict[str, torch.Tensor]) -> None:
    assert set(loaded) == set(original)
    for name, tensor in original.items():
        assert loaded[name].dtype == tensor.dtype, name
        assert torch.equal(loaded[name], tensor), name


def _leftovers(folder) -> list:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith(writer.TEMP_PREFIX))


# -- a plain safetensors file ------------------------------------------------------------------------------
def test_slim_file_opens_with_plain_safetensors_and_lists_its_physical_parts(tmp_path):
    path = tmp_path / "model.safetensors"
    tensors = _mixed()
    slimtorch.save(tensors, path, quantize="int8-weight")

    assert sorted(_physical(path)) == [
        "fc.weight::q",
        "fc.weight::scale",
        "norm.weight",  # stored as is: under its own name, readable by anyone
        "pruned.weight::mask",
        "pruned.weight::scale",
        "pruned.weight::values",
        "steps",
    ]
    plain = load_file(path)
    assert torch.equal(plain["norm.weight"], tensors["norm.weight"])
    assert torch.equal(plain["steps"], tensors["steps"])
    assert plain["fc.weight::q"].dtype == torch.int8 and plain["fc.weight::q"].shape == (128, 64)
    body = _slim_metadata(path)
    assert (body["format"], body["version"]) == ("slimtorch", 1)
    assert set(body["tensors"]) == set(tensors)


def test_open_shows_logical_tensors_with_their_codec_and_get_decodes(tmp_path):
    path = tmp_path / "model.safetensors"
    tensors = _mixed()
    slimtorch.save(tensors, path, quantize="int8-weight")

    with slimtorch.open(path) as source:
        assert source.format == "slim"
        assert sorted(source.names()) == sorted(tensors)
        codecs = {info.name: info.codec for info in source.infos()}
        assert codecs == {
            "fc.weight": "int8",
            "pruned.weight": "int8+sparse",
            "norm.weight": "raw",
            "steps": "raw",
        }
        assert source.info("fc.weight").shape == (128, 64)
        assert source.info("pruned.weight").stored_nbytes < 0.3 * source.info("pruned.weight").nbytes
        fc = source.get("fc.weight")
        assert fc.dtype == torch.float32 and fc.shape == (128, 64)
        assert torch.allclose(fc, tensors["fc.weight"], atol=tensors["fc.weight"].abs().max() / 254 + 1e-6)
        assert torch.equal(source.get("norm.weight"), tensors["norm.weight"])


# -- round trips -------------------------------------------------------------------------------------------
def test_lossless_default_round_trip_is_exact_including_integer_buffers(tmp_path):
    model = SmallCNN()
    model(torch.randn(4, 1, 8, 8))  # moves the running statistics and num_batches_tracked (int64)
    state = dict(model.state_dict())
    prune.l1_unstructured(model.features[0], "weight", amount=0.7)
    prune.remove(model.features[0], "weight")
    state["features.0.weight"] = model.features[0].weight.detach()  # mostly zeros, but small: dense
    state["wide"] = torch.randn(64, 64) * (torch.rand(64, 64) > 0.7)  # mostly zeros: stored sparsely
    state.update(
        {
            "flags": torch.rand(100) > 0.5,
            "codes": torch.randint(-128, 127, (300,), dtype=torch.int8),
            "half": torch.randn(50, dtype=torch.bfloat16),
            "empty": torch.empty(0, 3),
            "scalar": torch.tensor(2.5, dtype=torch.float64),
            "transposed": state["head.weight"].t(),  # a view sharing memory in another layout: a value
        }
    )
    path = tmp_path / "model.safetensors"

    slimtorch.save(state, path)

    loaded = slimtorch.load(path).tensors
    _assert_same(loaded, state)
    assert loaded["features.1.num_batches_tracked"].dtype == torch.int64
    assert slimtorch.open(path).info("wide").codec == "sparse"


def test_a_tensor_is_stored_sparse_only_where_that_saves_more_than_its_decode_costs(tmp_path):
    state = {"bias": torch.zeros(768), "wide_bias": torch.zeros(3072), "weight": torch.randn(4, 4)}
    path = tmp_path / "model.safetensors"

    slimtorch.save(state, path)

    opened = slimtorch.open(path)
    assert opened.info("bias").codec == "raw"  # saves 3 KiB: reading them is cheaper than a decode
    assert opened.info("wide_bias").codec == "sparse"  # saves 12 KiB
    _assert_same(slimtorch.load(path).tensors, state)


def _int8_bound(x: torch.Tensor) -> torch.Tensor:
    """|err| <= scale / 2, scale = max|row| / 127."""
    return (x.abs().amax(dim=1, keepdim=True) / 254).expand_as(x)


def _int4_bound(x: torch.Tensor, group: int = 128) -> torch.Tensor:
    """|err| <= scale / 2 + 2**-10 max|group|, scale = (max - min) / 15 over groups along each row."""
    g = x.reshape(x.shape[0], -1, group)
    high, low = g.amax(dim=2, keepdim=True), g.amin(dim=2, keepdim=True)
    bound = (high - low) / 30 + 2**-10 * g.abs().amax(dim=2, keepdim=True)
    return bound.expand_as(g).reshape(x.shape)


def _fp16_bound(x: torch.Tensor) -> torch.Tensor:
    """Round to nearest float16: relative 2**-11 in the normal range, 2**-25 absolute below it."""
    return torch.clamp(x.abs() * 2**-11, min=2**-25)


@pytest.mark.parametrize(
    ("options", "bound", "dtype"),
    [
        ({"quantize": "int8-weight"}, _int8_bound, torch.float32),
        ({"quantize": "int4-weight"}, _int4_bound, torch.float32),
        ({"dtype": "fp16"}, _fp16_bound, torch.float16),
    ],
    ids=["int8", "int4", "fp16"],
)
def test_lossy_round_trip_stays_within_the_documented_bound(tmp_path, options, bound, dtype):
    weight = torch.randn(128, 256) * torch.logspace(-3, 1, 128).unsqueeze(1)  # rows of very different scale
    bias = torch.randn(128)
    path = tmp_path / "model.safetensors"

    slimtorch.save({"fc.weight": weight, "fc.bias": bias}, path, **options)

    loaded = slimtorch.load(path).tensors
    assert loaded["fc.weight"].dtype == dtype
    error = (loaded["fc.weight"].float() - weight).abs()
    assert bool((error <= bound(weight) * (1 + 1e-5) + 1e-12).all())
    assert error.max() > 0  # it is lossy: the bound is what the test checks, not luck
    if "quantize" in options:
        assert torch.equal(loaded["fc.bias"], bias)  # quantize leaves biases exact


@pytest.mark.parametrize("quantize", [None, "int8-weight"])
def test_tied_tensors_are_stored_once_and_come_back_as_one_tensor(tmp_path, quantize):
    model = TinyGPT()
    state = model.state_dict()
    assert state["head.weight"].data_ptr() == state["embed.weight"].data_ptr()
    path = tmp_path / "gpt.safetensors"

    slimtorch.save(state, path, quantize=quantize)

    assert not any(key.startswith("head.weight") for key in _physical(path))
    assert _slim_metadata(path)["ties"] == {"head.weight": "embed.weight"}
    loaded = slimtorch.load(path).tensors
    assert loaded["head.weight"] is loaded["embed.weight"]
    assert set(loaded) == set(state)
    if quantize is None:
        _assert_same(loaded, state)


def test_a_tensor_named_like_another_ones_part_is_refused_before_writing(tmp_path):
    path = tmp_path / "model.safetensors"

    with pytest.raises(slimtorch.SlimtorchError, match=re.escape("fc.weight::scale")):
        slimtorch.save(
            {"fc.weight": torch.randn(128, 64), "fc.weight::scale": torch.randn(128)},
            path,
            quantize="int8-weight",
        )

    assert not path.exists()
    assert _leftovers(tmp_path) == []


# -- damage --------------------------------------------------------------------------------------------------
def _flip_byte(path, key: str) -> None:
    begin, end = data_range(path, key)
    data = bytearray(path.read_bytes())
    data[(begin + end) // 2] ^= 0x40
    path.write_bytes(bytes(data))


def _edit_entry(name: str, change):
    return lambda path: edit_slim_metadata(path, lambda body: change(body["tensors"][name]))


def _stage(index: int, key: str, value):
    def change(entry: dict) -> None:
        entry["stages"][index][key] = value

    return change


def _set(key: str, value):
    return lambda entry: entry.__setitem__(key, value)


# name -> (how to damage a good file, words the message must hold)
DAMAGE = {
    "flipped byte in int8 codes": (lambda p: _flip_byte(p, "fc.weight::q"), ["fc.weight", "checksum"]),
    "flipped byte in a raw tensor": (lambda p: _flip_byte(p, "norm.weight"), ["norm.weight", "checksum"]),
    "flipped byte in a sparse mask": (
        lambda p: _flip_byte(p, "pruned.weight::mask"),
        ["pruned.weight", "checksum"],
    ),
    "file cut short": (lambda p: p.write_bytes(p.read_bytes()[:-50]), ["truncated"]),
    "header cut short": (lambda p: p.write_bytes(p.read_bytes()[:200]), ["truncated"]),
    "shape edited": (_edit_entry("fc.weight", _set("shape", [64, 128])), ["fc.weight", "[64, 128]"]),
    "shape of a raw tensor edited": (_edit_entry("norm.weight", _set("shape", [2, 32])), ["norm.weight"]),
    "dtype edited": (_edit_entry("fc.weight", _set("dtype", "float16")), ["fc.weight", "float16"]),
    "int8 stage shape edited": (_edit_entry("fc.weight", _stage(0, "shape", [64, 128])), ["fc.weight"]),
    "sparse stage shape edited": (
        _edit_entry("pruned.weight", _stage(1, "shape", [128, 32])),
        ["pruned.weight", "mask"],
    ),
    "stage codec renamed": (
        _edit_entry("fc.weight", _stage(0, "codec", "rot13")),
        ["fc.weight", "unknown codec"],
    ),
    "checksum list edited": (
        _edit_entry("fc.weight", lambda e: e["crc32"].__setitem__("q", [1, 2])),
        ["fc.weight", "checksum"],
    ),
    "scale part missing": (
        lambda p: remove_safetensors_entry(p, "fc.weight::scale"),
        ["fc.weight", "fc.weight::scale", "missing"],
    ),
    "stray tensor": (
        lambda p: add_safetensors_entry(p, "stray", "F32", [2], b"\x00" * 8),
        ["stray", "not in the slimtorch metadata"],
    ),
    "tie to a missing tensor": (
        lambda p: edit_slim_metadata(p, lambda body: body["ties"].update({"head.weight": "gone.weight"})),
        ["head.weight", "gone.weight"],
    ),
    "unknown format version": (
        lambda p: edit_slim_metadata(p, lambda body: body.update(version=2)),
        ["version 2"],
    ),
    "absurd header length": (
        lambda p: p.write_bytes((2**60).to_bytes(8, "little") + p.read_bytes()[8:]),
        ["header claims"],
    ),
}


def _damaged(tmp_path, damage: str):
    path = tmp_path / "damaged.safetensors"
    slimtorch.save(_mixed(), path, quantize="int8-weight")
    slimtorch.load(path)  # good before the damage
    hurt, words = DAMAGE[damage]
    hurt(path)
    return path, words


def _sharded(tmp_path, name: str = "sharded"):
    folder = tmp_path / name
    slimtorch.save(TinyGPT().state_dict(), folder, shard_bytes=100_000)
    shards = sorted(folder.glob("model-*-of-*.safetensors"))
    assert len(shards) >= 3
    return folder, shards


def _shard_missing(tmp_path):
    folder, shards = _sharded(tmp_path)
    shards[1].unlink()
    return folder, [shards[1].name, "missing"]


def _last_shard_and_index_missing(tmp_path):
    folder, shards = _sharded(tmp_path)
    (folder / "model.safetensors.index.json").unlink()  # the shards are then found by their names
    shards[-1].unlink()
    return folder, [f"shard {len(shards)} of {len(shards)} is missing"]


def _shard_from_another_save(tmp_path):
    folder, shards = _sharded(tmp_path)
    _, others = _sharded(tmp_path, "other")
    shutil.copyfile(others[1], shards[1])  # same name, same tensors, another save
    return folder, [shards[1].name, "different save"]


FOLDER_DAMAGE = {
    "shard missing": _shard_missing,
    "last shard and the index missing": _last_shard_and_index_missing,
    "shard from another save": _shard_from_another_save,
}
ALL_DAMAGE = [*DAMAGE, *FOLDER_DAMAGE]


def _broken(tmp_path, damage: str):
    if damage in FOLDER_DAMAGE:
        return FOLDER_DAMAGE[damage](tmp_path)
    return _damaged(tmp_path, damage)


@pytest.mark.parametrize("damage", ALL_DAMAGE)
def test_damaged_checkpoint_fails_to_load_with_an_error_naming_the_problem(tmp_path, damage):
    path, words = _broken(tmp_path, damage)

    with pytest.raises(slimtorch.FormatError) as error:
        slimtorch.load(path)

    message = str(error.value)
    assert message.startswith(str(path))
    for word in words:
        assert word in message, message


@pytest.mark.parametrize("damage", ALL_DAMAGE)
def test_damaged_checkpoint_is_one_line_and_exit_2_in_the_cli(tmp_path, capsys, damage):
    path, words = _broken(tmp_path, damage)

    code = main(["inspect", str(path)])

    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith("slimtorch: error: ")
    assert all(" ".join(word.split()) in err for word in words), err


def test_shrinking_a_damaged_slim_file_fails_and_writes_nothing(tmp_path, capsys):
    path, _ = _damaged(tmp_path, "flipped byte in int8 codes")
    out = tmp_path / "out.safetensors"

    assert main(["shrink", str(path), "-o", str(out)]) == 2

    assert "checksum mismatch" in capsys.readouterr().err
    assert not out.exists()
    assert _leftovers(tmp_path) == []


def test_verify_false_skips_the_checksums(tmp_path):
    path, _ = _damaged(tmp_path, "flipped byte in a raw tensor")

    loaded = slimtorch.load(path, verify=False).tensors

    assert not torch.equal(loaded["norm.weight"], _mixed()["norm.weight"])


# -- sharding ----------------------------------------------------------------------------------------------
def test_sharded_save_writes_numbered_shards_and_an_index_covering_every_part(tmp_path):
    state = TinyGPT().state_dict()
    folder = tmp_path / "gpt"

    report = slimtorch.save(state, folder, shard_bytes=100_000, quantize="int8-weight")

    shards = sorted(folder.glob("*.safetensors"))
    numbers = [SHARD.fullmatch(p.name) for p in shards]
    assert all(numbers) and len(shards) >= 2
    assert [int(m[1]) for m in numbers] == list(range(1, len(shards) + 1))
    assert {int(m[2]) for m in numbers} == {len(shards)}
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        [*(p.name for p in shards), "model.safetensors.index.json"]
    )
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    held = {key: shard.name for shard in shards for key in _physical(shard)}  # each shard opens alone
    assert index["weight_map"] == held
    assert any(key.endswith("::q") for key in held) and "head.weight" not in held
    assert {report.files[i] for i in range(len(shards))} == {str(p) for p in shards}
    checkpoints = {_slim_metadata(shard)["checkpoint"] for shard in shards}
    assert checkpoints == {index["metadata"]["checkpoint"]}

    loaded = slimtorch.load(folder).tensors
    assert set(loaded) == set(state)
    assert loaded["head.weight"] is loaded["embed.weight"]
    assert slimtorch.open(folder).format == f"slim ({len(shards)} shards)"


def test_sharded_lossless_folder_loads_back_equal(tmp_path):
    state = TinyGPT().state_dict()
    folder = tmp_path / "gpt"

    slimtorch.save(state, folder, shard_bytes=100_000)

    loaded = slimtorch.load(folder).tensors
    _assert_same({name: loaded[name] for name in state}, state)
    assert loaded["head.weight"] is loaded["embed.weight"]


def test_shrink_with_small_shards_writes_a_sharded_folder_that_loads_back(tmp_path):
    checkpoint = tmp_path / "mlp.pt"
    model = MLP((64, 128, 128, 10))
    torch.save(model.state_dict(), checkpoint)
    folder = tmp_path / "slim"

    slimtorch.shrink(checkpoint, folder, shard_bytes=40_000)

    assert len(list(folder.glob("model-*-of-*.safetensors"))) >= 2
    assert (folder / "model.safetensors.index.json").is_file()
    _assert_same(slimtorch.load(folder).tensors, model.state_dict())


def test_sharded_folder_without_its_index_loads_from_its_shards(tmp_path):
    folder, _ = _sharded(tmp_path)
    expected = slimtorch.load(folder).tensors
    (folder / "model.safetensors.index.json").unlink()

    _assert_same(slimtorch.load(folder).tensors, expected)


def test_single_shard_folder_is_model_safetensors_without_an_index(tmp_path):
    state = MLP().state_dict()
    folder = tmp_path / "mlp"

    slimtorch.save(state, folder)

    assert sorted(p.name for p in folder.iterdir()) == ["model.safetensors"]
    _assert_same(slimtorch.load(folder).tensors, state)


# -- atomic writes -----------------------------------------------------------------------------------------
def _interrupt_while_writing(monkeypatch, after_calls: int = 0) -> None:
    """The next shard finished after ``after_calls`` good ones is cut to half its bytes, then Ctrl-C."""
    real, calls = writer._ShardFile.finish, []

    def finish(self, metadata):
        calls.append(self.path)
        if len(calls) <= after_calls:
            return real(self, metadata)
        self.close()
        self.path.write_bytes(b"\x00" * 100)
        raise KeyboardInterrupt

    monkeypatch.setattr(writer._ShardFile, "finish", finish)


def _fail_rename(monkeypatch) -> None:
    def replace(source, target):
        raise OSError(28, "No space left on device", str(target))

    monkeypatch.setattr(writer.os, "replace", replace)


@pytest.mark.parametrize("where", ["while writing", "at the rename"])
def test_interrupted_save_leaves_the_previous_file_byte_identical_and_no_temp_file(
    tmp_path, monkeypatch, where
):
    path = tmp_path / "model.safetensors"
    old = {"w": torch.randn(64, 64)}
    slimtorch.save(old, path)
    before = path.read_bytes()
    if where == "while writing":
        _interrupt_while_writing(monkeypatch)
    else:
        _fail_rename(monkeypatch)

    with pytest.raises((KeyboardInterrupt, OSError)):
        slimtorch.save({"w": torch.randn(64, 64), "b": torch.randn(64)}, path)

    monkeypatch.undo()
    assert path.read_bytes() == before
    assert _leftovers(tmp_path) == []
    _assert_same(slimtorch.load(path).tensors, old)


def test_interrupted_sharded_save_leaves_the_previous_folder_as_it_was(tmp_path, monkeypatch):
    folder, _ = _sharded(tmp_path)
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    _interrupt_while_writing(monkeypatch, after_calls=2)

    with pytest.raises(KeyboardInterrupt):
        slimtorch.save(TinyGPT().state_dict(), folder, shard_bytes=100_000)

    monkeypatch.undo()
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    assert _leftovers(tmp_path) == []
    slimtorch.load(folder)


def test_saving_over_a_slim_folder_replaces_it_whole_and_leaves_no_temp_folder(tmp_path):
    folder, _ = _sharded(tmp_path)
    new = MLP().state_dict()

    slimtorch.save(new, folder)

    assert sorted(p.name for p in folder.iterdir()) == ["model.safetensors"]  # no stale shards or index
    _assert_same(slimtorch.load(folder).tensors, new)
    assert _leftovers(tmp_path) == []


def test_saving_into_an_existing_empty_folder_is_fine(tmp_path):
    folder = tmp_path / "out"
    folder.mkdir()

    slimtorch.save(MLP().state_dict(), folder)

    assert (folder / "model.safetensors").is_file()


def _plain_weights(folder) -> None:
    save_file({"w": torch.randn(4, 4)}, folder / "model.safetensors")


@pytest.mark.parametrize(
    "contents",
    [
        lambda folder: (folder / "notes.txt").write_text("a week of work"),
        _plain_weights,
    ],
    ids=["user files", "plain safetensors"],
)
def test_a_folder_that_is_not_a_slim_checkpoint_is_never_replaced(tmp_path, capsys, contents):
    folder = tmp_path / "work"
    folder.mkdir()
    contents(folder)
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    checkpoint = tmp_path / "mlp.pt"
    torch.save(MLP().state_dict(), checkpoint)

    with pytest.raises(slimtorch.SlimtorchError, match="refusing to replace"):
        slimtorch.save(MLP().state_dict(), folder)
    assert main(["shrink", str(checkpoint), "-o", str(folder)]) == 2

    err = capsys.readouterr().err
    assert err.startswith("slimtorch: error: ") and len(err.strip().splitlines()) == 1
    assert "refusing to replace" in err
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    assert _leftovers(tmp_path) == []


def test_training_checkpoint_round_trip_through_shrink_and_load(tmp_path):
    """The whole path on a real checkpoint: torch.save -> shrink -> load -> load_state_dict."""
    model = SmallCNN()
    checkpoint = tmp_path / "ckpt.pt"
    torch.save(trained_checkpoint(model, torch.randn(2, 1, 8, 8)), checkpoint)
    out = tmp_path / "model.safetensors"

    slimtorch.shrink(checkpoint, out)

    fresh = SmallCNN()
    fresh.load_state_dict(slimtorch.load(out).tensors)
    _assert_same(fresh.state_dict(), model.state_dict())


def test_the_fast_crc32_gives_zlibs_values_so_files_stay_readable_either_way() -> None:
    import zlib

    from slimtorch.format import layout

    data = memoryview(torch.randint(0, 256, (3 * 2**20 + 7,), dtype=torch.uint8).numpy())
    for piece in (data, data[1:], data[: 2**20 + 3], memoryview(b"")):
        assert layout.crc32(piece) == zlib.crc32(piece)
    tensor = torch.randn(1000, 37)
    assert layout.crc32_chunks(tensor) == [zlib.crc32(layout.tensor_bytes(tensor))]
    isal = pytest.importorskip("isal.isal_zlib")
    assert layout.crc32 is isal.crc32  # installed: the fast one is the one used
