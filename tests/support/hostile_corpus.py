"""The hostile-input corpus: every case a file, a command and what it must do
(``tests/test_hostile_corpus.py``, ``benchmarks.hostile``)."""

from __future__ import annotations

import json
import os
import random
import shutil
import struct
import zipfile
import zlib
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file

import slimtorch
from tests.hostile import (
    Case,
    Invocation,
    cases_of,
    compress_zip_entry,
    deflate_zeros_bomb,
    dict_key_tuple,
    edit_slim_metadata,
    memo_fan_out,
    nested_dict,
    nested_list,
    nested_tuple,
    p_call,
    p_global,
    p_int,
    p_str,
    read_safetensors,
    reseal,
    slim_with_encoded,
    torch_file_with_value,
    torch_zip_with_claims,
    write_safetensors_raw,
    zip_with_raw_entries,
    zstd_part,
)

Build = Callable[[Path], Path]


SECRET = "TOPSECRET-hostile-corpus"


# -- how a case calls the CLI -------------------------------------------------------------------------------
def _call(command: str, path: Path, folder: Path, check=None) -> Invocation:
    argv = {
        "inspect": ["inspect", str(path)],
        "shrink": ["shrink", str(path), "-o", str(folder / "out.safetensors")],
        "load": ["load", str(path)],
    }[command]
    return Invocation(argv, check=check)


def _cases(
    family: str, expect: str, name: str, build: Build, commands=("inspect",), check=None
) -> list[Case]:
    """One case per command over the same hostile file (``check(folder)`` builds the output check)."""
    return [
        Case(
            f"{family}/{name}/{command}",
            family,
            expect,
            lambda folder, command=command: _call(
                command, build(folder), folder, check and check(folder, command)
            ),
        )
        for command in commands
    ]


def _same_tensors(expected: Callable[[], dict[str, torch.Tensor]]):
    """A check factory: after ``shrink``, the output holds exactly ``expected()``, bit for bit."""

    def factory(folder: Path, command: str):
        if command != "shrink":
            return None

        def check(stdout: str, stderr: str) -> str | None:
            out = folder / "out.safetensors"
            if not out.exists():
                return None
            got, want = slimtorch.load(out).tensors, expected()
            if set(got) != set(want):
                return f"silently changed names: {sorted(set(got) ^ set(want))[:3]}"
            for name, tensor in want.items():
                if got[name].dtype != tensor.dtype or not torch.equal(got[name], tensor):
                    return f"silently changed tensor {name!r}"
            return None

        return check

    return factory


def _file(name: str, write: Callable[[Path], object]) -> Build:
    """A build writing one file ``name``; the cases sharing it (one per command) copy the first one's."""
    first: list[Path] = []

    def build(folder: Path) -> Path:
        path = folder / name
        if first and first[0].exists():
            shutil.copyfile(first[0], path)
        else:
            write(path)
            first[:] = [path]
        return path

    return build


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(64, 64, generator=generator)
    weight[:, :40] = 0
    return {
        "fc.weight": weight,
        "fc.bias": torch.randn(64, generator=generator),
        "emb.weight": torch.randn(32, 16, generator=generator).half(),
        "steps": torch.arange(5),
    }


def _slim(path: Path, **options) -> Path:
    slimtorch.save(_state(), path, **options)
    return path


# -- memory bombs -----------------------------------------------------------------------------------------
def _zip_entries(path: Path) -> list[tuple[str, bytes]]:
    torch.save({"w": torch.arange(16.0)}, path)
    with zipfile.ZipFile(path) as archive:
        return [(info.filename, archive.read(info.filename)) for info in archive.infolist()]


def _deflate_bomb(entry: str, zeros: int = 2 << 30) -> Build:
    """A torch zip whose ``entry`` is deflated: its real bytes followed by ``zeros`` zeros (~1 KB a MiB)."""

    def write(path: Path) -> None:
        rows = []
        for name, data in _zip_entries(path.with_name("good.pt")):
            if name.endswith("/" + entry):
                stored, crc = deflate_zeros_bomb(data, zeros)
                rows.append((name, stored, 8, crc, len(data) + zeros))
            else:
                rows.append((name, data, 0, zlib.crc32(data), len(data)))
        path.with_name("good.pt").unlink()
        zip_with_raw_entries(path, rows)

    return _file("bomb.pt", write)


def _compressed_entry(entry: str, method: int, padding: int = 0) -> Build:
    def write(path: Path) -> None:
        good = path.with_name("good.pt")
        state = {"w": torch.arange(16.0), "pad": bytes(padding)} if padding else {"w": torch.ones(4)}
        torch.save(state, good)
        compress_zip_entry(good, path, entry, method)
        good.unlink()

    return _file("packed.pt", write)


def _aliases(count: int, overlap: str = "full") -> Build:
    """A safetensors file whose ``count`` tensors share (``full``), half-share (``partial``) or leave a
    gap between (``gap``) their byte ranges; ``shuffled``: back to back, listed out of order (valid)."""
    numel = 1 << 18

    def write(path: Path) -> None:
        size = numel * 4
        if overlap == "full":
            header = {
                f"t{i}": {"dtype": "F32", "shape": [numel], "data_offsets": [0, size]} for i in range(count)
            }
            data = bytes(size)
        elif overlap == "partial":
            header = {
                "a": {"dtype": "F32", "shape": [numel], "data_offsets": [0, size]},
                "b": {"dtype": "F32", "shape": [numel], "data_offsets": [size // 2, size + size // 2]},
            }
            data = bytes(size + size // 2)
        elif overlap == "gap":
            header = {
                "a": {"dtype": "F32", "shape": [numel], "data_offsets": [0, size]},
                "b": {"dtype": "F32", "shape": [numel], "data_offsets": [size + 64, 2 * size + 64]},
            }
            data = bytes(2 * size + 64)
        else:
            header = {
                f"t{i}": {"dtype": "F32", "shape": [4], "data_offsets": [16 * i, 16 * i + 16]}
                for i in range(count)
            }
            header = dict(reversed(list(header.items())))
            data = torch.arange(4.0 * count).numpy().tobytes()
        write_safetensors_raw(path, header, data, reseal=False)

    return _file("aliases.safetensors", write)


def _shuffled_expected(count: int) -> dict[str, torch.Tensor]:
    values = torch.arange(4.0 * count)
    return {f"t{i}": values[4 * i : 4 * i + 4].clone() for i in range(count)}


def _broadcast_pair(size: int, kind: str) -> Build:
    """``weight_orig [1, N]`` and ``weight_mask [N, 1]``: folding them broadcasts to N x N."""
    tensors = {"fc.weight_orig": torch.ones(1, size), "fc.weight_mask": torch.ones(size, 1)}
    if kind == "pt":
        return _file("pruned.pt", lambda path: torch.save(tensors, path))
    return _file("pruned.safetensors", lambda path: save_file(tensors, path))


def _slim_zstd_bomb(codec: str, numel: int) -> Build:
    """A slim file, written by the real writer, whose one tensor decodes ``numel`` elements from zstd
    frames of zeros at the per-part ratio limit (256x)."""

    def write(path: Path) -> None:
        if codec == "sparse":
            parts = {"mask": zstd_part(numel // 8), "values": torch.zeros(0, dtype=torch.float64)}
            stages = [
                {"codec": "sparse", "dtype": "float64", "shape": [numel]},
                {"codec": "zstd", "parts": {"mask": {"dtype": "uint8", "shape": [numel // 8]}}},
            ]
            slim_with_encoded(path, "bomb", parts, stages, torch.float64, (numel,))
        elif codec == "int4":
            groups = numel // 256
            parts = {
                "q4": zstd_part(numel // 2),
                "scale": zstd_part(groups * 2),
                "zero": zstd_part(groups * 2),
            }
            int4 = {"codec": "int4", "dtype": "float32", "shape": [numel], "group_size": 256, "flat": True}
            listed = {
                "q4": {"dtype": "uint8", "shape": [1, numel // 2]},
                "scale": {"dtype": "float16", "shape": [1, groups]},
                "zero": {"dtype": "float16", "shape": [1, groups]},
            }
            slim_with_encoded(
                path, "bomb", parts, [int4, {"codec": "zstd", "parts": listed}], torch.float32, (numel,)
            )
        else:  # cast: float16 zeros, decoded to float64
            parts = {"": zstd_part(numel * 2)}
            stages = [
                {"codec": "cast", "dtype": "float64", "shape": [numel], "to": "float16"},
                {"codec": "zstd", "parts": {"": {"dtype": "float16", "shape": [numel]}}},
            ]
            slim_with_encoded(path, "bomb", parts, stages, torch.float64, (numel,))

    return _file("bomb.safetensors", write)


def memory_cases() -> list[Case]:
    cases = []
    for entry in ("data.pkl", "byteorder", "data/0"):
        cases += _cases(
            "memory", "refuse", f"deflate-2GiB-{entry}", _deflate_bomb(entry), ("inspect", "shrink", "load")
        )
    methods = {"deflate": zipfile.ZIP_DEFLATED, "bzip2": zipfile.ZIP_BZIP2, "lzma": zipfile.ZIP_LZMA}
    for label, method in methods.items():
        for entry in ("data.pkl", "data/0"):
            cases += _cases(
                "memory", "either", f"compressed-{label}-{entry}", _compressed_entry(entry, method)
            )
        bomb = _compressed_entry("data.pkl", method, padding=96 << 20)
        cases += _cases("memory", "refuse", f"{label}-96MiB-data.pkl", bomb, ("inspect", "load"))
    for size in (4 * 10**8, 2 * 10**9, 4 * 10**9, 2**40):
        for legacy in (False, True):
            value = p_call("builtins.bytearray", p_int(size))
            build = _file("bytes.pt", lambda p, v=value, lg=legacy: torch_file_with_value(p, v, lg))
            kind = "legacy" if legacy else "zip"
            cases += _cases("memory", "refuse", f"bytearray-{size}-{kind}", build, ("inspect", "shrink"))
    small = _file("small.pt", lambda p: torch_file_with_value(p, p_call("builtins.bytearray", p_int(10**4))))
    cases += _cases("memory", "either", "bytearray-10000", small, ("inspect", "shrink"))
    for count in (2, 100, 3000):
        cases += _cases("memory", "refuse", f"alias-{count}", _aliases(count), ("inspect", "shrink", "load"))
    for overlap in ("partial", "gap"):
        cases += _cases("memory", "refuse", f"ranges-{overlap}", _aliases(2, overlap), ("inspect", "load"))
    check = _same_tensors(lambda: _shuffled_expected(6))
    cases += _cases(
        "memory",
        "accept",
        "ranges-out-of-order",
        _aliases(6, "shuffled"),
        ("inspect", "shrink", "load"),
        check,
    )
    for size in (20_000, 30_000):
        for kind in ("pt", "safetensors"):
            cases += _cases(
                "memory",
                "either",
                f"broadcast-mask-{size}-{kind}",
                _broadcast_pair(size, kind),
                ("inspect", "shrink"),
            )
    for codec, numel in (("sparse", 1 << 28), ("sparse", 1 << 30), ("int4", 1 << 29), ("cast", 1 << 28)):
        commands = ("inspect", "shrink", "load") if numel == 1 << 28 or codec == "int4" else ("load",)
        cases += _cases(
            "memory", "refuse", f"slim-{codec}-zstd-{numel}", _slim_zstd_bomb(codec, numel), commands
        )
    for numel in (2**31, 2**40, 2**62):
        build = _file("claims.pt", lambda p, n=numel: torch_zip_with_claims(p, n, (n,), stored_bytes=16))
        cases += _cases("memory", "refuse", f"storage-claims-{numel}", build, ("inspect", "load"))
    return cases


# -- deep nesting ------------------------------------------------------------------------------------------
def _deep_json(depth: int, opener: str = "[", closer: str = "]") -> str:
    return opener * depth + closer * depth


def _safetensors_with_text(header_text: str) -> Build:
    def write(path: Path) -> None:
        raw = header_text.encode()
        raw += b" " * (-(8 + len(raw)) % 8)
        path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(16))

    return _file("model.safetensors", write)


def _slim_raw_edit(placeholder_into: Callable[[dict], None], text: str) -> Build:
    """A slim file whose slimtorch JSON gets ``text`` spliced in verbatim where ``placeholder_into``
    put the string ``"@@raw@@"`` (for JSON that json.dumps cannot write: deep, huge integers, NaN), its
    seal recomputed so that the parser behind it is what gets tested."""

    def write(path: Path) -> None:
        _slim(path, quantize="int8-weight")
        header, data = read_safetensors(path)
        body = json.loads(header["__metadata__"]["slimtorch"])
        placeholder_into(body)
        header["__metadata__"]["slimtorch"] = json.dumps(body).replace('"@@raw@@"', text)
        reseal(write_safetensors_raw(path, header, data))

    return _file("slim.safetensors", write)


def _sharded_state() -> dict[str, torch.Tensor]:
    """Four dense 64x64 tensors: with a 20 kB shard size, one shard each."""
    generator = torch.Generator().manual_seed(4)
    return {f"l{i}.weight": torch.randn(64, 64, generator=generator) for i in range(4)}


def _folder_with(files: dict[str, str], weights: str = "safetensors") -> Build:
    def build(folder: Path) -> Path:
        model = folder / "model"
        model.mkdir()
        if weights == "safetensors":
            save_file({"w": torch.ones(4)}, model / "model.safetensors")
        elif weights == "sharded":
            slimtorch.save(_sharded_state(), model, shard_bytes=20000)
        for name, text in files.items():
            (model / name).write_text(text)
        return model

    return build


def _index_edit(key: str, text: str) -> Build:
    def build(folder: Path) -> Path:
        model = _folder_with({}, "sharded")(folder)
        index = model / "model.safetensors.index.json"
        body = json.loads(index.read_text())
        body[key] = "@@raw@@"
        index.write_text(json.dumps(body).replace('"@@raw@@"', text))
        return model

    return build


def nesting_cases() -> list[Case]:
    cases = []
    values = {"key-tuple": dict_key_tuple, "list": nested_list, "tuple": nested_tuple, "dict": nested_dict}
    for label, make in values.items():
        for depth in (1000, 10**5, 10**6):
            if label == "dict" and depth == 10**6:
                continue
            for legacy in (False, True):
                if legacy and depth != 10**5:
                    continue
                build = _file(
                    "deep.pt", lambda p, m=make, d=depth, lg=legacy: torch_file_with_value(p, m(d), lg)
                )
                commands = ("inspect", "shrink", "load") if depth == 10**6 else ("inspect",)
                expect = "either" if depth == 1000 else "refuse"
                kind = "legacy" if legacy else "zip"
                cases += _cases("nesting", expect, f"pickle-{label}-{depth}-{kind}", build, commands)
    for depth in (1000, 10**5):
        deep = _deep_json(depth)
        header = '{"x":' + deep + ',"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}'
        cases += _cases(
            "nesting",
            "refuse",
            f"safetensors-header-{depth}",
            _safetensors_with_text(header),
            ("inspect", "load"),
        )
        metadata = (
            '{"__metadata__":'
            + _deep_json(depth, '{"a":', "}").replace("{}", '""')
            + ',"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}'
        )
        cases += _cases(
            "nesting",
            "refuse",
            f"safetensors-metadata-{depth}",
            _safetensors_with_text(metadata),
            ("inspect",),
        )
        slim = _slim_raw_edit(lambda body: body.update(objects={"deep": "@@raw@@"}), deep)
        cases += _cases(
            "nesting",
            "either" if depth == 1000 else "refuse",
            f"slim-objects-{depth}",
            slim,
            ("inspect", "shrink", "load"),
        )
        for key in ("metadata", "weight_map"):
            cases += _cases(
                "nesting", "refuse", f"index-{key}-{depth}", _index_edit(key, deep), ("inspect", "load")
            )
        config = _folder_with({"config.json": '{"model_type": "bert", "deep": ' + deep + "}"})
        cases += _cases(
            "nesting",
            "either" if depth == 1000 else "refuse",
            f"config-{depth}",
            config,
            ("inspect", "shrink"),
        )
        cases.append(
            Case(
                f"nesting/config-{depth}/memory",
                "nesting",
                "refuse",
                lambda folder, c=config: Invocation(["memory", str(c(folder))]),
            )
        )
    return cases


# -- CPU hangs --------------------------------------------------------------------------------------------
def _laughs(depth: int) -> Build:
    """``{"a": x, "b": x}`` ``depth`` levels deep over one tensor: 2**depth names, a few bytes a level."""

    def write(path: Path) -> None:
        value: object = torch.ones(4)
        for _ in range(depth):
            value = {"a": value, "b": value}
        torch.save({"model": value}, path)

    return _file("laughs.pt", write)


def _many_names(count: int, kind: str) -> Build:
    def write(path: Path) -> None:
        base = torch.arange(float(count))
        if kind == "same":
            torch.save({f"n{i}": base for i in range(count)}, path)
        elif kind == "views":
            torch.save({f"v{i}": base[i : i + 1] for i in range(count)}, path)
        else:  # slim ties
            from slimtorch.format.codecs.chain import encode
            from slimtorch.format.writer import SlimWriter

            with SlimWriter(path, ties={f"n{i}": "w" for i in range(count)}) as writer:
                writer.add("w", encode(base), torch.float32, (count,))

    return _file("names.safetensors" if kind == "ties" else "names.pt", write)


def _ones_shape(dims: int, kind: str) -> Build:
    if kind == "pt":
        return _claims((1,) * dims, 1, (1,) * dims)

    def write(path: Path) -> None:
        if kind == "safetensors":
            write_safetensors_raw(
                path, {"w": {"dtype": "F32", "shape": [1] * dims, "data_offsets": [0, 4]}}, bytes(4)
            )
        else:
            _slim(path)
            edit_slim_metadata(path, lambda body: body["tensors"]["fc.bias"].update(shape=[64] + [1] * dims))

    return _file("ones.safetensors", write)


def _many_tensors(count: int) -> Build:
    header = {f"t{i}": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]} for i in range(count)}
    return _file("many.safetensors", lambda path: write_safetensors_raw(path, header, b""))


def _many_zip_entries(count: int) -> Build:
    def write(path: Path) -> None:
        torch.save({"w": torch.ones(4)}, path)
        with zipfile.ZipFile(path, "a", zipfile.ZIP_STORED) as archive:
            for i in range(count):
                archive.writestr(f"archive/extra/{i}", b"")

    return _file("entries.pt", write)


def cpu_cases() -> list[Case]:
    cases = []
    for size, references in ((10**7, 1000), (10**8, 100), (10**6, 10**4)):
        build = _file("fan.pt", lambda p, s=size, r=references: torch_file_with_value(p, memo_fan_out(s, r)))
        commands = ("inspect", "shrink", "load") if size == 10**8 else ("inspect",)
        cases += _cases("cpu", "refuse", f"memo-fan-out-{size}x{references}", build, commands)
    counter = p_call("collections.Counter", p_call("builtins.bytearray", p_int(10**9)))
    cases += _cases(
        "cpu",
        "refuse",
        "counter-of-1e9-bytes",
        _file("counter.pt", lambda p: torch_file_with_value(p, counter)),
    )
    for depth in (20, 40, 64):
        commands = ("inspect", "shrink", "load") if depth == 40 else ("inspect",)
        # refused, or accepted in linear time (each shared object walked once)
        cases += _cases("cpu", "either", f"billion-laughs-{depth}", _laughs(depth), commands)
    for count in (5000, 20_000):
        for kind in ("same", "views", "ties"):
            # 20,000 views take seconds a command today: inspect alone keeps the corpus quick
            commands = ("inspect", "shrink", "load") if count == 20_000 and kind != "views" else ("inspect",)
            cases += _cases("cpu", "either", f"names-{kind}-{count}", _many_names(count, kind), commands)
    for dims in (1000, 10_000, 150_000):
        for kind in ("safetensors", "pt", "slim"):
            commands = ("inspect", "shrink", "load") if dims == 150_000 else ("inspect",)
            cases += _cases("cpu", "either", f"shape-{dims}-ones-{kind}", _ones_shape(dims, kind), commands)
    cases += _cases("cpu", "either", "tensors-10000", _many_tensors(10_000), ("inspect", "shrink", "load"))
    cases += _cases("cpu", "either", "zip-entries-20000", _many_zip_entries(20_000), ("inspect", "load"))
    long_name = {"x" * (1 << 20): {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}
    cases += _cases(
        "cpu",
        "either",
        "name-of-1MiB",
        _file("long.safetensors", lambda p: write_safetensors_raw(p, long_name, bytes(4))),
        ("inspect",),
    )
    return cases


# -- parser tracebacks ------------------------------------------------------------------------------------
W = '"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}'


HEADERS = {
    "int-4301-digits": '{"w":{"dtype":"F32","shape":[4],"data_offsets":[0,1' + "0" * 4300 + "]}}",
    "int-45-digits": '{"w":{"dtype":"F32","shape":[4],"data_offsets":[0,1' + "0" * 44 + "]}}",
    "shape-1e30-by-0": '{"w":{"dtype":"F32","shape":[1' + "0" * 30 + ',0],"data_offsets":[0,0]}}',
    "shape-0-by-1e30": '{"w":{"dtype":"F32","shape":[0,1' + "0" * 30 + '],"data_offsets":[0,0]}}',
    "shape-2e64-by-0": '{"w":{"dtype":"F32","shape":[18446744073709551616,0],"data_offsets":[0,0]}}',
    "shape-negative": '{"w":{"dtype":"F32","shape":[-4],"data_offsets":[0,16]}}',
    "shape-float": '{"w":{"dtype":"F32","shape":[4.0],"data_offsets":[0,16]}}',
    "shape-string": '{"w":{"dtype":"F32","shape":"4","data_offsets":[0,16]}}',
    "shape-bool": '{"w":{"dtype":"F32","shape":[true,4],"data_offsets":[0,16]}}',
    "shape-nan": '{"w":{"dtype":"F32","shape":[NaN],"data_offsets":[0,16]}}',
    "offsets-infinity": '{"w":{"dtype":"F32","shape":[4],"data_offsets":[0,Infinity]}}',
    "offsets-negative": '{"w":{"dtype":"F32","shape":[4],"data_offsets":[-16,0]}}',
    "offsets-reversed": '{"w":{"dtype":"F32","shape":[4],"data_offsets":[16,0]}}',
    "offsets-one": '{"w":{"dtype":"F32","shape":[4],"data_offsets":[0]}}',
    "offsets-null": '{"w":{"dtype":"F32","shape":[4],"data_offsets":null}}',
    "offsets-missing": '{"w":{"dtype":"F32","shape":[4]}}',
    "dtype-list": '{"w":{"dtype":["F32"],"shape":[4],"data_offsets":[0,16]}}',
    "dtype-object": '{"w":{"dtype":{"a":1},"shape":[4],"data_offsets":[0,16]}}',
    "dtype-unknown": '{"w":{"dtype":"F128","shape":[4],"data_offsets":[0,16]}}',
    "dtype-null": '{"w":{"dtype":null,"shape":[4],"data_offsets":[0,16]}}',
    "entry-list": '{"w":[1,2,3]}',
    "entry-string": '{"w":"F32"}',
    "metadata-list": '{"__metadata__":[1],' + W + "}",
    "metadata-int-value": '{"__metadata__":{"a":1},' + W + "}",
    "metadata-string": '{"__metadata__":"x",' + W + "}",
    "header-list": "[" + W[4:] + "]",
    "header-number": "5",
    "header-string": '"w"',
    "header-trailing-garbage": "{" + W + "}xx",
    "duplicate-key": "{" + W + "," + W.replace("[0,16]", "[0,8]") + "}",
    "bom": "\ufeff{" + W + "}",
    "slimtorch-not-json": '{"__metadata__":{"slimtorch":"{nope"},' + W + "}",
    "slimtorch-int-5000-digits": '{"__metadata__":{"slimtorch":"{\\"format\\":\\"slimtorch\\",\\"version\\":1'
    + "0" * 5000
    + '}"},'
    + W
    + "}",
}


LENGTHS = {"length-2**63": 2**63, "length-past-end": 10_000, "length-0": 0, "length-7": 7}


def _length_field(length: int) -> Build:
    body = ("{" + W + "}").encode()

    def write(path: Path) -> None:
        path.write_bytes(struct.pack("<Q", length) + body + bytes(16))

    return _file("model.safetensors", write)


def _not_utf8() -> Build:
    def write(path: Path) -> None:
        raw = ('{"w\xff":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}').encode("latin-1")
        raw += b" " * (-(8 + len(raw)) % 8)
        path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(16))

    return _file("model.safetensors", write)


def _slim_edit(edit: Callable[[dict], None], **options) -> Build:
    """A slim file whose slimtorch JSON went through ``edit(body)``, resealed: a crafted file, not a
    damaged one, so the checks behind the seal are what refuse it."""

    def write(path: Path) -> None:
        _slim(path, **options)
        reseal(edit_slim_metadata(path, edit))

    return _file("slim.safetensors", write)


def _stage(name: str, of: str = "", **changes) -> Callable[[dict], None]:
    """Change keys of tensor ``name``'s first stage, or of its first ``of`` stage."""

    def edit(body: dict) -> None:
        stages = body["tensors"][name]["stages"]
        stage = next(s for s in stages if s["codec"] == of) if of else stages[0]
        for key, value in changes.items():
            if value is _DELETE:
                del stage[key]
            else:
                stage[key] = value

    return edit


_DELETE = object()


def _rename_key(name: str, old: str, new: str) -> Callable[[dict], None]:
    def edit(body: dict) -> None:
        stage = body["tensors"][name]["stages"][0]
        stage[new] = stage.pop(old)

    return edit


def _set(*path_and_value) -> Callable[[dict], None]:
    *keys, value = path_and_value

    def edit(body: dict) -> None:
        target = body
        for key in keys[:-1]:
            target = target[key]
        target[keys[-1]] = value

    return edit


SLIM_EDITS: dict[str, tuple[Callable[[dict], None], dict]] = {
    "stage-without-codec": (_rename_key("fc.weight", "codec", "codeb"), {"quantize": "int8-weight"}),
    "stage-unknown-codec": (_stage("fc.weight", codec="lz77"), {"quantize": "int8-weight"}),
    "stage-codec-list": (_stage("fc.weight", codec=["int8"]), {"quantize": "int8-weight"}),
    "stage-dtype-list": (_stage("fc.weight", dtype=["float32"]), {"quantize": "int8-weight"}),
    "stage-dtype-object": (_stage("fc.weight", dtype={}), {"quantize": "int8-weight"}),
    "stage-dtype-qint8": (_stage("fc.weight", dtype="qint8"), {"quantize": "int8-weight"}),
    "stage-shape-1e30-by-0": (_stage("fc.weight", shape=[10**30, 0]), {"quantize": "int8-weight"}),
    "stage-shape-2**47-squared": (_stage("fc.weight", shape=[2**47, 2**47]), {"quantize": "int8-weight"}),
    "stage-shape-missing": (_stage("fc.weight", shape=_DELETE), {"quantize": "int8-weight"}),
    "stage-not-object": (_set("tensors", "fc.weight", "stages", ["int8"]), {"quantize": "int8-weight"}),
    "stages-object": (_set("tensors", "fc.weight", "stages", {"codec": "int8"}), {"quantize": "int8-weight"}),
    "stages-repeated-1000": (
        lambda body: body["tensors"]["fc.weight"].update(
            stages=body["tensors"]["fc.weight"]["stages"] * 1000
        ),
        {"quantize": "int8-weight"},
    ),
    "entry-dtype-list": (_set("tensors", "fc.bias", "dtype", ["float32"]), {}),
    "entry-shape-1e30-by-0": (_set("tensors", "fc.bias", "shape", [10**30, 0]), {}),
    "entry-shape-0": (_set("tensors", "fc.bias", "shape", [0]), {}),
    "crc-empty": (_set("tensors", "fc.bias", "crc32", {"": []}), {}),
    "crc-huge": (_set("tensors", "fc.bias", "crc32", {"": [2**100]}), {}),
    "crc-string": (_set("tensors", "fc.bias", "crc32", {"": ["0"]}), {}),
    "parts-of-another-tensor": (
        _set("tensors", "fc.bias", "parts", {"": "fc.weight::scale"}),
        {"quantize": "int8-weight"},
    ),
    "parts-missing-role": (
        lambda body: (
            body["tensors"]["fc.weight"]["parts"].pop("scale")
            and body["tensors"]["fc.weight"]["crc32"].pop("scale")
        ),
        {"quantize": "int8-weight"},
    ),
    "tie-cycle": (_set("ties", {"a": "b", "b": "a"}), {}),
    "tie-to-missing": (_set("ties", {"a": "nowhere"}), {}),
    "tie-to-itself": (_set("ties", {"fc.bias": "fc.bias"}), {}),
    "tie-value-int": (_set("ties", {"a": 1}), {}),
    "copy-cycle": (_set("copies", {"a": "b", "b": "a"}), {}),
    "copy-over-tensor": (_set("copies", {"fc.bias": "steps"}), {}),
    "delta-shape-1e30": (_set("delta", {"shapes": {"fc.weight": [10**30]}}), {}),
    "delta-shape-list-of-lists": (_set("delta", {"shapes": {"fc.weight": [[1]]}}), {}),
    "delta-not-object": (_set("delta", [1, 2]), {}),
    "version-2": (_set("version", 2), {}),
    "version-string": (_set("version", "1"), {}),
    "shard-0": (_set("shard", 0), {}),
    "shard-1e30": (_set("shard", 10**30), {}),
    "checkpoint-list": (_set("checkpoint", [1]), {}),
    "tensors-list": (_set("tensors", []), {}),
    "objects-list": (_set("objects", [1]), {}),
    "int4-group-size-0": (_stage("fc.weight", "int4", group_size=0), {"quantize": "int4-weight"}),
    "int4-group-size-1e18": (_stage("fc.weight", "int4", group_size=10**18), {"quantize": "int4-weight"}),
    "int4-flat-string": (_stage("fc.weight", "int4", flat="yes"), {"quantize": "int4-weight"}),
}


SLIM_RAW = {
    "slim-int-5000-digits": (lambda body: body.update(shard="@@raw@@"), "1" + "0" * 5000),
    "slim-nan-crc": (lambda body: body["tensors"]["fc.bias"].update(crc32={"": "@@raw@@"}), "[NaN]"),
    "slim-infinity-shape": (lambda body: body["tensors"]["fc.bias"].update(shape="@@raw@@"), "[Infinity]"),
}


def _shadowing_parameter(method: str) -> Build:
    """A Parameter whose pickled ``__dict__`` holds ``method``: torch restores it as an attribute that
    hides the tensor method of that name."""

    def write(path: Path) -> None:
        parameter = torch.nn.Parameter(torch.ones(4, 4))
        parameter.__dict__[method] = 5
        torch.save({"w": parameter, "b": torch.ones(4)}, path)

    return _file("shadow.pt", write)


def _sparse_coo() -> Build:
    dense = torch.zeros(8, 8)
    dense[1, 2] = 3.0
    return _file("sparse.pt", lambda path: torch.save({"w": dense.to_sparse(), "b": torch.ones(2)}, path))


def _claims(shape: tuple[int, ...], numel: int = 4, stride: tuple[int, ...] | None = None) -> Build:
    def write(path: Path) -> None:
        from tests import hostile

        claim = hostile._TensorClaim(hostile._StorageClaim(numel), shape, stride or (1,) * len(shape))
        import io

        class Pickler(__import__("pickle").Pickler):
            def persistent_id(self, obj):
                if isinstance(obj, hostile._StorageClaim):
                    return ("storage", torch.FloatStorage, "0", "cpu", obj.numel)
                return None

        buffer = io.BytesIO()
        Pickler(buffer, protocol=2).dump({"w": claim})
        hostile.torch_zip_with_pickle(path, buffer.getvalue())
        with zipfile.ZipFile(path, "a", zipfile.ZIP_STORED) as archive:
            archive.writestr("archive/data/0", bytes(numel * 4))

    return _file("claims.pt", write)


def _truncated(kind: str, fraction: float, offset: int | None = None) -> Build:
    def write(path: Path) -> None:
        good = path.with_name("good" + path.suffix)
        if kind == "pt":
            torch.save(_state(), good)
        elif kind == "legacy":
            torch.save(_state(), good, _use_new_zipfile_serialization=False)
        elif kind == "safetensors":
            save_file(_state(), good)
        else:
            _slim(good, quantize="int8-weight", entropy=kind == "slim-zstd")
        raw = good.read_bytes()
        good.unlink()
        cut = offset if offset is not None else int(len(raw) * fraction)
        path.write_bytes(raw[: min(cut, len(raw) - 1)])

    return _file(f"cut.{'safetensors' if 'slim' in kind or kind == 'safetensors' else 'pt'}", write)


def parser_cases() -> list[Case]:
    cases = []
    for name, text in HEADERS.items():
        commands = (
            ("inspect", "load")
            if name.startswith(("int-", "shape-1e30", "shape-nan", "dtype-list"))
            else ("inspect",)
        )
        expect = "either" if name in ("duplicate-key", "metadata-int-value") else "refuse"
        cases += _cases("parser", expect, f"safetensors-{name}", _safetensors_with_text(text), commands)
    for name, length in LENGTHS.items():
        cases += _cases("parser", "refuse", f"safetensors-{name}", _length_field(length), ("inspect", "load"))
    cases += _cases("parser", "refuse", "safetensors-not-utf8", _not_utf8(), ("inspect",))
    for name, (edit, options) in SLIM_EDITS.items():
        commands = (
            ("load", "shrink")
            if name in ("stage-without-codec", "stage-dtype-list", "tie-cycle")
            else ("load",)
        )
        # a delta matters only with --model, a checkpoint id only between shards: load may ignore both
        expect = "either" if name.startswith(("delta-", "checkpoint-")) else "refuse"
        cases += _cases("parser", expect, f"slim-{name}", _slim_edit(edit, **options), commands)
    for name, (edit, text) in SLIM_RAW.items():
        cases += _cases("parser", "refuse", name, _slim_raw_edit(edit, text), ("inspect", "load"))
    for method in (
        "size",
        "dim",
        "numel",
        "stride",
        "storage_offset",
        "untyped_storage",
        "element_size",
        "view",
    ):
        commands = ("inspect", "shrink", "load") if method in ("size", "untyped_storage") else ("inspect",)
        cases += _cases(
            "parser", "either", f"parameter-shadows-{method}", _shadowing_parameter(method), commands
        )
    cases += _cases("parser", "either", "sparse-coo", _sparse_coo(), ("inspect", "shrink", "load"))
    claims = {
        "1e30-by-0": ((10**30, 0), 4, (1, 1)),
        "0-by-2**63": ((0, 2**63), 4, (1, 1)),
        "negative": ((-1,), 4, (1,)),
        "negative-stride": ((4,), 4, (-1,)),
        "huge-stride": ((2, 2), 4, (2**62, 1)),
    }
    for name, (shape, numel, stride) in claims.items():
        cases += _cases(
            "parser", "refuse", f"pt-shape-{name}", _claims(shape, numel, stride), ("inspect", "load")
        )
    rng = random.Random(17)
    for kind in ("pt", "legacy", "safetensors", "slim", "slim-zstd"):
        for offset in (1, 7, 8, 9, 64):
            cases += _cases("parser", "refuse", f"truncated-{kind}-at-{offset}", _truncated(kind, 0, offset))
        for fraction in sorted(rng.uniform(0.05, 0.99) for _ in range(4)):
            commands = ("inspect", "load") if kind.startswith("slim") else ("inspect",)
            cases += _cases(
                "parser",
                "refuse",
                f"truncated-{kind}-at-{fraction:.2f}",
                _truncated(kind, fraction),
                commands,
            )
    return cases


# -- header integrity -------------------------------------------------------------------------------------
def _flipped(seed: int, options: dict) -> Build:
    """A slim file with one bit flipped in its safetensors header (length field and JSON), seeded."""

    def write(path: Path) -> None:
        _slim(path, **options)
        raw = bytearray(path.read_bytes())
        (length,) = struct.unpack("<Q", raw[:8])
        rng = random.Random(seed)
        where = rng.randrange(8 + length)
        raw[where] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(raw))

    return _file("flipped.safetensors", write)


def _decoded_state(options: dict) -> Callable[[], dict[str, torch.Tensor]]:
    def expected() -> dict[str, torch.Tensor]:
        import tempfile

        with tempfile.TemporaryDirectory() as scratch:
            return dict(slimtorch.load(_slim(Path(scratch) / "x.safetensors", **options)).tensors)

    return expected


def _damaged_key(new_key: str) -> Build:
    def write(path: Path) -> None:
        _slim(path, quantize="int8-weight")
        header, data = read_safetensors(path)
        header["__metadata__"][new_key] = header["__metadata__"].pop("slimtorch")
        write_safetensors_raw(path, header, data, reseal=False)

    return _file("damaged.safetensors", write)


RELABELS = {"F16": "BF16", "BF16": "F16", "F32": "I32", "I32": "F32", "I64": "F64", "U8": "I8", "I8": "U8"}


TORCH_OF = {
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "I32": torch.int32,
    "I64": torch.int64,
    "U8": torch.uint8,
    "F64": torch.float64,
    "I8": torch.int8,
}


def _relabelled(old: str, new: str, metadata_too: bool) -> Build:
    """A slim file whose raw tensor ``t`` of safetensors dtype ``old`` is relabelled ``new`` (same width),
    in the header only or in the slimtorch metadata as well: every CRC still matches."""

    def write(path: Path) -> None:
        tensor = (torch.arange(64) % 7 + 1).to(TORCH_OF[old])  # no zeros: stored as is, not sparse
        slimtorch.save({"t": tensor, "b": torch.ones(8)}, path)
        header, data = read_safetensors(path)
        header["t"]["dtype"] = new
        body = json.loads(header["__metadata__"]["slimtorch"])
        if metadata_too:
            body["tensors"]["t"]["dtype"] = str(TORCH_OF[new]).removeprefix("torch.")
        header["__metadata__"]["slimtorch"] = json.dumps(body)
        write_safetensors_raw(path, header, data, reseal=False)

    return _file("relabelled.safetensors", write)


def _swapped(how: str) -> Build:
    """Two same-shaped tensors ``a`` and ``b`` exchanged with their CRCs, or ``a`` renamed consistently."""

    def write(path: Path) -> None:
        slimtorch.save({"a": torch.ones(8, 8), "b": torch.full((8, 8), 2.0)}, path)
        header, data = read_safetensors(path)
        body = json.loads(header["__metadata__"]["slimtorch"])
        tensors = body["tensors"]
        if how == "metadata":
            tensors["a"], tensors["b"] = tensors["b"], tensors["a"]
        elif how == "offsets":
            header["a"]["data_offsets"], header["b"]["data_offsets"] = (
                header["b"]["data_offsets"],
                header["a"]["data_offsets"],
            )
            tensors["a"]["crc32"], tensors["b"]["crc32"] = tensors["b"]["crc32"], tensors["a"]["crc32"]
        else:
            header["c"] = header.pop("a")
            tensors["c"] = tensors.pop("a")
            tensors["c"]["parts"] = {"": "c"}
        header["__metadata__"]["slimtorch"] = json.dumps(body)
        write_safetensors_raw(path, header, data, reseal=False)

    return _file("swapped.safetensors", write)


def _shards(damage: str) -> Build:
    def build(folder: Path) -> Path:
        model = _folder_with({}, "sharded")(folder)
        index = model / "model.safetensors.index.json"
        body = json.loads(index.read_text())
        last, middle = "model-00004-of-00004.safetensors", "model-00002-of-00004.safetensors"
        if damage in ("last-deleted", "last-deleted-and-unlisted"):
            (model / last).unlink()
        if damage == "last-deleted-and-unlisted":
            body["weight_map"] = {k: v for k, v in body["weight_map"].items() if v != last}
        if damage == "middle-deleted-and-unlisted":
            (model / middle).unlink()
            body["weight_map"] = {k: v for k, v in body["weight_map"].items() if v != middle}
        if damage == "index-deleted":
            index.unlink()
            return model
        if damage == "shard-from-another-save":
            other = folder / "other"
            slimtorch.save(_sharded_state(), other, shard_bytes=20000)
            (model / middle).write_bytes((other / middle).read_bytes())
        if damage == "shards-renamed":
            first, second = model / "model-00001-of-00004.safetensors", model / middle
            data = first.read_bytes()
            first.write_bytes(second.read_bytes())
            second.write_bytes(data)
        if damage == "index-points-elsewhere":
            body["weight_map"]["l0.weight"] = last
        index.write_text(json.dumps(body))
        return model

    return build


def _folder_same_tensors(folder: Path, command: str):
    return _same_tensors(_sharded_state)(folder, command)


RESERVED = ["__metadata__", "a::b", "::", "", "x::q", "__metadata__::scale"]


def _reserved(name: str) -> tuple[Build, Callable[[], dict[str, torch.Tensor]]]:
    state = {name: torch.arange(4096.0).reshape(64, 64), "x": torch.ones(4)}
    return _file("reserved.pt", lambda path: torch.save(state, path)), lambda: state


def integrity_cases() -> list[Case]:
    cases = []
    for kind, options, flips in (("lossless", {}, 40), ("int8", {"quantize": "int8-weight"}, 20)):
        check = _same_tensors(_decoded_state(options))
        for seed in range(flips):
            cases += _cases(
                "integrity",
                "either",
                f"header-bit-flip-{kind}-{seed}",
                _flipped(seed, options),
                ("shrink",),
                check,
            )
    for new_key in ("slimtorcH", "slimtorc", "Slimtorch", "slimtorch ", "xlimtorch", "slim\u0074orch\u0000"):
        cases += _cases(
            "integrity", "refuse", f"slimtorch-key-{new_key!r}", _damaged_key(new_key), ("load", "shrink")
        )
    for old, new in RELABELS.items():
        for metadata_too in (False, True):
            commands = ("load", "shrink", "inspect") if old == "F16" and metadata_too else ("load",)
            label = "both" if metadata_too else "header"
            cases += _cases(
                "integrity",
                "refuse",
                f"relabel-{old}-as-{new}-{label}",
                _relabelled(old, new, metadata_too),
                commands,
            )
    for how in ("metadata", "offsets", "renamed"):
        cases += _cases("integrity", "refuse", f"swap-{how}", _swapped(how), ("load", "shrink"))
    for damage in (
        "last-deleted",
        "last-deleted-and-unlisted",
        "middle-deleted-and-unlisted",
        "shard-from-another-save",
        "index-points-elsewhere",
    ):
        commands = ("load", "inspect", "shrink") if damage.startswith("last") else ("load",)
        cases += _cases("integrity", "refuse", f"shards-{damage}", _shards(damage), commands)
    for damage in ("index-deleted", "shards-renamed"):
        cases += _cases(
            "integrity",
            "either",
            f"shards-{damage}",
            _shards(damage),
            ("load", "shrink"),
            _folder_same_tensors,
        )
    for name in RESERVED:
        build, expected = _reserved(name)
        cases += _cases(
            "integrity",
            "either",
            f"reserved-name-{name!r}",
            build,
            ("inspect", "shrink"),
            _same_tensors(expected),
        )
    return cases


# -- remote code ------------------------------------------------------------------------------------------
def _marker_absent(marker: Path):
    def check(stdout: str, stderr: str) -> str | None:
        return f"code from the folder ran ({marker.name} exists)" if marker.exists() else None

    return check


def _evil_folder(variant: str) -> Callable[[Path], tuple[Path, Path]]:
    """A model folder whose Python files create a marker when imported; ``variant`` says where the
    ``auto_map`` pointing at them sits."""

    def build(folder: Path) -> tuple[Path, Path]:
        model, marker = folder / "model", folder / "pwned"
        model.mkdir()
        code = f"import pathlib\npathlib.Path({str(marker)!r}).touch()\n"
        for name in ("configuration_evil.py", "modeling_evil.py", "tokenization_evil.py", "evil.py"):
            (model / name).write_text(code)
        auto_map = {"AutoConfig": "configuration_evil.EvilConfig", "AutoModel": "modeling_evil.EvilModel"}
        tiny_bert = {
            "model_type": "bert",
            "architectures": ["BertModel"],
            "hidden_size": 32,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "intermediate_size": 64,
            "vocab_size": 100,
            "max_position_embeddings": 64,
        }
        if variant == "tokenizer":
            from transformers import BertConfig, BertModel

            BertModel(
                BertConfig(**{k: v for k, v in tiny_bert.items() if k not in ("model_type", "architectures")})
            ).save_pretrained(model)
            tokenizer = {"auto_map": {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]}}
            (model / "tokenizer_config.json").write_text(json.dumps(tokenizer))
            return model, marker
        config = {"model_type": "evil", "architectures": ["EvilModel"], "auto_map": auto_map}
        if variant == "model-only":
            config["auto_map"] = {"AutoModel": "modeling_evil.EvilModel"}
        if variant == "nested":
            config = {**tiny_bert, "text_config": {"model_type": "evil", "auto_map": auto_map}}
        (model / "config.json").write_text(json.dumps(config))
        save_file({"w": torch.ones(4)}, model / "model.safetensors")
        return model, marker

    return build


def remote_code_cases() -> list[Case]:
    cases = []
    commands = {
        "prune": lambda m, f: ["prune", str(m), "-o", str(f / "out"), "--ratio", "0.5", "--runs", "0"],
        "quantize": lambda m, f: ["quantize", str(m), "-o", str(f / "out")],
        "memory": lambda m, f: ["memory", str(m)],
        "export": lambda m, f: ["export", str(m), "-o", str(f / "bundle")],
        "inspect": lambda m, f: ["inspect", str(m)],
        "shrink": lambda m, f: ["shrink", str(m), "-o", str(f / "out")],
        "load": lambda m, f: ["load", str(m)],
    }
    plan = {
        "auto-map": (commands, "refuse"),
        "model-only": (("prune", "quantize", "memory", "export"), "refuse"),
        "nested": (("prune", "memory"), "either"),
        "tokenizer": (("prune", "memory"), "either"),
    }
    for variant, (names, expect) in plan.items():
        for command in names:
            make = commands[command]
            wanted = "either" if command in ("inspect", "shrink", "load") else expect

            def build(folder: Path, variant=variant, make=make) -> Invocation:
                model, marker = _evil_folder(variant)(folder)
                return Invocation(make(model, folder), stdin="y\n" * 20, check=_marker_absent(marker))

            cases.append(Case(f"remote-code/{variant}/{command}", "remote-code", wanted, build))
    return cases


# -- --allow-global ---------------------------------------------------------------------------------------
def _payload(name: str, marker: Path, canary: Path) -> bytes:
    """The call of ``name`` that would create ``marker`` (or delete ``canary``) if it ran."""
    command = f"touch {marker}"
    python = f"__import__('pathlib').Path({str(marker)!r}).touch()"
    arguments = {
        "builtins.eval": p_str(python),
        "builtins.exec": p_str(python),
        "__builtin__.eval": p_str(python),
        "builtins.__import__": p_str("evilmod"),
        "importlib.import_module": p_str("evilmod"),
        "runpy.run_path": p_str("evilmod.py"),
        "shutil.rmtree": p_str(str(canary)),
        "builtins.open": p_str(str(marker)) + p_str("w"),
        "subprocess.Popen": b"]" + b"(" + p_str("touch") + p_str(str(marker)) + b"e",
        "functools.partial": p_global("os.system") + p_str(command),
        "copyreg._reconstructor": p_global("os.system") + p_global("builtins.object") + p_str(command),
        "builtins.getattr": p_global("os.system") + p_str("__call__"),
    }
    return p_call(name, arguments.get(name, p_str(command)))


DANGEROUS = [
    "builtins.eval",
    "builtins.exec",
    "builtins.getattr",
    "builtins.__import__",
    "builtins.open",
    "__builtin__.eval",
    "os.system",
    "posix.system",
    "os.popen",
    "nt.system",
    "subprocess.getoutput",
    "subprocess.Popen",
    "shutil.rmtree",
    "importlib.import_module",
    "runpy.run_path",
    "functools.partial",
    "pickle.loads",
    "_pickle.loads",
    "copyreg._reconstructor",
]


def _dangerous_file(name: str, folder: Path, allowed: bool = False) -> tuple[Path, Callable]:
    marker, canary = folder / "pwned", folder / "canary"
    canary.mkdir()
    (folder / "evilmod.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r}).touch()\nThing = 1\n")
    path = torch_file_with_value(folder / "model.pt", _payload(name, marker, canary))

    def check(stdout: str, stderr: str) -> str | None:
        if marker.exists() or not canary.exists():
            return f"{name} ran"
        if not allowed and f"--allow-global {name}" in stderr:
            return f"the message suggests --allow-global {name}"
        return None

    return path, check


def allow_global_cases() -> list[Case]:
    cases = []
    for name in DANGEROUS:
        for allowed in (True, False):

            def build(folder: Path, name=name, allowed=allowed) -> Invocation:
                path, check = _dangerous_file(name, folder, allowed)
                extra = ["--allow-global", name] if allowed else []
                return Invocation(["inspect", str(path), *extra], check=check, names_file=not allowed)

            label = "allowed" if allowed else "suggested"
            cases.append(Case(f"allow-global/{name}/{label}", "allow-global", "refuse", build))
    for with_model in (False, True):

        def build(folder: Path, with_model=with_model) -> Invocation:
            path, check = _dangerous_file("os.system", folder)
            save_file({"w": torch.ones(4)}, path.with_suffix(".safetensors"))
            model = ["--model", "torch.nn:Identity", "--non-strict"] if with_model else []
            argv = ["load", str(path.with_suffix(".safetensors")), *model, "--allow-global", "evilmod.Thing"]
            return Invocation(argv, check=check, names_file=False)

        cases.append(
            Case(
                f"allow-global/cwd-module/{'model' if with_model else 'plain'}",
                "allow-global",
                "either",
                build,
            )
        )
    return cases


# -- paths ------------------------------------------------------------------------------------------------
def _no_secret(folder: Path):
    def check(stdout: str, stderr: str) -> str | None:
        if SECRET in stderr or SECRET in stdout:
            return "the message prints the bytes of a file outside the folder"
        for path in folder.rglob("*"):
            if (
                path.is_file()
                and not path.is_symlink()
                and not path.name.startswith("secret.")
                and SECRET.encode() in path.read_bytes()
            ):
                return f"{path.name} holds a copy of a file outside the folder"
        return None

    return check


def _linked_folder(target: str, link_name: str = "model.safetensors") -> Callable[[Path], Path]:
    def build(folder: Path) -> Path:
        model = folder / "model"
        model.mkdir()
        secret = folder / "secret.txt"
        secret.write_text(SECRET * 20)
        if link_name.endswith(".json"):  # valid JSON, so only following the link can be what leaks it
            secret = folder / "secret.json"
            secret.write_text(json.dumps({"model_type": "bert", "secret": SECRET}))
        if link_name != "model.safetensors":
            save_file({"w": torch.ones(4)}, model / "model.safetensors")
        if link_name not in ("config.json", "model.safetensors"):
            (model / "config.json").write_text('{"model_type": "bert"}')
        if target == "secret":
            (model / link_name).symlink_to(secret)
        elif target == "outside-model":
            save_file({"w": torch.ones(4)}, folder / "elsewhere.safetensors")
            (model / link_name).symlink_to(folder / "elsewhere.safetensors")
        elif target == "fifo":
            os.mkfifo(model / link_name)
        elif target == "directory":
            (model / link_name).mkdir()
        elif target == "dangling":
            (model / link_name).symlink_to(folder / "nowhere")
        elif target == "loop":
            (model / link_name).symlink_to(model / "loop2")
            (model / "loop2").symlink_to(model / link_name)
        else:
            (model / link_name).symlink_to(target)
        return model

    return build


def _unchanged(path: Path, before: bytes | None = None):
    def check(stdout: str, stderr: str) -> str | None:
        if path.is_symlink() and not path.resolve().exists():
            return f"{path.name} now points nowhere"
        if before is not None and (not path.exists() or path.read_bytes() != before):
            return f"{path.name} was overwritten"
        return None

    return check


def _output_case(kind: str) -> Callable[[Path], Invocation]:
    def build(folder: Path) -> Invocation:
        source = folder / "in.safetensors"
        save_file({"w": torch.ones(64, 64)}, source)
        before = source.read_bytes()
        if kind == "same-file":
            return Invocation(["shrink", str(source), "-o", str(source)], check=_unchanged(source, before))
        if kind == "same-file-other-spelling":
            spelled = f"{folder}/./in.safetensors"
            return Invocation(["shrink", str(source), "-o", spelled], check=_unchanged(source, before))
        if kind == "link-to-input":
            link = folder / "link.safetensors"
            link.symlink_to(source)
            return Invocation(
                ["shrink", str(source), "-o", str(link)],
                check=_both(_unchanged(source, before), _still_link(link)),
            )
        if kind == "link-to-folder":
            outside = folder / "outside"
            outside.mkdir()
            (outside / "keep.txt").write_text("user data")
            link = folder / "out"
            link.symlink_to(outside)
            return Invocation(
                ["shrink", str(source), "-o", str(link)],
                check=_both(_still_link(link), _kept(outside / "keep.txt")),
            )
        if kind == "dangling-link":
            link = folder / "out.safetensors"
            link.symlink_to(folder / "elsewhere" / "x.safetensors")
            return Invocation(["shrink", str(source), "-o", str(link)], check=_still_link(link))
        if kind == "folder-with-user-files":
            out = folder / "out"
            out.mkdir()
            (out / "notes.txt").write_text("user data")
            (out / "keep.index.json").write_text("{}")
            (out / "runs.index.json").mkdir()
            (out / "runs.index.json" / "a.txt").write_text("user data")
            kept = [out / "notes.txt", out / "keep.index.json", out / "runs.index.json" / "a.txt"]
            return Invocation(["shrink", str(source), "-o", str(out)], check=_both(*map(_kept, kept)))
        # the input folder itself as the output
        model = folder / "model"
        model.mkdir()
        save_file({"w": torch.ones(64, 64)}, model / "model.safetensors")
        (model / "notes.txt").write_text("user data")
        return Invocation(["shrink", str(model), "-o", str(model)], check=_kept(model / "notes.txt"))

    return build


def _both(*checks):
    def check(stdout: str, stderr: str) -> str | None:
        return next((problem for c in checks if (problem := c(stdout, stderr))), None)

    return check


def _still_link(link: Path):
    def check(stdout: str, stderr: str) -> str | None:
        return None if link.is_symlink() else f"{link.name} is no longer a symlink"

    return check


def _kept(path: Path):
    def check(stdout: str, stderr: str) -> str | None:
        return None if path.exists() else f"deleted the user's {path.name}"

    return check


def path_cases() -> list[Case]:
    cases = []
    targets = {
        "secret": ("refuse", ("inspect", "shrink", "load")),
        "outside-model": ("either", ("inspect", "load")),
        "/dev/zero": ("refuse", ("inspect", "load")),
        "/dev/urandom": ("refuse", ("inspect",)),
        "fifo": ("refuse", ("inspect", "load")),
        "directory": ("refuse", ("inspect",)),
        "dangling": ("refuse", ("inspect",)),
        "loop": ("refuse", ("inspect",)),
    }
    for target, (expect, commands) in targets.items():
        for command in commands:

            def build(folder: Path, target=target, command=command) -> Invocation:
                model = _linked_folder(target)(folder)
                return _call(command, model, folder, _no_secret(folder))

            cases.append(Case(f"paths/model-link-{target.strip('/')}/{command}", "paths", expect, build))

        def direct(folder: Path, target=target) -> Invocation:
            link = _linked_folder(target)(folder) / "model.safetensors"
            return _call("inspect", link, folder, _no_secret(folder))

        direct_expect = "either" if target == "outside-model" else "refuse"
        cases.append(
            Case(f"paths/model-link-{target.strip('/')}/inspect-the-file", "paths", direct_expect, direct)
        )
    for link_name in ("config.json", "tokenizer.json", "generation_config.json"):

        def build(folder: Path, link_name=link_name) -> Invocation:
            model = _linked_folder("secret", link_name)(folder)
            return Invocation(["shrink", str(model), "-o", str(folder / "out")], check=_no_secret(folder))

        cases.append(Case(f"paths/{link_name}-link-outside/shrink", "paths", "either", build))
    for kind, expect in (
        ("same-file", "refuse"),
        ("same-file-other-spelling", "refuse"),
        ("link-to-input", "refuse"),
        ("link-to-folder", "refuse"),
        ("dangling-link", "refuse"),
        ("folder-with-user-files", "either"),
        ("input-folder", "refuse"),
    ):
        cases.append(Case(f"paths/output-{kind}/shrink", "paths", expect, _output_case(kind)))
    return cases


def corpus() -> list[Case]:
    """Every case, in a fixed order (ids are unique and stable)."""
    return cases_of(
        memory_cases(),
        nesting_cases(),
        cpu_cases(),
        parser_cases(),
        integrity_cases(),
        remote_code_cases(),
        allow_global_cases(),
        path_cases(),
    )


CASES = corpus()
