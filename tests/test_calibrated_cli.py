"""``slimtorch prune --method wanda|sparsegpt --data text.txt`` and ``slimtorch quantize --awq --data
text.txt`` on a Hugging Face language model folder: the perplexity before and after in the report, the
output read back in a fresh process that imports slimtorch alone, with the same perplexity. Wrong
combinations are one line, exit 2."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from slimtorch.cli.main import main
from tests.support.language import english, tiny_lm

SCORE = """\
import json, sys
import slimtorch
from slimtorch.recovery import evaluate, open_data
model = slimtorch.open_model(sys.argv[1], check_example=False).model
data = open_data(sys.argv[2], tokenizer=sys.argv[1], length=32, sequences=10, batch=4)
layer = model.model.layers[0].mlp.up_proj
zeros = float((layer.weight == 0).float().mean()) if type(layer).__name__ == "Linear" else None
print(json.dumps({"perplexity": evaluate(model, data), "zeros": zeros}))
"""


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lm")
    text = english(folder / "text.txt")
    return tiny_lm(folder / "tiny-lm", text), text


@pytest.mark.slow
@pytest.mark.parametrize(
    ("method", "budget"), [("wanda", ["--unstructured", "0.5"]), ("sparsegpt", ["--n-m", "2:4"])]
)
def test_a_language_model_pruned_from_text_reports_perplexity_and_reloads_in_a_fresh_process(
    lm, tmp_path, capsys, method, budget
) -> None:
    folder, text = lm
    out = tmp_path / "pruned"
    argv = ["prune", str(folder), "-o", str(out), *budget, "--method", method, "--data", str(text)]
    argv += ["--samples", "8", "--length", "32", "--skip", "lm_head", "--layout", "slim", "--json"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["method"] == (method if budget[0] == "--unstructured" else f"{method}:2:4")
    assert report["sparsity"] == pytest.approx(0.5) and set(report["perplexity"]) == {"before", "after"}
    assert "8 to calibrate" in report["data"] and report["file_bytes"] < report["file_bytes_before"]
    done = subprocess.run(
        [sys.executable, "-c", SCORE, str(out), str(text)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    scored = json.loads(done.stdout)
    assert scored["zeros"] == pytest.approx(0.5)
    # the same held-out sequences: the CLI read 10 (8 to calibrate, 2 held out), the child reads 10 too
    assert scored["perplexity"] == pytest.approx(report["perplexity"]["after"], rel=1e-4)


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (["--unstructured", "0.5", "--method", "wanda"], "give --data"),
        (["--unstructured", "0.5", "--data", "text.txt"], "--method wanda or sparsegpt only"),
        (["--ratio", "0.5", "--method", "wanda", "--data", "text.txt"], "not channel pruning"),
    ],
)
def test_a_calibrated_option_that_cannot_apply_is_one_line_and_exit_2(tmp_path, capsys, extra, says) -> None:
    code = main(["prune", "tests.zoo.models:MLP", "-o", str(tmp_path / "x.safetensors"), *extra])
    err = capsys.readouterr().err
    assert code == 2 and says in err and len(err.strip().splitlines()) <= 2, err
    assert not (tmp_path / "x.safetensors").exists()


def test_a_mistyped_method_is_a_usage_error_that_names_the_right_one(tmp_path, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(
            [
                "prune",
                "tests.zoo.models:MLP",
                "-o",
                str(tmp_path / "x.safetensors"),
                "--n-m",
                "2:4",
                "--method",
                "wandaa",
            ]
        )
    assert exit_.value.code == 2 and "did you mean wanda?" in capsys.readouterr().err


@pytest.mark.slow
def test_int4_with_awq_from_text_reports_perplexity_and_reloads_in_a_fresh_process(
    lm, tmp_path, capsys
) -> None:
    folder, text = lm
    out = tmp_path / "int4"
    argv = ["quantize", str(folder), "-o", str(out), "--scheme", "int4-weight", "--group-size", "32", "--awq"]
    argv += [
        "--data",
        str(text),
        "--samples",
        "8",
        "--length",
        "32",
        "--layout",
        "slim",
        "--runs",
        "0",
        "--json",
    ]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report["perplexity"]) == {"before", "after"} and "8 to calibrate" in report["data"]
    notes = report["notes"]
    assert any(note.startswith("AWQ scaled the inputs of 14 of 15") for note in notes), notes
    done = subprocess.run(
        [sys.executable, "-c", SCORE, str(out), str(text)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["perplexity"] == pytest.approx(report["perplexity"]["after"], rel=1e-4)


def test_awq_on_an_int8_scheme_is_one_line_before_the_model_loads(tmp_path, capsys) -> None:
    code = main(["quantize", "no.such:model", "-o", str(tmp_path / "x.safetensors"), "--awq"])
    err = capsys.readouterr().err
    assert code == 2 and "awq scales int4 weights" in err and len(err.strip().splitlines()) == 1, err
