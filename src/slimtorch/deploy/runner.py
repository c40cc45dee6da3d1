"""Run an exported slimtorch bundle: ``python predict.py INPUT`` in the bundle folder.

This file is copied into every bundle as ``predict.py``. It needs numpy and the bundle's runtime only
(onnxruntime for ``model.onnx``, torch for ``model.pt2``), never slimtorch, so it runs in the small
environment the bundle's ``requirements.txt`` describes.

    python predict.py image.npy                 # one input: a .npy file
    python predict.py inputs.npz -o out.npz     # named inputs (the manifest lists the names)
    python predict.py inputs.json               # {"input_ids": [[101, 2023, ...]]} or a bare list
    python predict.py --check                   # checksums, then the sample against its expected outputs
    python predict.py --text "a sentence" --text "another one"   # a text bundle: raw text in
    python predict.py --text-file sentences.json                 # ... or a JSON list of strings

From Python::

    from predict import Bundle
    outputs = Bundle(".").predict({"input_ids": ids})   # {output name: numpy array}
    outputs = Bundle(".").predict_text(["a sentence"])  # a text bundle

A text bundle (its manifest has a ``text`` section) tokenizes with the ``tokenizers`` package and its
``tokenizer.json``: truncated at the model's max length, padded on the right to the batch's longest text,
with the attention mask saying which tokens are real.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

import numpy as np

MANIFEST = "manifest.json"
TOKEN_FIELDS = {"input_ids": "ids", "attention_mask": "attention_mask", "token_type_ids": "type_ids"}
"""the inputs a tokenizer makes, and the field of a ``tokenizers.Encoding`` that holds each"""


class BundleError(Exception):
    """A bundle or an input this runner cannot use; the message says which file and why."""


class Bundle:
    """An exported model with its manifest: inputs are checked against it, outputs are named by it."""

    def __init__(self, folder: str | Path = ".") -> None:
        self.folder = Path(folder)
        try:
            self.manifest = json.loads((self.folder / MANIFEST).read_text())
        except (OSError, ValueError, RecursionError) as exc:  # this file runs without slimtorch's load_json
            raise BundleError(f"{self.folder / MANIFEST}: cannot read the manifest ({exc})") from None
        self.inputs = [spec["name"] for spec in self.manifest["inputs"]]
        self.outputs = [spec["name"] for spec in self.manifest["outputs"]]
        self._run = None

    def predict(self, inputs: dict[str, np.ndarray] | list[np.ndarray]) -> dict[str, np.ndarray]:
        """Outputs by name for inputs by name (or in the manifest's order)."""
        arrays = self._arrays(inputs)
        if self._run is None:
            self._run = load_runtime(
                self.folder / self.manifest["model"]["file"], self.manifest["model"]["format"]
            )
        return dict(zip(self.outputs, self._run(arrays), strict=False))

    def predict_text(self, texts: list[str]) -> dict[str, np.ndarray]:
        """Outputs for raw texts (a text bundle): tokenized, truncated and padded as :meth:`encode` does."""
        return self.predict(self.encode(texts))

    def encode(self, texts: list[str]) -> dict[str, np.ndarray]:
        """The model's inputs for ``texts``, by the bundle's tokenizer and the manifest's ``text`` section."""
        text = self.manifest.get("text")
        if not text:
            raise BundleError(f"{self.folder}: this bundle has no tokenizer; give token ids (.npz, .json)")
        return encode_texts(self.folder / text["tokenizer"], text, texts)

    def check(self) -> dict:
        """Verify every file's checksum, then run the sample and compare it with the expected outputs."""
        for name, entry in self.manifest["files"].items():
            if sha256(self.folder / name) != entry["sha256"]:
                raise BundleError(f"{self.folder / name}: checksum does not match the manifest")
        sample = self.manifest["sample"]
        inputs = dict(np.load(self.folder / sample["inputs"]))
        expected = np.load(self.folder / sample["outputs"])
        actual = self.predict(inputs)
        tolerance = self.manifest["tolerance"]
        errors = compare_outputs({n: expected[n] for n in self.outputs}, actual)
        ok = all(passes(e, tolerance) for e in errors.values())
        result = {"ok": ok, "tolerance": tolerance, "outputs": errors}
        source = self.manifest.get("verification", {}).get("embedding_source")
        # a quantized text model: its embedding decides
        if tolerance.get("min_cosine") is not None and source:
            worst = self._worst_cosine(source, inputs, expected, actual)
            ok = worst >= tolerance["min_cosine"]
            result.update(ok=ok, embedding_cosine=worst)
        if "text" in self.manifest:  # the sample is the sample texts: the tokenizer here must give its ids
            same = self._same_tokens(inputs)
            result.update(ok=ok and same, tokenizer="same token ids as at export" if same else "DIFFERENT")
        return result

    @staticmethod
    def _worst_cosine(source: dict, inputs: dict, expected: dict, actual: dict) -> float:
        """The least embedding cosine over the sample's texts (the manifest says where the embedding is)."""
        try:
            found = cosines(embeddings(source, inputs, expected), embeddings(source, inputs, actual))
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise BundleError(f"manifest.json: verification.embedding_source is unusable ({exc!r})") from None
        return float(np.min(found)) if found.size else 1.0

    def _same_tokens(self, sample: dict[str, np.ndarray]) -> bool:
        encoded = self.encode(self.manifest["text"]["sample_texts"])
        return all(np.array_equal(encoded[name], sample[name]) for name in encoded)

    def _arrays(self, inputs: dict[str, np.ndarray] | list[np.ndarray]) -> list[np.ndarray]:
        if not isinstance(inputs, dict):
            inputs = dict(zip(self.inputs, inputs, strict=False))
        missing = [name for name in self.inputs if name not in inputs]
        if missing:
            raise BundleError(f"missing input {missing[0]!r} (the model takes {', '.join(self.inputs)})")
        arrays = []
        for spec in self.manifest["inputs"]:
            array = np.asarray(inputs[spec["name"]]).astype(spec["dtype"], copy=False)
            shape = spec["shape"]
            if array.ndim != len(shape) or any(
                isinstance(want, int) and got != want for got, want in zip(array.shape, shape, strict=False)
            ):
                raise BundleError(f"input {spec['name']!r} has shape {list(array.shape)}, expected {shape}")
            longest = (self.manifest.get("text") or {}).get("max_length")
            if longest and "sequence" in shape and array.shape[shape.index("sequence")] > longest:
                raise BundleError(
                    f"input {spec['name']!r} has {array.shape[shape.index('sequence')]} tokens, "
                    f"more than the {longest} the model takes"
                )
            arrays.append(array)
        return arrays


def encode_texts(path: Path, settings: dict, texts: list[str]) -> dict[str, np.ndarray]:
    """Token inputs for ``texts``: encoded by the tokenizers package from ``path`` (its special tokens
    added), truncated at ``settings["max_length"]``, padded on the right to the longest text with
    ``pad_id`` (0 in the mask and token types). The same function makes the export's check inputs."""
    if not texts or not all(isinstance(t, str) for t in texts):
        raise BundleError("give one or more texts (strings)")
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise BundleError("raw text needs the tokenizers package: pip install -r requirements.txt") from None
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as exc:  # the Rust library raises a bare Exception
        raise BundleError(f"{path}: cannot read the tokenizer ({exc})") from None
    tokenizer.no_padding()  # a tokenizer.json may pad to a fixed length: padding is done here, per batch
    tokenizer.enable_truncation(settings["max_length"])
    encoded = tokenizer.encode_batch(list(texts))
    fields = settings["inputs"]
    lengths = [len(e.ids) for e in encoded]
    if "attention_mask" not in fields and len(set(lengths)) > 1:
        raise BundleError(
            "the model takes no attention_mask, so texts of different lengths cannot share a batch "
            "(padding would change its outputs): give them one at a time"
        )
    arrays = {}
    for name, field in fields.items():
        array = np.full((len(encoded), max(lengths)), settings["pad_id"] if field == "ids" else 0, np.int64)
        for row, encoding in enumerate(encoded):
            values = getattr(encoding, field)
            array[row, : len(values)] = values
        arrays[name] = array
    return arrays


def read_texts(path: str) -> list[str]:
    """The texts of a JSON file holding a list of strings."""
    try:
        texts = json.loads(Path(path).read_text())
    except (OSError, ValueError, RecursionError) as exc:
        raise BundleError(f"{path}: cannot read the texts ({exc})") from None
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
        raise BundleError(f'{path}: expected a JSON list of strings, like ["a sentence", "another"]')
    return texts


def compare_outputs(expected: dict[str, np.ndarray], actual: dict[str, np.ndarray]) -> dict[str, dict]:
    """For each output: the largest absolute difference, and that difference relative to the largest
    expected magnitude (elementwise relative errors blow up where values cross zero)."""
    errors = {}
    for name, want in expected.items():
        got = np.asarray(actual[name])
        if got.shape != want.shape:
            raise BundleError(f"output {name!r} has shape {list(got.shape)}, expected {list(want.shape)}")
        want64, got64 = want.astype(np.float64), got.astype(np.float64)
        max_abs = float(np.max(np.abs(got64 - want64))) if want.size else 0.0
        scale = float(np.max(np.abs(want64))) if want.size else 0.0
        errors[name] = {"max_abs": max_abs, "max_rel": max_abs / scale if scale else max_abs, "scale": scale}
    return errors


def embeddings(source: dict, inputs: dict[str, np.ndarray], outputs: dict[str, np.ndarray]) -> np.ndarray:
    """One embedding per text (row), float64, from ``source`` (``output``, ``pooled``, ``mask``: the
    manifest's ``verification.embedding_source``); a row whose mask keeps no token has none to give and is
    left out, so ``inputs`` decide which rows both sides keep."""
    values = np.asarray(outputs[source["output"]], dtype=np.float64)
    if not source["pooled"]:
        return values
    if source["mask"] is None:
        return values.mean(axis=1)
    mask = np.asarray(inputs[source["mask"]], dtype=np.float64)[..., None]
    kept = mask.sum(axis=1)[:, 0] > 0
    return ((values * mask).sum(axis=1) / np.maximum(mask.sum(axis=1), 1.0))[kept]


def cosines(expected: np.ndarray, actual: np.ndarray) -> np.ndarray:
    """Row-wise cosine; a zero row agrees only with a zero row (1), never with anything else (0).

    Example:
        >>> cosines(np.array([[1.0, 0.0], [0.0, 0.0]]), np.array([[2.0, 0.0], [0.0, 0.0]])).tolist()
        [1.0, 1.0]
    """
    a = np.linalg.norm(expected, axis=1)
    b = np.linalg.norm(actual, axis=1)
    dot = (expected * actual).sum(axis=1)
    both = (a > 0) & (b > 0)
    return np.where(both, dot / np.where(both, a * b, 1.0), np.where((a == 0) & (b == 0), 1.0, 0.0))


def passes(error: dict, tolerance: dict) -> bool:
    """Within ``atol + rtol * (largest expected magnitude)``."""
    return error["max_abs"] <= tolerance["atol"] + tolerance["rtol"] * error["scale"]


def read_inputs(paths: list[str], names: list[str]) -> dict[str, np.ndarray]:
    """Inputs from .npy files (one per input, in order), one .npz (by name) or one .json file
    (``{name: nested list}``, or a list: the only input, or one entry per input)."""
    if len(paths) == 1 and paths[0].endswith(".npz"):
        return dict(np.load(paths[0]))
    if len(paths) == 1 and paths[0].endswith(".json"):
        data = json.loads(Path(paths[0]).read_text())
        if isinstance(data, dict):
            return {name: np.asarray(value) for name, value in data.items()}
        return (
            {names[0]: np.asarray(data)}
            if len(names) == 1
            else dict(zip(names, map(np.asarray, data), strict=False))
        )
    if len(paths) != len(names):
        raise BundleError(
            f"the model takes {len(names)} input(s) ({', '.join(names)}); got {len(paths)} file(s)"
        )
    return {name: np.load(path) for name, path in zip(names, paths, strict=False)}


def load_runtime(path: Path, kind: str):
    """A function from input arrays (in the model's input order) to output arrays, on the bundle's
    runtime: onnxruntime on the CPU for ``"onnx"``, ``torch.export.load`` for ``"pt2"``."""
    if kind == "onnx":
        import onnxruntime

        options = onnxruntime.SessionOptions()
        options.log_severity_level = 3  # errors only: the session warns about every unused initializer
        session = onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        names = [i.name for i in session.get_inputs()]
        return lambda arrays: session.run(None, dict(zip(names, arrays, strict=False)))
    import torch

    program = torch.export.load(str(path)).module()

    def run(arrays: list[np.ndarray]) -> list[np.ndarray]:
        with torch.no_grad():
            out = program(*(torch.from_numpy(np.ascontiguousarray(a)) for a in arrays))
        leaves = torch.utils._pytree.tree_leaves(out)
        return [leaf.numpy() for leaf in leaves if isinstance(leaf, torch.Tensor)]

    return run


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        for block in iter(lambda: stream.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _write(outputs: dict[str, np.ndarray], target: str | None) -> None:
    if target and target.endswith(".npz"):
        np.savez(target, **outputs)
    elif target and target.endswith(".npy") and len(outputs) == 1:
        np.save(target, next(iter(outputs.values())))
    else:
        text = json.dumps({name: value.tolist() for name, value in outputs.items()})
        if target:
            Path(target).write_text(text + "\n")
        else:
            print(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run this bundle's model on .npy, .npz, .json or text.")
    parser.add_argument("inputs", nargs="*", metavar="INPUT", help=".npy per input, or one .npz / .json")
    parser.add_argument(
        "-o", "--output", help="write outputs to .npz, .npy or .json (default: JSON on stdout)"
    )
    parser.add_argument("--bundle", default=str(Path(__file__).resolve().parent), help="the bundle folder")
    parser.add_argument("--check", action="store_true", help="verify checksums and the bundled sample")
    parser.add_argument("--text", action="append", metavar="TEXT", help="raw text (text bundles; repeatable)")
    parser.add_argument("--text-file", metavar="JSON", help="a JSON list of strings (text bundles)")
    args = parser.parse_args(argv)
    try:
        texts = [*(args.text or ()), *(read_texts(args.text_file) if args.text_file else ())]
        bundle = Bundle(args.bundle)
        if args.check:
            result = bundle.check()
            print(json.dumps(result))
            return 0 if result["ok"] else 1
        if texts and args.inputs:
            parser.error("give INPUT files or --text, not both")
        if texts:
            _write(bundle.predict_text(texts), args.output)
            return 0
        if not args.inputs:
            parser.error("give an INPUT file, --text, or --check")
        _write(bundle.predict(read_inputs(args.inputs, bundle.inputs)), args.output)
        return 0
    except (BundleError, OSError, ValueError, KeyError) as exc:
        print(f"predict.py: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
