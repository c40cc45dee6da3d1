"""A pruned Hugging Face model saved as a folder: config.json carries the new sizes where a config can,
and from_pretrained rebuilds the pruned model; where it cannot, the report says why and load_model does."""

from __future__ import annotations

import json

import pytest
import torch

import slimtorch
from tests.zoo.transformers_models import TRANSFORMERS, example, main_output

pytest.importorskip("transformers")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_pruned_folder_loads_with_from_pretrained_and_load_model(name: str, tmp_path) -> None:
    model = TRANSFORMERS[name]().eval()
    slimtorch.prune.channels(model, example(name), ratio=0.5)
    expected = main_output(model(*example(name)))
    report = slimtorch.save_pretrained(model, tmp_path / name)
    assert report.config_update.problems == []
    assert report.to_dict()["config_update"]["values"] == report.config_update.values  # in --json too
    config = json.loads((tmp_path / name / "config.json").read_text())
    assert config.get("num_attention_heads", config.get("n_head")) == 2  # GPT-2 names it n_head
    rebuilt = type(model).from_pretrained(tmp_path / name).eval()
    assert torch.equal(main_output(rebuilt(*example(name))), expected)
    loaded = slimtorch.load_model(tmp_path / name, TRANSFORMERS[name]).model.eval()
    assert torch.equal(main_output(loaded(*example(name))), expected)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["bert", "vit"])
def test_a_head_size_the_config_cannot_express_is_reported_and_load_model_still_works(name, tmp_path) -> None:
    model = TRANSFORMERS[name]().eval()
    slimtorch.prune.channels(model, example(name), ratio=0.5)  # 4 heads of 16 -> 2 heads of 16, hidden 64
    update = slimtorch.save_pretrained(model, tmp_path / name).config_update
    assert any("hidden_size / num_attention_heads" in problem for problem in update.problems)
    loaded = slimtorch.load_model(tmp_path / name, TRANSFORMERS[name]).model.eval()
    assert torch.equal(main_output(loaded(*example(name))), main_output(model(*example(name))))


@pytest.mark.slow
def test_saving_again_replaces_the_folder(tmp_path) -> None:
    model = TRANSFORMERS["gpt2"]().eval()
    slimtorch.prune.channels(model, example("gpt2"), ratio=0.5)
    slimtorch.save_pretrained(model, tmp_path / "gpt2")
    # config.json is ours: replaced
    slimtorch.save_pretrained(model, tmp_path / "gpt2", quantize="int8-weight")
    assert {p.name for p in (tmp_path / "gpt2").iterdir()} == {"config.json", "model.safetensors"}


@pytest.mark.slow
def test_cli_prunes_a_hugging_face_folder_into_a_folder(tmp_path, capsys) -> None:
    from slimtorch.cli.main import main

    TRANSFORMERS["llama"]().save_pretrained(tmp_path / "llama")
    out = tmp_path / "llama-half"
    assert main(["prune", str(tmp_path / "llama"), "-o", str(out), "--ratio", "0.5", "--runs", "1"]) == 0
    printed = capsys.readouterr().out
    assert "parameters" in printed and "from_pretrained cannot" not in printed
    rebuilt = type(TRANSFORMERS["llama"]()).from_pretrained(out).eval()
    assert rebuilt.model.layers[0].self_attn.q_proj.out_features == 32
    assert main_output(rebuilt(*example("llama"))).shape == (2, 8, 100)


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_a_quantized_model_from_a_config_saves_as_a_folder_that_opens_as_its_own_class(
    name, tmp_path
) -> None:
    """save_pretrained read each layer's float weight for the config's sizes (a quantized layer has codes),
    and wrote no ``architectures`` for a model built from a config, so open_model built the base class."""
    model = TRANSFORMERS[name]().eval()
    slimtorch.quantize(model, "int4-weight", group_size=32)
    slimtorch.save_pretrained(model, tmp_path / name, slimtorch.ShrinkOptions(layout="slim"))
    written = json.loads((tmp_path / name / "config.json").read_text())["slimtorch"]["config"]  # slim layout
    assert written["architectures"] == [type(model).__name__]
    back = slimtorch.open_model(tmp_path / name, check_example=False).model
    inputs = example(name)
    with torch.no_grad():
        assert torch.equal(main_output(back(*inputs)), main_output(model(*inputs)))
