"""inspect and shrink on every wild checkpoint, as its package ships it: the bytes inspect counts are the
bytes the libraries read, a lossless shrink changes no tensor and no output, int8 keeps the model's
output at cosine 0.99 and int4 at 0.95 (loaded back into the real class)."""

from __future__ import annotations

import pytest
import torch

from tests.wild.matrix import run, verdict
from tests.wild.models import MODELS, WildModel

every_model = pytest.mark.parametrize("model", MODELS, ids=str)
TINY = 10 * 1024
"""A file this small (lpips' 6 KB) grows by the format's own header whatever is stored: shrink says so in
a note (tests/test_shrink.py), and the size checks below are for larger files."""


@every_model
def test_inspect_cli_counts_the_tensor_bytes_the_library_itself_reads(model: WildModel, workdir) -> None:
    outcome = run(model, "inspect", workdir)
    assert verdict(model, outcome) is None, verdict(model, outcome)


@every_model
def test_lossless_shrink_keeps_every_tensor_and_the_output_bit_for_bit(model: WildModel, workdir) -> None:
    outcome = run(model, "shrink-lossless", workdir)
    assert verdict(model, outcome) is None, verdict(model, outcome)
    assert (
        outcome.size_after <= outcome.size_before * 1.05 or outcome.size_before < TINY
    )  # never a second copy


@every_model
def test_int8_shrink_keeps_the_real_output_at_cosine_099(model: WildModel, workdir) -> None:
    outcome = run(model, "shrink-int8", workdir)
    assert verdict(model, outcome) is None, verdict(model, outcome)
    assert outcome.size_after < outcome.size_before or outcome.size_before < TINY


@every_model
def test_int4_shrink_keeps_the_real_output_at_cosine_095(model: WildModel, workdir) -> None:
    outcome = run(model, "shrink-int4", workdir)
    assert verdict(model, outcome) is None, verdict(model, outcome)
    assert outcome.size_after < outcome.size_before or outcome.size_before < TINY


@every_model
def test_shrink_in_the_writers_large_file_paths_keeps_every_tensor_bit_for_bit(
    model: WildModel, workdir, monkeypatch
) -> None:
    """The streaming writer's large-file paths on real files (issue 46): the room kept as spaces (as above
    64 MiB) in a lossless shrink, whose tensors must equal those of a shrink written the usual way, and the
    header's room too small (its data moved once) in an int8 shrink, which must hold the same names."""
    import slimtorch
    from slimtorch.format import writer

    usual, roomy, moved = (workdir / f"{model.name}-{k}" for k in ("usual", "roomy", "moved"))  # folders
    slimtorch.shrink(model.path, usual)
    monkeypatch.setattr(writer, "STREAM_COMPACT", 0)
    slimtorch.shrink(model.path, roomy)
    monkeypatch.setattr(writer, "_header_room", lambda expected: 8)
    slimtorch.shrink(model.path, moved, quantize="int8-weight")

    expected, written = slimtorch.load(usual).tensors, slimtorch.load(roomy).tensors
    assert written.keys() == expected.keys() and written
    for name, value in written.items():
        assert torch.equal(value, expected[name]), name
    weights = [sum(f.stat().st_size for f in folder.glob("*.safetensors")) for folder in (usual, roomy)]
    assert weights[1] >= weights[0]  # the header's spaces kept (a file over 64 MiB keeps them anyway)
    assert slimtorch.load(moved).tensors.keys() == written.keys()
