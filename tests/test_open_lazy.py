"""slimtorch.open: one tensor, or some rows of it, without reading or decoding the others."""

from __future__ import annotations

import pytest
import safetensors.torch
import torch

import slimtorch
from slimtorch.format import layout as slim_format
from slimtorch.sources import slim
from tests.hostile import data_range


@pytest.fixture
def weights() -> dict[str, torch.Tensor]:
    sparse = torch.randn(96, 64)
    sparse[torch.rand(96, 64) < 0.9] = 0
    return {"a": torch.randn(96, 64), "b": torch.randn(128, 256), "sparse": sparse, "bias": torch.randn(64)}


@pytest.mark.parametrize("quantize", [None, "int8-weight", "int4-weight"])
def test_get_decodes_only_the_tensor_asked_for(weights, tmp_path, monkeypatch, quantize) -> None:
    path = tmp_path / "w.safetensors"
    slimtorch.save(weights, path, quantize=quantize, group_size=64)
    expected = slimtorch.load(path).tensors["b"]
    decoded: list[list] = []
    mapped: list[str] = []
    real_decode, real_map = slim.decode, slim.SlimSource._map
    monkeypatch.setattr(
        slim, "decode", lambda parts, stages, *a: decoded.append(stages) or real_decode(parts, stages, *a)
    )
    monkeypatch.setattr(
        slim.SlimSource, "_map", lambda self, info: mapped.append(info.name) or real_map(self, info)
    )
    with slimtorch.open(path) as source:
        assert torch.equal(source.get("b"), expected)
        assert len(decoded) == (quantize is not None)  # one decode, of b, or none when stored as is
        assert mapped and all(key == "b" or key.startswith("b::") for key in mapped)


@pytest.mark.parametrize("quantize", [None, "int8-weight", "int4-weight"])
def test_rows_equal_the_same_rows_of_the_whole_tensor(weights, tmp_path, quantize) -> None:
    path = tmp_path / "w.safetensors"
    slimtorch.save(weights, path, quantize=quantize, group_size=64)
    with slimtorch.open(path) as source:
        for name in weights:
            whole = source.get(name)
            for start, stop in [(0, 1), (5, 17), (90, 200), (-10, -2), (7, 3)]:
                assert torch.equal(source.get_rows(name, start, stop), whole[start:stop]), (name, start, stop)


def test_rows_of_a_raw_tensor_are_a_view_of_the_file_mapping(tmp_path) -> None:
    path = tmp_path / "w.safetensors"
    safetensors.torch.save_file({"w": torch.randn(256, 256)}, path)
    with slimtorch.open(path) as source:
        rows = source.get_rows("w", 100, 110)
        assert rows.untyped_storage().data_ptr() == source.get("w").untyped_storage().data_ptr()
        assert rows.shape == (10, 256)
    with slimtorch.open(path) as source, pytest.raises(ValueError, match="0-d"):
        safetensors.torch.save_file({"s": torch.tensor(1.0)}, tmp_path / "s.safetensors")
        slimtorch.open(tmp_path / "s.safetensors").get_rows("s", 0, 1)


def test_rows_verify_only_the_checksum_chunks_they_fall_in(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(slim_format, "CHECKSUM_CHUNK", 1024)  # the writer's chunk: 4 rows of 256 bytes
    monkeypatch.setattr(slim, "CHECKSUM_CHUNK", 1024)
    path = tmp_path / "w.safetensors"
    slimtorch.save({"w": torch.randn(64, 64)}, path)
    start, _ = data_range(path, "w")
    data = bytearray(path.read_bytes())
    data[start + 60 * 256 + 3] ^= 0x10  # a byte of row 60
    path.write_bytes(bytes(data))
    with slimtorch.open(path) as source:
        assert source.get_rows("w", 0, 8).shape == (8, 64)  # chunks 0-1: intact
        with pytest.raises(slimtorch.FormatError, match=r"'w'.*checksum mismatch"):
            source.get_rows("w", 56, 64)
        with pytest.raises(slimtorch.FormatError, match="checksum mismatch"):
            source.get("w")
