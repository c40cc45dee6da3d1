"""Hostile data and example files and numbers: the cases of tests/test_hostile_inputs.py and
benchmarks.hostile."""

from __future__ import annotations

import io
import json
import zlib
from pathlib import Path

import numpy as np

import slimtorch.deploy  # imported before the fork, as the CLI is: a case's time is its own work
import slimtorch.loading  # noqa: F401
from tests.hostile import (
    Case,
    Invocation,
    cases_of,
    deflate_zeros_bomb,
    strict,
    zip_with_raw_entries,
)

NET = '''
import torch
from torch import nn


class Mlp(nn.Module):
    """Six features in, four classes out."""

    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 4))

    def forward(self, x):
        return self.layers(x)


class Pool(nn.Module):
    """Any image: each channel averaged, three channels to four outputs."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(3, 4)

    def forward(self, x):
        return self.head(x.mean(dim=(2, 3)))


def float_classes():
    """Batches whose targets are floats, under a module that says accuracy (class ids)."""
    x = torch.randn(32, 6)
    batches = [(x[i : i + 8], torch.rand(8)) for i in range(0, 32, 8)]
    return {"train": batches, "eval": batches, "metric": "accuracy"}
'''


BOMB_ZEROS = 3 << 30


# -- files ------------------------------------------------------------------------------------------------
def npy_header(dtype: str, shape: tuple[int, ...]) -> bytes:
    """The header numpy writes for an array of ``dtype`` and ``shape`` (what a file may claim freely)."""
    stream = io.BytesIO()
    np.lib.format.write_array_header_1_0(stream, {"descr": dtype, "fortran_order": False, "shape": shape})
    return stream.getvalue()


def npz_bomb(path: Path, members: dict[str, tuple[str, tuple[int, ...]]], *, lying: bool = False) -> Path:
    """An ``.npz`` of deflated members, each a header claiming ``(dtype, shape)`` and that many zeros
    (never held: see :func:`deflate_zeros_bomb`); ``lying``: the zip declares a few KiB decompressed."""
    rows = []
    for name, (dtype, dims) in members.items():
        header = npy_header(dtype, dims)
        zeros = int(np.prod(dims)) * np.dtype(dtype).itemsize
        stored, crc = deflate_zeros_bomb(header, zeros)
        rows.append((f"{name}.npy", stored, 8, crc, len(header) + (4096 if lying else zeros)))
    return zip_with_raw_entries(path, rows)


def many_members(path: Path, count: int, extra: dict[str, np.ndarray] | None = None) -> Path:
    """An ``.npz`` of ``count`` deflated 1 MiB arrays of zeros (about 1 KiB each in the file)."""
    header = npy_header("<f4", (1 << 18,))
    stored, crc = deflate_zeros_bomb(header, 1 << 20)
    rows = [(f"m{i}.npy", stored, 8, crc, len(header) + (1 << 20)) for i in range(count)]
    for name, array in (extra or {}).items():
        raw = io.BytesIO()
        np.save(raw, array)
        rows.append((f"{name}.npy", raw.getvalue(), 0, zlib.crc32(raw.getvalue()), len(raw.getvalue())))
    return zip_with_raw_entries(path, rows)


def lying_npy(path: Path, dims: tuple[int, ...] = (10**12, 6)) -> Path:
    """An ``.npy`` whose header claims ``dims`` of float32 over 16 bytes of data."""
    path.write_bytes(npy_header("<f4", dims) + bytes(16))
    return path


def arrays(path: Path, x: np.ndarray, y: np.ndarray) -> Path:
    np.savez(path, x=x, y=y)
    return path


def features(rows: int = 40, width: int = 6) -> np.ndarray:
    return np.random.default_rng(0).normal(size=(rows, width)).astype(np.float32)


def classes(rows: int = 40, low: int = 0, high: int = 4) -> np.ndarray:
    return np.random.default_rng(1).integers(low, high, rows)


# -- the corpus -------------------------------------------------------------------------------------------
def _net(folder: Path) -> str:
    (folder / "net.py").write_text(NET)
    return str(folder / "net.py")


def _export(folder: Path, *example: Path, extra: tuple[str, ...] = ()) -> Invocation:
    argv = ["export", f"{_net(folder)}:Mlp", "-o", str(folder / "bundle"), "--samples", "1"]
    return Invocation([*argv, "--example", *map(str, example), *extra])


def _recover(folder: Path, data: str, model: str = "Mlp") -> Invocation:
    argv = ["recover", f"{_net(folder)}:{model}", "-o", str(folder / "out.safetensors"), "--data", data]
    return Invocation([*argv, "--epochs", "1", "--json"])


def _json(document: object):
    def build(folder: Path) -> Invocation:
        (folder / "example.json").write_text(json.dumps(document))
        return _export(folder, folder / "example.json")

    return build


def _deep_list(depth: int) -> str:
    return "[" * depth + "1.0" + "]" * depth


def data_cases() -> list[Case]:
    x_bomb = {"x": ("<f4", (BOMB_ZEROS // 24, 6))}
    xy_bomb = {**x_bomb, "y": ("|i1", (BOMB_ZEROS // 24,))}

    def data(name: str, expect: str, build) -> Case:
        return Case(f"data/{name}", "data", expect, build)

    def recover_arrays(x: np.ndarray, y: np.ndarray):
        return lambda folder: _recover(folder, str(arrays(folder / "d.npz", x, y)))

    cases = [
        data("export-example-npz-bomb", "refuse", lambda f: _export(f, npz_bomb(f / "x.npz", x_bomb))),
        data(
            "export-example-npz-bomb-lying-size",
            "refuse",
            lambda f: _export(f, npz_bomb(f / "x.npz", x_bomb, lying=True)),
        ),
        data("recover-data-npz-bomb", "refuse", lambda f: _recover(f, str(npz_bomb(f / "d.npz", xy_bomb)))),
        data(
            "recover-data-npz-bomb-lying-size",
            "refuse",
            lambda f: _recover(f, str(npz_bomb(f / "d.npz", xy_bomb, lying=True))),
        ),
        data(
            "export-example-npz-2000-members",
            "refuse",
            lambda f: _export(f, many_members(f / "x.npz", 2000)),
        ),
        data(
            "recover-data-npz-2000-members",
            "refuse",
            lambda f: _recover(f, str(many_members(f / "d.npz", 2000, {"x": features(), "y": classes()}))),
        ),
        data("export-example-npy-huge-header", "refuse", lambda f: _export(f, lying_npy(f / "x.npy"))),
        data(
            "export-example-npy-header-beyond-memory-but-not-address-space",
            "refuse",
            lambda f: _export(f, lying_npy(f / "x.npy", (1 << 29, 6))),
        ),
        data("recover-data-npy-huge-header", "refuse", _npy_folder),
        data("recover-data-wrong-width", "refuse", recover_arrays(features(width=5), classes())),
        data("recover-data-class-ids-out-of-range", "refuse", recover_arrays(features(), classes(high=9))),
        data(
            "recover-data-negative-class-ids", "refuse", recover_arrays(features(), classes(low=-3, high=0))
        ),
        data(
            "recover-data-token-ids-to-a-float-model",
            "refuse",
            recover_arrays(np.ones((40, 6), np.int64), classes()),
        ),
        data(
            "recover-data-float-targets-where-accuracy-needs-classes",
            "refuse",
            lambda f: _recover(f, f"{_net(f)}:float_classes"),
        ),
        data("recover-data-that-fits-is-accepted", "accept", recover_arrays(features(), classes())),
        data("export-example-json-strings", "refuse", _json({"x": [["a", "b", "c", "d", "e", "f"]]})),
        data("export-example-json-objects", "refuse", _json({"x": {"rows": [[1, 2, 3, 4, 5, 6]]}})),
        data(
            "export-example-json-booleans", "refuse", _json({"x": [[True, False, True, True, False, True]]})
        ),
        data("export-example-json-null", "refuse", _json({"x": [[1.0, None, 1.0, 1.0, 1.0, 1.0]]})),
        data("export-example-json-a-bare-string", "refuse", _json("hello")),
        data("export-example-json-ragged", "refuse", _json({"x": [[1.0] * 6, [1.0] * 5]})),
        data("export-example-json-past-int64", "refuse", _json({"x": [[10**30] * 6]})),
        data("export-example-json-wrong-width", "refuse", _json({"x": [[0.5] * 5] * 2})),
        data("export-example-json-deeper-than-numpy-allows", "refuse", _deep_json),
        data("export-example-json-of-floats-is-accepted", "accept", _json({"x": [[0.5] * 6] * 2})),
        data("export-example-npz-is-accepted", "accept", lambda f: _export(f, _npz_example(f / "x.npz"))),
    ]
    return cases


def _npy_folder(folder: Path) -> Invocation:
    (folder / "arrays").mkdir()
    lying_npy(folder / "arrays" / "x.npy")
    np.save(folder / "arrays" / "y.npy", classes())
    return _recover(folder, str(folder / "arrays"))


def _deep_json(folder: Path) -> Invocation:
    (folder / "example.json").write_text('{"x": ' + _deep_list(100) + "}")
    return _export(folder, folder / "example.json")


def _npz_example(path: Path) -> Path:
    np.savez_compressed(path, x=features(2))
    return path


NUMBERS = {  # command: (options of a run that works, {option: bad values}); d.npz: data that fits Mlp
    "memory": (
        ["{net}:Pool", "--input-shape", "1,3,8,8", "--device", "cpu"],
        {
            "--batch": ["1099511627776", "0", "-1", "nan", "2.5"],
            "--input-shape": ["1099511627776,4", "0,3,8,8", "-1,3,8,8", ",".join(["1"] * 17), "1,x"],
            "--accumulation": ["1000000000", "0"],
            "--world-size": ["0", "-4"],
            "--budget": ["inf", "nan", "-1GB", "0"],
        },
    ),
    "fit": (
        ["{net}:Pool", "--input-shape", "1,3,8,8", "--device", "cpu", "--budget", "1GB"],
        {"--margin": ["nan", "1", "-0.5", "inf"], "--world-size": ["0", "1e9"]},
    ),
    "export": (
        ["{net}:Mlp", "--input-shape", "2,6", "-o", "{folder}/bundle"],
        {"--samples": ["-1", "0", "nan", "1e9"], "--atol": ["nan", "inf", "-1"], "--rtol": ["nan", "-inf"]},
    ),
    "prune": (
        ["{net}:Mlp", "--input-shape", "2,6", "-o", "{folder}/p.safetensors", "--runs", "0"],
        {"--ratio": ["nan", "inf", "-0.1", "1"], "--target-params": ["inf", "nan", "0"]},
    ),
    "prune-sparse": (
        ["{net}:Mlp", "-o", "{folder}/p.safetensors", "--runs", "0"],
        {"--unstructured": ["nan", "1.5"], "--n-m": ["1:100000"]},
    ),
    "prune-steps": (
        ["{net}:Mlp", "--input-shape", "2,6", "-o", "{folder}/p.safetensors", "--ratio", "0.5"],
        {"--steps": ["0", "100000000"], "--round-to": ["0", "-8"], "--runs": ["-1", "1e9"]},
    ),
    "quantize": (
        ["{net}:Mlp", "--input-shape", "2,6", "-o", "{folder}/q.safetensors"],
        {"--samples": ["0", "-1"], "--layers": ["-1"], "--runs": ["-1"]},
    ),
    "recover": (
        ["{net}:Mlp", "-o", "{folder}/r.safetensors", "--data", "{folder}/d.npz"],
        {
            "--epochs": ["0", "1000000000", "-1"],
            "--steps": ["0", "nan"],
            "--lr": ["nan", "inf", "0", "-1e-3"],
            "--batch": ["1099511627776", "0"],
            "--seed": ["-1"],
            "--target": ["nan", "inf"],
        },
    ),
}


def number_cases() -> list[Case]:
    cases = []
    for command, (base, bad) in NUMBERS.items():
        for option, values in bad.items():
            for value in values:

                def build(folder: Path, command=command, base=base, option=option, value=value) -> Invocation:
                    net = _net(folder)
                    arrays(folder / "d.npz", features(), classes())
                    argv = [part.format(net=net, folder=folder) for part in base]
                    return Invocation([command.split("-")[0], *argv, f"{option}={value}"], names_file=False)

                cases.append(Case(f"numbers/{command}{option}={value[:24]}", "numbers", "refuse", build))
    cases.append(
        Case(
            "numbers/memory-batch-whose-input-outgrows-any-machine",
            "numbers",
            "refuse",
            lambda folder: Invocation(
                ["memory", f"{_net(folder)}:Pool", "--input-shape", "1,3,1024,1024", "--batch", "65536"],
                names_file=False,
            ),
        )
    )
    return cases


def corpus() -> list[Case]:
    return cases_of(data_cases(), number_cases())


def _clean_export(folder: Path) -> Invocation:
    """An export of the same model on an input of the same shape, no file given: what exporting itself
    takes (a trace, an ONNX model, onnxruntime's session), which an example file may not add to."""
    argv = ["export", f"{_net(folder)}:Mlp", "-o", str(folder / "bundle"), "--samples", "1"]
    return Invocation([*argv, "--input-shape", "2,6"])


def _exports(case: Case) -> bool:
    return case.id.startswith("data/export-")


# Export does more than read its example (issue 44's rule for such a command): its cases are held over a
# clean export's peak; a fresh CLI process's, as before, let onnx's and onnxruntime's own start decide.
CASES = strict([c for c in corpus() if not _exports(c)]) + strict(
    [c for c in corpus() if _exports(c)], start=_clean_export
)
