"""slimtorch inspect: every byte in one category, sparsity per tensor, and what each action would save."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from torch.nn.utils import prune

import slimtorch
from slimtorch.cli.main import main
from slimtorch.inspection.breakdown import CATEGORIES
from tests.zoo import MLP, SmallCNN, TinyGPT, trained_checkpoint


def _save(tmp_path, obj, name="model.pt", **kwargs):
    path = tmp_path / name
    torch.save(obj, path, **kwargs)
    return path


def _saving(report: slimtorch.InspectReport, action_start: str):
    return next(s for s in report.savings if s.action.startswith(action_start))


def test_global_unstructured_90pct_shows_mask_leftovers_and_sparse_finalize_saves_most_of_the_file(tmp_path):
    model = MLP((256, 512, 512, 10))
    weights = [(m, "weight") for m in model.modules() if isinstance(m, torch.nn.Linear)]
    prune.global_unstructured(weights, pruning_method=prune.L1Unstructured, amount=0.9)
    path = _save(tmp_path, model.state_dict())

    report = slimtorch.inspect(path)

    masks = [t for t in report.tensors if t.category == "pruning_leftovers"]
    assert {t.name for t in masks} == {f"layers.{i}.weight_mask" for i in (0, 2, 4)}
    assert report.category("pruning_leftovers") > 0.45 * report.file_bytes  # the masks double the file
    # The weight prune would produce (orig * mask) is 90% zeros overall, though weight_orig itself is dense.
    origs = [t for t in report.tensors if t.name.endswith("weight_orig")]
    zeros = sum(t.sparsity * t.nbytes for t in origs) / sum(t.nbytes for t in origs)
    assert zeros == pytest.approx(0.9, abs=0.01)
    # Each mask's own zeros, counted in the same pass, match its weight's (random weights are never 0).
    sparsity = {t.name: t.sparsity for t in report.tensors}
    assert all(sparsity[m.name] == sparsity[m.name.replace("_mask", "_orig")] for m in masks)
    finalize = _saving(report, "finalize pruning")
    sparse = _saving(report, "store zeros sparsely")
    assert finalize.lossless and finalize.bytes_after < 0.52 * report.file_bytes
    assert sparse.bytes_after < 0.10 * report.file_bytes  # finalize + sparse keeps under a tenth


def test_training_checkpoint_puts_adam_state_in_optimizer_category(tmp_path):
    model = SmallCNN()
    path = _save(tmp_path, trained_checkpoint(model, torch.randn(2, 1, 8, 8)))

    report = slimtorch.inspect(path)

    params = sum(p.numel() * 4 for p in model.parameters())
    assert report.category("optimizer_state") == pytest.approx(2 * params, rel=0.01)  # exp_avg + exp_avg_sq
    assert report.category("parameters") == params
    buffers = {t.name for t in report.tensors if t.category == "buffers"}
    assert "model.features.1.running_var" in buffers and "model.features.1.num_batches_tracked" in buffers
    drop = _saving(report, "drop optimizer")
    assert drop.saved >= 2 * params


def test_categories_account_for_every_byte_of_the_file(tmp_path):
    model = TinyGPT()
    checkpoint = trained_checkpoint(model, torch.randint(0, 512, (2, 8)))
    checkpoint["window"] = torch.randn(1000)[:10]
    for path in (
        _save(tmp_path, checkpoint),
        _save(tmp_path, checkpoint, "old.pt", _use_new_zipfile_serialization=False),
    ):
        report = slimtorch.inspect(path)
        assert sum(b.bytes for b in report.categories) == report.file_bytes == path.stat().st_size
        assert [b.name for b in report.categories] == [c for c in CATEGORIES if report.category(c)]


def test_tied_embedding_is_counted_once_and_reported_as_tied(tmp_path):
    model = TinyGPT()
    path = _save(tmp_path, model.state_dict())

    report = slimtorch.inspect(path)

    head = next(t for t in report.tensors if t.name == "head.weight")
    assert head.stored_bytes == 0 and head.shares_with == "embed.weight"
    assert report.tied.tensors == 1 and report.tied.bytes == head.nbytes
    assert report.category("parameters") == sum(p.numel() * 4 for p in model.parameters())


def test_identical_copies_in_separate_storages_are_found_as_duplicates(tmp_path):
    state = SmallCNN().state_dict()
    path = _save(tmp_path, {"model": state, "best_model": {k: v.clone() for k, v in state.items()}})

    report = slimtorch.inspect(path)

    duplicates = {t.name: t.shares_with for t in report.tensors if t.category == "duplicates"}
    assert duplicates["best_model.features.3.weight"] == "model.features.3.weight"
    assert all(name.startswith("best_model.") for name in duplicates)
    assert _saving(report, "store duplicates once").saved >= sum(
        t.stored_bytes for t in report.tensors if t.category == "duplicates"
    )


def test_a_saved_view_reveals_the_storage_it_drags_along(tmp_path):
    big = torch.randn(100_000)
    path = _save(tmp_path, {"first_ten": big[:10]})

    report = slimtorch.inspect(path)

    assert report.category("unreferenced_storage") == (100_000 - 10) * 4
    assert any("clone()" in note for note in report.notes)


def test_sparsity_is_the_fraction_of_exact_zeros_per_tensor(tmp_path):
    values = torch.tensor([0.0, -0.0, 1.0, 2.0] * 25)
    path = tmp_path / "s.safetensors"
    save_file({"half": values, "none": torch.ones(10), "all": torch.zeros(10), "empty": torch.zeros(0)}, path)

    stats = {t.name: t.sparsity for t in slimtorch.inspect(path).tensors}

    assert stats == {"half": 0.5, "none": 0.0, "all": 1.0, "empty": None}


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.uint16, torch.bfloat16, torch.bool])
def test_zero_counting_works_for_dtypes_without_a_count_nonzero_kernel(tmp_path, dtype):
    values = torch.tensor([0, 1, 0, 1, 1, 0, 0, 0]).to(dtype)
    path = _save(tmp_path, {"x": values})
    assert slimtorch.inspect(path).tensors[0].sparsity == 0.625


def test_no_scan_reads_no_data_and_says_so(tmp_path):
    path = _save(tmp_path, SmallCNN().state_dict())
    report = slimtorch.inspect(path, scan=False)
    assert all(t.sparsity is None for t in report.tensors)
    assert any("not scanned" in note for note in report.notes)


def test_lossy_estimates_follow_the_codec_sizes(tmp_path):
    path = tmp_path / "w.safetensors"
    save_file({"weight": torch.randn(1024, 1024), "bias": torch.randn(1024)}, path)

    report = slimtorch.inspect(path)

    header = report.category("non_tensor") + report.category("format_overhead")
    assert _saving(report, "+ fp16").bytes_after == header + 2 * (1024 * 1024 + 1024)
    assert (
        _saving(report, "+ int8").bytes_after == header + 1024 * 1024 + 1024 * 4 + 1024 * 4
    )  # bias stays fp32
    # int4: half a byte per weight, a float16 scale and zero point per group of 32 (shrink's default)
    groups = 1024 * 1024 // 32
    assert _saving(report, "+ int4").bytes_after == header + 1024 * 1024 // 2 + groups * 4 + 1024 * 4


def test_module_tree_sums_bytes_per_prefix_to_the_requested_depth(tmp_path):
    path = _save(tmp_path, trained_checkpoint(SmallCNN(), torch.randn(2, 1, 8, 8)))

    tree = {n.prefix: n for n in slimtorch.inspect(path, depth=2).tree}

    assert max(n.depth for n in tree.values()) == 2
    assert tree["model"].bytes == tree["model.features"].bytes + tree["model.head"].bytes
    # AdamW keeps exp_avg, exp_avg_sq and a step tensor per parameter.
    assert tree["optimizer.state"].tensors == 3 * len(list(SmallCNN().parameters()))


def test_json_output_follows_the_documented_schema(tmp_path, capsys):
    path = _save(tmp_path, trained_checkpoint(SmallCNN(), torch.randn(2, 1, 8, 8)))

    assert main(["inspect", str(path), "--json", "--top", "3"]) == 0
    data = json.loads(capsys.readouterr().out)

    assert data["schema"] == "slimtorch.inspect/1"
    assert set(data) == {
        "schema",
        "path",
        "format",
        "file_bytes",
        "tensor_bytes",
        "stored_bytes",
        "categories",
        "tied",
        "by_dtype",
        "tree",
        "largest",
        "tensors",
        "objects",
        "savings",
        "scanned",
        "notes",
    }
    assert len(data["largest"]) == 3
    assert set(data["tensors"][0]) == {
        "name",
        "dtype",
        "shape",
        "nbytes",
        "stored_bytes",
        "category",
        "sparsity",
        "shares_with",
        "codec",
    }
    assert data["savings"]["estimates"] is False
    assert sum(c["bytes"] for c in data["categories"].values()) == data["file_bytes"]


def test_human_report_shows_each_section(tmp_path, capsys):
    path = _save(tmp_path, trained_checkpoint(SmallCNN(), torch.randn(2, 1, 8, 8)))

    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out

    for heading in (
        "Where the bytes go",
        "By dtype",
        "By module",
        "Largest",
        "What you could save (slimtorch shrink)",
    ):
        assert heading in out
    assert "optimizer state" in out and "epoch=3" in out


@pytest.mark.slow
@pytest.mark.parametrize(
    ("action", "options"),
    [
        ("store zeros sparsely", slimtorch.ShrinkOptions()),
        ("+ int8", slimtorch.ShrinkOptions(quantize="int8-weight")),
        ("+ int4", slimtorch.ShrinkOptions(quantize="int4-weight")),
        ("+ fp16", slimtorch.ShrinkOptions(dtype="fp16")),
    ],
)
def test_what_you_could_save_is_what_shrink_writes(tmp_path, action, options):
    model = TinyGPT()
    weights = [(m, "weight") for m in model.blocks.modules() if isinstance(m, torch.nn.Linear)]
    prune.global_unstructured(weights, pruning_method=prune.L1Unstructured, amount=0.8)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randint(0, 100, (2, 8))).sum().backward()
    optimizer.step()
    path = _save(tmp_path, {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": 3})

    report = slimtorch.inspect(path)
    shrunk = slimtorch.shrink(path, tmp_path / "out.safetensors", options=options)

    header_and_pickle = report.file_bytes - report.stored_bytes
    predicted_tensor_bytes = _saving(report, action).bytes_after - header_and_pickle
    assert predicted_tensor_bytes == sum(t.after_bytes for t in shrunk.tensors)


def test_inspect_shows_the_codec_of_each_tensor_in_a_slim_file(tmp_path, capsys):
    model = TinyGPT()
    slimtorch.save(model.state_dict(), tmp_path / "slim.safetensors", quantize="int8-weight")

    report = slimtorch.inspect(tmp_path / "slim.safetensors")

    codecs = {t.name: t.codec for t in report.tensors}
    assert codecs["embed.weight"] == "int8"
    assert not any("int" in codec for name, codec in codecs.items() if name.endswith(".bias"))
    embed = next(t for t in report.tensors if t.name == "embed.weight")
    assert embed.stored_bytes < embed.nbytes / 3
    assert main(["inspect", str(tmp_path / "slim.safetensors")]) == 0
    assert "int8" in capsys.readouterr().out
