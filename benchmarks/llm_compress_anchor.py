"""The anchor of ``benchmarks/llm_compress.py``: llm-compressor's own Wanda, SparseGPT, GPTQ and AWQ on the
same model and the same calibration sequences, saved as plain float folders slimtorch then scores.

llm-compressor 0.14 needs transformers <= 5.17 (this project runs 5.24), so it lives in a venv of its own
and this script runs there, by that venv's python, one method per process::

    python3 -m venv /tmp/llmc && /tmp/llmc/bin/pip install torch==2.13.0
    PIP_CONSTRAINT=<a file pinning torch==2.13.0> /tmp/llmc/bin/pip install llmcompressor==0.14.0.1
    OMP_NUM_THREADS=1 /tmp/llmc/bin/python benchmarks/llm_compress_anchor.py NAME build/llm-compress

``python -m benchmarks.llm_compress --anchor-python /tmp/llmc/bin/python`` runs every NAME. The work folder
is the benchmark's: it holds ``smollm2-135m`` (the model), ``calibration.npy`` (the 32 x 512 token ids the
benchmark calibrates on). Each run writes ``anchor/NAME`` (a float32 Hugging Face folder: zeros in place,
or the int4 values the quantized model computes with, with no ``quantization_config``) and its record in
``anchor/summary.json``. What llm-compressor needed on a CPU, found while writing this:

- ``ignore=["lm_head"]`` is not honoured by its Wanda and SparseGPT (they match ``"lm_head."``): the
  output head, tied to the token embeddings, was pruned with them; the regular expression form works.
- AWQ pins memory, which needs an accelerator: the cache's ``pin_memory`` is made a no-op.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

NAMES = ("wanda-50pct", "sparsegpt-50pct", "wanda-2-4", "sparsegpt-2-4", "int4-GPTQ", "int4-AWQ")
IGNORE = ["re:.*lm_head"]
COMPANIONS = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")
INT4 = {
    "group_0": {
        "targets": ["Linear"],
        "weights": {"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group", "group_size": 128},
    }
}
"""int4, asymmetric, groups of 128 inputs, weights only: the grid of slimtorch's int4 rows"""


def recipe(name: str) -> list[Any]:
    if name.startswith("wanda"):
        from llmcompressor.modifiers.pruning import WandaPruningModifier

        structure = "0:0" if name.endswith("50pct") else "2:4"
        return [
            WandaPruningModifier(sparsity=0.5, mask_structure=structure, targets=["Linear"], ignore=IGNORE)
        ]
    if name.startswith("sparsegpt"):
        from llmcompressor.modifiers.pruning import SparseGPTModifier

        structure = "0:0" if name.endswith("50pct") else "2:4"
        return [SparseGPTModifier(sparsity=0.5, mask_structure=structure, targets=["Linear"], ignore=IGNORE)]
    if name == "int4-GPTQ":
        from llmcompressor.modifiers.quantization import GPTQModifier

        return [GPTQModifier(config_groups=INT4, ignore=IGNORE)]
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from llmcompressor.modifiers.transform.awq import AWQModifier
    from llmcompressor.pipelines.cache import IntermediatesCache

    IntermediatesCache.pin_memory = lambda self, *args, **kwargs: None  # type: ignore[method-assign]
    return [AWQModifier(), QuantizationModifier(config_groups=INT4, ignore=IGNORE)]


def computed_weights(model: Any) -> dict[str, Any]:
    """Every parameter as the model computes with it: a quantized Linear's weight through its own
    fake quantization (scale and zero point)."""
    import torch
    from compressed_tensors.quantization.lifecycle.forward import forward_quantize

    state = {}
    with torch.no_grad():
        for module_name, module in model.named_modules():
            prefix = f"{module_name}." if module_name else ""
            for name, parameter in module.named_parameters(recurse=False):
                state[prefix + name] = parameter.detach().clone()
            scheme = getattr(module, "quantization_scheme", None)
            if scheme is not None and scheme.weights is not None and hasattr(module, "weight_scale"):
                state[prefix + "weight"] = forward_quantize(module, module.weight, "weight", scheme.weights)
    return state


def main(name: str, work: Path) -> int:
    import numpy as np
    import torch
    from datasets import Dataset
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    source, out = work / "smollm2-135m", work / "anchor" / name
    ids = np.load(work / "calibration.npy")
    data = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": np.ones_like(ids).tolist()})
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    started = time.perf_counter()
    model = oneshot(
        model=model,
        recipe=recipe(name),
        dataset=data,
        processor=AutoTokenizer.from_pretrained(source),
        num_calibration_samples=len(ids),
        max_seq_length=ids.shape[1],
        shuffle_calibration_samples=False,
    )
    seconds = time.perf_counter() - started
    state = computed_weights(model)
    plain = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    missing, _ = plain.load_state_dict(
        {k: v for k, v in state.items() if k in plain.state_dict()}, strict=False
    )
    assert [k for k in missing if k != "lm_head.weight"] == [], missing  # the head is the embeddings'
    shutil.rmtree(out, ignore_errors=True)
    plain.save_pretrained(out, safe_serialization=True)
    for companion in COMPANIONS:
        if (source / companion).is_file():
            shutil.copy(source / companion, out / companion)
    config = json.loads((out / "config.json").read_text())
    config.pop("quantization_config", None)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    up = plain.model.layers[0].mlp.up_proj.weight
    record = {
        "seconds": round(seconds, 1),
        "zeros_up0": round(float((up == 0).float().mean()), 4),
        "notes": [],
    }
    summary = work / "anchor" / "summary.json"
    records = json.loads(summary.read_text()) if summary.is_file() else {}
    records[name] = record
    summary.write_text(json.dumps(records, indent=2) + "\n")
    print(json.dumps({name: record}))
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in NAMES:
        sys.exit(f"usage: python llm_compress_anchor.py {{{','.join(NAMES)}}} WORK_FOLDER")
    sys.exit(main(sys.argv[1], Path(sys.argv[2])))
