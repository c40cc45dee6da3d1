"""A stage's done marker, ``done.json``, and what a resume checks before it trusts one.

A marker records the stage's result, the sha256 and size of every file the stage wrote, and what the stage
was made from (:class:`Inputs`: the recipe with the model's tensors, what the plan asked of this stage, and
the seal of the stage it started from, so a changed stage invalidates every later one), with the version
of slimtorch that wrote it. A resume reads it within budgets, checks its schema (types, keys, bounds),
compares its inputs with this run's and hashes the files again; the first mismatch is the reason the stage
is redone, in one line.

The hashes catch a folder mixed up, copied over, damaged or left by another run. A forger who rewrites a
stage's files and its marker to match would pass them, so each marker is also signed (HMAC-SHA256) with a
key of this user's, kept outside the work folder (:func:`signing_key`, ``~/.cache/slimtorch/marker.key``,
readable by the user alone): a marker written elsewhere, by hand or by another user is redone, whatever its
hashes say. The signature is checked last, so that a folder merely damaged is named by what changed in it.
A work folder moved to another machine or user is redone from its start, as a folder it cannot vouch for.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import json
import os
import stat
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from slimtorch._version import __version__
from slimtorch.errors import SlimtorchError
from slimtorch.format.cache import cache_folder
from slimtorch.format.untrusted import load_json
from slimtorch.slimming.measuring import CATEGORIES
from slimtorch.slimming.options import SCHEMES
from slimtorch.slimming.schema import Check, Invalid, items, number, record, shown, table, text

MARKER = "done.json"
SCHEMA = "slimtorch.slim-stage/1"
MAX_MARKER_BYTES = 16 * 2**20
"""A marker holds a few entries per layer (sensitivity, zeros, how it was quantized), about 100 bytes
each: 16 MiB is over 100,000 layers, far beyond any model slim runs on."""
MAX_FILES = 10_000
"""A stage writes one file, a Hugging Face folder (a config, a few shards, a tokenizer) or a bundle."""
MAX_LAYERS = 100_000
CHUNK = 1 << 20
KEY_FILE = "marker.key"
KEY_BYTES = 32


@dataclass(frozen=True)
class Inputs:
    """What a stage was made from, each a sha256: ``recipe`` (the model's tensors, its spec, the weights'
    path, the data spec, every option), ``step`` (what the plan asked of this stage: its candidate, or the
    plan a recipe forced) and ``after`` (the seal of the stage whose model it started from; "" for none)."""

    recipe: str
    step: str
    after: str = ""


def digest(value: Any) -> str:
    """The sha256 of ``value`` as canonical JSON (sorted keys, no spaces)."""
    raw = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=True)
    return hashlib.sha256(raw.encode()).hexdigest()


def seal(marker: dict[str, Any]) -> str:
    """The fingerprint of a finished stage, which the next stage's :attr:`Inputs.after` records."""
    return digest(marker)


def make_marker(name: str, inputs: Inputs, files: dict[str, dict[str, Any]], result: Any) -> dict[str, Any]:
    """The marker of stage ``name``: schema, version, inputs, files and result, signed (:func:`signature`;
    ``""`` where no key can be kept, which a resume redoes)."""
    marker = {
        "schema": SCHEMA,
        "stage": name,
        "version": __version__,
        "inputs": asdict(inputs),
        "files": files,
        "result": result,
    }
    key = signing_key()
    return {**marker, "signature": "" if key is None else signature(marker, key)}


def signature(marker: dict[str, Any], key: bytes) -> str:
    """The HMAC-SHA256, under ``key``, of the marker's content (:func:`digest` of all but its signature)."""
    content = digest({field: value for field, value in marker.items() if field != "signature"})
    return hmac.new(key, content.encode(), hashlib.sha256).hexdigest()


@functools.cache
def signing_key() -> bytes | None:
    """This user's marker key, :data:`KEY_BYTES` random bytes in ``$XDG_CACHE_HOME/slimtorch/marker.key``,
    made on first use (mode 0600, written whole and linked into place: two processes making it at once
    agree on one); ``None`` where it can be neither read nor made (a read-only home)."""
    path = cache_folder(KEY_FILE)
    try:
        return _read_key(path)
    except FileNotFoundError:
        pass
    except OSError:
        return None
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        temporary = path.with_name(f".{KEY_FILE}.{os.getpid()}")
        descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(descriptor, os.urandom(KEY_BYTES))
            os.fsync(descriptor)
        finally:
            os.close(descriptor)
        try:
            os.link(temporary, path)  # fails where another process linked its key first: that one is read
        except FileExistsError:
            pass
        finally:
            os.unlink(temporary)
        return _read_key(path)
    except OSError:
        return None


def _read_key(path: Path) -> bytes:
    """The key at ``path``: a regular file of :data:`KEY_BYTES` bytes that only its owner, this user, can
    read or write; anything else is an :class:`OSError` (the key is then not used)."""
    descriptor = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    try:
        info = os.fstat(descriptor)
        key = os.read(descriptor, KEY_BYTES + 1)
    finally:
        os.close(descriptor)
    owned = not hasattr(os, "getuid") or info.st_uid == os.getuid()
    if not stat.S_ISREG(info.st_mode) or not owned or info.st_mode & 0o077 or len(key) != KEY_BYTES:
        raise OSError(f"{path} is not a key of this user's (a {KEY_BYTES}-byte file only they can read)")
    return key


def stage_files(folder: Path) -> dict[str, dict[str, Any]]:
    """The sha256 and size of every file under ``folder`` but its marker, by path relative to it."""
    return {
        name: {"sha256": file_sha256(folder / name), "bytes": size} for name, size in listing(folder).items()
    }


def listing(folder: Path) -> dict[str, int]:
    """The size of every file under ``folder`` but its marker; links and anything not a regular file or
    folder are :class:`Invalid` (a stage never writes one), as are more than :data:`MAX_FILES` files."""
    found: dict[str, int] = {}
    seen = 0
    for parent, folders, files in os.walk(folder, onerror=_raise):
        for name in [*folders, *files]:
            seen += 1
            if seen > MAX_FILES:
                raise Invalid(f"holds more than {MAX_FILES:,} files and folders")
            path = Path(parent) / name
            relative = path.relative_to(folder).as_posix()
            mode = path.lstat().st_mode
            if stat.S_ISLNK(mode):
                raise Invalid(f"{shown(relative)} is a link")
            if stat.S_ISREG(mode):
                if relative != MARKER:
                    found[relative] = path.lstat().st_size
            elif not stat.S_ISDIR(mode):
                raise Invalid(f"{shown(relative)} is not a regular file")
    return found


def _raise(error: OSError) -> None:
    raise Invalid(f"cannot list it ({error.strerror or error})")


def file_sha256(path: Path) -> str:
    """The sha256 of a file's bytes, read a MiB at a time."""
    hashed = hashlib.sha256()
    with open(path, "rb") as stream:
        while chunk := stream.read(CHUNK):
            hashed.update(chunk)
    return hashed.hexdigest()


def read_marker(path: Path) -> dict[str, Any]:
    """The marker at ``path``, its envelope checked (results are checked by :func:`verify`, knowing the
    stage); what cannot be read or does not fit is :class:`Invalid`."""
    try:
        info = path.lstat()
        if not stat.S_ISREG(info.st_mode):
            raise Invalid(f"{MARKER} is not a regular file")
        if info.st_size > MAX_MARKER_BYTES:
            raise Invalid(f"{MARKER} is {info.st_size:,} bytes, more than the {MAX_MARKER_BYTES:,} allowed")
        with open(path, "rb") as stream:
            raw = stream.read(MAX_MARKER_BYTES + 1)
        data = load_json(path, raw, MARKER)
    except OSError as error:
        raise Invalid(f"cannot read {MARKER} ({error.strerror or error})") from None
    except SlimtorchError as error:  # load_json's FormatError: "path: corrupt done.json: ..."
        raise Invalid(f"{MARKER} is not valid JSON ({str(error).rpartition(': ')[2]})") from None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        raise Invalid(f"{MARKER} is not a {SCHEMA} marker (an older slimtorch's, or not slimtorch's)")
    ENVELOPE(data, MARKER)
    return data


def verify(folder: Path, marker: dict[str, Any], name: str, inputs: Inputs, after: str) -> None:
    """Raise :class:`Invalid` with the first reason not to trust ``marker`` as stage ``name``'s, made from
    ``inputs`` (``after``: the folder of the stage it started from, for the message): cheap checks first,
    the files' hashes last."""
    if marker["stage"] != name:
        raise Invalid(f"{MARKER} is a {marker['stage']} stage's, not a {name} stage's")
    if marker["version"] != __version__:
        raise Invalid(f"{MARKER} was written by slimtorch {shown(marker['version'])}, this is {__version__}")
    recorded = marker["inputs"]
    if recorded["recipe"] != inputs.recipe:
        raise Invalid("made from other inputs (the model's tensors, the data, the options)")
    if recorded["step"] != inputs.step:
        raise Invalid("made for another plan")
    if recorded["after"] != inputs.after:
        raise Invalid(f"made from another {after or 'start'} than the one this run has")
    RESULTS[name](marker["result"], f"{MARKER} result")
    _consistent(folder.name, marker)
    actual = listing(folder)
    files = marker["files"]
    for relative in sorted({*files, *actual}):
        if relative not in actual:
            raise Invalid(f"{shown(relative)} is missing")
        if relative not in files:
            raise Invalid(f"holds {shown(relative)}, which {MARKER} does not list")
        if actual[relative] != files[relative]["bytes"]:
            said = files[relative]["bytes"]
            raise Invalid(f"{shown(relative)} is {actual[relative]:,} bytes, {MARKER} says {said:,}")
    for relative in sorted(files):
        if file_sha256(folder / relative) != files[relative]["sha256"]:
            raise Invalid(f"{shown(relative)} does not match the sha256 {MARKER} recorded")
    key = signing_key()
    if key is None:
        raise Invalid(f"no key to check {MARKER}'s signature with ({cache_folder(KEY_FILE)} cannot be kept)")
    if not hmac.compare_digest(marker["signature"], signature(marker, key)):
        raise Invalid(f"{MARKER} was not signed by slimtorch for this user on this machine")


def _consistent(folder: str, marker: dict[str, Any]) -> None:
    """A result names its own stage's files: the report shows nothing the hashes did not cover."""
    result, files = marker["result"], marker["files"]
    model = "bundle" if marker["stage"] == "export" else "model.safetensors"
    if result["output"] != f"{folder}/{model}":
        raise Invalid(f"{MARKER} result.output is {shown(result['output'])}, not {folder}/{model}")
    if "hf_folder" in result and result["hf_folder"] != f"{folder}/hf":
        raise Invalid(f"{MARKER} result.hf_folder is {shown(result['hf_folder'])}, not {folder}/hf")
    if model in files and files[model]["bytes"] != result.get("file_bytes", files[model]["bytes"]):
        raise Invalid(f"{MARKER} result.file_bytes is not the size of {model}")
    if marker["stage"] != "export" and model not in files:
        raise Invalid(f"{MARKER} lists no {model}")


def _hex(value: Any, where: str) -> None:
    if not isinstance(value, str) or len(value) != 64 or value.strip("0123456789abcdef"):
        raise Invalid(f"{where} must be a sha256 (64 hex digits), not {shown(value)}")


def _hex_or_empty(value: Any, where: str) -> None:
    if value != "":
        _hex(value, where)


COUNT = number(0, 2**63, integer=True)
FINITE = number()
SHARE = number(0, 1)
NAME = text(1024)
REASON = text(1 << 20)
ENVELOPE = record(
    {
        "schema": text(64),
        "stage": text(64),
        "version": text(64),
        "inputs": record({"recipe": _hex, "step": _hex, "after": _hex_or_empty}),
        "files": table(record({"sha256": _hex, "bytes": COUNT}), MAX_FILES),
        "result": table(lambda value, where: None, 64),
        "signature": _hex_or_empty,
    }
)
SAVED = {
    "reason": REASON,
    "metric": FINITE,
    "output": NAME,
    "file_bytes": number(1, 2**63, integer=True),
    "params": COUNT,
    "bytes_by_category": record(dict.fromkeys(CATEGORIES, COUNT)),
    "seconds": number(0, 1e9),
}
CANDIDATE = record(
    {
        "ratio": number(0, 1, open_high=True),
        "sparsity": number(0, 1, open_high=True),
        "scheme": text(choices=("", *SCHEMES)),
    }
)
PROBE = record({"label": NAME, "value": FINITE, "removed": FINITE})
PLAN = record(
    {"attempts": items(CANDIDATE, 1000), "probes": items(PROBE, 10_000)},
    {"sensitivity": table(FINITE, MAX_LAYERS)},
)
TIMES = record(dict.fromkeys(("median_ms", "q1_ms", "q3_ms"), number(0, open_low=True)) | {"runs": COUNT})
LATENCY = record({"batch": COUNT, "threads": COUNT, "before": TIMES, "after": TIMES})
FOOTPRINT = record(
    {
        "command": REASON,
        "bundle_bytes": COUNT,
        "runtime": NAME,
        "runtime_bytes": COUNT,
        "torch_bytes": number(0, 2**63, integer=True, optional=True),
    }
)
RESULTS: dict[str, Check] = {
    "baseline": record({**SAVED, "plan": PLAN, "value": FINITE}),
    "prune": record(SAVED),
    "sparsify": record({**SAVED, "zeros": table(SHARE, MAX_LAYERS)}),
    "recover": record(SAVED),
    "quantize": record({**SAVED, "quantized": table(NAME, MAX_LAYERS), "kept": table(REASON, MAX_LAYERS)}),
    "save": record(SAVED, {"latency": LATENCY, "hf_folder": NAME}),
    "export": record(
        {
            "reason": REASON,
            "metric": number(optional=True),
            "output": NAME,
            "footprint": FOOTPRINT,
            "seconds": SAVED["seconds"],
        }
    ),
}
"""Each stage's result, key by key: what the report and the next stages read from it."""
