"""Hostile paths and folders (issue 17): nothing runs after a "y", no byte of a file the user did not name is
printed, ``-o`` never replaces an input or a link, and the CLI's error boundary is one line, exit 2.

Every hostile folder is built here, at test time, in ``tmp_path``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import slimtorch
from slimtorch.cli.main import main
from slimtorch.deploy.bundle import read_manifest
from slimtorch.errors import FormatError
from slimtorch.loading import open_model
from slimtorch.models import hub
from tests.support.bert import bert_folder
from tests.support.cli import one_error_line

transformers = pytest.importorskip("transformers")

SECRET = b"SECRETKEY=hunter2-do-not-print"


def remote_code_folder(path: Path, marker: Path) -> Path:
    """A BERT folder whose config maps AutoConfig and AutoModel to its own Python file, which, imported,
    creates ``marker``."""
    folder = bert_folder(path, auto_map={"AutoConfig": "evil.EvilConfig", "AutoModel": "evil.EvilModel"})
    (folder / "evil.py").write_text(
        f"open({str(marker)!r}, 'w').write('ran')\n"
        "from transformers import BertConfig, BertModel\n"
        "class EvilConfig(BertConfig): pass\n"
        "class EvilModel(BertModel): pass\n"
    )
    return folder


# -- remote code ------------------------------------------------------------------------------------------

CHILD = """
import contextlib, io, json, sys
from slimtorch.cli.main import main
results = []
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(argv)
    results.append([code, err.getvalue()])
print(json.dumps(results))
"""


@pytest.mark.slow
def test_auto_map_folder_runs_nothing_when_yes_is_piped_to_prune_quantize_memory_and_export(tmp_path):
    marker = tmp_path / "ran"
    folder = str(remote_code_folder(tmp_path / "remote", marker))
    commands = [
        ["prune", folder, "-o", str(tmp_path / "p"), "--ratio", "0.5", "--runs", "0"],
        ["quantize", folder, "-o", str(tmp_path / "q"), "--runs", "0"],
        ["memory", folder, "--device", "cpu"],
        ["export", folder, "-o", str(tmp_path / "e")],
    ]
    # One interpreter for the four commands (each would pay torch's import); stdin is `yes`.
    done = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(commands)],
        input="y\n" * 10,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    for argv, (code, err) in zip(commands, json.loads(done.stdout), strict=True):
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and "auto_map" in lines[0], (argv[0], err)
    assert not marker.exists()


def test_transformers_is_always_asked_with_trust_remote_code_false(tmp_path, monkeypatch):
    asked = []
    for owner, method in (
        (transformers.AutoConfig, "from_pretrained"),
        (transformers.AutoModel, "from_config"),
    ):
        real = getattr(owner, method)

        def spy(*args, _real=real, _name=method, **kwargs):
            asked.append((_name, kwargs.get("trust_remote_code", "unset")))
            return _real(*args, **kwargs)

        monkeypatch.setattr(owner, method, spy)
    folder = bert_folder(tmp_path / "bert", architectures=["BertForSomethingNew"])  # -> AutoModel
    hub.model_factory(hub.read_config(folder))()
    assert asked == [("from_pretrained", False), ("from_config", False)]


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ('{"model_type": "bert", "hidden_size": ' + "9" * 5000 + "}", "integer of 5000 digits"),
        ("[" * 100_000 + "]" * 100_000, "corrupt JSON config"),
        ('{"model_type": NaN}', "NaN is not JSON"),
    ],
    ids=["huge int", "deep", "NaN"],
)
def test_a_hostile_config_json_is_one_line_naming_it(tmp_path, capsys, text, words):
    folder = tmp_path / "bad"
    folder.mkdir()
    (folder / "config.json").write_text(text)
    assert main(["memory", str(folder), "--device", "cpu"]) == 2
    line = one_error_line(capsys)
    assert str(folder / "config.json") in line and words in line


def test_a_deep_modules_json_is_a_format_error(tmp_path):
    folder = tmp_path / "st"
    folder.mkdir()
    (folder / "modules.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(FormatError, match=r"modules\.json: corrupt JSON"):
        open_model(folder)


@pytest.mark.parametrize("module_path", ["../elsewhere", "/etc"])
def test_a_sentence_folder_module_outside_the_folder_is_refused(tmp_path, module_path):
    folder = bert_folder(tmp_path / "st")
    (tmp_path / "elsewhere").mkdir()
    modules = [
        {"idx": 0, "name": "0", "path": module_path, "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    (folder / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(FormatError, match="is outside the folder"):
        open_model(folder)


def test_a_deep_bundle_manifest_is_not_a_bundle_and_no_recursion_error(tmp_path):
    (tmp_path / "manifest.json").write_text("[" * 100_000 + "]" * 100_000)
    assert read_manifest(tmp_path, strict=False) is None
    with pytest.raises(slimtorch.SlimtorchError, match="not a slimtorch bundle"):
        read_manifest(tmp_path)


# -- symbolic links inside a folder -------------------------------------------------------------------------


def weights_folder_linking_to(tmp_path: Path, target: Path) -> Path:
    folder = tmp_path / "downloaded"
    folder.mkdir()
    (folder / "model.safetensors").symlink_to(target)
    return folder


def test_a_weight_file_linking_outside_the_folder_is_refused_without_printing_its_bytes(tmp_path, capsys):
    secret = tmp_path / "secret.txt"
    secret.write_bytes(SECRET)
    folder = weights_folder_linking_to(tmp_path, secret)
    assert main(["inspect", str(folder)]) == 2
    line = one_error_line(capsys)
    assert "outside the folder" in line and "SECRET" not in line


def test_a_real_checkpoint_outside_the_folder_is_not_followed_either(tmp_path):
    elsewhere = tmp_path / "elsewhere.safetensors"
    save_file({"w": torch.ones(2)}, elsewhere)
    folder = weights_folder_linking_to(tmp_path, elsewhere)
    with pytest.raises(FormatError, match="symbolic link to a file outside the folder"):
        slimtorch.open(folder)
    assert slimtorch.open(elsewhere).names() == ["w"]  # named directly, it is read


def test_links_inside_the_folder_are_followed(tmp_path):
    folder = tmp_path / "model"
    (folder / "blobs").mkdir(parents=True)
    save_file({"w": torch.ones(2)}, folder / "blobs" / "abc")
    (folder / "model.safetensors").symlink_to(Path("blobs", "abc"))
    assert list(slimtorch.open(folder).names()) == ["w"]


def test_a_folder_file_that_is_no_checkpoint_is_named_without_its_bytes(tmp_path, capsys):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(SECRET)
    assert main(["inspect", str(folder)]) == 2
    assert "SECRET" not in one_error_line(capsys)
    assert main(["inspect", str(folder / "model.safetensors")]) == 2  # named: its first bytes help
    assert "SECRETKE" in one_error_line(capsys)


def test_a_git_lfs_pointer_in_a_folder_says_so(tmp_path, capsys):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "model.safetensors").write_text("version https://git-lfs.github.com/spec/v1\noid sha256:ab\n")
    assert main(["inspect", str(folder)]) == 2
    assert "Git LFS pointer" in one_error_line(capsys)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no named pipes here")
def test_a_named_pipe_is_refused_not_read_forever(tmp_path, capsys):
    pipe = tmp_path / "model.safetensors"
    os.mkfifo(pipe)
    writer = os.open(pipe, os.O_RDWR)  # a writer that never writes: a read would block for good
    try:
        assert main(["inspect", str(pipe)]) == 2
    finally:
        os.close(writer)
    assert "not a regular file" in one_error_line(capsys)


def test_quantize_refuses_a_companion_file_linking_outside_the_model_folder(tmp_path, capsys):
    folder = bert_folder(tmp_path / "bert")
    secret = tmp_path / "netrc"
    secret.write_bytes(SECRET)
    (folder / "tokenizer.json").symlink_to(secret)
    out = tmp_path / "q"
    capsys.readouterr()  # transformers' save_pretrained progress
    assert main(["quantize", str(folder), "-o", str(out), "--runs", "0", "--samples", "1"]) == 2
    assert "tokenizer.json: a symbolic link to a file outside the folder" in one_error_line(capsys)
    assert not out.exists()


# -- -o OUT ------------------------------------------------------------------------------------------------


@pytest.fixture
def checkpoint(tmp_path) -> Path:
    path = tmp_path / "in.safetensors"
    save_file({"w": torch.randn(8, 8)}, path)
    return path


def shrink_to(out: Path | str, source: Path | str) -> int:
    return main(["shrink", str(source), "-o", str(out), "--json"])


@pytest.mark.parametrize("how", ["same path", "another path", "hard link"])
def test_shrink_refuses_to_write_over_its_input(tmp_path, capsys, checkpoint, how):
    before = checkpoint.read_bytes()
    out = {
        "same path": checkpoint,
        "another path": tmp_path / "sub" / ".." / checkpoint.name,
        "hard link": tmp_path / "linked.safetensors",
    }[how]
    (tmp_path / "sub").mkdir()
    if how == "hard link":
        os.link(checkpoint, out)
    assert shrink_to(out, checkpoint) == 2
    assert "-o is the input" in one_error_line(capsys)
    assert checkpoint.read_bytes() == before


def test_shrink_refuses_to_replace_the_folder_holding_its_input(tmp_path, capsys):
    folder = tmp_path / "slim"
    slimtorch.save({"w": torch.randn(8, 8)}, folder)
    assert shrink_to(folder, folder / "model.safetensors") == 2
    assert "the folder holding the input" in one_error_line(capsys)
    assert shrink_to(folder, folder) == 2
    assert "-o is the input" in one_error_line(capsys)
    assert shrink_to(folder / "model.safetensors", folder) == 2
    assert "a file of the input folder" in one_error_line(capsys)
    assert list(slimtorch.load(folder).tensors) == ["w"]


@pytest.mark.parametrize("kind", ["folder", "file", "dangling"])
def test_an_output_that_is_a_symbolic_link_is_refused_and_left_as_it_was(tmp_path, capsys, checkpoint, kind):
    real = tmp_path / {"folder": "real", "file": "real.safetensors", "dangling": "nowhere"}[kind]
    if kind != "dangling":
        slimtorch.save({"old": torch.ones(2)}, real)
    link = tmp_path / ("link.safetensors" if kind == "file" else "link")
    link.symlink_to(real)
    assert shrink_to(link, checkpoint) == 2
    assert "-o is a symbolic link" in one_error_line(capsys)
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".slimtorch-tmp-")]
    if kind != "dangling":
        assert list(slimtorch.load(real).tensors) == ["old"]


def test_ops_refuses_to_write_over_the_model_file(tmp_path, capsys):
    code = tmp_path / "net.py"
    code.write_text("import torch\n\ndef build():\n    return torch.nn.Linear(4, 2)\n")
    before = code.read_text()
    assert main(["ops", f"{code}:build", "--input-shape", "1,4", "-o", str(code)]) == 2
    assert "-o is the input" in one_error_line(capsys)
    assert code.read_text() == before


# -- the error boundary ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("error", "words"), [(MemoryError, "more memory than"), (RecursionError, "nesting too deep")]
)
def test_memory_and_recursion_errors_on_input_are_one_line_naming_it(
    monkeypatch, capsys, checkpoint, error, words
):
    def exhausted(*_args, **_kwargs):
        raise error()

    monkeypatch.setattr("slimtorch.inspection.breakdown.inspect", exhausted)
    assert main(["inspect", str(checkpoint)]) == 2
    line = one_error_line(capsys)
    assert str(checkpoint) in line and words in line


def test_other_exceptions_are_bugs_and_keep_their_traceback(monkeypatch, checkpoint):
    def buggy(*_args, **_kwargs):
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr("slimtorch.inspection.breakdown.inspect", buggy)
    with pytest.raises(ZeroDivisionError):
        main(["inspect", str(checkpoint)])


@pytest.mark.slow
def test_a_closed_stdout_is_no_traceback_and_no_error_line(tmp_path):
    path = tmp_path / "many.safetensors"
    save_file({f"layer{i}.weight": torch.zeros(2) for i in range(2000)}, path)
    child = subprocess.Popen(
        [sys.executable, "-m", "slimtorch.cli.main", "inspect", str(path), "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    child.stdout.read(10)  # `| head -c 10`
    child.stdout.close()
    err = child.stderr.read().decode()
    assert child.wait(timeout=60) == 0  # the reader asked for no more: not a failure
    assert "Traceback" not in err and "Broken pipe" not in err and "error" not in err, err


# -- the writer: what it replaces, what it leaves, what it syncs --------------------------------------------


@pytest.mark.parametrize("kind", ["file", "folder"])
def test_replacing_an_output_folder_keeps_the_users_index_json_files_and_folders(tmp_path, kind):
    out = tmp_path / "slim"
    slimtorch.save({"w": torch.ones(2)}, out)
    mine = out / "notes.index.json"
    if kind == "folder":
        mine.mkdir()
        (mine / "work.txt").write_text("mine")
    else:
        mine.write_text("mine")
    with pytest.raises(slimtorch.SlimtorchError, match=r"holds 'notes\.index\.json'"):
        slimtorch.save({"w": torch.zeros(2)}, out)
    assert mine.exists() and torch.equal(slimtorch.load(out).tensors["w"], torch.ones(2))


def test_a_folder_named_like_a_companion_is_not_replaced_by_the_companion(tmp_path):
    config = tmp_path / "config.json"
    config.write_text("{}")
    out = tmp_path / "slim"
    slimtorch.save({"w": torch.ones(2)}, out)
    (out / "config.json").mkdir()
    (out / "config.json" / "work.txt").write_text("mine")
    with pytest.raises(slimtorch.SlimtorchError, match=r"holds 'config\.json'"):
        slimtorch.save_model(torch.nn.Linear(2, 2), out, extra_files={"config.json": config})
    assert (out / "config.json" / "work.txt").is_file()


@pytest.mark.parametrize("name", ["out.safetensors", "out"])
def test_stale_temps_of_a_killed_run_are_removed_by_the_next_write_to_the_same_place(tmp_path, name):
    from slimtorch.format.writer import STARTED

    stale_file = tmp_path / f".slimtorch-tmp-{name}-deadbeef"
    stale_folder = tmp_path / f".slimtorch-tmp-{name}-old-0123abcd"
    others = tmp_path / ".slimtorch-tmp-another.safetensors-deadbeef"  # another output's
    running = tmp_path / f".slimtorch-tmp-{name}-feedf00d"  # started after this process: not ours to judge
    stale_file.write_bytes(b"x" * 100)
    stale_folder.mkdir()
    (stale_folder / "model.safetensors").write_bytes(b"x")
    others.write_bytes(b"x")
    running.write_bytes(b"x")
    for path in (stale_file, stale_folder, others):
        os.utime(path, (STARTED - 60, STARTED - 60))
    os.utime(running, (STARTED + 60, STARTED + 60))
    slimtorch.save({"w": torch.ones(2)}, tmp_path / name)
    assert not stale_file.exists() and not stale_folder.exists()
    assert others.exists() and running.exists()


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc to name fsynced files")
def test_companion_files_are_fsynced_before_the_folder_is_renamed(tmp_path, monkeypatch):
    config = tmp_path / "config.json"
    config.write_text("{}")
    synced = []
    real = os.fsync

    def spy(fd):
        synced.append(Path(os.readlink(f"/proc/self/fd/{fd}")).name)
        return real(fd)

    monkeypatch.setattr(os, "fsync", spy)
    slimtorch.save_model(torch.nn.Linear(2, 2), tmp_path / "out", extra_files={"config.json": config})
    assert "config.json" in synced


@pytest.mark.parametrize("out_name", ["link", "link.safetensors"])
def test_the_api_refuses_to_write_through_a_symbolic_link(tmp_path, out_name):
    real = tmp_path / ("real.safetensors" if out_name.endswith(".safetensors") else "real")
    slimtorch.save({"old": torch.ones(2)}, real)
    link = tmp_path / out_name
    link.symlink_to(real)
    with pytest.raises(slimtorch.SlimtorchError, match="is a symbolic link"):
        slimtorch.save({"new": torch.ones(2)}, link)
    assert link.is_symlink() and list(slimtorch.load(real).tensors) == ["old"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".slimtorch-tmp-")]
