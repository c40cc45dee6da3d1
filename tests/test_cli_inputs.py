"""MODEL and its options, the same on every command: real folders work, wrong inputs are one line and exit 2.

prune, quantize, export and ops load weights (--weights, --non-strict, --prefix, --rename); memory builds
on the meta device. All of them take a factory, a Hugging Face folder or a sentence-transformers folder,
find an example input from the model, and turn a model that rejects the input into one line.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from slimtorch.cli.main import main
from slimtorch.loading import open_model
from slimtorch.models import SentenceEmbedder
from slimtorch.quant import Int8DynamicLinear
from tests.support.bert import MINILM, SENTENCES, bert_folder, tokenized
from tests.support.cli import one_error_line
from tests.support.specs import two_linears

pytest.importorskip("transformers")

COMMANDS = ("prune", "quantize", "export", "ops", "memory")
LOADING = ("prune", "quantize", "export", "ops")


def command_args(command: str, model: str, tmp_path: Path) -> list[str]:
    """The command on MODEL with the options that make it quick; output under tmp_path."""
    extra = {
        "prune": ["-o", str(tmp_path / "pruned"), "--ratio", "0.25", "--runs", "0"],
        "quantize": ["-o", str(tmp_path / "quantized"), "--runs", "0", "--samples", "1"],
        "export": ["-o", str(tmp_path / "bundle"), "--samples", "1"],
        "ops": ["--json"],
        "memory": ["--device", "cpu", "--json"],
    }[command]
    return [command, model, *extra]


@pytest.mark.slow
def test_quantize_the_real_minilm_folder_keeps_what_its_sentences_mean(tmp_path, capsys) -> None:
    out = tmp_path / "minilm-int8"
    assert main(["quantize", str(MINILM), "-o", str(out), "--runs", "0", "--samples", "2", "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["scheme"] == "int8-dynamic"
    assert "embeddings.position_ids" in captured.err  # left out, and said so
    float_model = open_model(MINILM).model
    quantized = open_model(MINILM, weights=out).model
    assert isinstance(quantized, SentenceEmbedder)
    assert type(quantized.encoder.layer[0].intermediate.dense) is Int8DynamicLinear
    batch = tokenized(SENTENCES)
    with torch.no_grad():
        cosine = nn.functional.cosine_similarity(quantized(**batch), float_model(**batch), dim=1)
    assert cosine.min() >= 0.99, cosine


@pytest.mark.slow
def test_export_the_real_minilm_folder_without_an_example_takes_ids_and_mask(tmp_path, capsys) -> None:
    bundle = tmp_path / "bundle"
    assert main(["export", str(MINILM), "-o", str(bundle), "--samples", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert [i["name"] for i in manifest["inputs"]] == ["input_ids", "attention_mask", "token_type_ids"]
    assert all(i["shape"] == ["batch", "sequence"] for i in manifest["inputs"])  # a text bundle
    assert report["passed"] and report["outputs"][0]["shape"] == ["batch", 384]  # one embedding per sentence


@pytest.mark.slow
def test_memory_of_the_real_minilm_folder_counts_its_parameters(capsys) -> None:
    assert main(["memory", str(MINILM), "--device", "cpu", "--json"]) == 0
    step = json.loads(capsys.readouterr().out)["steps"][0]
    params, pooler = 22_713_216 * 4, (384 * 384 + 384) * 4
    assert step["breakdown"]["parameters"] == params  # with the pooler the folder holds
    # AdamW's two moments for every weight the embedding uses; the pooler gets no gradient, so no state
    assert 2 * (params - pooler) <= step["breakdown"]["optimizer_state"] < 2 * params


@pytest.mark.slow
def test_prune_the_real_minilm_folder_and_open_the_result_with_the_original_folder(tmp_path, capsys) -> None:
    out = tmp_path / "pruned"
    assert main(["prune", str(MINILM), "-o", str(out), "--ratio", "0.1", "--runs", "0", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["after"]["params"] < 0.97 * report["before"]["params"]
    pruned = open_model(MINILM, weights=out).model  # the folder's classes, the pruned file's shapes
    assert pruned.encoder.layer[0].intermediate.dense.out_features < 1536
    batch = tokenized(SENTENCES)
    with torch.no_grad():
        embeddings, original = pruned(**batch), open_model(MINILM).model(**batch)
    assert embeddings.shape == (4, 384) and torch.allclose(embeddings.norm(dim=1), torch.ones(4))
    # no fine-tuning after removing 10% of the channels: close to the original (measured 0.90 to 0.94)
    assert nn.functional.cosine_similarity(embeddings, original, dim=1).min() > 0.85
    assert (embeddings @ embeddings.T)[0, 1:].argmax() == 0  # the two sentences about eating stay closest


@pytest.mark.parametrize("command", COMMANDS)
def test_a_text_model_given_an_image_shape_is_one_line_and_exit_2(command, tmp_path, capsys) -> None:
    folder = bert_folder(tmp_path / "bert")
    capsys.readouterr()
    args = command_args(command, str(folder), tmp_path)
    assert main([*args, "--input-shape", "1,3,224,224"]) == 2
    line = one_error_line(capsys)
    assert f"{folder} does not accept an input of shape 1,3,224,224 (ValueError: " in line
    assert line.endswith("give the right one with --input-shape")


@pytest.mark.parametrize("command", COMMANDS)
def test_the_default_shape_an_lstm_rejects_is_one_line_and_the_right_one_works(
    command, tmp_path, capsys
) -> None:
    spec = "tests.support.specs:recurrent"
    assert main(command_args(command, spec, tmp_path)) == 2
    assert "does not accept an input of shape 1,3,224,224 (ValueError: LSTM" in one_error_line(capsys)
    if command == "ops":  # the same model with its own shape goes through
        assert main([*command_args(command, spec, tmp_path), "--input-shape", "1,5,40"]) == 0


@pytest.mark.slow
@pytest.mark.parametrize("command", LOADING)
def test_non_strict_loads_a_file_with_an_extra_tensor_and_says_what_was_left_out(
    command, tmp_path, capsys
) -> None:
    weights = tmp_path / "extra.safetensors"
    save_file({**two_linears().state_dict(), "extra.weight": torch.ones(2)}, weights)
    args = [*command_args(command, "tests.support.specs:two_linears", tmp_path), "--weights", str(weights)]
    args += ["--input-shape", "2,4"]
    assert main(args) == 2
    assert "--non-strict" in one_error_line(capsys)
    assert main([*args, "--non-strict"]) == 0
    assert "slimtorch: note: the load left out extra.weight (not in the model)" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("command", LOADING)
def test_prefix_and_rename_reach_load_model(command, tmp_path, capsys, monkeypatch) -> None:
    from slimtorch.loading import loader

    reference = two_linears()
    weights = tmp_path / "wrapped.safetensors"
    renamed = {
        k.replace("0.", "layer.", 1) if k.startswith("0.") else k: v
        for k, v in reference.state_dict().items()
    }
    save_file({f"net.{k}": v for k, v in renamed.items()}, weights)
    seen = {}
    real = loader.load_model

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(loader, "load_model", spy)
    args = [*command_args(command, "tests.support.specs:two_linears", tmp_path), "--weights", str(weights)]
    args += ["--input-shape", "2,4", "--prefix", "net.", "--rename", "layer.=0."]
    assert main(args) == 0
    assert seen["prefix"] == "net." and list(seen["rename"]) == [("layer.", "0.")]
    assert main([*args[:-2], "--rename", "layer"]) == 2
    assert "--rename 'layer': expected OLD=NEW" in one_error_line(capsys)


BAD_INPUTS = ("bad spec", "missing weights", "checkpoint as model", "empty folder", "auto_map")


@pytest.mark.parametrize(
    ("command", "case"),
    [(c, case) for c in COMMANDS for case in BAD_INPUTS if not (c == "memory" and case == "missing weights")],
)
def test_bad_model_input_is_one_line_and_exit_2(command, case, tmp_path, capsys) -> None:
    checkpoint = tmp_path / "w.safetensors"
    save_file(two_linears().state_dict(), checkpoint)
    (tmp_path / "empty").mkdir()
    remote = bert_folder(tmp_path / "remote", auto_map={"AutoModel": "modeling_x.X"})
    model, extra, words = {
        "bad spec": ("no_such_module_xyz:build", [], "cannot import no_such_module_xyz"),
        "missing weights": (
            "tests.support.specs:two_linears",
            ["--weights", str(tmp_path / "nope.pt")],
            "nope.pt",
        ),
        "checkpoint as model": (str(checkpoint), [], "is a file, not a model"),
        "empty folder": (str(tmp_path / "empty"), [], "not a model folder"),
        "auto_map": (str(remote), [], "never runs code from a model folder"),
    }[case]
    capsys.readouterr()
    assert main([*command_args(command, model, tmp_path), *extra]) == 2
    assert words in one_error_line(capsys)


def test_a_wrong_option_value_is_a_usage_error_without_a_traceback(tmp_path, capsys) -> None:
    with pytest.raises(SystemExit) as usage:
        spec = "tests.support.specs:two_linears"
        main(["quantize", spec, "-o", str(tmp_path / "q"), "--input-shape", "2,x"])
    err = capsys.readouterr().err
    assert usage.value.code == 2 and "not a comma-separated shape" in err and "Traceback" not in err
