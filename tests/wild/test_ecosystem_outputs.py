"""The real all-MiniLM-L6-v2 folder through shrink (lossless, int8), quantize int8-dynamic and prune:
``SentenceTransformer(output)`` opens every output offline, with the embeddings of slimtorch.load_model
and, where the weights are kept, of the original model (int8: cosine >= 0.99)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from slimtorch.cli.main import main
from slimtorch.format.policy import ShrinkOptions
from slimtorch.loading import open_model
from slimtorch.shrinking.saving import shrink
from tests.wild.classes import MINILM
from tests.wild.inputs import SENTENCES
from tests.wild.matrix import INT8_DYNAMIC_COSINE

transformers = pytest.importorskip("transformers")
sentence_transformers = pytest.importorskip("sentence_transformers")
transformers.logging.set_verbosity_error()

LAYERS = 6


def st_embeddings(folder: Path) -> torch.Tensor:
    model = sentence_transformers.SentenceTransformer(str(folder), device="cpu", local_files_only=True)
    return model.encode(list(SENTENCES), convert_to_tensor=True)


def slimtorch_embeddings(folder: Path) -> torch.Tensor:
    """The output opened by slimtorch (its sentence model: BertModel, mean pooling, normalize), tokenized
    as sentence-transformers does (the folder's tokenizer, truncated at its max_seq_length)."""
    opened = open_model(folder)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    batch = tokenizer(list(SENTENCES), padding=True, truncation=True, max_length=256, return_tensors="pt")
    with torch.no_grad():
        return opened.model(**dict(batch))


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a, b).min())


@pytest.fixture(scope="module")
def original() -> torch.Tensor:
    return st_embeddings(MINILM)


def _shrink(options: ShrinkOptions) -> Callable[[Path], None]:
    return lambda out: shrink(MINILM, out, options=options) and None


def _cli(*args: str) -> Callable[[Path], None]:
    def run(out: Path) -> None:
        assert main([args[0], str(MINILM), "-o", str(out), "--runs", "0", *args[1:]]) == 0

    return run


ATTENTION = [
    f"encoder.layer.{i}.attention.self.{m}" for i in range(LAYERS) for m in ("query", "key", "value")
]
WRITERS = {
    # name: (writes the output, the least cosine to the original (None: the weights changed by design),
    # the least cosine between SentenceTransformer's and slimtorch's embeddings (None: within 1e-5))
    "shrink-lossless": (_shrink(ShrinkOptions()), 1.0, None),
    "shrink-int8": (_shrink(ShrinkOptions(quantize="int8-weight")), 0.99, None),
    # int4 groups with a zero point each, as compressed-tensors holds them (issue 45: the symmetric groups
    # written before gave 0.94 at worst over the 16 sentences, 0.88 on other CPUs); the two readers agree
    # but for float16 vs float32 decoding of (code - point) * scale
    "shrink-int4": (_shrink(ShrinkOptions(quantize="int4-weight")), 0.95, 0.9999),
    # transformers decodes the weights as it loads them and leaves activations float; slimtorch rounds
    # them to int8 per row, as the quantized model computes
    "quantize-int8-dynamic": (
        _cli("quantize", "--scheme", "int8-dynamic", "--samples", "1"),
        INT8_DYNAMIC_COSINE,
        INT8_DYNAMIC_COSINE,
    ),
    # SentenceTransformer computes in the float16 the config names; load_model in float32
    "shrink-fp16": (_shrink(ShrinkOptions(dtype=torch.float16)), 0.999, 0.999),
    # symmetric int4 groups on every Linear costs MiniLM more than int8 (0.90 at worst): int8 is its scheme
    "quantize-int4-weight": (_cli("quantize", "--scheme", "int4-weight", "--samples", "1"), 0.88, 0.9999),
    # only the feed-forward layers shrink (heads and the pooler stay): what the config can say
    "prune": (_cli("prune", "--ratio", "0.3", "--skip", *ATTENTION, "pooler.dense"), None, None),
    "prune-int8": (
        _cli("prune", "--ratio", "0.3", "--scheme", "int8-weight", "--skip", *ATTENTION, "pooler.dense"),
        None,
        None,
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(WRITERS))
def test_sentence_transformers_opens_the_output_with_slimtorchs_embeddings(
    name: str, workdir: Path, original: torch.Tensor
) -> None:
    write, bound, agree = WRITERS[name]
    out = workdir / f"minilm-{name}"
    write(out)
    for companion in ("modules.json", "1_Pooling/config.json", "tokenizer.json", "sentence_bert_config.json"):
        assert (out / companion).is_file(), companion
    assert "## slimtorch" in (out / "README.md").read_text()
    embeddings = st_embeddings(out)
    if agree is None:
        torch.testing.assert_close(slimtorch_embeddings(out), embeddings, atol=1e-5, rtol=0)
    else:
        embeddings = embeddings.float()
        assert cosine(slimtorch_embeddings(out).float(), embeddings) >= agree
    if bound == 1.0:
        assert torch.equal(embeddings, original)
    elif bound is not None:
        assert cosine(embeddings, original) >= bound
