"""The real all-MiniLM-L6-v2 folder as a text bundle: `slimtorch export FOLDER` carries its tokenizer, and
the bundle's runner, given raw sentences, returns what sentence-transformers' own ``encode`` returns."""

from __future__ import annotations

import json

import numpy as np
import pytest

from slimtorch.cli.main import main
from slimtorch.deploy.runner import Bundle
from tests.wild import inputs
from tests.wild.classes import MINILM

LONG = " ".join(inputs.SENTENCES * 6)  # over 300 tokens: sentence-transformers truncates it at 256


@pytest.mark.slow
def test_minilm_text_bundle_gives_sentence_transformers_embeddings_from_raw_text(workdir) -> None:
    from sentence_transformers import SentenceTransformer

    bundle = workdir / "minilm-text"
    assert main(["export", str(MINILM), "-o", str(bundle), "--json"]) == 0
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert [s["name"] for s in manifest["inputs"]] == ["input_ids", "attention_mask", "token_type_ids"]
    assert manifest["outputs"][0]["name"] == "sentence_embedding" and manifest["text"]["max_length"] == 256
    texts = [*inputs.SENTENCES, LONG]
    runner = Bundle(bundle)
    assert runner.check()["ok"]
    got = runner.predict_text(texts)["sentence_embedding"]
    want = SentenceTransformer(str(MINILM), device="cpu").encode(texts, convert_to_numpy=True)
    assert runner.encode(texts)["input_ids"].shape == (len(texts), 256)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
