"""Every output loads back in a fresh process, as users chain commands: each step is a process of its own.

Writers (the command line, or a script that imports only ``slimtorch``): shrink in each scheme, quantize in
each scheme, prune channels / unstructured / N:M, recover, slim, save_model after pruning and quantizing,
save_pretrained, export. Readers, each a new process: ``slimtorch load FILE --model SPEC``, and a script
that imports only ``slimtorch`` and the user's model module, calls ``load_model`` and checks the outputs
(``from_pretrained`` for folders, the bundle's ``predict.py`` for bundles). A reader asserts that nothing of
slimtorch but its top package was imported before the load: registrations that waited for another module
to be imported once left fresh processes unable to read quantized and pruned files while this suite's own
process, which had imported everything, passed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from slimtorch.quant.kernels import BF16_AGREEMENT
from slimtorch.schemes import SCHEMES
from tests.fresh_models import DigitsNet, example

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "tests" / "fresh_models.py"
TIMEOUT = 600


@dataclass(frozen=True)
class Writer:
    """One step that writes an output: a command line (``slimtorch ...``) or a script."""

    name: str
    model: str  # "MLP" or "DigitsNet"
    output: str  # a file or folder name in the working folder
    argv: tuple[str, ...] = ()
    script: str = ""
    min_cosine: float | None = 0.99  # against the float model; None: only the writer's own outputs count
    readers: tuple[str, ...] = ("load-cli", "load_model")


def _spec(model: str) -> str:
    return f"{MODELS}:{model}"


def _cli(*argv: str) -> tuple[str, ...]:
    return (sys.executable, "-m", "slimtorch.cli.main", *argv)


WRITERS = [
    *(
        Writer(
            f"shrink-{scheme}",
            "MLP",
            f"shrink-{scheme}.safetensors",
            _cli(
                "shrink",
                "MLP.pt",
                "-o",
                f"shrink-{scheme}.safetensors",
                *(("--scheme", scheme) if scheme != "lossless" else ()),
            ),
            min_cosine=1.0 if scheme == "lossless" else 0.99,
        )
        for scheme in ("lossless", "int8-weight", "int4-weight")
    ),
    *(
        Writer(
            f"quantize-{scheme}",
            "MLP",
            f"quantize-{scheme}.safetensors",
            _cli(
                "quantize",
                _spec("MLP"),
                "--weights",
                "MLP.pt",
                "--input-shape",
                "4,64",
                "-o",
                f"quantize-{scheme}.safetensors",
                "--scheme",
                scheme,
            ),
        )
        for scheme in SCHEMES
    ),
    Writer(
        "prune-channels",
        "DigitsNet",
        "prune-channels.safetensors",
        _cli(
            "prune",
            _spec("DigitsNet"),
            "--weights",
            "DigitsNet.pt",
            "--input-shape",
            "2,1,8,8",
            "-o",
            "prune-channels.safetensors",
            "--ratio",
            "0.5",
            "--runs",
            "0",
        ),
        min_cosine=None,
    ),
    Writer(
        "prune-unstructured",
        "MLP",
        "prune-unstructured.safetensors",
        _cli(
            "prune",
            _spec("MLP"),
            "--weights",
            "MLP.pt",
            "-o",
            "prune-unstructured.safetensors",
            "--unstructured",
            "0.5",
            "--runs",
            "0",
        ),
        min_cosine=0.8,
    ),
    Writer(
        "prune-n-m",
        "MLP",
        "prune-n-m.safetensors",
        _cli(
            "prune",
            _spec("MLP"),
            "--weights",
            "MLP.pt",
            "-o",
            "prune-n-m.safetensors",
            "--n-m",
            "2:4",
            "--runs",
            "0",
        ),
        min_cosine=0.8,
    ),
    Writer(
        "recover",
        "DigitsNet",
        "recover.safetensors",
        _cli(
            "recover",
            _spec("DigitsNet"),
            "--weights",
            "prune-channels.safetensors",
            "--data",
            "digits",
            "-o",
            "recover.safetensors",
            "--steps",
            "5",
        ),
        min_cosine=None,
    ),
    Writer(
        "slim",
        "DigitsNet",
        "slim-work",
        _cli(
            "slim",
            _spec("DigitsNet"),
            "--weights",
            "DigitsNet.pt",
            "--data",
            "digits",
            "--goal",
            "size=0.5x",
            "--max-drop",
            "100",
            "--work",
            "slim-work",
            "--epochs",
            "1",
            "--no-timings",
        ),
        min_cosine=None,
    ),
    Writer(
        "save_model-pruned-quantized",
        "DigitsNet",
        "api-pruned-quantized.safetensors",
        script=(
            "import torch, slimtorch\n"
            "from tests.fresh_models import DigitsNet, example\n"
            "model = DigitsNet().eval(); model.load_state_dict(torch.load('DigitsNet.pt'))\n"
            "slimtorch.prune.channels(model, example('DigitsNet'), ratio=0.5)\n"
            "slimtorch.quantize(model, 'int8-weight', calibration=[example('DigitsNet')])\n"
            "slimtorch.save_model(model, 'api-pruned-quantized.safetensors')\n"
            "torch.save(model(example('DigitsNet')), 'api-pruned-quantized.safetensors.expected.pt')\n"
        ),
        min_cosine=None,
    ),
    Writer(
        "save_model-int8-dynamic",
        "MLP",
        "api-int8-dynamic.safetensors",
        script=(
            "import torch, slimtorch\n"
            "from tests.fresh_models import MLP, example\n"
            "model = MLP().eval(); model.load_state_dict(torch.load('MLP.pt'))\n"
            "slimtorch.quantize(model, 'int8-dynamic')\n"
            "slimtorch.save_model(model, 'api-int8-dynamic.safetensors')\n"
        ),
    ),
    Writer(
        "save_pretrained",
        "bert",
        "bert-int8",
        script=(
            "import torch, slimtorch, transformers\n"
            "transformers.logging.set_verbosity_error()\n"
            "torch.manual_seed(0)\n"
            "config = transformers.BertConfig(vocab_size=200, hidden_size=32, num_hidden_layers=2,\n"
            "    num_attention_heads=2, intermediate_size=64, max_position_embeddings=32)\n"
            "model = transformers.BertModel(config).eval()\n"
            "ids = torch.randint(0, 200, (2, 12), generator=torch.Generator().manual_seed(1))\n"
            "torch.save({'ids': ids, 'out': model(input_ids=ids).last_hidden_state}, 'bert.expected.pt')\n"
            "slimtorch.save_pretrained(model, 'bert-int8', quantize='int8-weight')\n"
        ),
        readers=("from_pretrained",),
    ),
    Writer(
        "export",
        "DigitsNet",
        "bundle",
        _cli(
            "export",
            _spec("DigitsNet"),
            "--weights",
            "DigitsNet.pt",
            "--input-shape",
            "1,1,8,8",
            "--dynamic-batch",
            "-o",
            "bundle",
        ),
        readers=("predict.py",),
    ),
]


def _run(argv: list[str] | tuple[str, ...], folder: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=TIMEOUT, cwd=folder, env=env)


def _say(step: str, run: subprocess.CompletedProcess) -> str:
    return (
        f"{step} exited {run.returncode}\n--- stdout\n{run.stdout[-2500:]}\n--- stderr\n{run.stderr[-2500:]}"
    )


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, subprocess.CompletedProcess]]:
    """The float checkpoints and their outputs, then every writer, each in its own process (two at a time;
    a writer that reads another's output runs after it)."""
    folder = tmp_path_factory.mktemp("fresh")
    from tests import fresh_models

    for name in ("MLP", "DigitsNet"):
        torch.manual_seed(0)
        model = getattr(fresh_models, name)().eval()
        torch.save(model.state_dict(), folder / f"{name}.pt")
        torch.save(model(example(name)).detach(), folder / f"{name}.float.pt")
    first = [w for w in WRITERS if w.name != "recover"]
    with ThreadPoolExecutor(2) as pool:
        runs = dict(zip([w.name for w in first], pool.map(lambda w: _write(w, folder), first), strict=True))
    runs.update({w.name: _write(w, folder) for w in WRITERS if w.name == "recover"})
    return folder, runs


def _write(writer: Writer, folder: Path) -> subprocess.CompletedProcess:
    argv = writer.argv or (sys.executable, "-c", writer.script)
    return _run(argv, folder)


READER = """
import json, sys, torch
import slimtorch
early = sorted(m for m in sys.modules if m.startswith("slimtorch.") and m.split(".")[1] in
               ("quant", "prune", "shrinking", "slimming", "recovery", "loading"))
assert not early, f"imported before the load: {early}"
from tests import fresh_models
name, path = sys.argv[1], sys.argv[2]
model = slimtorch.load_model(path, getattr(fresh_models, name)).model.eval()
out = model(fresh_models.example(name)).detach()
float_out = torch.load(f"{name}.float.pt")
cosine = float(torch.nn.functional.cosine_similarity(out.flatten(), float_out.flatten(), dim=0))
expected = None
try:
    expected = torch.load(path + ".expected.pt")
except FileNotFoundError:
    pass
params = sum(p.numel() for p in model.parameters())
error = None if expected is None else float((out - expected).norm() / expected.norm().clamp(min=1e-12))
print(json.dumps({"cosine": cosine, "error": error,
                  "finite": bool(torch.isfinite(out).all()), "shape": list(out.shape), "params": params}))
"""

PRETRAINED = """
import sys, torch, transformers
import slimtorch  # noqa: F401  (a user's script may import it; from_pretrained needs nothing of ours)
expected = torch.load("bert.expected.pt")
model = transformers.AutoModel.from_pretrained(sys.argv[1]).eval()
out = model(input_ids=expected["ids"]).last_hidden_state
cosine = torch.nn.functional.cosine_similarity(out.flatten(), expected["out"].flatten(), dim=0)
sys.exit(0 if cosine > 0.99 else 1)
"""


def _output_file(writer: Writer, folder: Path) -> Path:
    if writer.name == "slim":
        report = json.loads((folder / "slim-work" / "report.json").read_text())
        return folder / "slim-work" / report["outputs"]["model"]
    return folder / writer.output


CASES = [(w, r) for w in WRITERS for r in w.readers]


@pytest.mark.slow
@pytest.mark.parametrize(("writer", "reader"), CASES, ids=[f"{w.name}->{r}" for w, r in CASES])
def test_each_output_loads_back_in_a_fresh_process(written, writer: Writer, reader: str) -> None:
    folder, runs = written
    run = runs[writer.name]
    assert run.returncode == 0 or (writer.name == "slim" and run.returncode == 1), _say(writer.name, run)
    assert "Traceback" not in run.stderr, _say(writer.name, run)
    path = _output_file(writer, folder)
    if reader == "load-cli":
        loaded = _run(_cli("load", str(path), "--model", _spec(writer.model)), folder)
        assert loaded.returncode == 0, _say(f"{writer.name} -> slimtorch load", loaded)
        return
    if reader == "from_pretrained":
        loaded = _run((sys.executable, "-c", PRETRAINED, str(path)), folder)
        assert loaded.returncode == 0, _say(f"{writer.name} -> from_pretrained", loaded)
        return
    if reader == "predict.py":
        image = folder / "image.json"
        image.write_text(json.dumps(example("DigitsNet")[:1].tolist()))
        loaded = _run((sys.executable, str(path / "predict.py"), "--check"), folder)
        assert loaded.returncode == 0, _say(f"{writer.name} -> predict.py --check", loaded)
        return
    loaded = _run((sys.executable, "-c", READER, writer.model, str(path)), folder)
    assert loaded.returncode == 0, _say(f"{writer.name} -> load_model", loaded)
    result = json.loads(loaded.stdout.strip().splitlines()[-1])
    assert result["finite"] and result["shape"][0] == example(writer.model).shape[0]
    if result["error"] is not None:  # within the kernels' agreement: a new process times its own choice
        assert result["error"] <= BF16_AGREEMENT, (writer.name, "the reloaded model's outputs moved", result)
    if writer.min_cosine is not None:
        assert result["cosine"] >= writer.min_cosine - 1e-6, (writer.name, result)
    if writer.name.startswith(("prune-channels", "recover", "save_model-pruned")):
        assert result["params"] < sum(p.numel() for p in DigitsNet().parameters()), result
