"""sentence-transformers reads what slimtorch writes from a sentence-transformers folder (shrink, quantize,
prune), with the embeddings slimtorch.load_model gives; and a SentenceTransformer builds on meta."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from slimtorch.cli.main import main
from slimtorch.format.policy import ShrinkOptions
from slimtorch.loading import open_model
from slimtorch.loading.loader import load_model
from slimtorch.loading.opening import _built_on_meta
from slimtorch.shrinking.saving import shrink

transformers = pytest.importorskip("transformers")
st = pytest.importorskip("sentence_transformers")
transformers.logging.set_verbosity_error()

WORDS = ["a", "man", "is", "eating", "food", "bread", "the", "new", "movie", "awesome", "cheetah", "running"]
WORDS += ["behind", "its", "prey", "piece", "of"]
SENTENCES = ["a man is eating food", "the new movie is awesome", "a cheetah is running behind its prey"]
HIDDEN = 32


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny sentence-transformers folder as sentence-transformers itself saves it (its newest module
    names, ``pooling_mode``), with a real WordPiece tokenizer."""
    from sentence_transformers.base.modules import Normalize, Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling

    root = tmp_path_factory.mktemp("sentence")
    (root / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]))
    tokenizer = transformers.BertTokenizerFast(vocab_file=str(root / "vocab.txt"))
    config = transformers.BertConfig(
        hidden_size=HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        vocab_size=len(WORDS) + 5,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    transformers.BertModel(config).save_pretrained(root / "bert")
    tokenizer.save_pretrained(root / "bert")
    modules = [Transformer(str(root / "bert")), Pooling(HIDDEN, "mean"), Normalize()]
    st.SentenceTransformer(modules=modules, device="cpu").save(str(root / "st"))
    return root / "st"


def st_embeddings(path: Path) -> torch.Tensor:
    return st.SentenceTransformer(str(path), device="cpu").encode(SENTENCES, convert_to_tensor=True)


def our_embeddings(path: Path) -> torch.Tensor:
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    batch = dict(tokenizer(SENTENCES, padding=True, return_tensors="pt"))
    with torch.no_grad():
        return open_model(path).model(**batch)


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a, b).min())


def test_a_lossless_shrink_opens_in_sentence_transformers_with_equal_embeddings(folder, tmp_path) -> None:
    shrink(folder, tmp_path / "out")
    assert json.loads((tmp_path / "out" / "modules.json").read_text()) == json.loads(
        (folder / "modules.json").read_text()
    )
    assert (tmp_path / "out" / "2_Normalize" / "config.json").is_file()
    embeddings = st_embeddings(tmp_path / "out")
    assert torch.equal(embeddings, st_embeddings(folder))
    torch.testing.assert_close(our_embeddings(tmp_path / "out"), embeddings, atol=1e-6, rtol=0)


def test_an_int8_shrink_opens_in_sentence_transformers_within_the_int8_bound(folder, tmp_path) -> None:
    shrink(folder, tmp_path / "out", options=ShrinkOptions(quantize="int8-weight", quantize_all=True))
    embeddings = st_embeddings(tmp_path / "out")
    assert cosine(embeddings, st_embeddings(folder)) >= 0.99
    torch.testing.assert_close(our_embeddings(tmp_path / "out"), embeddings, atol=1e-5, rtol=0)


@pytest.mark.slow
def test_a_quantize_output_opens_in_sentence_transformers_as_slimtorch_loads_it(folder, tmp_path) -> None:
    out = tmp_path / "out"
    assert main(["quantize", str(folder), "-o", str(out), "--scheme", "int8-dynamic", "--runs", "0"]) == 0
    assert "layers quantized (int8-dynamic)" in (out / "README.md").read_text()
    embeddings = st_embeddings(out)
    assert cosine(embeddings, st_embeddings(folder)) >= 0.99
    # transformers decodes the int8 weights and leaves activations float; slimtorch rounds them per row
    assert cosine(our_embeddings(out), embeddings) >= 0.999


@pytest.mark.slow
def test_a_pruned_output_keeps_its_tokenizer_and_modules_and_opens_in_sentence_transformers(
    folder, tmp_path
) -> None:
    out = tmp_path / "out"
    attention = [f"encoder.layer.{i}.attention.self.{m}" for i in range(2) for m in ("query", "key", "value")]
    keep = [*attention, "pooler.dense"]  # only the feed-forward layers shrink: the config says so
    assert main(["prune", str(folder), "-o", str(out), "--ratio", "0.5", "--runs", "0", "--skip", *keep]) == 0
    assert json.loads((out / "config.json").read_text())["intermediate_size"] == 32
    assert (out / "tokenizer.json").is_file() and (out / "1_Pooling" / "config.json").is_file()
    torch.testing.assert_close(our_embeddings(out), st_embeddings(out), atol=1e-6, rtol=0)


def test_the_old_layout_with_the_transformer_in_a_sub_folder_comes_out_flat(folder, tmp_path) -> None:
    old = tmp_path / "old"
    (old / "0_Transformer").mkdir(parents=True)
    for path in folder.rglob("*"):
        if path.is_file():
            inner = path.parent == folder and path.name not in ("modules.json", "README.md")
            target = old / "0_Transformer" / path.name if inner else old / path.relative_to(folder)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(path.read_bytes())
    listed = json.loads((folder / "modules.json").read_text())
    listed[0]["path"] = "0_Transformer"
    (old / "modules.json").write_text(json.dumps(listed))
    shrink(old / "0_Transformer", tmp_path / "out")  # the model folder: the whole sentence folder comes along
    assert json.loads((tmp_path / "out" / "modules.json").read_text())[0]["path"] == ""
    assert torch.equal(st_embeddings(tmp_path / "out"), st_embeddings(folder))


def test_load_model_builds_a_sentence_transformer_factory_on_meta_and_fills_it(folder, tmp_path) -> None:
    shrink(folder, tmp_path / "out")
    report = load_model(tmp_path / "out", lambda: st.SentenceTransformer(str(folder), device="cpu"))
    model = report.model
    assert report.notes == []  # built with its parameters on meta, not loaded twice
    embeddings = model.encode(SENTENCES, convert_to_tensor=True)
    assert torch.equal(embeddings, st_embeddings(folder))


def test_a_sentence_transformer_builds_on_meta_although_from_pretrained_refuses_a_meta_device(folder) -> None:
    with pytest.raises(RuntimeError, match="meta"), torch.device("meta"):
        st.SentenceTransformer(str(folder), device="cpu")
    model = _built_on_meta(lambda: st.SentenceTransformer(str(folder), device="cpu"), "factory")
    tensors = [*model.parameters(), *model.buffers()]
    assert tensors and all(t.is_meta for t in tensors)
    real = st.SentenceTransformer(str(folder), device="cpu")
    assert [(n, p.shape) for n, p in model.named_parameters()] == [
        (n, p.shape) for n, p in real.named_parameters()
    ]
