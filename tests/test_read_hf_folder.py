"""Reading Hugging Face model folders: what transformers writes, sharded or not, safetensors or .bin.

Every folder is written at test time by the real writers (``save_pretrained``, ``torch.save``,
``huggingface_hub``'s shard splitter) from small models built from configs: no network, no committed binaries.

What transformers 5.x writes, as these tests pin it down:

- ``save_pretrained`` writes only safetensors. ``safe_serialization`` is no longer a parameter: passed anyway
  it falls into ``**kwargs`` and is silently ignored (still safetensors), so the .bin folders below are built
  the way transformers 4.x built them: ``huggingface_hub.split_torch_state_dict_into_shards``, one
  ``torch.save`` per shard, and a ``pytorch_model.bin.index.json`` in the HF layout.
- The saved names are exactly ``state_dict()``'s (non-persistent buffers such as BERT's ``position_ids`` are
  in neither), except tied weights: GPT-2's ``lm_head.weight`` is dropped from the safetensors file, and
  ``tie_word_embeddings`` in config.json says so.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from huggingface_hub import split_torch_state_dict_into_shards
from safetensors.torch import load_file, save_file
from transformers import BertConfig, BertModel, GPT2Config, GPT2LMHeadModel

import slimtorch
from slimtorch.cli.main import main

SHARD_SIZE = "50KB"  # the BERT below is ~150 KB of float32: three shards


def tiny_bert() -> BertModel:
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=100,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
    )
    return BertModel(config).eval()


def tiny_gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=100, n_positions=64)
    config.bos_token_id = config.eos_token_id = 99  # the defaults (50256) lie outside this tiny vocabulary
    return GPT2LMHeadModel(config).eval()


def save_bin_shards(state_dict: dict[str, torch.Tensor], folder: Path, max_shard_size: str) -> None:
    """What ``save_pretrained(..., safe_serialization=False)`` wrote in transformers 4.x.

    transformers 5.x no longer writes .bin files, so the folder is built from the same parts 4.x used: the
    shard plan from huggingface_hub, one ``torch.save`` per shard, and the index in the HF layout.
    """
    folder.mkdir(parents=True, exist_ok=True)
    split = split_torch_state_dict_into_shards(
        state_dict, filename_pattern="pytorch_model{suffix}.bin", max_shard_size=max_shard_size
    )
    for filename, names in split.filename_to_tensors.items():
        torch.save({name: state_dict[name].contiguous() for name in names}, folder / filename)
    if split.is_sharded:
        index = {"metadata": {**split.metadata}, "weight_map": split.tensor_to_filename}
        (folder / "pytorch_model.bin.index.json").write_text(json.dumps(index, indent=2))


def saved_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor in a folder's weight files, read by the format's own reference loader."""
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(shard))
    for shard in sorted(folder.glob("*.bin")):
        tensors.update(torch.load(shard, weights_only=True))
    return tensors


def assert_same_bits(actual: torch.Tensor, expected: torch.Tensor, name: str) -> None:
    assert actual.dtype == expected.dtype, name
    assert actual.shape == expected.shape, name
    as_bytes = [t.detach().contiguous().reshape(-1).view(torch.uint8) for t in (actual, expected)]
    assert torch.equal(*as_bytes), f"{name}: bytes differ"


def assert_reads_back(folder: Path) -> slimtorch.TensorSource:
    """The folder opens, lists exactly the saved tensors, and every one reads back bit for bit."""
    expected = saved_tensors(folder)
    source = slimtorch.open(folder)
    assert sorted(source.names()) == sorted(expected)
    assert len(source.names()) == len(set(source.names()))
    for name, tensor in expected.items():
        info = source.info(name)
        assert (info.dtype, info.shape) == (tensor.dtype, tuple(tensor.shape)), name
        assert_same_bits(source.get(name), tensor, name)
    return source


def folder_bytes(folder: Path, *names: str) -> int:
    return sum((folder / name).stat().st_size for name in names)


@pytest.fixture(scope="module")
def bert() -> BertModel:
    return tiny_bert()


@pytest.fixture(scope="module")
def sharded_safetensors(bert: BertModel, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("bert-sharded-safetensors")
    bert.save_pretrained(folder, max_shard_size=SHARD_SIZE)
    return folder


@pytest.fixture
def broken_folder(sharded_safetensors: Path, tmp_path: Path) -> Path:
    """A private copy of the sharded folder that a test may damage."""
    return Path(shutil.copytree(sharded_safetensors, tmp_path / "model"))


def rewrite_index(folder: Path, change) -> Path:
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    change(index["weight_map"])
    index_path.write_text(json.dumps(index))
    return index_path


# -- sharded and single-file folders ------------------------------------------------------------------------


def test_save_pretrained_with_small_shards_writes_safetensors_shards_and_an_index(sharded_safetensors: Path):
    shards = sorted(p.name for p in sharded_safetensors.glob("*.safetensors"))
    assert len(shards) > 1
    assert shards == [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    assert (sharded_safetensors / "model.safetensors.index.json").is_file()
    assert not list(sharded_safetensors.glob("*.bin"))


def test_sharded_safetensors_folder_lists_every_saved_tensor_with_its_dtype_shape_and_bits(
    sharded_safetensors: Path, bert: BertModel
):
    source = assert_reads_back(sharded_safetensors)
    weight_map = json.loads((sharded_safetensors / "model.safetensors.index.json").read_text())["weight_map"]
    assert sorted(source.names()) == sorted(weight_map)
    assert source.format == "hf-folder (safetensors, sharded)"
    assert set(source.names()) == set(bert.state_dict())
    for name in source.names():
        assert_same_bits(source.get(name), bert.state_dict()[name], name)


def test_sharded_safetensors_folder_reads_each_tensor_from_the_shard_the_index_names(
    sharded_safetensors: Path,
):
    weight_map = json.loads((sharded_safetensors / "model.safetensors.index.json").read_text())["weight_map"]
    source = slimtorch.open(sharded_safetensors)
    for name, shard in weight_map.items():
        assert source.locations[source.info(name).storage].file.name == shard


def test_sharded_bin_folder_in_the_transformers_4_layout_lists_every_tensor_bit_for_bit(
    bert: BertModel, tmp_path: Path
):
    # transformers 5.x ignores safe_serialization=False (it writes safetensors anyway): build the 4.x layout.
    bert.save_pretrained(tmp_path / "ignored", max_shard_size=SHARD_SIZE, safe_serialization=False)
    assert not list((tmp_path / "ignored").glob("*.bin"))

    folder = tmp_path / "bert-bin"
    save_bin_shards(bert.state_dict(), folder, SHARD_SIZE)
    bert.config.save_pretrained(folder)
    shards = sorted(p.name for p in folder.glob("pytorch_model-*-of-*.bin"))
    assert len(shards) > 1
    assert (folder / "pytorch_model.bin.index.json").is_file()

    source = assert_reads_back(folder)
    assert set(source.names()) == set(bert.state_dict())
    assert source.format == "hf-folder (torch-zip, sharded)"


def test_single_file_folder_without_index_reads_model_safetensors(bert: BertModel, tmp_path: Path):
    bert.save_pretrained(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    source = assert_reads_back(tmp_path)
    assert source.format == "hf-folder (safetensors)"
    assert source.files == [tmp_path / "model.safetensors", tmp_path / "config.json"]


def test_folder_with_both_model_safetensors_and_pytorch_model_bin_reads_the_safetensors(
    bert: BertModel, tmp_path: Path
):
    bert.save_pretrained(tmp_path)
    state = bert.state_dict()
    torch.save({name: torch.zeros_like(t) for name, t in state.items()}, tmp_path / "pytorch_model.bin")
    source = slimtorch.open(tmp_path)
    assert "safetensors" in source.format
    assert all(f.suffix != ".bin" for f in source.files)
    name = "embeddings.word_embeddings.weight"
    assert_same_bits(source.get(name), state[name], name)


def test_single_model_safetensors_wins_over_sharded_bin_files_in_the_same_folder(
    bert: BertModel, tmp_path: Path
):
    # A common Hub layout: old .bin shards with their index, plus a model.safetensors converted later.
    bert.save_pretrained(tmp_path)
    save_bin_shards({k: torch.zeros_like(v) for k, v in bert.state_dict().items()}, tmp_path, SHARD_SIZE)
    assert (tmp_path / "pytorch_model.bin.index.json").is_file()
    source = slimtorch.open(tmp_path)
    assert source.format == "hf-folder (safetensors)"
    assert [f.name for f in source.files] == ["model.safetensors", "config.json"]


def test_sharded_folder_in_the_hub_cache_layout_reads_through_its_symlinks(
    sharded_safetensors: Path, tmp_path: Path
):
    # huggingface_hub's cache: snapshots/<revision>/<file> is a relative symlink to blobs/<hash>.
    blobs, snapshot = tmp_path / "blobs", tmp_path / "snapshots" / "0123abcd"
    blobs.mkdir()
    snapshot.mkdir(parents=True)
    for number, original in enumerate(sorted(sharded_safetensors.iterdir())):
        shutil.copy(original, blobs / f"blob{number}")
        (snapshot / original.name).symlink_to(Path("..", "..", "blobs", f"blob{number}"))
    source = assert_reads_back(snapshot)
    assert source.format == "hf-folder (safetensors, sharded)"
    assert source.file_bytes == sum(p.stat().st_size for p in blobs.iterdir())


def test_config_json_values_appear_as_objects(sharded_safetensors: Path):
    objects = {o.name: o for o in slimtorch.open(sharded_safetensors).objects}
    assert objects["config.model_type"].summary == "bert"
    assert objects["config.hidden_size"].summary == "32"
    assert objects["config.num_hidden_layers"].summary == "2"
    assert objects["config.vocab_size"].summary == "100"
    assert "BertModel" in objects["config.architectures"].summary


# -- tied weights -------------------------------------------------------------------------------------------


def test_gpt2_folder_stores_the_tied_embedding_once_and_inspect_counts_it_once(tmp_path: Path):
    model = tiny_gpt2()
    assert model.lm_head.weight is model.transformer.wte.weight
    model.save_pretrained(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
    ]
    # transformers drops the tied lm_head.weight from the file; config.json says it is tied.
    source = assert_reads_back(tmp_path)
    assert "lm_head.weight" not in source
    assert set(source.names()) == set(model.state_dict()) - {"lm_head.weight"}
    objects = {o.name: o.summary for o in source.objects}
    assert objects["config.tie_word_embeddings"] == "True"
    assert objects["config.model_type"] == "gpt2"

    report = slimtorch.inspect(tmp_path)
    assert len(report.tensors) == len(source.names())
    assert report.tied.tensors == 0
    assert report.category("duplicates") == 0
    tensor_bytes = sum(t.nbytes for t in model.state_dict().values()) - model.lm_head.weight.nbytes
    assert report.tensor_bytes == report.stored_bytes == tensor_bytes
    assert report.category("parameters") + report.category("buffers") == tensor_bytes
    assert report.file_bytes == folder_bytes(tmp_path, "model.safetensors", "config.json")


def test_gpt2_bin_folder_keeps_both_tied_names_and_inspect_counts_their_bytes_once(tmp_path: Path):
    model = tiny_gpt2()
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")  # torch.save keeps the tie as one storage
    model.config.save_pretrained(tmp_path)
    source = assert_reads_back(tmp_path)
    wte, head = source.info("transformer.wte.weight"), source.info("lm_head.weight")
    assert wte.storage == head.storage

    report = slimtorch.inspect(tmp_path)
    stats = {t.name: t for t in report.tensors}
    assert stats["lm_head.weight"].stored_bytes == 0
    assert stats["lm_head.weight"].shares_with == "transformer.wte.weight"
    assert stats["transformer.wte.weight"].stored_bytes == wte.nbytes
    assert report.tied.tensors == 1
    assert report.tied.bytes == wte.nbytes
    assert report.category("duplicates") == 0
    assert report.stored_bytes == report.tensor_bytes - wte.nbytes


# -- bad folders --------------------------------------------------------------------------------------------


def index_names_missing_shard(folder: Path) -> tuple[Path, type[Exception], str]:
    missing = sorted(folder.glob("model-*.safetensors"))[-1]
    missing.unlink()
    return folder / "model.safetensors.index.json", slimtorch.FormatError, missing.name


def index_names_tensor_absent_from_its_shard(folder: Path) -> tuple[Path, type[Exception], str]:
    index = rewrite_index(folder, lambda m: m.update({"ghost.weight": next(iter(m.values()))}))
    return index, slimtorch.FormatError, "ghost.weight"


def index_shard_escapes_folder(folder: Path) -> tuple[Path, type[Exception], str]:
    outside = folder.parent / "x.safetensors"
    save_file({"ghost.weight": torch.zeros(2)}, outside)  # it exists, and must still be refused
    index = rewrite_index(folder, lambda m: m.update({"ghost.weight": "../x.safetensors"}))
    return index, slimtorch.FormatError, "../x.safetensors"


def index_shard_is_an_absolute_path(folder: Path) -> tuple[Path, type[Exception], str]:
    outside = folder.parent / "abs.safetensors"
    save_file({"ghost.weight": torch.zeros(2)}, outside)
    index = rewrite_index(folder, lambda m: m.update({"ghost.weight": str(outside)}))
    return index, slimtorch.FormatError, "outside the folder"


def index_shard_name_has_a_nul_byte(folder: Path) -> tuple[Path, type[Exception], str]:
    index = rewrite_index(folder, lambda m: m.update({"ghost.weight": "model\0.safetensors"}))
    return index, slimtorch.FormatError, "outside the folder"


def index_is_not_json(folder: Path) -> tuple[Path, type[Exception], str]:
    index = folder / "model.safetensors.index.json"
    index.write_text('{"weight_map": {"a": "model-00001-of-00003.safetensors"')
    return index, slimtorch.FormatError, "index"


def index_without_weight_map(folder: Path) -> tuple[Path, type[Exception], str]:
    index = folder / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}}))
    return index, slimtorch.FormatError, "weight_map"


def folder_without_weights(folder: Path) -> tuple[Path, type[Exception], str]:
    for weights in [*folder.glob("*.safetensors"), *folder.glob("*.index.json")]:
        weights.unlink()
    return folder, slimtorch.CheckpointNotFoundError, "without weights"


def config_is_not_json(folder: Path) -> tuple[Path, type[Exception], str]:
    config = folder / "config.json"
    config.write_text("{not json")
    return config, slimtorch.FormatError, "not valid JSON"


BAD_FOLDERS = [
    index_names_missing_shard,
    index_names_tensor_absent_from_its_shard,
    index_shard_escapes_folder,
    index_shard_is_an_absolute_path,
    index_shard_name_has_a_nul_byte,
    index_is_not_json,
    index_without_weight_map,
    folder_without_weights,
    config_is_not_json,
]


@pytest.mark.parametrize("damage", BAD_FOLDERS, ids=lambda f: f.__name__)
def test_bad_folder_raises_a_slimtorch_error_that_names_the_file(broken_folder: Path, damage):
    culprit, error, detail = damage(broken_folder)
    with pytest.raises(error) as raised:
        slimtorch.open(broken_folder)
    assert isinstance(raised.value, slimtorch.SlimtorchError)
    message = str(raised.value)
    assert message.startswith(str(culprit))
    assert detail in message


@pytest.mark.parametrize("damage", BAD_FOLDERS, ids=lambda f: f.__name__)
def test_bad_folder_through_the_cli_exits_2_with_one_line_on_stderr(broken_folder: Path, damage, capsys):
    culprit, _, detail = damage(broken_folder)
    assert main(["inspect", str(broken_folder)]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.endswith("\n") and err.count("\n") == 1
    assert err.startswith(f"slimtorch: error: {culprit}")
    assert detail in err
    assert "Traceback" not in err


# -- the CLI ------------------------------------------------------------------------------------------------


def test_inspect_json_on_a_sharded_folder_reports_format_and_the_bytes_of_every_file_it_read(
    sharded_safetensors: Path, capsys
):
    assert main(["inspect", str(sharded_safetensors), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["format"].startswith("hf-folder")
    shards = sorted(p.name for p in sharded_safetensors.glob("*.safetensors"))
    expected = folder_bytes(sharded_safetensors, *shards, "model.safetensors.index.json", "config.json")
    assert report["file_bytes"] == expected
    assert report["path"] == str(sharded_safetensors)
    assert len(report["tensors"]) == len(saved_tensors(sharded_safetensors))
    assert sum(c["bytes"] for c in report["categories"].values()) == expected
    assert {"name": "config.model_type", "type": "str", "summary": "bert"} in report["objects"]


def test_inspect_of_a_folder_path_given_with_a_trailing_separator_works(sharded_safetensors: Path, capsys):
    assert main(["inspect", str(sharded_safetensors) + os.sep, "--json", "--no-scan"]) == 0
    assert json.loads(capsys.readouterr().out)["format"] == "hf-folder (safetensors, sharded)"
