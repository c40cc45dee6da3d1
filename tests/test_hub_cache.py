"""Models by Hugging Face Hub repo id, read from the local cache and never downloaded.

The cache is built in tmp_path in huggingface_hub's own layout (``models--org--name/`` with ``blobs/`` named
by content, ``snapshots/<commit>/`` of relative symlinks into them, ``refs/<branch>`` holding the commit),
and ``HF_HUB_CACHE`` points at it.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import slimtorch
from slimtorch.cli.main import main
from slimtorch.errors import CheckpointNotFoundError, FormatError
from slimtorch.loading import open_meta_model, open_model
from slimtorch.models import SentenceEmbedder
from slimtorch.sources.hub_cache import HubId, hub_cache_dir, parse_hub_id, resolve_model_path
from tests.support.bert import bert_folder, sentence_folder, tiny_bert
from tests.support.cli import one_error_line

pytest.importorskip("huggingface_hub")
REPO = "org/tiny-bert"


def cache_repo(cache: Path, repo_id: str, folder: Path, revision: str = "main") -> Path:
    """Put ``folder``'s files in ``cache`` as ``hf download`` does; the snapshot folder."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    commit = hashlib.sha1(f"{repo_id}@{revision}@{folder}".encode()).hexdigest()
    snapshot = repo / "snapshots" / commit
    for file in sorted(p for p in folder.rglob("*") if p.is_file()):
        data = file.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / file.relative_to(folder)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    ref = repo / "refs" / revision
    ref.parent.mkdir(parents=True, exist_ok=True)
    ref.write_text(commit)
    return snapshot


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """An empty cache that huggingface_hub and slimtorch both use, in a fresh working folder."""
    cache = tmp_path / "hf-cache"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    return cache


@pytest.fixture
def cached_bert(cache, tmp_path) -> Path:
    """The tiny BERT folder (seed 0), cached as org/tiny-bert at main."""
    folder = bert_folder(tmp_path / "bert")
    cache_repo(cache, REPO, folder)
    return folder


def test_inspect_by_repo_id_reads_the_cached_snapshot(cached_bert, capsys) -> None:
    assert main(["inspect", REPO, "--json"]) == 0
    by_id = json.loads(capsys.readouterr().out)
    assert main(["inspect", str(cached_bert), "--json"]) == 0
    by_path = json.loads(capsys.readouterr().out)
    assert by_id["tensors"] == by_path["tensors"] and len(by_id["tensors"]) > 10
    assert by_id["file_bytes"] == by_path["file_bytes"] and by_id["format"] == by_path["format"]


def test_shrink_by_repo_id_writes_the_weights_and_the_folders_config(cached_bert, tmp_path) -> None:
    out = tmp_path / "slim"
    assert main(["shrink", REPO, "-o", str(out)]) == 0
    assert json.loads((out / "config.json").read_text()) == json.loads(
        (cached_bert / "config.json").read_text()
    )
    shrunk, original = slimtorch.load(out).tensors, slimtorch.load(cached_bert).tensors
    assert shrunk.keys() == original.keys()
    assert all(torch.equal(shrunk[name], original[name]) for name in original)


def test_load_model_and_open_model_by_repo_id_give_what_from_pretrained_gives(
    cached_bert, cache, capsys
) -> None:
    transformers = pytest.importorskip("transformers")
    # transformers reads the same cache: the fake one is in the real layout
    expected = transformers.BertModel.from_pretrained(
        REPO, cache_dir=cache, local_files_only=True
    ).state_dict()
    loaded = slimtorch.load_model(REPO, tiny_bert).model.state_dict()
    opened = open_model(REPO)
    assert opened.source == REPO and opened.folder.parent.name == "snapshots"
    capsys.readouterr()
    assert main(["load", REPO, "--json"]) == 0
    profile = json.loads(capsys.readouterr().out)
    assert profile["path"] == REPO and profile["tensors"] == len(slimtorch.open(cached_bert).names())
    for state in (loaded, opened.model.state_dict()):
        assert all(torch.equal(state[name], expected[name]) for name in expected)


def test_a_sentence_transformers_repo_opens_as_its_pipeline(cache, tmp_path) -> None:
    cache_repo(cache, "org/tiny-st", sentence_folder(tmp_path / "st"))
    assert isinstance(open_model("org/tiny-st").model, SentenceEmbedder)


@pytest.mark.slow
def test_memory_needs_only_the_cached_config(cache, tmp_path, capsys) -> None:
    folder = bert_folder(tmp_path / "bert")
    (folder / "model.safetensors").unlink()
    cache_repo(cache, "org/config-only", folder)
    assert type(open_meta_model("org/config-only").model).__name__ == "BertModel"
    assert main(["memory", "org/config-only", "--batch", "2", "--device", "cpu", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)


def test_an_id_not_in_the_cache_is_one_line_saying_how_to_download_it(cache, capsys) -> None:
    assert main(["inspect", "org/absent"]) == 2
    line = one_error_line(capsys)
    assert line.startswith("slimtorch: error: org/absent: not a file or folder here, and not in the local ")
    assert f"Hugging Face cache (HF_HUB_CACHE={cache}); download it with `hf download org/absent`" in line
    assert line.endswith("or give a path")
    assert main(["memory", "org/absent"]) == 2
    assert "hf download org/absent" in one_error_line(capsys)


def test_a_revision_reads_its_own_snapshot(cache, tmp_path, capsys) -> None:
    cache_repo(cache, REPO, bert_folder(tmp_path / "main"))
    torch.manual_seed(1)
    other = tmp_path / "v1"
    tiny_bert().save_pretrained(other)
    snapshot = cache_repo(cache, REPO, other, revision="v1")
    by_tag = slimtorch.load(f"{REPO}@v1").tensors
    by_commit = slimtorch.load(f"{REPO}@{snapshot.name}").tensors
    on_main = slimtorch.load(REPO).tensors
    name = "embeddings.word_embeddings.weight"
    assert torch.equal(by_tag[name], slimtorch.load(other).tensors[name]) and torch.equal(
        by_commit[name], by_tag[name]
    )
    assert not torch.equal(on_main[name], by_tag[name])
    capsys.readouterr()  # transformers' save progress
    assert main(["inspect", f"{REPO}@v2"]) == 2
    line = one_error_line(capsys)
    assert "(it holds main, v1)" in line and f"`hf download {REPO} --revision v2`" in line


def test_an_existing_local_path_wins_over_the_id(cached_bert, tmp_path) -> None:
    torch.manual_seed(2)
    tiny_bert().save_pretrained(Path(REPO))  # ./org/tiny-bert in the working folder
    assert resolve_model_path(REPO) == Path(REPO)
    name = "embeddings.word_embeddings.weight"
    assert torch.equal(slimtorch.load(REPO).tensors[name], slimtorch.load(Path(REPO)).tensors[name])
    assert not torch.equal(slimtorch.load(REPO).tensors[name], slimtorch.load(cached_bert).tensors[name])


@pytest.mark.parametrize("offline", ["1", "0", None])
def test_the_cache_is_read_without_the_network_whatever_hf_hub_offline_says(
    cached_bert, monkeypatch, offline, capsys
) -> None:
    if offline is None:
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    else:
        monkeypatch.setenv("HF_HUB_OFFLINE", offline)

    def no_network(*args, **kwargs):
        raise AssertionError("slimtorch tried to reach the network")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    monkeypatch.setattr(socket, "getaddrinfo", no_network)
    assert slimtorch.open(REPO).names() == slimtorch.open(cached_bert).names()
    assert main(["inspect", "org/absent"]) == 2
    assert "not in the local Hugging Face cache" in one_error_line(capsys)


def test_hf_home_is_respected_when_hf_hub_cache_is_unset(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    assert hub_cache_dir() == tmp_path / "home" / "hub"
    snapshot = cache_repo(tmp_path / "home" / "hub", REPO, bert_folder(tmp_path / "bert"))
    assert resolve_model_path(REPO) == snapshot


@pytest.mark.parametrize(
    "env",
    [
        {"HF_HUB_CACHE": "$ROOT/hub-cache", "HF_HOME": "$ROOT/home"},
        {"HUGGINGFACE_HUB_CACHE": "$ROOT/legacy", "HF_HOME": "$ROOT/home"},
        {"XDG_CACHE_HOME": "$ROOT/xdg"},
    ],
)
def test_the_cache_folder_is_the_one_huggingface_hub_computes(tmp_path, monkeypatch, env) -> None:
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("ROOT", str(tmp_path))  # expanded as huggingface_hub expands it
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    code = "import huggingface_hub.constants as c; print(c.HF_HUB_CACHE)"
    theirs = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert hub_cache_dir() == Path(theirs.stdout.strip())


def _unfinished_blob(snapshot: Path) -> str:
    (snapshot / "model.safetensors").unlink()
    (snapshot.parent.parent / "blobs" / "0123abcd.incomplete").write_bytes(b"\0" * 10)
    return "a download into the cache is unfinished"


def _blob_gone(snapshot: Path) -> str:
    (snapshot / "model.safetensors").resolve().unlink()
    return "model.safetensors in the cache links to a blob that is gone"


def _shard_missing(snapshot: Path) -> str:
    index = {"metadata": {}, "weight_map": {"pooler.dense.bias": "model-00002-of-00002.safetensors"}}
    (snapshot / "model.safetensors.index.json").write_text(json.dumps(index))
    return "listed in the index is missing"


@pytest.mark.parametrize("damage", [_unfinished_blob, _blob_gone, _shard_missing])
def test_a_partly_downloaded_snapshot_is_refused_not_half_read(cache, tmp_path, damage, capsys) -> None:
    expected = damage(cache_repo(cache, REPO, bert_folder(tmp_path / "bert")))
    with pytest.raises(FormatError, match=expected) as raised:
        slimtorch.open(REPO)
    assert str(raised.value).startswith(f"{REPO}: ") and f"`hf download {REPO}`" in str(raised.value)
    capsys.readouterr()  # transformers' save progress
    assert main(["shrink", REPO, "-o", str(tmp_path / "out")]) == 2
    assert expected in one_error_line(capsys)
    assert not (tmp_path / "out").exists()


def test_files_left_out_on_purpose_do_not_make_a_snapshot_incomplete(cache, tmp_path) -> None:
    """huggingface_hub 2.4 keeps the repo's file listing and calls a snapshot that lacks any of it
    incomplete; ``hf download --include '*.safetensors' '*.json'`` leaves out the rest on purpose."""
    snapshot = cache_repo(cache, REPO, bert_folder(tmp_path / "bert"))
    listing = {name: {"size": 1, "blob_id": "0" * 40} for name in ("config.json", "model.safetensors")}
    listing["onnx/model.onnx"] = {"size": 1, "blob_id": "1" * 40}
    trees = snapshot.parent.parent / "trees"
    trees.mkdir()
    (trees / f"{snapshot.name}.json").write_text(json.dumps({"format_version": 1, "files": listing}))
    assert resolve_model_path(REPO) == snapshot


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("org/name", HubId("org/name")),
        ("BAAI/bge-small-en-v1.5@main", HubId("BAAI/bge-small-en-v1.5", "main")),
        ("org/name@refs/pr/1", HubId("org/name", "refs/pr/1")),
        ("gpt2", HubId("gpt2")),
        ("./org/name", None),
        ("/abs/name", None),
        ("a/b/c", None),
        ("torch.nn:Identity", None),
        ("models/net.py:build", None),
        ("org/-name", None),
        ("org/na--me", None),
        ("org/name@../../etc", None),
        ("org/name@", None),
    ],
)
def test_what_reads_as_a_repo_id(text, expected) -> None:
    assert parse_hub_id(text) == expected


def test_a_missing_file_or_bare_name_keeps_the_plain_not_found_error(cache) -> None:
    for missing in ("runs/model.pt", "bert-base-uncased"):
        with pytest.raises(CheckpointNotFoundError, match=f"^{missing}: no such file or folder$"):
            slimtorch.open(missing)


def test_a_bare_name_in_the_cache_resolves(cache, tmp_path) -> None:
    snapshot = cache_repo(cache, "bert-tiny", bert_folder(tmp_path / "bert"))
    assert resolve_model_path("bert-tiny") == snapshot


def test_help_texts_mention_repo_ids(capsys) -> None:
    for command in ("inspect", "load", "memory", "quantize", "prune", "export"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        assert "Hugging Face cache" in " ".join(capsys.readouterr().out.split()), command


def test_a_snapshot_sub_folder_reads_its_links_into_the_repos_blobs(cache, tmp_path) -> None:
    """An old sentence-transformers repo keeps its transformer in ``0_Transformer/``: links there point two
    levels up into the same blobs, and are the repository's own files, not links leaving the folder."""
    plain = bert_folder(tmp_path / "bert")
    nested = tmp_path / "nested"
    (nested / "0_Transformer").mkdir(parents=True)
    for file in plain.iterdir():
        (nested / "0_Transformer" / file.name).write_bytes(file.read_bytes())
    snapshot = cache_repo(cache, "org/old-layout", nested)
    inner = snapshot / "0_Transformer"
    with slimtorch.open(inner) as by_link, slimtorch.open(plain) as original:
        assert sorted(by_link.names()) == sorted(original.names())
    outside = tmp_path / "elsewhere.safetensors"
    outside.write_bytes((plain / "model.safetensors").read_bytes())
    (inner / "model.safetensors").unlink()
    (inner / "model.safetensors").symlink_to(outside)
    with pytest.raises(FormatError, match="outside the folder"):
        slimtorch.open(inner)
