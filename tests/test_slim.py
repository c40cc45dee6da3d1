"""slimtorch.slim and `slimtorch slim`: goals, the plan, resuming, the recipe, the report's keys, exit codes.

A tiny CNN (about 5,200 parameters) trained for a few epochs on scikit-learn's digits keeps every run here
to seconds; the full-size digits goal is the demo's (`make demo`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import safetensors.torch
import torch
from safetensors import safe_open
from torch import nn

import slimtorch
from slimtorch.cli.main import main
from slimtorch.errors import OptionError, SlimtorchError
from slimtorch.recovery import open_data
from slimtorch.recovery.data import TaskData
from slimtorch.slimming import SlimOptions, parse_goal, read_recipe, slim
from slimtorch.slimming import stages as slim_stages
from slimtorch.slimming.charts import CHARTS, unmeasured
from slimtorch.slimming.markers import digest
from slimtorch.slimming.recipe import Recipe
from tests.tiny_cnn import TINY

REPORT_KEYS = {
    "version", "command", "model", "data", "metric", "goal", "max_drop", "met", "reason", "work", "stages",
    "layers", "latency", "load", "memory", "footprint", "outputs",
}  # fmt: skip
STAGE_KEYS = {
    "name", "status", "reason", "seconds", "metric", "params", "file_bytes", "bytes_by_category", "output"
}  # fmt: skip
LAYER_KEYS = {"name", "kind", "params_before", "params_after", "sensitivity", "pruned", "quantized"}
FAST = {"timings": False, "recover_epochs": 1, "ratios": (0.5,), "sparsities": (0.9,), "attempts": 1}


@pytest.fixture(scope="module")
def tiny_spec(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, nn.Module]:
    """``tiny.py:Tiny``, trained 3 epochs on digits, its weights saved: the model of every test here."""
    folder = tmp_path_factory.mktemp("tiny")
    (folder / "tiny.py").write_text(TINY)
    spec = f"{folder / 'tiny.py'}:Tiny"
    torch.manual_seed(0)
    model = slimtorch.open_model(spec, check_example=False).model
    slimtorch.recover(model, open_data("digits").train, epochs=3, lr=3e-3, recalibrate_bn=False)
    weights = folder / "tiny.safetensors"
    safetensors.torch.save_file({k: v.contiguous() for k, v in model.state_dict().items()}, weights)
    return spec, weights, model.eval()


def tensors(path: Path) -> dict[str, torch.Tensor]:
    """A saved file's stored tensors, as stored (codes and scales of quantized layers); its bytes differ
    from run to run only by the id each slim file gets."""
    with safe_open(path, "pt") as opened:
        return {name: opened.get_tensor(name) for name in opened.keys()}  # noqa: SIM118


def same_tensors(a: Path, b: Path) -> bool:
    first, second = tensors(a), tensors(b)
    return first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)


@pytest.mark.parametrize(
    ("text", "kind", "target", "relative"),
    [
        ("size=50MB", "size", 50e6, False),
        ("size=512KiB", "size", 524288, False),
        ("size=0.05x", "size", 0.05, True),
        ("latency=2x", "latency", 2.0, True),
        ("params=0.5", "params", 0.5, True),
        ("params=0.5x", "params", 0.5, True),
        ("params=2M", "params", 2e6, False),
        (" Size = 1GB ", "size", 1e9, False),
    ],
)
def test_every_goal_form_parses_to_its_kind_and_target(text, kind, target, relative) -> None:
    goal = parse_goal(text)
    assert (goal.kind, goal.target, goal.relative) == (kind, target, relative)


@pytest.mark.parametrize(
    "text", ["size", "speed=2x", "size=abc", "size=2x", "latency=0.5x", "latency=5ms", "params=-1", "size=0x"]
)
def test_a_bad_goal_is_one_line_naming_it(text: str) -> None:
    with pytest.raises(OptionError) as caught:
        parse_goal(text)
    assert "\n" not in str(caught.value) and text.strip() in str(caught.value)


def test_bad_options_fail_when_made() -> None:
    with pytest.raises(OptionError, match="stages"):
        SlimOptions(stages=("prune", "distil"))
    with pytest.raises(OptionError, match="goal"):
        SlimOptions(goal="size=big")
    with pytest.raises(OptionError, match="unknown option 'epochs'"):
        slim(nn.Linear(2, 2), "digits", goal="size=0.5x", epochs=3)


def test_a_whole_number_and_its_float_are_one_recipe() -> None:
    """slim(max_drop=2) in Python and --max-drop 2 (2.0) on the command line resume each other's work: the
    stages' digests hash the recipe's JSON, where 2 and 2.0 differ."""
    whole = SlimOptions(goal="size=0.5x", max_drop=2, ratios=(0.5, 0.75), lr=1)
    real = SlimOptions(goal="size=0.5x", max_drop=2.0, ratios=(0.5, 0.75), lr=1.0)
    assert digest(whole.to_dict()) == digest(real.to_dict())
    assert isinstance(whole.max_drop, float) and isinstance(whole.lr, float)


def test_recipe_text_reads_back_to_the_same_recipe(tmp_path: Path) -> None:
    recipe = Recipe(
        {"model": 'a "quoted" path.py:Net', "data": "digits"},
        SlimOptions(goal="size=0.05x", ratios=(0.25, 0.5)),
        {"ratios": [0.5], "sparsities": [0.0], "schemes": ["int4-weight"], "chosen": 0},
    )
    (tmp_path / "r.toml").write_text(recipe.text())
    assert read_recipe(tmp_path / "r.toml") == recipe


@pytest.mark.slow
def test_a_goal_the_original_meets_skips_every_stage_and_reports_every_key(tmp_path: Path, tiny_spec) -> None:
    _, _, model = tiny_spec
    report = slim(model, "digits", goal="size=1GB", work=tmp_path / "w")
    data = report.to_dict()
    assert report.met and data["outputs"]["model"] == "01-baseline/model.safetensors"
    assert [(s["name"], s["status"]) for s in data["stages"]] == [
        ("baseline", "done"),
        *((name, "skipped") for name in ("prune", "sparsify", "recover", "quantize", "save")),
    ]
    assert set(data) == REPORT_KEYS
    assert all(set(stage) == STAGE_KEYS for stage in data["stages"])
    assert [row["name"] for row in data["layers"]] == ["features.0", "features.3", "classifier"]
    assert all(set(row) == LAYER_KEYS for row in data["layers"])
    for section in ("latency", "load", "memory"):  # timings on: measured, before and after
        assert data[section]["before"] and data[section]["after"] and data[section]["command"]
    assert data["memory"]["before"]["peak_bytes"] > 0 and len(data["memory"]["before"]["curve"]) > 2
    assert sum(data["stages"][0]["bytes_by_category"].values()) == data["stages"][0]["file_bytes"]
    assert (tmp_path / "w" / "report.json").exists() and (tmp_path / "w" / "report.html").exists()


@pytest.mark.slow
def test_a_spec_without_weights_is_slimmed_with_one_line_saying_its_scores_are_of_its_initial_values(
    tmp_path: Path, tiny_spec
) -> None:
    """Issue 45: slim of a factory with no weights optimised a random model and reported "met", silently."""
    spec, weights, _ = tiny_spec
    bare = slim(spec, "digits", goal="size=1GB", timings=False, work=tmp_path / "bare")
    assert [note for note in bare.notes if "was given no weights (--weights)" in note] == [
        f"{spec} was given no weights (--weights): it keeps what its factory gives (random initial values, "
        "unless the factory loads weights itself), and every score and verdict here is of those"
    ]
    given = slim(spec, "digits", goal="size=1GB", timings=False, weights=weights, work=tmp_path / "given")
    assert not [note for note in given.notes if "no weights" in note]


@pytest.mark.slow
def test_size_goal_prunes_recovers_quantizes_and_the_saved_file_reaches_it(tmp_path: Path, tiny_spec) -> None:
    _, _, model = tiny_spec
    report = slim(model, "digits", goal="size=0.35x", max_drop=100, work=tmp_path / "w", **FAST)
    data = report.to_dict()
    saved = next(s for s in data["stages"] if s["output"] == data["outputs"]["model"])
    assert report.met and saved["name"] == "save"
    assert saved["file_bytes"] <= 0.35 * data["stages"][0]["file_bytes"]
    assert (tmp_path / "w" / saved["output"]).stat().st_size == saved["file_bytes"]
    assert report.result is not None and report.result(torch.zeros(2, 1, 8, 8)).shape == (2, 10)


@pytest.mark.slow
def test_unreachable_goal_exits_1_keeps_the_best_and_says_why_in_one_line(
    tmp_path: Path, tiny_spec, capsys
) -> None:
    spec, weights, _ = tiny_spec
    work = tmp_path / "w"
    args = [
        "slim",
        spec,
        "--weights",
        str(weights),
        "--data",
        "digits",
        "--goal",
        "size=1KB",
        "--max-drop",
        "0",
    ]
    code = main([*args, "--work", str(work), "--epochs", "1", "--no-timings", "--json"])
    captured = capsys.readouterr()
    assert code == 1
    lines = [line for line in captured.err.splitlines() if line.startswith("slimtorch: goal not met")]
    assert len(lines) == 1 and "size=1KB" in lines[0]
    report = __import__("json").loads(captured.out)
    assert report["met"] is False and "size=1KB" in report["reason"]
    assert (work / report["outputs"]["model"]).exists()


def test_slim_without_a_goal_is_bad_input(tmp_path: Path, tiny_spec, capsys) -> None:
    spec, _, _ = tiny_spec
    assert main(["slim", spec, "--data", "digits", "--work", str(tmp_path / "w")]) == 2
    assert "--goal" in capsys.readouterr().err


@pytest.mark.slow
def test_a_rerun_after_a_failure_resumes_and_ends_as_an_uninterrupted_run(
    tmp_path: Path, tiny_spec, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, _, model = tiny_spec
    calls = {"prune": 0, "recover": 0}
    prune, recover = slim_stages.prune, slim_stages.recover

    def counting_prune(*args, **kwargs):
        calls["prune"] += 1
        return prune(*args, **kwargs)

    def failing_recover(*args, **kwargs):
        calls["recover"] += 1
        if calls["recover"] == 1:
            raise RuntimeError("interrupted")
        return recover(*args, **kwargs)

    monkeypatch.setattr(slim_stages, "prune", counting_prune)
    monkeypatch.setattr(slim_stages, "recover", failing_recover)
    options = SlimOptions(goal="params=0.6", max_drop=100, **FAST)
    with pytest.raises(RuntimeError, match="interrupted"):
        slim(model, "digits", options, work=tmp_path / "w")
    assert (tmp_path / "w" / "02-prune" / "done.json").exists()
    assert not (tmp_path / "w" / "04-recover" / "done.json").exists()
    resumed = slim(model, "digits", options, work=tmp_path / "w")
    assert calls == {"prune": 1, "recover": 2}
    assert [s["status"] for s in resumed.stages if s["name"] in ("baseline", "prune", "recover")] == [
        "resumed",
        "resumed",
        "done",
    ]
    straight = slim(model, "digits", options, work=tmp_path / "straight")
    assert straight.met and resumed.met
    assert resumed.stages[-1]["metric"] == straight.stages[-1]["metric"]
    assert same_tensors(
        tmp_path / "w" / "06-save/model.safetensors", tmp_path / "straight/06-save/model.safetensors"
    )


@pytest.mark.slow
def test_another_recipe_in_the_same_work_folder_is_refused_unless_restarted_and_no_timings_says_so(
    tmp_path: Path, tiny_spec
) -> None:
    _, _, model = tiny_spec
    left_out = slim(model, "digits", goal="size=1GB", timings=False, work=tmp_path / "w").to_dict()
    for section in ("latency", "load", "memory"):  # not measured, and the page says why, not "no stage says"
        assert left_out[section] is None
        assert "--no-timings" in unmeasured(left_out, next(c for c in CHARTS if c.section == section))
    with pytest.raises(SlimtorchError, match=r"goal differs.*--restart"):
        slim(model, "digits", goal="size=2GB", timings=False, work=tmp_path / "w")
    assert slim(model, "digits", goal="size=2GB", timings=False, work=tmp_path / "w", restart=True).met


@pytest.mark.slow
def test_the_recipe_reproduces_the_run_from_the_command_line(tmp_path: Path, tiny_spec, capsys) -> None:
    spec, weights, _ = tiny_spec
    first = tmp_path / "first"
    args = ["slim", spec, "--weights", str(weights), "--data", "digits", "--goal", "size=0.3x"]
    assert main([*args, "--max-drop", "50", "--work", str(first), "--epochs", "1", "--no-timings"]) == 0
    recipe = read_recipe(first / "recipe.toml")
    assert recipe.plan["schemes"] and recipe.options.goal == "size=0.3x" and recipe.inputs["model"] == spec
    assert main(["slim", "--recipe", str(first / "recipe.toml"), "--work", str(tmp_path / "again")]) == 0
    capsys.readouterr()
    reports = [__import__("json").loads((f / "report.json").read_text()) for f in (first, tmp_path / "again")]
    models = [f / r["outputs"]["model"] for f, r in zip((first, tmp_path / "again"), reports, strict=True)]
    assert reports[0]["stages"][-1]["metric"] == reports[1]["stages"][-1]["metric"]
    assert same_tensors(*models)


@pytest.mark.slow
def test_a_hugging_face_folder_comes_out_as_one_too_and_scores_by_cosine(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, vocab_size=1000
    )
    torch.manual_seed(0)
    transformers.BertModel(config).save_pretrained(tmp_path / "bert")
    generator = torch.Generator().manual_seed(0)
    batches = [(torch.randint(5, 1000, (4, 16), generator=generator), torch.zeros(4)) for _ in range(2)]
    data = TaskData("tokens", batches, batches, "cosine", batches[0][0])
    report = slim(
        str(tmp_path / "bert"), data, goal="size=0.3x", max_drop=0.01, timings=False, work=tmp_path / "w"
    )
    saved = report.stages[-1]
    assert report.met and report.metric == "cosine" and saved["metric"] >= 0.99
    hf = tmp_path / "w" / "06-save" / "hf"
    assert "06-save/hf" in saved["reason"] and (hf / "config.json").exists()
    reread = transformers.BertModel.from_pretrained(hf).eval()
    with torch.no_grad():
        cosine = nn.functional.cosine_similarity(
            reread(batches[0][0]).last_hidden_state.flatten(0, 1),
            report.result(batches[0][0]).last_hidden_state.flatten(0, 1),
        )
    assert cosine.min() > 0.999
