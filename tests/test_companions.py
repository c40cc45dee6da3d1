"""What a model folder holds besides its weights (slimtorch.sources.companions) and how the writer carries it
into an output folder: sub-folders, the model card with its provenance, replacing its own output again."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from slimtorch.errors import FormatError, SlimtorchError
from slimtorch.format.codecs import encode
from slimtorch.format.writer import SlimWriter
from slimtorch.sources import companions
from slimtorch.sources.companions import companion_files, find_companions, model_card, source_provenance

TRANSFORMER = "sentence_transformers.models.Transformer"
POOLING = "sentence_transformers.models.Pooling"


def write(path: Path, text: str = "{}") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def modules(path: Path, transformer_path: str = "") -> None:
    listed = [
        {"idx": 0, "name": "0", "path": transformer_path, "type": TRANSFORMER},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": POOLING},
    ]
    write(path / "modules.json", json.dumps(listed))


@pytest.fixture
def sentence_folder(tmp_path: Path) -> Path:
    """A sentence-transformers folder with everything a real one holds, and what must stay behind."""
    folder = tmp_path / "minilm"
    for name in ("config.json", "tokenizer.json", "vocab.txt", "sentence_bert_config.json"):
        write(folder / name)
    modules(folder)
    write(folder / "1_Pooling" / "config.json", '{"pooling_mode_mean_tokens": true}')
    write(folder / "2_Dense" / "model.safetensors", "another module's weights, untouched")
    write(folder / "README.md", "# MiniLM\n")
    write(folder / "LICENSE", "Apache-2.0")
    write(folder / "model.safetensors", "weights")
    write(folder / "optimizer.pt", "training state")
    write(folder / "onnx" / "model.onnx", "old export")
    write(folder / "model-q4.gguf", "old export")
    write(folder / ".git" / "HEAD", "ref")
    return folder


def test_a_sentence_folder_brings_its_modules_pooling_card_and_licence_but_not_weights_or_exports(
    sentence_folder: Path,
) -> None:
    found = find_companions(sentence_folder)
    assert sorted(found.files) == [
        "1_Pooling/config.json",
        "2_Dense/model.safetensors",
        "LICENSE",
        "README.md",
        "config.json",
        "modules.json",
        "sentence_bert_config.json",
        "tokenizer.json",
        "vocab.txt",
    ]
    assert found.files["1_Pooling/config.json"] == sentence_folder / "1_Pooling" / "config.json"
    reasons = dict(line.split(": ", 1) for line in found.left_out)
    assert set(reasons) == {"model.safetensors", "optimizer.pt", "onnx/model.onnx", "model-q4.gguf"}
    assert "export" in reasons["onnx/model.onnx"] and "rewrites" in reasons["model.safetensors"]


def test_a_folder_without_a_card_gets_an_empty_one_for_the_writer_to_fill(tmp_path: Path) -> None:
    write(tmp_path / "bert" / "config.json")
    assert companion_files(tmp_path / "bert") == {
        "config.json": tmp_path / "bert" / "config.json",
        "README.md": b"",
    }


def test_the_old_layout_puts_the_transformer_at_the_top_and_modules_json_points_there(tmp_path: Path) -> None:
    folder = tmp_path / "old"
    modules(folder, "0_Transformer")
    write(folder / "config.json", '{"__version__": "0.3.9"}')  # sentence-transformers' own, not the model's
    write(folder / "1_Pooling" / "config.json")
    for name in ("config.json", "vocab.txt", "sentence_bert_config.json", "pytorch_model.bin"):
        write(folder / "0_Transformer" / name, name)
    for given in (folder, folder / "0_Transformer"):  # the folder, or the model folder open_model reports
        found = find_companions(given)
        assert found.files["config.json"] == folder / "0_Transformer" / "config.json"
        assert found.files["vocab.txt"] == folder / "0_Transformer" / "vocab.txt"
        assert "pytorch_model.bin" not in found.files and "0_Transformer/config.json" not in found.files
        listed = json.loads(found.files["modules.json"])
        assert [m["path"] for m in listed] == ["", "1_Pooling"]
        assert "config.json: 0_Transformer/config.json takes its place" in found.left_out


def test_a_link_leaving_the_folder_is_refused(tmp_path: Path) -> None:
    write(tmp_path / "secret", "token")
    write(tmp_path / "bert" / "config.json")
    (tmp_path / "bert" / "tokenizer.json").symlink_to(tmp_path / "secret")
    with pytest.raises(FormatError, match=r"tokenizer\.json: a symbolic link to a file outside the folder"):
        companion_files(tmp_path / "bert")


def test_a_pipe_in_the_folder_is_refused_not_read(tmp_path: Path) -> None:
    write(tmp_path / "bert" / "config.json")
    os.mkfifo(tmp_path / "bert" / "vocab.txt")
    with pytest.raises(FormatError, match=r"vocab\.txt: not a regular file"):
        companion_files(tmp_path / "bert")


def test_more_files_or_bytes_than_the_budget_is_refused_in_one_line(tmp_path, monkeypatch) -> None:
    for i in range(4):
        write(tmp_path / "bert" / f"extra-{i}.json", "x" * 100)
    monkeypatch.setattr(companions, "MAX_FILES", 3)
    with pytest.raises(SlimtorchError, match="more than 3 files"):
        companion_files(tmp_path / "bert")
    monkeypatch.setattr(companions, "MAX_FILES", 1000)
    monkeypatch.setattr(companions, "MAX_BYTES", 250)
    with pytest.raises(SlimtorchError, match="besides its weights"):
        companion_files(tmp_path / "bert")


def test_the_card_keeps_the_input_card_and_says_what_was_done(tmp_path: Path) -> None:
    card = write(tmp_path / "README.md", "---\nlicense: apache-2.0\n---\n# MiniLM\n")
    provenance = {
        "tool": "slimtorch 0.1.0",
        "command": "shrink",
        "source": "minilm",
        "source_bytes": 4096,
        "options": {"quantize": "int8-weight", "group_size": 32, "sparse": "auto", "skip": []},
    }
    text = model_card(card, provenance, {"quantized": {"fc": {"scheme": "int8-dynamic"}}}, 1024).decode()
    assert text.startswith("---\nlicense: apache-2.0\n---\n# MiniLM\n\n## slimtorch\n")
    assert "`slimtorch 0.1.0` (`shrink`) from `minilm`" in text
    assert "from `minilm`.\n\n- weights: 1 KiB, from 4 KiB (0.25x)" in text
    assert "`quantize=int8-weight`" in text and "sparse" not in text  # defaults left out, no int8 groups
    assert "1 layers quantized (int8-dynamic)" in text
    grouped = {**provenance, "options": {"quantize": "int4-weight", "group_size": 32}}
    assert "`quantize=int4-weight group_size=32`" in model_card(card, grouped, None, 1024).decode()
    assert model_card(b"", {}, None, 10).decode().startswith("# Model compressed with slimtorch\n")


def test_source_provenance_measures_the_input_weights(sentence_folder: Path) -> None:
    assert source_provenance("quantize int8-dynamic", sentence_folder) == {
        "command": "quantize int8-dynamic",
        "source": "minilm",
        "source_bytes": len("weights"),
    }


def _write_folder(out: Path, extra: dict) -> list[Path]:
    provenance = {"tool": "slimtorch test"}
    card = lambda old, written: model_card(old, provenance, None, written)  # noqa: E731
    with SlimWriter(out, extra_files=extra, provenance=provenance, card=card) as writer:
        writer.add("fc.weight", encode(torch.ones(2, 2), []), torch.float32, (2, 2))
    return [p for p in out.rglob("*") if p.is_file()]


def test_the_writer_copies_sub_folders_writes_the_card_and_replaces_its_own_output(
    sentence_folder: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    extra = companion_files(sentence_folder)
    _write_folder(out, extra)
    assert (out / "1_Pooling" / "config.json").read_text() == '{"pooling_mode_mean_tokens": true}'
    assert (out / "README.md").read_text().startswith("# MiniLM\n\n## slimtorch\n")
    _write_folder(out, extra)  # again: its own sub-folders and card are no one's work
    assert (out / "2_Dense" / "model.safetensors").is_file()


@pytest.mark.parametrize(
    ("stray", "named"),
    [
        ("1_Pooling/notes.txt", "1_Pooling/notes.txt"),
        ("3_Other/config.json", "3_Other"),
        ("notes.txt", "notes.txt"),
    ],
)
def test_the_writer_still_refuses_to_replace_a_folder_holding_anything_else(
    sentence_folder: Path, tmp_path: Path, stray: str, named: str
) -> None:
    out = tmp_path / "out"
    extra = companion_files(sentence_folder)
    _write_folder(out, extra)
    write(out / stray, "the user's")
    with pytest.raises(SlimtorchError, match=f"holds '{named}'"):
        _write_folder(out, extra)
    assert (out / stray).read_text() == "the user's"


@pytest.mark.parametrize(
    ("name", "problem"),
    [("../escape.json", "not a relative name"), ("model.safetensors", "replace the weights")],
)
def test_the_writer_refuses_a_companion_outside_the_folder_or_over_its_weights(
    tmp_path: Path, name: str, problem: str
) -> None:
    with pytest.raises(SlimtorchError, match=problem):
        _write_folder(tmp_path / "out", {name: write(tmp_path / "file", "x")})
    assert not (tmp_path / "escape.json").exists() and not (tmp_path / "out").exists()


@pytest.mark.slow
def test_what_stays_behind_is_said_by_shrink_and_quantize_not_dropped_silently(tmp_path, capsys) -> None:
    """A stale ``onnx/`` export is left behind by every writer, and each says so: shrink in its report's
    notes, quantize and prune on stderr (stdout may be --json)."""
    import slimtorch
    from slimtorch.cli.main import main
    from tests.support.bert import bert_folder

    folder = bert_folder(tmp_path / "bert")
    write(folder / "onnx" / "model.onnx", "stale")
    report = slimtorch.shrink(folder, tmp_path / "shrunk")
    assert any(n.startswith("not copied: onnx/model.onnx") for n in report.notes)
    assert not (tmp_path / "shrunk" / "onnx").exists()
    capsys.readouterr()
    out = tmp_path / "quantized"
    assert main(["quantize", str(folder), "-o", str(out), "--runs", "0", "--samples", "1", "--json"]) == 0
    captured = capsys.readouterr()
    assert "slimtorch: note: not copied: onnx/model.onnx" in captured.err
    json.loads(captured.out)  # the JSON on stdout stays clean
