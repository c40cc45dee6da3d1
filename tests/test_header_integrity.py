"""Header integrity of slim checkpoints: the header is sealed, damage to it is found, never half believed.

The parts' CRC-32s guard the data; the seal (``__metadata__["slimtorch.crc"]``) guards the rest: every
tensor's name, dtype, shape and offsets and the slimtorch JSON. Every shard records the save's id and its
shard count. Files are damaged byte by byte here, as a bad disk or a hand edit would; a hand edit that
reseals the header is judged by the checks behind the seal (tests/test_slim_format.py).
"""

from __future__ import annotations

import json
import random
import shutil
import time
from pathlib import Path

import pytest
import torch

import slimtorch
from slimtorch.cli.main import main
from slimtorch.format.layout import CRC_KEY, METADATA_KEY, is_slim
from tests.hostile import read_safetensors, write_safetensors_raw
from tests.support.header import KINDS, flip_bits, slim_template, small_state


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_random_single_bit_flips_in_slim_files_are_detected_or_harmless(tmp_path, kind):
    path = slim_template(tmp_path, kind)
    clock = time.perf_counter()

    counts = flip_bits(path, 200, random.Random(f"flips-{kind}"))

    assert counts.silent == [], counts
    assert counts.detected + counts.harmless == 200
    assert counts.detected > 150, counts  # most flips change something, and each of those is found
    assert time.perf_counter() - clock < 10


# -- the seal ----------------------------------------------------------------------------------------------
def _write(path: Path, header: dict, data: bytes) -> Path:
    """Write a header as is, its seal not recomputed (as a bad disk or a careless edit leaves it)."""
    return write_safetensors_raw(path, header, data, reseal=False)


def _edit_body(path: Path, edit) -> Path:
    header, data = read_safetensors(path)
    body = json.loads(header["__metadata__"][METADATA_KEY])
    edit(body)
    header["__metadata__"][METADATA_KEY] = json.dumps(body)
    return _write(path, header, data)


def _saved(tmp_path, **options) -> Path:
    path = tmp_path / "model.safetensors"
    slimtorch.save(small_state(), path, **options)
    return path


def test_renaming_a_tensor_everywhere_in_the_header_is_caught_by_the_seal(tmp_path):
    path = _saved(tmp_path)
    header, data = read_safetensors(path)
    header["norm.weigth"] = header.pop("norm.weight")
    body = json.loads(header["__metadata__"][METADATA_KEY])
    entry = body["tensors"].pop("norm.weight")
    entry["parts"] = {"": "norm.weigth"}
    body["tensors"]["norm.weigth"] = entry
    header["__metadata__"][METADATA_KEY] = json.dumps(body)
    _write(path, header, data)

    with pytest.raises(slimtorch.FormatError, match="header checksum mismatch"):
        slimtorch.load(path)


def test_relabelling_float16_parts_as_bfloat16_is_caught(tmp_path):
    path = _saved(tmp_path, dtype="fp16")
    header, data = read_safetensors(path)
    relabelled = [key for key, entry in header.items() if key != "__metadata__" and entry["dtype"] == "F16"]
    for key in relabelled:
        header[key]["dtype"] = "BF16"
    _write(path, header, data)

    assert relabelled
    with pytest.raises(slimtorch.FormatError, match="header checksum mismatch"):
        slimtorch.load(path)


def test_swapping_two_parts_with_their_checksums_is_caught(tmp_path):
    path = tmp_path / "model.safetensors"
    slimtorch.save({"a": torch.randn(8, 8), "b": torch.randn(8, 8)}, path)
    header, data = read_safetensors(path)
    header["a"]["data_offsets"], header["b"]["data_offsets"] = (
        header["b"]["data_offsets"],
        header["a"]["data_offsets"],
    )
    _write(path, header, data)
    _edit_body(path, lambda body: _swap(body["tensors"]["a"], body["tensors"]["b"], "crc32"))

    with pytest.raises(slimtorch.FormatError, match="header checksum mismatch"):
        slimtorch.load(path)


def _swap(first: dict, second: dict, key: str) -> None:
    first[key], second[key] = second[key], first[key]


@pytest.mark.parametrize("damaged_key", ["slimtorcx", "Slimtorch", "slimtorch "])
def test_a_damaged_slimtorch_key_is_corrupt_not_plain_safetensors(tmp_path, damaged_key):
    path = _saved(tmp_path, quantize="int8-weight")
    header, data = read_safetensors(path)
    header["__metadata__"][damaged_key] = header["__metadata__"].pop(METADATA_KEY)
    _write(path, header, data)

    with pytest.raises(slimtorch.FormatError, match="slimtorch metadata is missing or damaged"):
        slimtorch.load(path)


def test_a_damaged_seal_key_is_refused_not_skipped(tmp_path):
    path = _saved(tmp_path)
    header, data = read_safetensors(path)
    header["__metadata__"]["slimtorch.cbc"] = header["__metadata__"].pop(CRC_KEY)
    _write(path, header, data)

    with pytest.raises(slimtorch.FormatError, match=r"header checksum .* missing"):
        slimtorch.load(path)


def _unsealed(path: Path) -> Path:
    """The file as slimtorch wrote it before the seal: no seal, no ``minor``, no shard count."""
    header, data = read_safetensors(path)
    del header["__metadata__"][CRC_KEY]
    _write(path, header, data)
    return _edit_body(path, lambda body: [body.pop("minor"), body.pop("shards")])


def test_files_written_before_the_seal_still_load_and_verify_their_parts(tmp_path):
    path = _unsealed(_saved(tmp_path))
    loaded = slimtorch.load(path).tensors
    assert all(torch.equal(loaded[name], tensor) for name, tensor in small_state().items())
    header, data = read_safetensors(path)
    begin = header["norm.weight"]["data_offsets"][0]
    damaged = bytearray(data)
    damaged[begin] ^= 1
    _write(path, header, bytes(damaged))

    with pytest.raises(slimtorch.FormatError, match=r"norm\.weight.*checksum mismatch"):
        slimtorch.load(path)


def test_an_unsealed_file_with_a_damaged_slimtorch_key_is_still_corrupt(tmp_path):
    path = _unsealed(_saved(tmp_path))
    header, data = read_safetensors(path)
    header["__metadata__"]["slimtorcx"] = header["__metadata__"].pop(METADATA_KEY)
    _write(path, header, data)

    with pytest.raises(slimtorch.FormatError, match="slimtorch metadata is missing or damaged"):
        slimtorch.load(path)


def test_name_role_parts_without_slimtorch_metadata_are_corrupt(tmp_path):
    path = _saved(tmp_path, quantize="int8-weight")
    header, data = read_safetensors(path)
    del header["__metadata__"]
    _write(path, header, data)

    assert is_slim({}, ["fc.weight::q"]) and not is_slim({}, ["fc.weight"])
    with pytest.raises(slimtorch.FormatError, match="slimtorch metadata is missing or damaged"):
        slimtorch.load(path)


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ('{"format":"slimtorch","version":1,"shard":' + "9" * 5000 + "}", "not valid JSON"),
        (
            '{"format":"slimtorch","version":1,"delta":' + "[" * 100_000 + "]" * 100_000 + "}",
            "not valid JSON",
        ),
        ('{"format":"slimtorch","version":1,"minor":"1"}', "minor version"),
        ('{"format":"slimtorch","version":1,"minor":1,"shard":4,"shards":3,"tensors":{}}', "shard number 4"),
    ],
    ids=["huge integer", "deep nesting", "minor not a number", "shard past the count"],
)
def test_hostile_slimtorch_json_is_one_format_error(tmp_path, capsys, body, words):
    path = _saved(tmp_path)
    header, data = read_safetensors(path)
    header["__metadata__"][METADATA_KEY] = body
    _write(path, header, data)

    assert main(["inspect", str(path)]) == 2

    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and words in err and str(path) in err, err


# -- shards ------------------------------------------------------------------------------------------------
def _sharded(tmp_path) -> tuple[Path, list[Path]]:
    folder = slim_template(tmp_path, "sharded")
    shards = sorted(folder.glob("model-*.safetensors"))
    assert len(shards) == 3
    return folder, shards


def test_every_shard_records_the_save_id_and_the_shard_count(tmp_path):
    _, shards = _sharded(tmp_path)
    bodies = [json.loads(read_safetensors(shard)[0]["__metadata__"][METADATA_KEY]) for shard in shards]

    assert [(b["shard"], b["shards"]) for b in bodies] == [(1, 3), (2, 3), (3, 3)]
    assert len({b["checkpoint"] for b in bodies}) == 1
    assert len(bodies[0]["checkpoint"]) == 32


def test_a_missing_last_shard_is_found_by_the_recorded_count_whatever_the_file_names(tmp_path):
    folder, shards = _sharded(tmp_path)
    (folder / "model.safetensors.index.json").unlink()
    shards[-1].unlink()
    for number, shard in enumerate(shards[:-1], start=1):  # names that claim two shards in all
        shard.rename(folder / f"model-{number:05d}-of-00002.safetensors")

    with pytest.raises(slimtorch.FormatError, match="shard 3 of 3 is missing"):
        slimtorch.load(folder)


def test_a_shard_dropped_from_the_index_is_found(tmp_path):
    folder, shards = _sharded(tmp_path)
    index = folder / "model.safetensors.index.json"
    body = json.loads(index.read_text())
    body["weight_map"] = {k: v for k, v in body["weight_map"].items() if v != shards[-1].name}
    index.write_text(json.dumps(body))

    with pytest.raises(slimtorch.FormatError, match="shard 3 of 3 is missing"):
        slimtorch.load(folder)


def test_a_part_dropped_from_the_index_is_found(tmp_path):
    folder, _ = _sharded(tmp_path)
    index = folder / "model.safetensors.index.json"
    body = json.loads(index.read_text())
    dropped = sorted(body["weight_map"])[0]
    del body["weight_map"][dropped]
    index.write_text(json.dumps(body))

    with pytest.raises(slimtorch.FormatError, match=f"part '{dropped}' .* not listed"):
        slimtorch.load(folder)


def test_a_shard_copied_under_another_number_is_found(tmp_path):
    folder, shards = _sharded(tmp_path)
    (folder / "model.safetensors.index.json").unlink()
    shards[-1].unlink()
    shutil.copyfile(shards[0], shards[-1])

    with pytest.raises(slimtorch.FormatError, match="shard 1 is there twice"):
        slimtorch.load(folder)


def test_a_shard_from_another_save_with_the_same_count_is_found(tmp_path):
    folder, shards = _sharded(tmp_path)
    (tmp_path / "other").mkdir()
    other = slim_template(tmp_path / "other", "sharded")
    shutil.copyfile(other / shards[1].name, shards[1])

    with pytest.raises(slimtorch.FormatError, match="different save"):
        slimtorch.load(folder)


def test_hostile_index_json_is_one_format_error(tmp_path):
    folder, _ = _sharded(tmp_path)
    index = folder / "model.safetensors.index.json"
    index.write_text('{"weight_map": ' + "[" * 100_000 + "]" * 100_000 + "}")

    with pytest.raises(slimtorch.FormatError, match="not a valid shard index"):
        slimtorch.load(folder)


def test_a_config_with_a_huge_integer_is_one_format_error(tmp_path):
    folder, _ = _sharded(tmp_path)
    (folder / "config.json").write_text('{"hidden_size": ' + "9" * 5000 + "}")

    with pytest.raises(slimtorch.FormatError, match=r"config\.json is not valid JSON"):
        slimtorch.open(folder)


# -- reserved names ----------------------------------------------------------------------------------------
def test_a_tensor_named_metadata_is_refused_by_save_before_writing(tmp_path):
    path = tmp_path / "model.safetensors"

    with pytest.raises(slimtorch.SlimtorchError, match="'__metadata__' cannot be saved"):
        slimtorch.save({"__metadata__": torch.randn(4), "w": torch.randn(4)}, path)

    assert list(tmp_path.iterdir()) == []


def test_a_tensor_named_metadata_is_refused_by_shrink_with_one_line(tmp_path, capsys):
    checkpoint = tmp_path / "ckpt.pt"
    torch.save({"__metadata__": torch.randn(4), "w": torch.randn(4)}, checkpoint)
    out = tmp_path / "out.safetensors"

    assert main(["shrink", str(checkpoint), "-o", str(out)]) == 2

    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "'__metadata__' cannot be saved" in err, err
    assert not out.exists()
