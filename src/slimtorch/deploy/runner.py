"""Run an exported slimtorch bundle: ``python predict.py INPUT`` in the bundle folder.

This file is copied into every bundle as ``predict.py``. It needs numpy and the bundle's runtime only
(onnxruntime for ``model.onnx``, torch for ``model.pt2``), never slimtorch, so it runs in the small
environment the bundle's ``requirements.txt`` describes.

    python predict.py image.npy                 # one input: a .npy file
    python predict.py inputs.npz -o out.npz     # named inputs (the manifest lists the names)
    python predict.py inputs.json               # {"input_ids": [[101, 2023, ...]]} or a bare list
    python predict.py --check                   # the bundle verified, then its sample against its outputs
    python predict.py --text "a sentence" --text "another one"   # a text bundle: raw text in
    python predict.py --text-file sentences.json                 # ... or a JSON list of strings

From Python::

    from predict import Bundle
    outputs = Bundle(".").predict({"input_ids": ids})   # {output name: numpy array}
    outputs = Bundle(".").predict_text(["a sentence"])  # a text bundle

A text bundle (its manifest has a ``text`` section) tokenizes with the ``tokenizers`` package and its
``tokenizer.json``: truncated at the model's max length, padded on the right to the batch's longest text,
with the attention mask saying which tokens are real. Many texts run in batches of similar length, each at
most :data:`TEXT_BATCH_TOKENS` tokens padded (one long text among thousands of short ones would otherwise
pad them all to its length); their outputs come back in the texts' order, token-level outputs as long as
the longest text and zero past each text's own length, whichever batch it ran in (the model's values on
padding are numbers no one should read, and they would depend on the batch).

What is checked, and when. Every start reads ``manifest.json`` within a size bound and checks its shape
(:func:`check_manifest`), and looks at the folder (:func:`verify_files` without hashes: each listed file a
regular file of its listed size, nothing unlisted that Python could import). ``--check`` and slimtorch's
``footprint`` verify all of it: every file's sha256, ``requirements.txt`` nothing but ``name==version``
lines, the sample files' headers within the input budget. Every start does not hash the model: that costs
a read of the whole model per call, and it proves nothing against a deliberate change (whoever edits the
model can edit this file and the manifest too); what stops code from a downloaded folder running is
slimtorch's ``footprint``, which compares this file byte for byte with the runner it ships before running
it. Inputs (and the sample files) are read by their headers first: the shape the manifest gives, within
``--max-input-bytes`` of memory, no pickle, before numpy allocates anything.
"""

import os
import sys

if __name__ == "__main__":
    # Run as a script, Python put this folder first on sys.path: a json.py or numpy.py beside the runner
    # would be imported in place of the real one. Nothing is imported from the bundle's folder (os and sys
    # are loaded before any script runs).
    _here = os.path.dirname(os.path.realpath(__file__))
    sys.path[:] = [entry for entry in sys.path if os.path.realpath(entry or os.curdir) != _here]

import argparse  # after the path is cleaned, above
import contextlib
import hashlib
import json
import math
import re
import stat
import struct
import zipfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import numpy as np

MANIFEST, RUNNER, REQUIREMENTS = "manifest.json", "predict.py", "requirements.txt"
FORMAT, VERSION = "slimtorch-bundle", 1
TOKEN_FIELDS = {"input_ids": "ids", "attention_mask": "attention_mask", "token_type_ids": "type_ids"}
"""the inputs a tokenizer makes, and the field of a ``tokenizers.Encoding`` that holds each"""

MAX_INPUT_BYTES = 1 << 30
"""What the arrays of one input file (or of a sample file) may take in memory, read from their headers
before anything is allocated: 1 GiB, 268 million float32 values, beyond any one call of a model exported
for inference (a thousand 224x224 RGB images are 0.6 GB); ``--max-input-bytes`` raises it. A fixed shape
is held to the manifest's exactly; only a dynamic batch (and a text bundle's sequence, up to its max
length) is open, and this is its bound."""
JSON_EXPANSION = 32
"""A number in JSON takes 2 bytes at least, and 32 as a Python float in its list: a JSON input may be at
most this many times smaller than the input budget."""
MAX_MANIFEST_BYTES = 16 << 20
MAX_FILE_BYTES = 1 << 40
MAX_FILES, MAX_TENSORS, MAX_RANK, MAX_DIM = 64, 256, 16, 1 << 40
MAX_REQUIREMENTS_BYTES, MAX_TEXTS, MAX_TEXT_CHARS = 1 << 16, 64, 1 << 14
TEXT_BATCH_TOKENS = 8192
"""Padded tokens one batch of raw texts may hold (a text longer than this runs alone): a BERT-base batch of
8192 tokens takes about 0.4 GB at 512 tokens a text (its attention scores), 50 MB at 64."""
TEXT_BLOCK = 1024
"""Texts tokenized at a time: their encodings are held for one block, not for all the texts."""
MAX_MEMBER_ENTRY = 1024
"""zip directory bytes per array: the fixed fields, a name and a ZIP64 extra fit in far less"""
DTYPES = ("bool", "uint8", "int8", "int16", "int32", "int64", "float16", "float32", "float64")
DYNAMIC = ("batch", "sequence")
PLAIN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+-]{0,127}", re.ASCII)
"""a file of the bundle: a plain name in its folder (no path, no ``..``, not hidden)"""
SHA256 = re.compile(r"[0-9a-f]{64}", re.ASCII)
PINNED = re.compile(
    r"([A-Za-z0-9]|[A-Za-z0-9][A-Za-z0-9._-]{0,98}[A-Za-z0-9])"  # a PEP 508 name
    r"==(\d{1,9}(\.\d{1,9}){0,7}((a|b|rc)\d{1,9})?(\.post\d{1,9})?(\.dev\d{1,9})?)",  # a plain version
    re.ASCII,
)
"""the one line requirements.txt may hold: no pip option, URL, path, extra or marker"""
IMPORTABLE = (".py", ".pyw", ".pyc", ".pyo", ".pyd", ".so", ".pth", ".dylib", ".dll")
OWN_BYTECODE = re.compile(r"predict\.[\w.-]+\.pyc", re.ASCII)
"""what ``from predict import Bundle`` writes in ``__pycache__`` (a script's own bytecode is never read)"""


class BundleError(Exception):
    """A bundle or an input this runner cannot use; the message says which file and why."""


class InvalidBundle(BundleError):
    """A bundle's file fails verification: ``path`` is the file, ``problem`` what is wrong with it."""

    def __init__(self, path: str | Path, problem: str) -> None:
        self.path, self.problem = Path(path), problem
        super().__init__(f"{path}: {problem}")


class Bundle:
    """An exported model with its manifest: inputs are checked against it, outputs are named by it.

    The manifest is schema-checked and the folder looked at (no hashes) when the bundle is opened;
    :meth:`check` verifies every file before it runs the sample.
    """

    def __init__(self, folder: str | Path = ".", *, max_input_bytes: int = MAX_INPUT_BYTES) -> None:
        self.folder = Path(folder)
        self.manifest = read_manifest(self.folder)
        verify_files(self.folder, self.manifest, hashes=False)
        self.max_input_bytes = max_input_bytes
        self.inputs = [spec["name"] for spec in self.manifest["inputs"]]
        self.outputs = [spec["name"] for spec in self.manifest["outputs"]]
        self.longest = (self.manifest.get("text") or {}).get("max_length")
        self._run: Callable[[list[np.ndarray]], list[np.ndarray]] | None = None

    def predict(self, inputs: dict[str, np.ndarray] | list[np.ndarray]) -> dict[str, np.ndarray]:
        """Outputs by name for inputs by name (or in the manifest's order)."""
        arrays = self._arrays(inputs)
        model = self.folder / self.manifest["model"]["file"]
        try:  # the runtime's own errors on a model or input it cannot take: one line, not its traceback
            if self._run is None:
                self._run = load_runtime(
                    model, self.manifest["model"]["format"], self.manifest["model"].get("threads")
                )
            outputs = self._run(arrays)
        except Exception as exc:
            raise BundleError(f"{model}: the runtime failed: {_first_line(exc)}") from None
        return dict(zip(self.outputs, outputs, strict=False))

    def predict_text(self, texts: list[str]) -> dict[str, np.ndarray]:
        """Outputs for raw texts (a text bundle), in their order: tokenized and truncated as :meth:`encode`
        does, run in batches of similar length (at most :data:`TEXT_BATCH_TOKENS` padded tokens; of one
        length where the model takes no attention mask), token-level outputs as long as the longest text,
        zero past each text's own length. The outputs are held to the input budget (``max_input_bytes``)
        before they are made."""
        _check_texts(texts)
        settings = self._text_settings()
        tokenizer = text_tokenizer(self.folder / settings["tokenizer"], settings)
        lengths: list[int] = []
        for at in range(0, len(texts), TEXT_BLOCK):  # first the lengths, a block of encodings at a time
            encoded = tokenizer.encode_batch(texts[at : at + TEXT_BLOCK])
            lengths += [len(e.ids) for e in encoded]
        outputs = _TextOutputs(self, lengths)
        masked = "attention_mask" in settings["inputs"]
        for at in range(0, len(texts), TEXT_BLOCK):
            if len(texts) > TEXT_BLOCK:  # one block's encodings are still those above
                encoded = tokenizer.encode_batch(texts[at : at + TEXT_BLOCK])
            for rows in text_batches(np.array(lengths[at : at + TEXT_BLOCK]), masked):
                arrays = pad_encodings([encoded[row] for row in rows], settings)
                outputs.place([at + row for row in rows], self.predict(arrays))
        return outputs.arrays

    def encode(self, texts: list[str]) -> dict[str, np.ndarray]:
        """The model's inputs for ``texts`` as one batch, by the bundle's tokenizer and the manifest's
        ``text`` section."""
        settings = self._text_settings()
        return encode_texts(self.folder / settings["tokenizer"], settings, texts)

    def _text_settings(self) -> dict:
        text = self.manifest.get("text")
        if not text:
            raise BundleError(f"{self.folder}: this bundle has no tokenizer; give token ids (.npz, .json)")
        return text

    def read(self, paths: list[str]) -> dict[str, np.ndarray]:
        """Inputs from files (see :func:`read_inputs`), held to the manifest's inputs and the budget."""
        return read_inputs(paths, self.manifest["inputs"], self.max_input_bytes, self.longest)

    def check(self) -> dict:
        """Verify the bundle (:func:`verify_files`), then run the sample and compare it with the expected
        outputs."""
        verify_files(self.folder, self.manifest, max_input_bytes=self.max_input_bytes)
        sample = self.manifest["sample"]
        inputs = read_arrays(self.folder / sample["inputs"], self.manifest["inputs"], self.max_input_bytes)
        expected = read_arrays(
            self.folder / sample["outputs"], self.manifest["outputs"], self.max_input_bytes
        )
        missing = [name for name in self.outputs if name not in expected]
        if missing:
            raise InvalidBundle(self.folder / sample["outputs"], f"has no output {missing[0]!r}")
        actual = self.predict(inputs)
        tolerance = self.manifest["tolerance"]
        errors = compare_outputs({n: expected[n] for n in self.outputs}, actual)
        ok = all(passes(e, tolerance) for e in errors.values())
        result = {"ok": ok, "tolerance": tolerance, "outputs": errors}
        source = (self.manifest.get("verification") or {}).get("embedding_source")
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
        return all(name in sample and np.array_equal(encoded[name], sample[name]) for name in encoded)

    def _arrays(self, inputs: dict[str, np.ndarray] | list[np.ndarray]) -> list[np.ndarray]:
        if not isinstance(inputs, dict):
            inputs = dict(zip(self.inputs, inputs, strict=False))
        missing = [name for name in self.inputs if name not in inputs]
        if missing:
            raise BundleError(f"missing input {missing[0]!r} (the model takes {', '.join(self.inputs)})")
        arrays = []
        for spec in self.manifest["inputs"]:
            try:
                array = np.asarray(inputs[spec["name"]]).astype(spec["dtype"], copy=False)
            except (TypeError, ValueError, OverflowError) as exc:
                raise BundleError(
                    f"input {spec['name']!r} is not an array of {spec['dtype']} ({_first_line(exc)})"
                ) from None
            problem = shape_problem(f"input {spec['name']!r}", spec, array.shape, self.longest)
            if problem:
                raise BundleError(problem)
            arrays.append(array)
        return arrays


def encode_texts(path: Path, settings: dict, texts: list[str]) -> dict[str, np.ndarray]:
    """Token inputs for ``texts`` as one batch: encoded by the tokenizers package from ``path`` (its special
    tokens added), truncated at ``settings["max_length"]``, padded on the right to the longest text with
    ``pad_id`` (0 in the mask and token types). The same function makes the export's check inputs."""
    _check_texts(texts)
    encoded = text_tokenizer(path, settings).encode_batch(list(texts))
    if "attention_mask" not in settings["inputs"] and len({len(e.ids) for e in encoded}) > 1:
        raise BundleError(
            "the model takes no attention_mask, so texts of different lengths cannot share a batch "
            "(padding would change its outputs): give them one at a time"
        )
    return pad_encodings(encoded, settings)


def _check_texts(texts: list[str]) -> None:
    if not texts or not all(isinstance(t, str) for t in texts):
        raise BundleError("give one or more texts (strings)")


def text_tokenizer(path: Path, settings: dict):
    """The ``tokenizers.Tokenizer`` of ``path``, truncating at ``settings["max_length"]``, not padding."""
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
    return tokenizer


def pad_encodings(encoded: list, settings: dict) -> dict[str, np.ndarray]:
    """The model's inputs for tokenizer encodings: padded on the right to the longest."""
    longest = max(len(e.ids) for e in encoded)
    arrays = {}
    for name, field in settings["inputs"].items():
        array = np.full((len(encoded), longest), settings["pad_id"] if field == "ids" else 0, np.int64)
        for row, encoding in enumerate(encoded):
            values = getattr(encoding, field)
            array[row, : len(values)] = values
        arrays[name] = array
    return arrays


def text_batches(lengths: np.ndarray, masked: bool) -> list[list[int]]:
    """Rows of ``lengths`` (token counts) in batches: all in one, in their order, where that is at most
    :data:`TEXT_BATCH_TOKENS` tokens padded; else by length, each batch within that (a longer text alone),
    and of one length where the model is not ``masked`` (takes no attention mask: padding would change
    its outputs)."""
    rows = len(lengths)
    if rows * int(lengths.max()) <= TEXT_BATCH_TOKENS and (masked or len(set(lengths.tolist())) == 1):
        return [list(range(rows))]
    batches: list[list[int]] = []
    batch: list[int] = []
    for row in np.argsort(lengths, kind="stable").tolist():
        length = int(lengths[row])  # the batch's longest: rows come shortest first
        full = (len(batch) + 1) * length > TEXT_BATCH_TOKENS
        if batch and (full or (not masked and length != lengths[batch[0]])):
            batches.append(batch)
            batch = []
        batch.append(row)
    return [*batches, batch]


class _TextOutputs:
    """The outputs of many texts, filled batch by batch in the texts' order: allocated at the first batch,
    from its outputs' shapes, within the bundle's input budget; each output's ``"sequence"`` axes as long as
    the longest text, zero past each text's own length (whichever batch it ran in). One batch of all the
    texts is handed on as the model gave it, its padding zeroed alike."""

    def __init__(self, bundle: "Bundle", lengths: list[int]) -> None:
        self.bundle, self.lengths, self.count, self.longest = bundle, lengths, len(lengths), max(lengths)
        self.sequence_axes = {
            spec["name"]: [axis for axis, size in enumerate(spec["shape"]) if axis and size == "sequence"]
            for spec in bundle.manifest["outputs"]
        }
        self.arrays: dict[str, np.ndarray] = {}

    def place(self, rows: list[int], outputs: dict[str, np.ndarray]) -> None:
        if len(rows) == self.count:  # the one batch, in the texts' order
            self.arrays = {name: a if a.flags.writeable else a.copy() for name, a in outputs.items()}
        else:
            if not self.arrays:
                self.arrays = self._allocate(outputs)
            for name, array in outputs.items():
                target = self.arrays[name]
                fits = array.ndim == target.ndim and array.shape[0] == len(rows)
                if not fits or any(
                    got > size for got, size in zip(array.shape[1:], target.shape[1:], strict=True)
                ):
                    raise BundleError(
                        f"output {name!r} has shape {list(array.shape)} for {len(rows)} texts, where an "
                        f"earlier batch gave {list(target.shape[1:])} a text: give the texts in smaller calls"
                    )
                where: tuple[list[int] | slice, ...] = (rows, *(slice(0, size) for size in array.shape[1:]))
                target[where] = array
        for name, target in self.arrays.items():
            for axis in self.sequence_axes.get(name, ()):
                if axis < target.ndim:
                    for row in rows:
                        padding: tuple[int | slice, ...]
                        padding = (row, *[slice(None)] * (axis - 1), slice(self.lengths[row], None))
                        target[padding] = 0

    def _allocate(self, outputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        shapes, total = {}, 0
        for name, array in outputs.items():
            if array.ndim == 0:
                raise BundleError(f"output {name!r} has no row per text: give the texts in one small call")
            shape = [self.count, *array.shape[1:]]
            for axis in self.sequence_axes.get(name, ()):
                if axis < len(shape):
                    shape[axis] = max(shape[axis], self.longest)
            shapes[name] = (tuple(shape), array.dtype)
            total += math.prod(shape) * array.dtype.itemsize
        if total > self.bundle.max_input_bytes:
            raise BundleError(
                f"the outputs of {self.count:,} texts would take {total:,} bytes, more than the "
                f"{self.bundle.max_input_bytes:,} allowed (--max-input-bytes): give fewer texts at a time"
            )
        return {name: np.zeros(shape, dtype) for name, (shape, dtype) in shapes.items()}


def read_texts(path: str, max_bytes: int = MAX_INPUT_BYTES // JSON_EXPANSION) -> list[str]:
    """The texts of a JSON file holding a list of strings."""
    texts = _read_json(Path(path), max_bytes, "the texts")
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


def embeddings(
    source: dict, inputs: Mapping[str, np.ndarray], outputs: Mapping[str, np.ndarray]
) -> np.ndarray:
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


# -- verification: the manifest's shape, the folder against it ------------------------------------------
def read_manifest(folder: str | Path) -> dict:
    """``folder``'s manifest, read within :data:`MAX_MANIFEST_BYTES` and schema-checked
    (:func:`check_manifest`); :class:`InvalidBundle` naming it otherwise."""
    path = Path(folder) / MANIFEST
    try:
        found = os.lstat(path)
        if not stat.S_ISREG(found.st_mode):
            raise InvalidBundle(path, "is not a regular file (a link or a folder)")
        if found.st_size > MAX_MANIFEST_BYTES:
            raise InvalidBundle(
                path, f"is {found.st_size:,} bytes, more than the {MAX_MANIFEST_BYTES:,} read"
            )
        document = json.loads(path.read_bytes(), parse_int=_bounded_int)
    except (OSError, ValueError, RecursionError) as exc:  # this file runs without slimtorch's load_json
        raise InvalidBundle(path, f"cannot read the manifest ({_first_line(exc)})") from None
    check_manifest(document, path)
    return document


def check_manifest(manifest: object, path: str | Path = MANIFEST) -> None:
    """Refuse (:class:`InvalidBundle` on ``path``) a manifest not shaped as the exporter writes it
    (:data:`SCHEMA`: every key the runner reads, of its type, within its bounds, and no other key), or
    whose names disagree: the model, samples and tokenizer among the files listed, the runner and
    requirements listed, the manifest not, each tensor named once."""

    def need(ok: object, where: str, problem: str) -> None:
        if not ok:
            raise InvalidBundle(path, f"{where} {problem}")

    _match(manifest, SCHEMA, ROOT, need)
    assert isinstance(manifest, dict)
    files, model, text = manifest["files"], manifest["model"], manifest.get("text") or {}
    named = [("model.file", model["file"]), *((f"model.files[{i}]", n) for i, n in enumerate(model["files"]))]
    named += [(f"sample.{key}", name) for key, name in manifest["sample"].items()]
    named += [("text.tokenizer", text["tokenizer"])] if text else []
    named += [(f"text.files[{i}]", name) for i, name in enumerate(text.get("files", []))]
    for where, name in named:
        need(name in files, where, f"{name!r} is not a file the manifest lists")
    need(model["file"] in model["files"], "model.file", "is not among model.files")
    need(RUNNER in files and REQUIREMENTS in files, "files", f"does not list {RUNNER} and {REQUIREMENTS}")
    need(MANIFEST not in files, "files", "lists the manifest itself")
    code = [name for name in files if name != RUNNER and name.lower().endswith(IMPORTABLE)]
    need(not code, f"files: {code[:1]!r}", "is code; a bundle holds none but its runner")
    names = {key: [spec["name"] for spec in manifest[key]] for key in ("inputs", "outputs")}
    for key, listed in names.items():
        need(listed and len(set(listed)) == len(listed), key, "is not one or more tensors, each named once")
    need(
        set(text.get("inputs", {})) <= set(names["inputs"]),
        "text.inputs",
        "names what the model does not take",
    )
    source = (manifest.get("verification") or {}).get("embedding_source") or {}
    where = "verification.embedding_source"
    found = source.get("output", names["outputs"][0])
    need(found in names["outputs"], where, f"is unusable: {found!r} is none of the model's outputs")
    found = source.get("mask")
    need(found in [None, *names["inputs"]], where, f"is unusable: {found!r} is none of the model's inputs")


def _match(value: object, rule: object, where: str, need) -> None:
    """``value`` against a :data:`SCHEMA` rule: an object (``"key?"``: optional; no other key), ``_Each``,
    ``_Map``, ``_Null``, or a leaf ``(what it should be, test)``."""
    if isinstance(rule, _Null):
        if value is not None:
            _match(value, rule.rule, where, need)
    elif isinstance(rule, dict):
        need(isinstance(value, dict), where, "is not a JSON object")
        assert isinstance(value, dict)
        known = {key.rstrip("?"): key.endswith("?") for key in rule}
        missing = [key for key, optional in known.items() if not optional and key not in value]
        need(not missing, _at(where, str(missing[:1])), "is missing")
        unknown = [key for key in value if key not in known]
        need(not unknown, _at(where, str(unknown[:1])[:80]), "is not a key a bundle's manifest has there")
        for key, sub in rule.items():
            if key.rstrip("?") in value:
                _match(value[key.rstrip("?")], sub, _at(where, key.rstrip("?")), need)
    elif isinstance(rule, _Each):
        need(
            isinstance(value, list) and len(value) <= rule.most,
            where,
            f"is not a list of {rule.most} at most",
        )
        assert isinstance(value, list)
        for index, item in enumerate(value):
            _match(item, rule.item, f"{where}[{index}]", need)
    elif isinstance(rule, _Map):
        need(
            isinstance(value, dict) and len(value) <= rule.most, where, f"is not {rule.most} entries at most"
        )
        assert isinstance(value, dict)
        for key, item in value.items():
            _match(key, rule.key, f"{where} key {key[:80]!r}", need)
            _match(item, rule.value, f"{where}[{key!r}]", need)
    else:
        assert isinstance(rule, tuple)  # a leaf
        what, test = rule
        need(test(value), where, f"is not {what}")


ROOT = "the manifest"


def _at(where: str, key: str) -> str:
    return key if where == ROOT else f"{where}.{key}"


class _Each:
    def __init__(self, item: object, most: int) -> None:
        self.item, self.most = item, most


class _Map:
    def __init__(self, key: object, value: object, most: int) -> None:
        self.key, self.value, self.most = key, value, most


class _Null:
    def __init__(self, rule: object) -> None:
        self.rule = rule


def _plain(name: object) -> bool:
    return isinstance(name, str) and bool(PLAIN_NAME.fullmatch(name))


def _count(value: object, limit: int) -> bool:
    return type(value) is int and 0 <= value <= limit


def _number(value: object) -> bool:
    return (type(value) is int or type(value) is float) and math.isfinite(value)


ANY = ("JSON", lambda value: True)
FILE = ("a plain file name inside the bundle's folder", _plain)
SIZE = (f"a size of 0 to {MAX_FILE_BYTES:,} bytes", lambda value: _count(value, MAX_FILE_BYTES))
COUNT = (f"a count of 0 to {MAX_DIM:,}", lambda value: _count(value, MAX_DIM))
TEXT = ("a string", lambda value: isinstance(value, str) and len(value) <= MAX_TEXT_CHARS)
NAME = ("a name", lambda value: isinstance(value, str) and 0 < len(value) <= 256)
FLAG = ("true or false", lambda value: isinstance(value, bool))
TENSORS = _Each(
    {
        "name": NAME,
        "dtype": (f"one of {', '.join(DTYPES)}", lambda value: isinstance(value, str) and value in DTYPES),
        "shape": _Each(("a size, batch or sequence", lambda v: _count(v, MAX_DIM) or v in DYNAMIC), MAX_RANK),
    },
    MAX_TENSORS,
)
SCHEMA = {
    "format": (FORMAT, lambda value: value == FORMAT),
    "version": (str(VERSION), lambda value: type(value) is int and value == VERSION),
    "model": {
        "file": FILE,
        "files": _Each(FILE, MAX_FILES),
        "format": ("onnx or pt2", lambda value: value in ("onnx", "pt2")),
        "bytes?": SIZE,
        "threads?": ("a count of 1 to 4,096 threads", lambda value: _count(value, 4096) and value >= 1),
    },
    "quantized?": _Null(TEXT),
    "inputs": TENSORS,
    "outputs": TENSORS,
    "tolerance": {
        "atol": ("a number >= 0", lambda value: _number(value) and value >= 0),
        "rtol": ("a number >= 0", lambda value: _number(value) and value >= 0),
        "meaning?": TEXT,
        "min_cosine?": _Null(("a cosine", lambda value: _number(value) and -1 <= value <= 1)),
    },
    "verification?": {
        "passed?": FLAG,
        "samples?": COUNT,
        "outputs?": _Each(ANY, MAX_TENSORS),
        "embedding?": ANY,
        "embedding_source?": _Null({"output": NAME, "pooled": FLAG, "mask": _Null(NAME)}),
    },
    "created_by?": _Map(NAME, TEXT, MAX_FILES),
    "text?": {
        "tokenizer": FILE,
        "files?": _Each(FILE, MAX_FILES),
        "inputs": _Map(NAME, ("a token field", lambda value: value in TOKEN_FIELDS.values()), MAX_TENSORS),
        "max_length": ("a length", lambda value: _count(value, MAX_DIM) and value > 0),
        "truncation?": TEXT,
        "padding?": TEXT,
        "pad_id": ("a token id", lambda value: _count(value, 1 << 31)),
        "pad_token?": _Null(TEXT),
        "sample_texts?": _Each(TEXT, MAX_TEXTS),
    },
    "pip_options?": (
        '["--no-deps"]: pip is given no other option',
        lambda value: value in ([], ["--no-deps"]),
    ),
    "sample": {"inputs": FILE, "outputs": FILE},
    "requirements": _Each(
        ("name==version", lambda v: isinstance(v, str) and PINNED.fullmatch(v)), MAX_FILES * 4
    ),
    "files": _Map(
        FILE,
        {"bytes": SIZE, "sha256": ("a sha256", lambda v: isinstance(v, str) and SHA256.fullmatch(v))},
        MAX_FILES,
    ),
}
"""The manifest as the exporter writes it (see ``_match`` for how a rule reads)."""


def verify_files(
    folder: str | Path, manifest: dict, *, hashes: bool = True, max_input_bytes: int = MAX_INPUT_BYTES
) -> None:
    """The folder against its (checked) ``manifest``: every listed file a regular file of its listed size,
    nothing unlisted that Python could import or the system run (a link, a folder, code), and, with
    ``hashes``, every file's sha256, ``requirements.txt`` pinned names only and the sample files' headers
    within the budget. :class:`InvalidBundle` names the first file that fails."""
    folder = Path(folder)
    files = manifest["files"]
    for name, entry in files.items():
        path = folder / name
        try:
            found = os.lstat(path)
        except FileNotFoundError:
            raise InvalidBundle(path, "is missing (the manifest lists it)") from None
        if not stat.S_ISREG(found.st_mode):
            raise InvalidBundle(path, "is not a regular file (a link or a folder), which no bundle holds")
        if found.st_size != entry["bytes"]:
            raise InvalidBundle(path, f"is {found.st_size:,} bytes; the manifest says {entry['bytes']:,}")
    with os.scandir(folder) as entries:
        for entry in entries:
            if entry.name not in files and entry.name != MANIFEST:
                _check_unlisted(folder / entry.name, entry)
    if not hashes:
        return
    check_requirements(folder / REQUIREMENTS, manifest["requirements"])
    for name, entry in files.items():
        if sha256(folder / name) != entry["sha256"]:
            raise InvalidBundle(folder / name, "checksum does not match the manifest")
    sample = manifest["sample"]
    array_bytes(folder / sample["inputs"], manifest["inputs"], max_input_bytes)
    array_bytes(folder / sample["outputs"], manifest["outputs"], max_input_bytes)


def _check_unlisted(path: Path, entry: os.DirEntry) -> None:
    """A file the manifest does not list may be the user's data (an output written here), never a link, a
    folder Python could import from, or code."""
    if entry.is_symlink():
        raise InvalidBundle(path, "is a link the manifest does not list; a bundle holds none")
    if entry.is_dir():
        with os.scandir(path) as inside:
            if entry.name == "__pycache__" and all(
                e.is_file(follow_symlinks=False) and OWN_BYTECODE.fullmatch(e.name) for e in inside
            ):
                return
        raise InvalidBundle(path, "is a folder the manifest does not list; Python could import code from it")
    if entry.name.lower().endswith(IMPORTABLE) or entry.stat(follow_symlinks=False).st_mode & 0o111:
        raise InvalidBundle(
            path, "is code the manifest does not list (Python could import it, or it is executable)"
        )


def check_requirements(path: Path, pinned: list[str]) -> None:
    """``requirements.txt`` holds comments and ``name==version`` lines only, the manifest's requirements:
    no pip option (``--index-url``, ``-e``, ``-r``, ``-f`` ...), URL, path, extra or marker."""
    try:
        text = path.read_bytes()[:MAX_REQUIREMENTS_BYTES].decode("ascii")
    except UnicodeDecodeError:
        raise InvalidBundle(path, "is not plain ASCII text") from None
    lines = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if line and not line.startswith("#"):
            if not PINNED.fullmatch(line):
                raise InvalidBundle(
                    path,
                    f"line {number} {line[:80]!r} is not a pinned package (name==version); a bundle's "
                    "requirements hold no pip option, URL, path or marker",
                )
            lines.append(line)
    if lines != pinned:
        raise InvalidBundle(path, "does not hold the requirements the manifest lists")


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        for block in iter(lambda: stream.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _bounded_int(digits: str) -> int:
    if len(digits) > 40:
        raise ValueError(f"an integer of {len(digits)} digits")
    return int(digits)


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]


# -- inputs: headers first, within the budget --------------------------------------------------------------
def read_inputs(
    paths: list[str], specs: list[dict], max_bytes: int = MAX_INPUT_BYTES, longest: int | None = None
) -> dict[str, np.ndarray]:
    """Inputs from .npy files (one per input, in order), one .npz (by name) or one .json file
    (``{name: nested list}``, or a list: the only input, or one entry per input); ``specs`` are the
    manifest's inputs. Arrays are read by their headers first (:func:`read_arrays`); JSON within
    :data:`JSON_EXPANSION` of the budget."""
    names = [spec["name"] for spec in specs]
    if len(paths) == 1 and paths[0].endswith(".npz"):
        return read_arrays(Path(paths[0]), specs, max_bytes, longest)
    if len(paths) == 1 and paths[0].endswith(".json"):
        path = Path(paths[0])
        data = _read_json(path, max_bytes // JSON_EXPANSION, "the inputs")
        if not isinstance(data, dict):
            data = (
                {names[0]: data} if len(names) == 1 else dict(zip(names, _listed(path, data), strict=False))
            )
        return {name: _numbers(path, name, value) for name, value in data.items()}
    if len(paths) != len(names):
        raise BundleError(
            f"the model takes {len(names)} input(s) ({', '.join(names)}); got {len(paths)} file(s)"
        )
    found, left = {}, max_bytes
    for spec, given in zip(specs, paths, strict=False):
        found[spec["name"]] = read_array(Path(given), spec, left, longest)
        left -= _memory(found[spec["name"]].shape, found[spec["name"]].dtype, spec)
    return found


def _listed(path: Path, data: object) -> list:
    if not isinstance(data, list):
        raise BundleError(f"{path}: expected inputs by name ({{name: nested list}}) or a list of them")
    return data


def _numbers(path: Path, name: str, value: object) -> np.ndarray:
    """A JSON input as an array of numbers (bool, integers, floats), or a line naming the file."""
    try:
        array = np.asarray(value)
    except (ValueError, TypeError, OverflowError) as exc:  # ragged lists, numbers beyond any dtype
        raise BundleError(f"{path}: input {name!r} is not an array ({_first_line(exc)})") from None
    if array.dtype.kind not in "biuf":
        raise BundleError(f"{path}: input {name!r} holds {array.dtype}, not numbers")
    return array


def read_arrays(
    path: Path, specs: list[dict], max_bytes: int = MAX_INPUT_BYTES, longest: int | None = None
) -> dict[str, np.ndarray]:
    """The arrays of an ``.npz`` by name, once :func:`array_bytes` has found them within the budget."""
    array_bytes(path, specs, max_bytes, longest)
    with _readable(path), np.load(path, allow_pickle=False) as archive:
        return {name: archive[name] for name in archive.files}


def array_bytes(path: Path, specs: list[dict], max_bytes: int, longest: int | None = None) -> int:
    """The memory an ``.npz``'s arrays would take, from its zip directory and each member's ``.npy``
    header, nothing decompressed beyond those: at most one member per spec, each named by one, of a
    number dtype, of the shape the spec gives, its header within the member's size, all within
    ``max_bytes`` (converted to the spec's dtype); :class:`InvalidBundle` on ``path`` otherwise."""
    by_name = {spec["name"]: spec for spec in specs}
    with _readable(path):
        members, directory = _zip_members(path)
        if members > len(specs) or directory > len(specs) * MAX_MEMBER_ENTRY:
            raise InvalidBundle(path, f"holds {members:,} arrays; at most {len(specs)} are read here")
        total, seen = 0, set()
        with zipfile.ZipFile(path) as archive:
            for info in archive.infolist():
                name = info.filename.removesuffix(".npy")
                if not info.filename.endswith(".npy") or name not in by_name or name in seen:
                    known = ", ".join(by_name)
                    raise InvalidBundle(path, f"member {info.filename[:80]!r} is none of {known} (once each)")
                seen.add(name)
                with archive.open(info) as member:
                    shape, dtype = _npy_header(path, member, name)
                    header = member.tell()
                if header + math.prod(shape) * dtype.itemsize != info.file_size:
                    raise InvalidBundle(path, f"{name!r}: its header does not match the member's size")
                total += _fits(path, name, shape, dtype, by_name[name], longest)
                if total > max_bytes:
                    raise InvalidBundle(path, _too_big(total, max_bytes))
    return total


def read_array(path: Path, spec: dict, max_bytes: int, longest: int | None = None) -> np.ndarray:
    """The array of one ``.npy`` for input ``spec``, its header checked (as :func:`array_bytes` does)
    against the file's size, the spec and ``max_bytes`` before numpy allocates it."""
    with _readable(path):
        with open(path, "rb") as stream:
            shape, dtype = _npy_header(path, stream, spec["name"])
            header = stream.tell()
        if header + math.prod(shape) * dtype.itemsize != os.stat(path).st_size:
            raise InvalidBundle(path, "its header does not match the file's size")
        needed = _fits(path, spec["name"], shape, dtype, spec, longest)
        if needed > max_bytes:
            raise InvalidBundle(path, _too_big(needed, max_bytes))
        return np.load(path, allow_pickle=False)


def shape_problem(what: str, spec: dict, shape: tuple, longest: int | None) -> str | None:
    """Why ``shape`` is not ``spec``'s (fixed sizes equal, ``"sequence"`` within ``longest``), or None."""
    want = spec["shape"]
    if len(shape) != len(want) or any(
        isinstance(size, int) and got != size for got, size in zip(shape, want, strict=False)
    ):
        return f"{what} has shape {list(shape)}, expected {want}"
    if longest and "sequence" in want and shape[want.index("sequence")] > longest:
        return f"{what} has {shape[want.index('sequence')]} tokens, more than the {longest} the model takes"
    return None


def _fits(path: Path, name: str, shape: tuple, dtype: np.dtype, spec: dict, longest: int | None) -> int:
    problem = shape_problem(repr(name), spec, shape, longest)
    if problem:
        raise InvalidBundle(path, problem)
    return _memory(shape, dtype, spec)


def _memory(shape: tuple, dtype: np.dtype, spec: dict) -> int:
    """The bytes an array takes read and then converted to ``spec``'s dtype (the larger of the two)."""
    return math.prod(shape) * max(dtype.itemsize, np.dtype(spec["dtype"]).itemsize)


def _npy_header(path: Path, stream, name: str) -> tuple[tuple, np.dtype]:
    """``(shape, dtype)`` of the ``.npy`` header at ``stream``, the stream left at its data; numbers only
    (bool, integers, floats): no Python objects, no strings or records."""
    version = np.lib.format.read_magic(stream)
    if version not in ((1, 0), (2, 0)):
        raise InvalidBundle(path, f"{name!r}: .npy version {version} is not read here")
    reader = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
    shape, _, dtype = reader(stream)
    if dtype.hasobject or dtype.kind not in "biuf":
        raise InvalidBundle(path, f"{name!r} holds {dtype}, not numbers (Python objects are never loaded)")
    return shape, dtype


def _zip_members(path: Path) -> tuple[int, int]:
    """The member count and directory size the zip's end record gives, read before zipfile parses the
    directory (a directory of millions of entries is refused unparsed); zeros when there is no record
    (zipfile then says what is wrong). A ZIP64 archive's record says 0xFFFF: more than any bundle reads."""
    size = os.stat(path).st_size
    with open(path, "rb") as stream:
        stream.seek(size - min(size, 22 + 0xFFFF))  # the record is last, but for a comment of 64 KiB
        tail = stream.read()
    at = tail.rfind(b"PK\x05\x06")
    if at < 0 or len(tail) - at < 22:
        return 0, 0
    members, directory = struct.unpack_from("<HI", tail, at + 10)
    return members, directory


def _too_big(needed: int, max_bytes: int) -> str:
    return (
        f"its arrays would take {needed:,} bytes in memory, more than the {max_bytes:,} allowed "
        "(--max-input-bytes)"
    )


@contextlib.contextmanager
def _readable(path: Path) -> Iterator[None]:
    """What zipfile and numpy raise on a broken or hostile array file, as :class:`InvalidBundle`."""
    try:
        yield
    except (zipfile.BadZipFile, ValueError, EOFError, NotImplementedError, RuntimeError, struct.error) as exc:
        raise InvalidBundle(path, f"cannot read the arrays ({_first_line(exc)})") from None


def _read_json(path: Path, max_bytes: int, what: str) -> object:
    try:
        size = os.stat(path).st_size
        if size > max_bytes:
            raise BundleError(f"{path}: {size:,} bytes of JSON, more than the {max_bytes:,} read")
        return json.loads(path.read_bytes(), parse_int=_bounded_int)
    except (OSError, ValueError, RecursionError) as exc:
        raise BundleError(f"{path}: cannot read {what} ({_first_line(exc)})") from None


def load_runtime(path: Path, kind: str, threads: int | None = None):
    """A function from input arrays (in the model's input order) to output arrays, on the bundle's
    runtime: onnxruntime on the CPU for ``"onnx"`` (on ``threads`` threads; None: its default, every
    core), ``torch.export.load`` for ``"pt2"``."""
    if kind == "onnx":
        import onnxruntime

        options = onnxruntime.SessionOptions()
        options.log_severity_level = 3  # errors only: the session warns about every unused initializer
        if threads:  # the manifest's: a graph onnxruntime computes wrong on more (a racy ScatterND)
            options.intra_op_num_threads = threads
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


def _write(outputs: dict[str, np.ndarray], target: str | None, max_bytes: int = MAX_INPUT_BYTES) -> None:
    """The outputs to ``.npz`` or ``.npy``, else as JSON (to ``target`` or stdout), JSON only within
    ``max_bytes`` once expanded (:data:`JSON_EXPANSION`)."""
    if target and target.endswith(".npz"):
        # mypy matches **outputs against savez's keyword allow_pickle (a bool) too
        np.savez(target, **outputs)  # type: ignore[arg-type]
    elif target and target.endswith(".npy") and len(outputs) == 1:
        np.save(target, next(iter(outputs.values())))
    else:
        size = sum(value.nbytes for value in outputs.values())
        if size * JSON_EXPANSION > max_bytes:
            raise BundleError(
                f"the outputs take {size:,} bytes, more than JSON is written for within the "
                f"{max_bytes:,} allowed (--max-input-bytes): write them with -o out.npz"
            )
        text = json.dumps({name: value.tolist() for name, value in outputs.items()})
        if target:
            Path(target).write_text(text + "\n")
        else:
            print(text)


def _byte_count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"a number of bytes, 1 or more, not {text!r}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run this bundle's model on .npy, .npz, .json or text.")
    parser.add_argument("inputs", nargs="*", metavar="INPUT", help=".npy per input, or one .npz / .json")
    parser.add_argument(
        "-o", "--output", help="write outputs to .npz, .npy or .json (default: JSON on stdout)"
    )
    parser.add_argument("--bundle", default=str(Path(__file__).resolve().parent), help="the bundle folder")
    parser.add_argument("--check", action="store_true", help="verify the bundle's files and run its sample")
    parser.add_argument("--text", action="append", metavar="TEXT", help="raw text (text bundles; repeatable)")
    parser.add_argument("--text-file", metavar="JSON", help="a JSON list of strings (text bundles)")
    parser.add_argument(
        "--max-input-bytes",
        type=_byte_count,
        default=MAX_INPUT_BYTES,
        metavar="N",
        help=f"the memory an input file's arrays, or the outputs, may take (default {MAX_INPUT_BYTES:,})",
    )
    args = parser.parse_args(argv)
    try:
        texts = [*(args.text or ()), *(read_texts(args.text_file) if args.text_file else ())]
        bundle = Bundle(args.bundle, max_input_bytes=args.max_input_bytes)
        if args.check:
            result = bundle.check()
            print(json.dumps(result))
            return 0 if result["ok"] else 1
        if texts and args.inputs:
            parser.error("give INPUT files or --text, not both")
        if texts:
            _write(bundle.predict_text(texts), args.output, args.max_input_bytes)
            return 0
        if not args.inputs:
            parser.error("give an INPUT file, --text, or --check")
        _write(bundle.predict(bundle.read(args.inputs)), args.output, args.max_input_bytes)
        return 0
    except (BundleError, OSError, ValueError, KeyError, TypeError, OverflowError, RecursionError) as exc:
        print(f"predict.py: error: {_first_line(exc)}", file=sys.stderr)
        return 2
    except MemoryError:  # a budget missed: still one line, never a traceback
        print("predict.py: error: out of memory (an input beyond this machine?)", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
