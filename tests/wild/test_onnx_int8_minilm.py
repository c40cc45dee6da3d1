"""``slimtorch export --scheme int8-dynamic`` of the real all-MiniLM-L6-v2 folder: the check passes on the
sentence embedding's cosine, and the bundle, run by onnxruntime on sentences the check never saw, gives
what sentence-transformers' pooling of the original model gives, within cosine 0.99."""

from __future__ import annotations

import json

import numpy as np
import onnxruntime
import pytest
import torch
import torch.nn.functional as F

from slimtorch.cli.main import main
from tests.wild import classes, inputs


@pytest.mark.slow
def test_minilm_int8_onnx_passes_its_check_and_keeps_unseen_sentences_at_cosine_099(workdir, capsys) -> None:
    bundle = workdir / "minilm-int8-onnx"
    code = main(["export", str(classes.MINILM), "-o", str(bundle), "--scheme", "int8-dynamic", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["passed"], report["embedding"]
    assert report["tolerance"]["min_cosine"] == 0.99 and report["embedding"]["min_cosine"] >= 0.99
    manifest = json.loads((bundle / "manifest.json").read_text())
    ids, mask = inputs.sentence_batch(classes.MINILM)
    feeds = {"input_ids": ids, "attention_mask": mask, "token_type_ids": torch.zeros_like(ids)}
    session = onnxruntime.InferenceSession(str(bundle / "model.onnx"), providers=["CPUExecutionProvider"])
    names = [spec["name"] for spec in manifest["inputs"]]
    got = session.run(None, {name: feeds[name].numpy() for name in names})[0]
    with torch.no_grad():
        original = classes.bert_original()(input_ids=ids, attention_mask=mask)
    want = classes.sentence_embeddings(original, (ids, mask))
    cosine = F.cosine_similarity(torch.from_numpy(got), want)
    assert cosine.min() >= 0.99, cosine
    assert np.isclose(float(np.linalg.norm(got, axis=1).mean()), 1.0, atol=1e-2)  # normalised in the graph
