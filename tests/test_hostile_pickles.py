"""Hostile pickles and torch archives: a budget before memory, one line naming the file, never a crash.

Every file is written byte by byte at test time; each would take gigabytes, hang or crash the process
without the check it tests, and each is refused here before anything is allocated for it.
"""

from __future__ import annotations

import pickle
import struct
import sys
import tracemalloc
import zipfile
from collections import Counter, OrderedDict
from decimal import Decimal
from pathlib import Path

import pytest
import torch

import slimtorch
from slimtorch.cli.main import main
from slimtorch.errors import FormatError, SlimtorchError, UnsafeCheckpointError
from slimtorch.format import untrusted
from slimtorch.sources import objects, pickle_budget, pickled
from slimtorch.sources.objects import plain_objects, short_repr
from slimtorch.sources.pickled import flatten
from slimtorch.sources.torch_legacy import SIGNATURE as LEGACY_SIGNATURE
from tests.hostile import legacy_with_pickle, torch_zip_with_pickle

PROTO, STOP, MARK = b"\x80\x02", b".", b"("
EMPTY_DICT, EMPTY_LIST, EMPTY_TUPLE = b"}", b"]", b")"
APPEND, SETITEM, SETITEMS, TUPLE, TUPLE1 = b"a", b"s", b"u", b"t", b"\x85"
REDUCE, NEWOBJ, BUILD = b"R", b"\x81", b"b"


def op_global(dotted: str) -> bytes:
    module, _, name = dotted.rpartition(".")
    return b"c" + f"{module}\n{name}\n".encode()


def op_int(value: int) -> bytes:
    return b"J" + struct.pack("<i", value)


def op_str(text: str) -> bytes:
    raw = text.encode()
    return b"X" + struct.pack("<I", len(raw)) + raw


def op_put(index: int) -> bytes:
    return b"r" + struct.pack("<I", index)


def op_get(index: int) -> bytes:
    return b"j" + struct.pack("<I", index)


def call(function: str, *args: bytes) -> bytes:
    return op_global(function) + MARK + b"".join(args) + TUPLE + REDUCE


def in_dict(value: bytes) -> bytes:
    """A pickle of ``{"x": value}``."""
    return PROTO + EMPTY_DICT + op_str("x") + value + SETITEM + STOP


def refusal(path: Path, **options) -> str:
    """The one-line message slimtorch.open refuses ``path`` with (a FormatError naming the file)."""
    with pytest.raises(SlimtorchError) as refused:
        slimtorch.open(path, **options)
    message = str(refused.value)
    assert message.startswith(str(path)) and "\n" not in message
    return message


def zip_entry_compressed(path: Path, data_pkl: bytes, method: int) -> Path:
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("archive/data.pkl", data_pkl, compress_type=method)
        archive.writestr("archive/byteorder", "little")
    return path


def rebuild_args(size: bytes, stride: bytes, offset: bytes = op_int(0)) -> list[bytes]:
    """The arguments torch.save gives _rebuild_tensor_v2 for a float32 tensor in storage "0" of 4 floats."""
    storage = MARK + op_str("storage") + op_global("torch.FloatStorage") + op_str("0") + op_str("cpu")
    return [
        storage + op_int(4) + TUPLE + b"Q",
        offset,
        size,
        stride,
        b"\x89",
        call("collections.OrderedDict"),
    ]


def torch_zip_with_tensor(path: Path, value: bytes) -> Path:
    torch_zip_with_pickle(path, in_dict(value))
    with zipfile.ZipFile(path, "a") as archive:
        archive.writestr("archive/data/0", bytes(16))
    return path


def script_object(module: str, state: bytes = EMPTY_DICT) -> bytes:
    """A TorchScript class instance, as torch.jit.save pickles it: NEWOBJ of ``module.C``, then BUILD."""
    return op_global(f"{module}.C") + EMPTY_TUPLE + NEWOBJ + state + BUILD


def script_archive(path: Path, data_pkl: bytes, code: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("archive/data.pkl", data_pkl)
        for name, text in code.items():
            archive.writestr(f"archive/code/{name}", text, compress_type=zipfile.ZIP_DEFLATED)
    return path


# -- 1. zip entries: stored, and never larger than the file ----------------------------------------------
@pytest.mark.parametrize(
    "method", [zipfile.ZIP_DEFLATED, zipfile.ZIP_BZIP2, zipfile.ZIP_LZMA], ids=["deflate", "bzip2", "lzma"]
)
def test_a_compressed_data_pkl_is_refused_before_it_is_decoded(tmp_path, method):
    # 16 MB of one opcode packs into a few hundred bytes; torch.save never compresses an entry
    path = zip_entry_compressed(tmp_path / "bomb.pt", PROTO + b"N" * 16_000_000 + STOP, method)
    assert path.stat().st_size < 100_000

    message = refusal(path)

    assert "data.pkl is compressed" in message and "zip bomb" in message


def test_an_entry_declaring_more_bytes_than_the_file_holds_is_refused(tmp_path):
    path = torch_zip_with_pickle(tmp_path / "big.pt", pickle.dumps({"epoch": 3}, protocol=2))
    raw = bytearray(path.read_bytes())
    header = raw.index(b"PK\x01\x02")  # data.pkl's central directory entry comes first
    raw[header + 20 : header + 28] = struct.pack("<II", 300_000_000, 300_000_000)
    path.write_bytes(bytes(raw))

    assert "declares 300,000,000 bytes" in refusal(path)


def test_deflated_torchscript_code_is_still_read_as_real_archives_store_it(tmp_path):
    scripted = tmp_path / "scripted.pt"
    torch.jit.save(torch.jit.script(torch.nn.Linear(3, 2)), scripted)
    deflated = tmp_path / "deflated.pt"
    with zipfile.ZipFile(scripted) as old, zipfile.ZipFile(deflated, "w") as new:
        for info in old.infolist():
            method = zipfile.ZIP_DEFLATED if "/code/" in info.filename else zipfile.ZIP_STORED
            new.writestr(info.filename, old.read(info), compress_type=method)

    roles = {info.name: info.role for info in slimtorch.open(deflated).tensors}

    assert roles == {"weight": "parameter", "bias": "parameter"}


# -- 2. the opcode pre-scan ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "nesting",
    [
        EMPTY_DICT + op_int(1) + op_int(0) + TUPLE1 * 1_000_000 + op_int(1) + SETITEM,  # a key 10^6 deep
        MARK * 1_000_000,
        EMPTY_LIST * 1_000 + APPEND * 999,
        op_int(0) + (MARK + op_int(1)) * 200 + TUPLE * 200,
    ],
    ids=["tuple-key-1e6-deep", "marks-1e6-deep", "lists-1000-deep", "tuples-200-deep"],
)
def test_containers_nested_beyond_the_limit_are_refused_before_unpickling(tmp_path, nesting):
    path = torch_zip_with_pickle(tmp_path / "deep.pt", PROTO + nesting + STOP)

    assert f"nested more than {pickle_budget.MAX_NESTING} deep" in refusal(path)


def test_bytearray_of_a_huge_size_is_refused_without_allocating(tmp_path):
    path = torch_zip_with_pickle(
        tmp_path / "bytearray.pt", in_dict(call("builtins.bytearray", op_int(10**7)))
    )

    tracemalloc.start()
    message = refusal(path)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()

    assert "builtins.bytearray" in message and "memory bomb" in message
    assert peak < 5_000_000


@pytest.mark.parametrize(
    ("payload", "words"),
    [
        (call("torch.storage.UntypedStorage", op_int(10**9)), "torch.storage.UntypedStorage"),
        (call("torch.FloatTensor", op_int(10**9)), "torch.FloatTensor"),
        (
            op_global("torch.FloatTensor") + MARK + op_int(10**9) + TUPLE + NEWOBJ,
            "creates a torch.FloatTensor",
        ),
        (call("_codecs.encode", op_str("\U0010ffff" * 100), op_str("unicode_escape")), "'latin1'"),
        (call("builtins.set", call("_codecs.encode", op_str("ab"), op_str("latin1"))), "builtins.set"),
        (call("collections.OrderedDict", op_int(5), op_int(6)), "collections.OrderedDict"),
        (
            call(
                "torch._tensor._rebuild_from_type_v2",
                op_global("builtins.bytearray"),
                op_global("torch.Tensor"),
                MARK + op_int(10**9) + TUPLE,
                EMPTY_DICT,
            ),
            "not a tensor rebuild",
        ),
    ],
    ids=[
        "untyped-storage",
        "tensor-class",
        "newobj-tensor-class",
        "encode-expanding",
        "set-of-bytes",
        "odict",
        "rebuild-from-type-calls-bytearray",
    ],
)
def test_calls_torch_save_never_makes_are_refused_naming_the_call(tmp_path, payload, words):
    path = torch_zip_with_pickle(tmp_path / "call.pt", in_dict(payload))

    message = refusal(path)

    assert "refused pickle" in message and words in message


def test_one_big_list_fetched_again_and_again_through_the_memo_is_refused(tmp_path):
    big = EMPTY_LIST + op_put(1) + MARK + op_int(7) * 10_000 + b"e"
    calls = (op_get(0) + op_get(1) + TUPLE1 + REDUCE + APPEND) * 2_100  # set(big) 2,100 times
    data = PROTO + op_global("builtins.set") + op_put(0) + big + EMPTY_LIST + calls + STOP
    path = torch_zip_with_pickle(tmp_path / "fanout.pt", data)

    assert "a hang bomb" in refusal(path)


def test_more_opcodes_than_the_budget_are_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(pickle_budget, "MAX_OPCODES", 1_000)
    path = torch_zip_with_pickle(tmp_path / "long.pt", PROTO + EMPTY_LIST + (op_int(1) + APPEND) * 600 + STOP)

    assert "more than 1,000 opcodes" in refusal(path)


def test_a_tensor_with_more_dimensions_than_any_real_one_is_refused(tmp_path):
    size = MARK + op_int(1) * 100 + TUPLE
    path = torch_zip_with_tensor(
        tmp_path / "dims.pt", call("torch._utils._rebuild_tensor_v2", *rebuild_args(size, size))
    )

    assert f"more than {pickle_budget.MAX_TENSOR_DIMS} dimensions" in refusal(path)


@pytest.mark.parametrize("inside", [False, True], ids=["rebuild", "rebuild-from-type"])
def test_a_negative_stride_is_refused_as_torch_load_refuses_it(tmp_path, inside):
    # torch.load refuses it; a meta tensor would silently take contiguous strides, reading as what it is not
    args = rebuild_args(MARK + op_int(4) + TUPLE, MARK + op_int(-1) + TUPLE)
    value = call("torch._utils._rebuild_tensor_v2", *args)
    if inside:
        rebuild = op_global("torch._utils._rebuild_tensor_v2")
        value = call(
            "torch._tensor._rebuild_from_type_v2",
            rebuild,
            op_global("torch.Tensor"),
            MARK + b"".join(args) + TUPLE,
            EMPTY_DICT,
        )
    path = torch_zip_with_tensor(tmp_path / "negative.pt", value)

    assert "negative size, stride or offset" in refusal(path)


def test_the_same_tensor_with_a_positive_stride_reads_back(tmp_path):
    args = rebuild_args(MARK + op_int(4) + TUPLE, MARK + op_int(1) + TUPLE)
    path = torch_zip_with_tensor(tmp_path / "positive.pt", call("torch._utils._rebuild_tensor_v2", *args))

    assert torch.equal(slimtorch.open(path).get("x"), torch.zeros(4))


def test_the_pre_scan_covers_legacy_files_and_plain_pickles(tmp_path):
    deep = PROTO + MARK * 1_000 + STOP
    legacy = legacy_with_pickle(tmp_path / "legacy.pt", deep)
    plain = tmp_path / "plain.pkl"
    plain.write_bytes(deep)

    assert "nested more than" in refusal(legacy)
    assert "nested more than" in refusal(plain)


def test_what_torch_save_writes_still_passes_the_pre_scan(tmp_path):
    """The budget refuses bombs, not checkpoints: every container and call torch.save writes reads back."""
    tagged = torch.zeros(3, dtype=torch.int64)
    tagged.note = "kept"  # a tensor with attributes is pickled through _rebuild_from_type_v2
    checkpoint = {
        "model": OrderedDict(w=torch.nn.Parameter(torch.ones(2, 3)), b=tagged),
        "ids": {1, 2, 3},
        "blob": b"\x00\x01" * 100,
        "buffer": bytearray(b"abc"),
        "counts": Counter("hello"),
        "z": complex(1, 2),
        "shape": torch.Size([2, 3]),
        "device": torch.device("cpu"),
        "nested": {"a": [{"b": (1, 2.5, "c")}] * 3},
    }
    path = tmp_path / "ok.pt"
    torch.save(checkpoint, path)

    source = slimtorch.open(path)

    assert source.names() == ["model.w", "model.b"]
    assert torch.equal(source.get("model.w"), torch.ones(2, 3))


def test_a_truncated_torchscript_pickle_is_one_line(tmp_path):
    path = script_archive(tmp_path / "cut.pt", PROTO + MARK, {"__torch__.py": b""})

    assert "corrupt pickle" in refusal(path)


def test_torchscript_with_more_classes_than_the_limit_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(pickled, "MAX_SCRIPT_CLASSES", 10)
    items = b"".join(op_str(f"m{i}") + script_object(f"__torch__.m{i}") for i in range(11))
    data = PROTO + script_object("__torch__.root", EMPTY_DICT + MARK + items + SETITEMS) + STOP
    path = script_archive(tmp_path / "classes.pt", data, {"__torch__.py": b""})

    assert "more than 10 TorchScript classes" in refusal(path)


def test_objects_times_allowed_globals_beyond_the_budget_are_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(pickle_budget, "MAX_ALLOWLIST_WORK", 1_000)
    items = b"".join(op_str(f"m{i}") + script_object(f"__torch__.m{i % 20}") for i in range(200))
    data = PROTO + script_object("__torch__.root", EMPTY_DICT + MARK + items + SETITEMS) + STOP
    path = script_archive(tmp_path / "objects.pt", data, {"__torch__.py": b""})

    assert "allowed globals (a hang bomb?)" in refusal(path)


def test_torchscript_code_decoding_far_beyond_the_archive_is_refused(tmp_path, monkeypatch):
    # Each file passes alone, within the slack allowed on top of 64x (64 MiB, made 1 MB for a small test);
    # all together decode to 4 MB from a 10 KB archive, as 100 files of 10 MB would from 1 MB.
    monkeypatch.setattr(untrusted, "EXPANSION_SLACK", 1_000_000)
    blank = b" " * 200_000
    items = b"".join(op_str(f"m{i}") + script_object(f"__torch__.m{i}") for i in range(20))
    data = PROTO + script_object("__torch__.root", EMPTY_DICT + MARK + items + SETITEMS) + STOP
    code = {f"__torch__/m{i}.py": blank for i in range(20)}
    path = script_archive(tmp_path / "code.pt", data, {"__torch__/root.py": b"", **code})

    assert "TorchScript code would decode" in refusal(path)


def test_a_pickle_of_another_protocol_is_read_without_a_warning_line(tmp_path, recwarn):
    path = torch_zip_with_pickle(tmp_path / "p3.pt", b"\x80\x03" + EMPTY_DICT + STOP)

    assert slimtorch.open(path).names() == []
    assert not [w for w in recwarn if "pickle protocol" in str(w.message)]


# -- 3. linear walks over the unpickled object -----------------------------------------------------------
def test_a_list_shared_by_many_names_is_looked_at_once(monkeypatch):
    checks = []
    original = pickled._is_scalar_sequence
    monkeypatch.setattr(pickled, "_is_scalar_sequence", lambda value: checks.append(1) or original(value))
    shared = list(range(1_000))

    flat = flatten({"all": [shared] * 5_000})

    assert len(flat.objects) == 5_000
    assert len(checks) == 4  # the outer list and `shared`, once in each pass (paths counted, then named)


def test_a_dict_shared_twice_on_every_level_is_refused_as_a_billion_laughs(tmp_path):
    value: object = torch.ones(4)
    for _ in range(40):
        value = {"a": value, "b": value}  # one tensor, 2**40 paths to it
    path = tmp_path / "laughs.pt"
    torch.save({"model": value}, path)

    assert "billion-laughs" in refusal(path)


def test_a_state_dict_saved_under_two_keys_is_still_read_once(tmp_path):
    state = {"w": torch.ones(2), "b": torch.zeros(2)}
    path = tmp_path / "twice.pt"
    torch.save({"model": state, "ema": state}, path)

    assert slimtorch.open(path).names() == ["model.w", "model.b"]


def test_the_summary_of_a_large_bytearray_never_prints_it_whole():
    tree = {"blob": bytearray(20_000_000), "n": 2**5000}
    tracemalloc.start()
    flat = flatten(tree)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()

    summaries = {o.name: o.summary for o in flat.objects}
    assert peak < 1_000_000 and all(len(s) <= 80 for s in summaries.values())
    assert summaries["n"] == "<an integer of 5,001 bits>"


def test_values_nested_deeper_than_the_limit_are_refused_not_named_quadratically():
    deep: list = [torch.ones(1)]
    for _ in range(1_000):
        deep = [deep]

    with pytest.raises(FormatError, match=f"more than {pickle_budget.MAX_NESTING} deep"):
        flatten({"deep": deep}, path="deep.pt")


def test_names_beyond_the_name_budget_are_refused(monkeypatch):
    monkeypatch.setattr(pickled, "MAX_NAME_CHARS", 10_000)
    long_key = "k" * 1_000

    with pytest.raises(FormatError, match="its names take more than 10,000 characters"):
        flatten({long_key: {str(i): i for i in range(20)}}, path="names.pt")


def test_plain_objects_walk_one_shared_list_a_bounded_number_of_times(monkeypatch):
    monkeypatch.setattr(objects, "MAX_TOTAL_VALUES", 300_000)
    shared = list(range(100_000))

    kept = plain_objects({f"run{i}": shared for i in range(50)}, max_bytes=100 * 2**20)

    assert list(kept.values) == ["run0", "run1"]  # each walk: the list and its items, 100,001 values
    assert "in all" in kept.dropped["run2"] and len(kept.dropped) == 48


def test_a_string_shared_by_many_entries_is_charged_for_its_length():
    text = "x" * 1_000_000  # 62,500 values' worth

    kept = plain_objects({f"t{i}": text for i in range(1_000)}, max_bytes=10**12)

    assert len(kept.values) == objects.MAX_TOTAL_VALUES // 62_501
    assert "too large" in kept.dropped[f"t{len(kept.values)}"] and "..." in kept.dropped


def test_short_repr_is_bounded_whatever_the_value():
    assert short_repr(list(range(10**6))) == "[0, 1, 2, 3, 4, 5, 6, 7, ...]"
    assert short_repr(torch.Size([2, 3])) == "Size([2, 3])"
    assert len(short_repr("x" * 10**6)) == 80


# -- 4. whatever the unpickled structure does wrong is one line ------------------------------------------
def test_parameter_state_that_shadows_a_tensor_method_is_a_format_error(tmp_path):
    parameter = torch.nn.Parameter(torch.ones(2))
    parameter.stride = 3  # pickled as the parameter's state, set back on it when unpickled
    path = tmp_path / "shadow.pt"
    torch.save({"w": parameter}, path)

    assert "state 'stride' that shadows a tensor method" in refusal(path)


def test_a_legacy_file_whose_magic_number_is_a_tensor_is_a_format_error(tmp_path):
    meta = call(
        "torch._utils._rebuild_meta_tensor_no_storage",
        op_global("torch.float32"),
        MARK + op_int(2) + TUPLE,
        MARK + op_int(1) + TUPLE,
        b"\x89",
    )
    path = tmp_path / "legacy.pt"  # the signature (the magic number's opcodes), then a tensor on top of it
    path.write_bytes(LEGACY_SIGNATURE + meta + STOP + pickle.dumps(1001, protocol=2))

    assert "wrong magic number" in refusal(path)


def test_a_storage_key_that_is_not_a_string_is_refused(tmp_path):
    storage = MARK + op_str("storage") + op_global("torch.FloatStorage") + EMPTY_LIST + op_str("cpu")
    path = torch_zip_with_pickle(tmp_path / "key.pt", in_dict(storage + op_int(1) + TUPLE + b"Q"))

    assert "storage key that is not a short string" in refusal(path)


# -- 5. --allow-global ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name",
    [
        "builtins.eval",
        "__builtin__.eval",
        "builtins.getattr",
        "os.system",
        "posix.system",
        "subprocess.Popen",
        "functools.partial",
        "operator.attrgetter",
        "importlib.import_module",
        "copyreg._reconstructor",
    ],
)
def test_the_refusal_never_suggests_allowing_what_runs_code(tmp_path, name):
    path = torch_zip_with_pickle(tmp_path / "evil.pt", in_dict(call(name, op_str("x"))))

    with pytest.raises(UnsafeCheckpointError) as refused:
        slimtorch.open(path)

    assert "--allow-global" not in str(refused.value)


def test_a_global_named_by_a_megabyte_line_is_refused_in_one_short_line(tmp_path):
    path = torch_zip_with_pickle(tmp_path / "long.pt", in_dict(op_global("m" * 1_000_000 + ".x")))

    assert len(refusal(path)) < 500 + len(str(path))


def test_a_placeholder_suggests_allowing_only_an_importable_class(tmp_path, recwarn):
    path = torch_zip_with_pickle(tmp_path / "path.pt", in_dict(call("pathlib.PosixPath", op_str("/data"))))
    slimtorch.open(path)
    assert "--allow-global pathlib.PosixPath" in str(recwarn.pop(slimtorch.PlaceholderWarning).message)

    # a class its module no longer has, and a module not installed: never suggested
    for name in ("pathlib.NoSuchPath", "nowhere.Thing"):
        path = torch_zip_with_pickle(tmp_path / f"{name}.pt", in_dict(call(name, op_str("x"))))
        with pytest.warns(slimtorch.PlaceholderWarning) as said:
            source = slimtorch.open(path)
        message = str(said[0].message)
        assert name in message and "--allow-global" not in message and "cannot be built" in message
        assert [o.type for o in source.objects] == [f"{name} (placeholder)"]


@pytest.mark.parametrize("name", ["builtins.eval", "os.system", "subprocess.Popen", "torch.hub.load"])
def test_allow_global_refuses_code_execution_primitives_in_one_line(tmp_path, capsys, name):
    path = tmp_path / "w.pt"
    torch.save({"w": torch.ones(2)}, path)

    assert main(["inspect", str(path), "--allow-global", name]) == 2
    err = capsys.readouterr().err.strip()
    assert "refused" in err and name in err and "\n" not in err
    assert f"--allow-global {name}" not in err  # not even quoted back, which reads as a suggestion


def test_allow_global_never_imports_a_module_from_the_current_directory(tmp_path, monkeypatch):
    marker = tmp_path / "imported"
    (tmp_path / "plantedmod.py").write_text(f"open({str(marker)!r}, 'w').close()\nclass Thing: pass\n")
    path = tmp_path / "w.pt"
    torch.save({"w": torch.ones(2)}, path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "path", ["", *sys.path])
    path_before = list(sys.path)

    with pytest.raises(SlimtorchError, match="cannot import"):
        slimtorch.open(path, allow_globals=["plantedmod.Thing"])

    assert not marker.exists() and "plantedmod" not in sys.modules
    assert sys.path == path_before


def test_allow_global_still_imports_an_installed_module(tmp_path):
    path = tmp_path / "with_decimal.pt"
    torch.save({"w": torch.ones(2), "price": Decimal("1.5")}, path)

    source = slimtorch.open(path, allow_globals=["decimal.Decimal"])

    assert source.names() == ["w"] and [o.summary for o in source.objects] == ["Decimal('1.5')"]


def test_a_tensor_under_the_empty_key_is_refused_and_a_lone_tensor_is_named_root(tmp_path) -> None:
    torch.save({"": torch.ones(2)}, tmp_path / "empty-key.pt")  # once it came back silently as "<root>"
    with pytest.raises(slimtorch.FormatError, match="empty key"):
        slimtorch.open(tmp_path / "empty-key.pt")
    torch.save(torch.ones(2), tmp_path / "one.pt")
    with slimtorch.open(tmp_path / "one.pt") as source:
        assert [info.name for info in source.infos()] == ["<root>"]
