"""slimtorch.open_model: the model a user names (a factory, a Hugging Face folder, a
sentence-transformers folder), its weights loaded safely, and an example input it is known to accept."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import slimtorch
from slimtorch.errors import SlimtorchError
from slimtorch.loading import ModelInput, open_meta_model, open_model
from slimtorch.models import SentenceEmbedder
from slimtorch.models.sentence import pool
from tests.support.bert import MINILM, SENTENCES, bert_folder, sentence_folder, tiny_bert, tokenized
from tests.support.specs import one_linear

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()


def reference_minilm_embeddings(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """all-MiniLM-L6-v2 as sentence-transformers computes it: BertModel, mean over real tokens, L2 norm."""
    from safetensors.torch import load_file

    config = transformers.BertConfig.from_json_file(MINILM / "config.json")
    bert = transformers.BertModel(config).eval()
    bert.load_state_dict(load_file(MINILM / "model.safetensors"), strict=False)
    with torch.no_grad():
        tokens = bert(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).float()
    return nn.functional.normalize((tokens * mask).sum(1) / mask.sum(1), dim=1)


@pytest.mark.slow
def test_the_real_minilm_folder_opens_as_its_sentence_pipeline_with_the_transformers_own_names() -> None:
    opened = open_model(MINILM)
    assert isinstance(opened.model, SentenceEmbedder) and isinstance(opened.model, transformers.BertModel)
    assert opened.model.pooling == ("mean",) and opened.model.normalize
    assert not opened.model.training and opened.folder == MINILM
    reference = transformers.BertModel(transformers.BertConfig.from_json_file(MINILM / "config.json"))
    assert set(opened.model.state_dict()) == set(reference.state_dict())
    assert any("embeddings.position_ids" in line for line in opened.ignored)
    batch = tokenized(SENTENCES)
    with torch.no_grad():
        embeddings = opened.model(**batch)
    assert torch.allclose(embeddings, reference_minilm_embeddings(batch), atol=1e-5)
    similarity = embeddings @ embeddings.T
    assert similarity[0, 1] > 0.5 > similarity[0, 2]  # the two sentences about eating are the close ones


@pytest.mark.slow
def test_a_text_models_example_is_ids_and_mask_of_ordinary_tokens_with_one_padded_row() -> None:
    opened = open_model(MINILM)
    assert list(opened.kwargs) == ["input_ids", "attention_mask", "token_type_ids"] and opened.args == ()
    ids, mask = opened.kwargs["input_ids"], opened.kwargs["attention_mask"]
    assert ids.shape == mask.shape == (2, 64) and opened.shape == (2, 64)
    real = ids[mask.bool()]
    assert real.min() >= 1000 and real.max() < 30522  # not [PAD], [CLS], [SEP], [MASK] or unused tokens
    assert mask[0].all() and mask[1, :48].all() and not mask[1, 48:].any() and (ids[1, 48:] == 0).all()
    assert opened.positional() == (ids, mask, opened.kwargs["token_type_ids"])  # BertModel's forward order


@pytest.mark.slow
def test_samples_draw_new_tokens_and_keep_the_masks() -> None:
    opened = open_model(MINILM)
    first, second, third = opened.samples(3)
    assert first == opened.example
    assert torch.equal(second["attention_mask"], first["attention_mask"])
    assert not torch.equal(second["input_ids"], first["input_ids"])
    assert not torch.equal(second["input_ids"], third["input_ids"])
    real = second["input_ids"][first["attention_mask"].bool()]
    assert real.min() >= 1000 and (second["input_ids"][1, 48:] == 0).all()


def test_an_explicit_shape_of_a_text_model_is_batch_and_length(tmp_path) -> None:
    opened = open_model(bert_folder(tmp_path / "bert"), input_shape=(3, 10))
    assert opened.kwargs["input_ids"].shape == (3, 10) and opened.origin == "the given shape"
    assert opened.kwargs["input_ids"].max() < 120  # a tiny vocabulary: ids stay in it


def test_a_vit_folder_loads_under_the_names_transformers_5_renamed_and_gets_an_image(tmp_path) -> None:
    config = transformers.ViTConfig(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        image_size=32,
        patch_size=8,
    )
    transformers.ViTModel(config).save_pretrained(tmp_path / "vit")  # saved as encoder.layer.0.attention...
    opened = open_model(tmp_path / "vit")
    assert opened.kwargs == {} and opened.args[0].shape == (1, 3, 32, 32)
    assert opened.args[0].dtype == torch.float32
    expected = transformers.ViTModel.from_pretrained(tmp_path / "vit").eval()
    with torch.no_grad():
        assert torch.equal(opened.model(*opened.args)[0], expected(*opened.args)[0])


def test_a_sentence_folder_pools_as_its_pooling_config_says(tmp_path) -> None:
    opened = open_model(sentence_folder(tmp_path / "st", "pooling_mode_cls_token", normalize=False))
    plain = slimtorch.load_model(tmp_path / "st", tiny_bert).model.eval()
    with torch.no_grad():
        pooled = opened.model(**opened.kwargs)
        tokens = plain(**opened.kwargs).last_hidden_state
    assert torch.equal(pooled, tokens[:, 0])


def test_an_older_sentence_folder_with_its_transformer_in_a_sub_folder_opens(tmp_path) -> None:
    folder = sentence_folder(tmp_path / "st")
    (folder / "0_Transformer").mkdir()
    for name in ("config.json", "model.safetensors"):
        (folder / name).rename(folder / "0_Transformer" / name)
    modules = json.loads((folder / "modules.json").read_text())
    modules[0]["path"] = "0_Transformer"
    (folder / "modules.json").write_text(json.dumps(modules))
    opened = open_model(folder)
    assert isinstance(opened.model, SentenceEmbedder) and opened.folder == folder / "0_Transformer"


def test_a_sentence_checkpoint_without_a_pooler_builds_none(tmp_path) -> None:
    folder = sentence_folder(tmp_path / "st")
    torch.manual_seed(0)
    bare = transformers.BertModel(tiny_bert().config, add_pooling_layer=False)
    bare.save_pretrained(folder)  # what many sentence-transformers folders hold: no pooler.dense
    opened = open_model(folder)
    assert opened.model.pooler is None and opened.ignored == ()


def test_pool_follows_sentence_transformers_modes() -> None:
    tokens = torch.tensor([[[1.0, 4.0], [3.0, 0.0], [100.0, 100.0]]])
    mask = torch.tensor([[1, 1, 0]])
    assert pool(tokens, mask, ["mean"]).tolist() == [[2.0, 2.0]]
    assert pool(tokens, mask, ["max"]).tolist() == [[3.0, 4.0]]
    assert pool(tokens, mask, ["cls", "last"]).tolist() == [[1.0, 4.0, 3.0, 0.0]]
    assert pool(tokens, mask, ["mean_sqrt_len"])[0].tolist() == pytest.approx([4 / 2**0.5, 4 / 2**0.5])
    assert pool(tokens, mask, ["weighted_mean"])[0].tolist() == pytest.approx([7 / 3, 4 / 3])


def test_a_sentence_folder_with_a_module_slimtorch_does_not_build_is_refused(tmp_path) -> None:
    folder = sentence_folder(tmp_path / "st")
    modules = json.loads((folder / "modules.json").read_text())
    modules.append({"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"})
    (folder / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(
        SlimtorchError, match=r"sentence_transformers\.models\.Dense, which slimtorch does not build"
    ):
        open_model(folder)


def test_a_config_with_auto_map_is_refused_and_its_code_never_runs(tmp_path) -> None:
    folder = bert_folder(tmp_path / "remote", auto_map={"AutoModel": "modeling_evil.EvilModel"})
    marker = tmp_path / "ran"
    (folder / "modeling_evil.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    with pytest.raises(SlimtorchError, match=r"auto_map .* never runs code") as error:
        open_model(folder)
    assert len(str(error.value).splitlines()) == 1 and not marker.exists()


def test_an_architecture_transformers_lacks_falls_back_to_automodel(tmp_path) -> None:
    opened = open_model(bert_folder(tmp_path / "bert", architectures=["BertForSomethingNew"]))
    assert type(opened.model) is transformers.BertModel


def test_a_factory_with_example_input_shape_gets_that_shape() -> None:
    opened = open_model("tests.support.specs:Hinted")
    assert opened.args[0].shape == (3, 5) and opened.origin == "Hinted.example_input_shape"


def test_a_factory_whose_first_layer_is_an_embedding_gets_token_ids() -> None:
    opened = open_model("tests.support.specs:TokenBag", input_shape=(2, 7))
    ids = opened.args[0]
    assert ids.dtype == torch.long and ids.shape == (2, 7) and ids.max() < 50


@pytest.mark.parametrize("opener", [open_model, open_meta_model])
def test_a_shape_the_model_rejects_is_one_line_naming_it(opener) -> None:
    with pytest.raises(SlimtorchError) as error:
        opener("tests.support.specs:recurrent")  # the default 1,3,224,224 into an LSTM
    message = str(error.value)
    assert message.startswith("tests.support.specs:recurrent does not accept an input of shape 1,3,224,224 (")
    assert "LSTM: Expected input to be 2D or 3D" in message and message.endswith("--input-shape")
    assert len(message.splitlines()) == 1
    assert opener("tests.support.specs:recurrent", input_shape=(1, 9, 40)).shape == (1, 9, 40)


def test_a_text_model_on_meta_is_checked_on_fake_tensors(tmp_path) -> None:
    folder = bert_folder(tmp_path / "bert")
    opened = open_meta_model(folder)
    assert all(p.is_meta for p in opened.model.parameters()) and "attention_mask" in opened.kwargs
    with pytest.raises(SlimtorchError, match="does not accept an input of shape 2,3,8"):
        open_meta_model(folder, input_shape=(2, 3, 8))


def test_prefix_and_rename_reach_the_loader(tmp_path) -> None:
    reference = one_linear()
    state = {"wrapper.layer.weight": reference[0].weight, "wrapper.layer.bias": reference[0].bias}
    path = tmp_path / "wrapped.safetensors"
    save_file({name: t.detach() for name, t in state.items()}, path)
    opened = open_model(
        "tests.support.specs:one_linear",
        path,
        prefix="wrapper.",
        rename=[("layer.", "0.")],
        input_shape=(1, 4),
    )
    assert torch.equal(opened.model[0].weight, reference[0].weight)
    assert opened.weights == path
    with pytest.raises(SlimtorchError):
        open_model("tests.support.specs:one_linear", path, prefix="wrapper.", input_shape=(1, 4))


def test_non_strict_loads_past_an_extra_tensor_and_says_so(tmp_path) -> None:
    reference = one_linear()
    save_file({**reference.state_dict(), "extra.weight": torch.ones(2)}, tmp_path / "extra.safetensors")
    with pytest.raises(SlimtorchError, match="non-strict"):
        open_model("tests.support.specs:one_linear", tmp_path / "extra.safetensors", input_shape=(1, 4))
    opened = open_model(
        "tests.support.specs:one_linear", tmp_path / "extra.safetensors", strict=False, input_shape=(1, 4)
    )
    assert torch.equal(opened.model[0].weight, reference[0].weight)
    assert opened.ignored == ("extra.weight (not in the model)",)


def test_a_checkpoint_given_as_the_model_says_to_use_weights(tmp_path) -> None:
    save_file(one_linear().state_dict(), tmp_path / "w.safetensors")
    with pytest.raises(SlimtorchError, match=r"is a file, not a model: .* --weights"):
        open_model(tmp_path / "w.safetensors")
    (tmp_path / "empty").mkdir()
    with pytest.raises(SlimtorchError, match="not a model folder"):
        open_model(tmp_path / "empty")


def test_model_input_is_what_the_commands_need() -> None:
    opened = open_model("tests.support.specs:one_linear", input_shape=(2, 4))
    assert isinstance(opened, ModelInput) and opened.example == opened.positional() == opened.args
    assert [s[0].shape for s in opened.samples(2)] == [(2, 4), (2, 4)]
    assert opened.folder is None and opened.weights is None and opened.ignored == ()
