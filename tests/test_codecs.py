"""Property tests for the codecs of the slim format (:mod:`slimtorch.format.codecs`).

Every chain the writer uses must give back what it was given: bit for bit for the lossless chains (except that
``sparse`` turns -0.0 into +0.0), and within the bound ``lossy.py`` documents for the lossy ones, for 0-d,
empty, odd-sized, non-contiguous, all-zero and zero-free tensors of every dtype the chain takes. Decoding must
answer parts that do not fit together with :class:`CodecError`, never with another exception or a wrong
tensor.

Tensors are made by torch from a hypothesis-drawn seed (a :class:`Case`), so a failure prints a case that
rebuilds the exact tensor.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import zstandard
from hypothesis import example, given, settings
from hypothesis import strategies as st

from slimtorch.format.codecs import CodecError, decode, encode
from slimtorch.format.codecs.entropy import MAX_RATIO

# Small budgets: the parametrized tests multiply them by chain x dtype, and explicit examples come on top.
FEW = settings(max_examples=8, deadline=None, database=None)
SOME = settings(max_examples=40, deadline=None, database=None)

INT4_GROUPS = (32, 64, 128, 256)
INT8_GROUPS = (1, 7, 32)  # 7 and 32 leave short last groups on most rows

LOSSLESS_CHAINS: dict[str, list] = {
    "raw": [],
    "bytes": ["bytes"],
    "sparse": ["sparse"],
    "zstd": ["zstd"],
    "sparse+zstd": ["sparse", "zstd"],
    "bytes+zstd": ["bytes", "zstd"],
}
LOSSY_CHAINS: dict[str, list] = {
    "cast-fp16": [("cast", {"to": "float16"})],
    "cast-bf16": [("cast", {"to": "bfloat16"})],
    "cast-fp16+sparse": [("cast", {"to": "float16"}), "sparse"],
    "cast-bf16+sparse+zstd": [("cast", {"to": "bfloat16"}), "sparse", "zstd"],
    "int8": ["int8"],
    "int8+sparse": ["int8", "sparse"],
    "int8+sparse+zstd": ["int8", "sparse", "zstd"],
    **{f"int8-g{g}": [("int8", {"group_size": g})] for g in INT8_GROUPS},
    "int8-g7+sparse": [("int8", {"group_size": 7}), "sparse"],
    **{f"int4-g{g}": [("int4", {"group_size": g})] for g in INT4_GROUPS},
    **{f"int4-g{g}-flat": [("int4", {"group_size": g, "flat": True})] for g in INT4_GROUPS},
    **{f"sparse+int4-g{g}": ["sparse", ("int4", {"group_size": g})] for g in INT4_GROUPS},
    "int4-g64+zstd": [("int4", {"group_size": 64}), "zstd"],
}
ALL_CHAINS = {**LOSSLESS_CHAINS, **LOSSY_CHAINS}

FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
FLOAT8 = [torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz]
OTHER_DTYPES = [
    torch.float8_e8m0fnu,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.uint16,
    torch.uint32,
    torch.uint64,
    torch.bool,
    torch.complex64,
    torch.complex128,
]
LOSSLESS_DTYPES = FLOATS + FLOAT8 + OTHER_DTYPES
NO_NEGATIVE_ZERO = {torch.float8_e8m0fnu, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz}

FP32_MAX = torch.finfo(torch.float32).max
# What rounding the decoded value to the input's dtype may add: relative (float64 gets float32's, since the
# integer codecs compute in float32) and absolute (half the smallest subnormal).
REL_ROUNDING = {
    torch.float16: 2.0**-11,
    torch.bfloat16: 2.0**-8,
    torch.float32: 2.0**-24,
    torch.float64: 2.0**-24,
}
ABS_ROUNDING = {
    torch.float16: 2.0**-25,
    torch.bfloat16: 2.0**-134,
    torch.float32: 2.0**-150,
    torch.float64: 0.0,
}
CAST_REL = {"float16": 2.0**-11, "bfloat16": 2.0**-8}
FLOAT32_FLOOR = 2.0**-140  # lossy.py: what float32 cannot resolve near zero
ARITHMETIC = 2.0**-20  # float32 rounding inside int8 / int4, relative to the row's or group's largest value

# -- building tensors --------------------------------------------------------------------------------------
LAYOUTS = ("contiguous", "transposed", "strided", "expanded")
FILLS = ("dense", "sparse", "zeros", "no-zeros")
EDGE_SHAPES = [(), (0,), (0, 5), (3, 0), (1,), (7,), (13,), (3, 5, 7), (2, 33), (4, 65), (2, 300), (1, 1, 9)]


@dataclass(frozen=True)
class Case:
    """How to build one test tensor: its shape, memory layout, where its zeros are, and its random seed."""

    shape: tuple[int, ...]
    layout: str = "contiguous"
    fill: str = "dense"
    density: float = 0.5  # share of non-zeros when fill == "sparse"
    seed: int = 0
    magnitude: str = "unit"  # lossy only: unit | scaled | mixed | bits
    exponent: int = 0  # lossy, magnitude == "scaled": values are randn * 2**exponent


@st.composite
def cases(draw) -> Case:
    return Case(
        shape=draw(
            st.one_of(st.sampled_from(EDGE_SHAPES), st.lists(st.integers(0, 7), max_size=4).map(tuple))
        ),
        layout=draw(st.sampled_from(LAYOUTS)),
        fill=draw(st.sampled_from(FILLS)),
        density=draw(st.floats(0.0, 1.0)),
        seed=draw(st.integers(0, 2**32 - 1)),
        magnitude=draw(st.sampled_from(("unit", "scaled", "mixed", "bits"))),
        exponent=draw(st.integers(-200, 200)),
    )


EDGE_CASES = [
    Case(()),
    Case((0,)),
    Case((0, 5), layout="transposed"),
    Case((3, 0), layout="strided"),
    Case((3, 5, 7), layout="transposed", fill="zeros"),
    Case((5, 13), layout="strided", fill="no-zeros"),
    Case((4, 33), layout="expanded", fill="sparse", density=0.3),
    Case((2, 300), fill="sparse", density=0.1, seed=1),
]


def with_edge_cases(test):
    """Run ``test`` on every edge case (0-d, empty, odd sizes, non-contiguous, all-zero, no-zero) too."""
    for case in reversed(EDGE_CASES):
        test = example(case=case)(test)
    return test


def build(case: Case, make) -> torch.Tensor:
    """A tensor of ``case.shape`` laid out as ``case.layout``; ``make(shape, gen)`` makes a contiguous one."""
    gen = torch.Generator().manual_seed(case.seed)
    shape = case.shape
    if case.layout == "transposed" and len(shape) >= 2:
        x = make(shape[::-1], gen).permute(*reversed(range(len(shape))))
    elif case.layout == "strided" and shape:
        x = make((*shape[:-1], 2 * shape[-1] + 1), gen)[..., 1::2]
    elif case.layout == "expanded" and shape:
        x = make((1, *shape[1:]), gen).expand(shape)
    else:
        x = make(shape, gen)
    assert tuple(x.shape) == shape
    return x


def random_bits(case: Case, dtype: torch.dtype) -> torch.Tensor:
    """Random bit patterns (NaN, inf, subnormals, -0.0 included), with zeros placed as ``case.fill`` says."""

    def make(shape, gen):
        n = math.prod(shape)
        if dtype == torch.bool:
            p = {"zeros": 0.0, "no-zeros": 1.0, "sparse": case.density, "dense": 0.5}[case.fill]
            return (torch.rand(n, generator=gen) < p).reshape(shape)
        raw = torch.randint(0, 256, (n, dtype.itemsize), dtype=torch.uint8, generator=gen)
        if case.fill == "no-zeros":
            raw[:, 0] |= 1  # the lowest byte odd: no element is 0 or -0.0
        elif case.fill in ("zeros", "sparse"):
            # Zero each float on its own, so that a complex number may have just one half zero.
            width = dtype.itemsize // (2 if dtype.is_complex else 1)
            floats = raw.reshape(-1, width)
            zero = torch.rand(floats.shape[0], generator=gen) >= (
                case.density if case.fill == "sparse" else 0.0
            )
            floats[zero] = 0
            if dtype.is_floating_point or dtype.is_complex:  # half of them -0.0: the sign bit is the top one
                floats[zero & (torch.rand(floats.shape[0], generator=gen) < 0.5), -1] = 0x80
        return raw.view(dtype).reshape(shape)

    return build(case, make)


def finite_floats(case: Case, dtype: torch.dtype) -> torch.Tensor:
    """Finite values of ``dtype``: unit normal, scaled by 2**exponent, mixed scales, or random finite bits."""
    lo, hi = (-24, 12) if dtype == torch.float16 else (-200, 200) if dtype == torch.float64 else (-130, 120)

    def make(shape, gen):
        n = math.prod(shape)
        if case.magnitude == "bits":
            raw = torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=gen).view(dtype)
            v = torch.where(torch.isfinite(raw), raw, torch.zeros((), dtype=dtype)).double()
        else:
            v = torch.randn(n, generator=gen, dtype=torch.float64)
            if case.magnitude == "scaled":
                v *= 2.0 ** min(max(case.exponent, lo), hi)
            elif case.magnitude == "mixed":
                v *= 2.0 ** torch.randint(max(lo, -20), min(hi, 20) + 1, (n,), generator=gen).double()
        if case.fill in ("zeros", "sparse"):
            zero = torch.rand(n, generator=gen) >= (case.density if case.fill == "sparse" else 0.0)
            signed_zero = torch.where(torch.rand(n, generator=gen) < 0.5, -0.0, 0.0).double()
            v = torch.where(zero, signed_zero, v)
        x = v.to(dtype)
        if case.fill == "no-zeros":
            x = torch.where(x == 0, torch.ones((), dtype=dtype), x)
        return x.reshape(shape)

    return build(case, make)


def test_layouts_really_are_non_contiguous() -> None:
    for layout in ("transposed", "strided", "expanded"):
        for make in (random_bits, finite_floats):
            x = make(Case((3, 5, 7), layout=layout), torch.float32)
            assert x.shape == (3, 5, 7) and not x.is_contiguous(), layout


# -- comparing ---------------------------------------------------------------------------------------------
def bytes_of(t: torch.Tensor) -> torch.Tensor:
    # Through a fresh tensor: an empty one sliced with a step keeps its stride and cannot be viewed as bytes.
    return torch.empty(t.numel(), dtype=t.dtype).copy_(t.reshape(-1)).view(torch.uint8)


def with_zeros_unsigned(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes with every zero element made +0.0, like sparse does (a complex number is zero when both
    its halves are ±0.0; a -0.0 half of a non-zero one is kept)."""
    b = bytes_of(t).clone()
    if t.dtype in NO_NEGATIVE_ZERO or not (t.dtype.is_floating_point or t.dtype.is_complex):
        return b
    halves = 2 if t.dtype.is_complex else 1
    floats = b.reshape(t.numel(), halves, t.dtype.itemsize // halves)
    zero = ((floats[..., :-1] == 0).all(dim=2) & ((floats[..., -1] & 0x7F) == 0)).all(dim=1)
    floats[zero] = 0
    return b


def round_trip(x: torch.Tensor, chain: list) -> torch.Tensor:
    """Encode and decode ``x``, checking that neither touches its input."""
    before = bytes_of(x).clone()
    enc = encode(x, chain)
    parts = {role: p.clone() for role, p in enc.parts.items()}
    y = decode(enc.parts, enc.stages, x.dtype, tuple(x.shape))
    assert torch.equal(bytes_of(x), before), "encode changed its input"
    for role, p in parts.items():
        assert p.dtype == enc.parts[role].dtype and torch.equal(bytes_of(p), bytes_of(enc.parts[role])), (
            f"decode changed the part {role!r}"
        )
    assert y.dtype == x.dtype and tuple(y.shape) == tuple(x.shape)
    return y


# -- lossless: bit for bit ---------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", LOSSLESS_DTYPES, ids=str)
@pytest.mark.parametrize("chain_id", LOSSLESS_CHAINS)
@FEW
@with_edge_cases
@given(case=cases())
def test_lossless_chain_gives_back_every_bit(chain_id: str, dtype: torch.dtype, case: Case) -> None:
    x = random_bits(case, dtype)
    y = round_trip(x, LOSSLESS_CHAINS[chain_id])
    # sparse stores -0.0 as a zero; everything else (NaN payloads, inf, subnormals) must be kept exactly.
    want = with_zeros_unsigned(x) if "sparse" in chain_id else bytes_of(x)
    assert torch.equal(bytes_of(y), want)


# -- lossy: within the documented bound --------------------------------------------------------------------
def _spec(item) -> tuple[str, dict]:
    return (item, {}) if isinstance(item, str) else (item[0], dict(item[1]))


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(x.shape[0], math.prod(x.shape[1:])) if x.dim() >= 2 else x.reshape(1, x.numel())


def _with_rounding(base: torch.Tensor, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``base`` plus the decoded value's rounding to ``dtype`` and float32's floor near zero."""
    return base + REL_ROUNDING[dtype] * (x.abs() + base) + ABS_ROUNDING[dtype] + FLOAT32_FLOOR


def int8_bound(x: torch.Tensor, dtype: torch.dtype, group_size: int | None = None) -> torch.Tensor:
    """|err| <= scale / 2, scale = max|row| / 127 (rows of x.reshape(shape[0], -1); 0-d / 1-d: one row), or
    max|group| / 127 of the value's group of ``group_size`` along its row."""
    rows = _rows(x)
    if rows.numel() == 0:
        return torch.zeros(x.shape, dtype=torch.float64)
    size = rows.shape[1] if group_size is None else group_size
    pad = -rows.shape[1] % size
    groups = F.pad(rows.abs(), (0, pad)).reshape(rows.shape[0], -1, size)
    top = groups.amax(dim=2).repeat_interleave(size, dim=1)[:, : rows.shape[1]]
    base = top / 127 / 2 + ARITHMETIC * top
    return _with_rounding(base, rows, dtype).reshape(x.shape)


def int4_bound(x: torch.Tensor, dtype: torch.dtype, group_size: int, flat: bool) -> torch.Tensor:
    """|err| <= scale / 2 + 2**-10 max|group|, scale = (max - min) / 15, groups of consecutive row values."""
    rows = x.reshape(1, x.numel()) if flat or x.dim() < 2 else _rows(x)
    if rows.numel() == 0:
        return torch.zeros(x.shape, dtype=torch.float64)
    n_rows, cols = rows.shape
    pad = -cols % group_size
    grouped = (n_rows, (cols + pad) // group_size, group_size)
    high = F.pad(rows, (0, pad), value=-math.inf).reshape(grouped).amax(dim=2)
    low = F.pad(rows, (0, pad), value=math.inf).reshape(grouped).amin(dim=2)
    top = torch.maximum(high.abs(), low.abs())
    base = (high - low) / 15 / 2 + (2.0**-10 + ARITHMETIC) * top
    base = base.repeat_interleave(group_size, dim=1)[:, :cols]
    return _with_rounding(base, rows, dtype).reshape(x.shape)


def sparse_int4_bound(x: torch.Tensor, dtype: torch.dtype, group_size: int) -> torch.Tensor:
    """Zeros come back exactly; the non-zeros, in order, are one row for int4."""
    flat = x.reshape(-1)
    kept = flat != 0
    bound = torch.zeros_like(flat)
    bound[kept] = int4_bound(flat[kept], dtype, group_size, flat=True)
    return bound.reshape(x.shape)


def cast_bound(x: torch.Tensor, dtype: torch.dtype, to: str) -> torch.Tensor:
    """Round to nearest in ``to``: relative 2**-11 / 2**-8, absolute half its smallest subnormal."""
    target = getattr(torch, to)
    tiny = torch.finfo(target).smallest_normal * torch.finfo(target).eps / 2
    base = torch.clamp(CAST_REL[to] * x.abs(), min=tiny)
    return base + REL_ROUNDING[dtype] * (x.abs() + base) + ABS_ROUNDING[dtype]


def lossy_bound(x: torch.Tensor, chain: list) -> torch.Tensor:
    """The documented per-element bound for ``chain``, computed in float64 from the input like the codec."""
    names = [_spec(item) for item in chain]
    x64 = x.double()
    for i, (name, options) in enumerate(names):
        if name == "cast":
            return cast_bound(x64, x.dtype, options["to"])
        if name == "int8":
            return int8_bound(x64, x.dtype, options.get("group_size"))
        if name == "int4":
            group_size = options.get("group_size", 128)
            if i and names[i - 1][0] == "sparse":
                return sparse_int4_bound(x64, x.dtype, group_size)
            return int4_bound(x64, x.dtype, group_size, options.get("flat", False))
    raise AssertionError(f"no lossy stage in {chain}")


def may_refuse(x: torch.Tensor, chain: list) -> bool:
    """Whether the codecs are documented to refuse ``x``: values they would round or compute to infinity."""
    largest = float(x.double().abs().max()) if x.numel() else 0.0
    name, options = next(_spec(item) for item in chain if _spec(item)[0] in ("cast", "int8", "int4"))
    if name == "cast":
        # Beyond the target's range, or (float16 to bfloat16) rounded beyond the input's own range.
        limit = min(torch.finfo(getattr(torch, options["to"])).max, torch.finfo(x.dtype).max)
        return largest >= limit * (1 - 2.0**-8)
    if name == "int8":
        return largest > FP32_MAX
    return largest > FP32_MAX / 2 * (1 - 2.0**-20)  # int4: a group may span more than float32's range


def assert_within(y: torch.Tensor, x: torch.Tensor, bound: torch.Tensor) -> None:
    assert bool(torch.isfinite(y).all()), f"finite input decoded to {y}"
    err = (y.double() - x.double()).abs()
    over = (err > bound).reshape(-1)
    if bool(over.any()):
        i = int(over.nonzero()[0])
        flat_x, flat_y = x.reshape(-1), y.reshape(-1)
        raise AssertionError(
            f"element {i}: x={float(flat_x[i])!r} decoded to {float(flat_y[i])!r}, "
            f"error {float(err.reshape(-1)[i])!r} > bound {float(bound.reshape(-1)[i])!r}"
        )


@pytest.mark.slow
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("chain_id", LOSSY_CHAINS)
@FEW
@with_edge_cases
@given(case=cases())
def test_lossy_chain_stays_within_its_documented_bound(chain_id: str, dtype: torch.dtype, case: Case) -> None:
    chain = LOSSY_CHAINS[chain_id]
    x = finite_floats(case, dtype)
    try:
        y = round_trip(x, chain)
    except CodecError:
        assert may_refuse(x, chain), "refused a tensor the codec is documented to take"
        return
    assert_within(y, x, lossy_bound(x, chain))


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@SOME
@given(case=cases())
def test_int8_error_is_at_most_half_a_row_scale(dtype: torch.dtype, case: Case) -> None:
    x = finite_floats(case, dtype)
    if x.dtype == torch.float64 and x.numel() and float(x.abs().max()) > FP32_MAX:
        with pytest.raises(CodecError):
            encode(x, ["int8"])
        return
    assert_within(round_trip(x, ["int8"]), x, int8_bound(x.double(), dtype))


def test_int8_one_scale_gives_every_row_the_largest_values_scale_in_the_same_format() -> None:
    x = torch.randn(6, 10, generator=torch.Generator().manual_seed(0)) * torch.arange(1, 7).unsqueeze(1)
    rows, one = encode(x, ["int8"]), encode(x, [("int8", {"one_scale": True})])
    assert one.stages == rows.stages  # nothing new in the metadata: any reader decodes it
    scale = one.parts["scale"]
    assert bool((scale == float(x.abs().max()) / 127).all())
    assert float((decode(one.parts, one.stages, x.dtype, x.shape) - x).abs().max()) <= float(scale[0]) / 2
    assert not torch.equal(rows.parts["scale"], scale)  # rows of unlike ranges: a scale per row differs


# -- int8 with a scale per group ---------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", [(6, 40), (5, 3, 3, 3)], ids=["2d", "4d"])
@pytest.mark.parametrize("group_size", [1, 7, 16, 64])
def test_int8_groups_keep_a_float32_scale_per_group_of_a_row_and_err_by_half_of_it(
    shape: tuple[int, ...], dtype: torch.dtype, group_size: int
) -> None:
    rows, cols = shape[0], math.prod(shape[1:])  # 40 and 27 columns: the last group of a row is short
    ranges = torch.linspace(0.01, 3, cols)  # groups of unlike ranges, so their scales differ
    x = (
        (torch.randn(rows, cols, generator=torch.Generator().manual_seed(0)) * ranges)
        .reshape(shape)
        .to(dtype)
    )
    enc = encode(x, [("int8", {"group_size": group_size})])
    name = str(dtype).removeprefix("torch.")
    assert enc.stages == [{"codec": "int8", "dtype": name, "shape": list(shape), "group_size": group_size}]
    q, scale = enc.parts["q"], enc.parts["scale"]
    groups = math.ceil(cols / group_size)
    assert q.dtype == torch.int8 and q.shape == x.shape and int(q.abs().max()) <= 127
    assert scale.dtype == torch.float32 and tuple(scale.shape) == (rows, groups)
    padded = F.pad(_rows(x).double().abs(), (0, groups * group_size - cols)).reshape(rows, groups, -1)
    want = padded.amax(dim=2).float().double() / 127
    assert torch.allclose(scale.double(), want, rtol=2.0**-21, atol=2.0**-149)
    y = decode(enc.parts, enc.stages, dtype, shape)
    assert_within(y, x, int8_bound(x.double(), dtype, group_size))
    if groups > 1:  # a group of small values steps finer than the row's largest value would let it
        rows_error = (round_trip(x, ["int8"]).double() - x.double()).norm()
        assert (y.double() - x.double()).norm() < rows_error


@SOME
@given(case=cases(), dtype=st.sampled_from(FLOATS), group_size=st.sampled_from((1, 3, 7, 32, 1000)))
def test_int8_error_is_at_most_half_its_groups_scale(case: Case, dtype: torch.dtype, group_size: int) -> None:
    x = finite_floats(case, dtype)
    chain = [("int8", {"group_size": group_size})]
    try:
        y = round_trip(x, chain)
    except CodecError:
        assert may_refuse(x, chain)
        return
    assert_within(y, x, int8_bound(x.double(), dtype, group_size))


@pytest.mark.parametrize("group_size", [None, 7], ids=["rows", "groups"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_int8_measure_gives_the_error_of_what_decode_gives_a_block_at_a_time(
    group_size: int | None, dtype: torch.dtype, monkeypatch
) -> None:
    from slimtorch.format.codecs import lossy

    monkeypatch.setattr(lossy, "ROW_BLOCK_ELEMENTS", 64)  # a row a block: 9 blocks
    x = (torch.randn(9, 50, generator=torch.Generator().manual_seed(1)) * torch.linspace(0.1, 4, 50)).to(
        dtype
    )
    stats = lossy.ErrorStats()
    grouped = {"group_size": group_size} if group_size else {}
    enc = encode(x, [("int8", {"measure": stats, **grouped})])
    diff = decode(enc.parts, enc.stages, dtype, x.shape).float() - x.float()
    largest, relative = stats.result
    assert stats.blocks == 9 and largest == float(diff.abs().max())
    assert relative == pytest.approx(float(diff.norm() / x.float().norm()), rel=1e-5)


def test_int8_with_a_scale_per_row_records_no_group_size_and_reads_as_before() -> None:
    x = torch.randn(6, 40)
    rows = encode(x, ["int8"])
    assert rows.stages == [{"codec": "int8", "dtype": "float32", "shape": [6, 40]}]
    assert tuple(rows.parts["scale"].shape) == (6,)
    column = {**rows.parts, "scale": rows.parts["scale"].reshape(6, 1)}  # compressed-tensors' column
    assert torch.equal(decode(column, rows.stages, x.dtype, x.shape), round_trip(x, ["int8"]))
    whole = encode(x, [("int8", {"group_size": 40})])  # one group a row: the same scales, as (rows, 1)
    assert torch.equal(whole.parts["scale"], rows.parts["scale"].reshape(6, 1))
    assert torch.equal(whole.parts["q"], rows.parts["q"])


@pytest.mark.parametrize("bad", [0, -1, True, "8", 8.0])
def test_int8_encode_refuses_a_group_size_that_is_not_a_positive_int(bad: object) -> None:
    with pytest.raises(CodecError, match="group size"):
        encode(torch.randn(4, 16), [("int8", {"group_size": bad})])


def test_int8_takes_one_scale_or_a_scale_per_group_not_both() -> None:
    with pytest.raises(CodecError, match="not both"):
        encode(torch.randn(4, 16), [("int8", {"group_size": 8, "one_scale": True})])


@pytest.mark.parametrize("bad", [0, -1, True, False, "8", 8.0, None, [8]])
def test_int8_decode_refuses_a_recorded_group_size_that_is_not_a_positive_int(bad: object) -> None:
    _, enc = _sample([("int8", {"group_size": 8})])
    _refused(enc.parts, [{**enc.stages[0], "group_size": bad}], match="group size")


def test_decode_refuses_int8_group_scales_that_do_not_fit_the_groups() -> None:
    x, enc = _sample([("int8", {"group_size": 8})])
    scale = enc.parts["scale"]  # (6, 5)
    for bad in (
        scale[:, :-1],
        torch.cat([scale, scale[:, :1]], dim=1),
        scale[:-1],
        scale[:, 0],  # a scale per row under a stage with groups
        scale.reshape(-1),
        scale.t().contiguous(),
        scale.double(),
        scale.half(),
    ):
        _refused({**enc.parts, "scale": bad}, enc.stages)
    per_row = {k: v for k, v in enc.stages[0].items() if k != "group_size"}
    _refused(enc.parts, [per_row])  # scales of groups read as scales of rows: refused, not misread
    _refused(enc.parts, [{**enc.stages[0], "group_size": 16}])  # 3 groups a row, not 5
    # a size beyond every row is one group a row: nothing is sized by the number a file gives
    whole = encode(x, [("int8", {"group_size": 40})])
    huge = [{**whole.stages[0], "group_size": 1 << 62}]
    assert torch.equal(decode(whole.parts, huge, x.dtype, x.shape), round_trip(x, ["int8"]))


STAGES_ON_META = [
    "int8",
    ("int8", {"one_scale": True}),
    ("int8", {"group_size": 7}),
    ("int8", {"group_size": 64}),
    ("int4", {"group_size": 32, "flat": False}),
    ("int4", {"group_size": 32, "flat": True}),
    ("int4", {"group_size": 64, "symmetric": True}),
    ("int4", {"group_size": 32, "integer_zero": True}),
]


@pytest.mark.parametrize("item", STAGES_ON_META, ids=str)
@pytest.mark.parametrize("shape", [(6, 40), (5, 3, 3, 3), (70,), (4, 0)], ids=str)
def test_encoded_on_meta_has_the_parts_and_the_stage_that_encode_makes(item, shape) -> None:
    from slimtorch.format.codecs.lossy import encoded_on_meta

    x = torch.randn(shape, generator=torch.Generator().manual_seed(2), dtype=torch.bfloat16)
    real, empty = encode(x, [item]), encoded_on_meta(item, list(shape), torch.bfloat16)
    assert empty.stages == real.stages
    assert {r: (p.shape, p.dtype) for r, p in empty.parts.items()} == {
        r: (p.shape, p.dtype) for r, p in real.parts.items()
    }
    assert all(p.is_meta for p in empty.parts.values())


def test_encoded_on_meta_checks_options_as_encode_does() -> None:
    from slimtorch.format.codecs.lossy import encoded_on_meta

    for item in (("int8", {"group_size": 0}), ("int8", {"group_size": 8, "one_scale": True}), "sparse"):
        with pytest.raises(CodecError):
            encoded_on_meta(item, [4, 16], torch.float32)
    with pytest.raises(CodecError):
        encoded_on_meta(("int4", {"group_size": 33}), [4, 66], torch.float32)


@pytest.mark.parametrize("flat", [False, True], ids=["rows", "flat"])
@SOME
@given(case=cases(), group_size=st.sampled_from(INT4_GROUPS), dtype=st.sampled_from(FLOATS))
def test_int4_error_is_at_most_half_a_group_scale_plus_side_rounding(
    flat: bool, case: Case, group_size: int, dtype: torch.dtype
) -> None:
    x = finite_floats(case, dtype)
    chain = [("int4", {"group_size": group_size, "flat": flat})]
    try:
        y = round_trip(x, chain)
    except CodecError:
        assert may_refuse(x, chain)
        return
    assert_within(y, x, int4_bound(x.double(), dtype, group_size, flat))


def test_tiny_values_lose_at_most_what_float32_cannot_resolve() -> None:
    # float32 subnormals and float64 values below float32's range: the scale underflows to 0 or loses bits.
    for x in (
        torch.tensor([1e-45, 0.0, -3e-45]),
        torch.tensor([1e-44, 3e-45] * 20),
        torch.tensor([[1e-300, -5e-301], [1e-40, 3e-39]], dtype=torch.float64),
    ):
        assert_within(round_trip(x, ["int8"]), x, int8_bound(x.double(), x.dtype))
        assert_within(
            round_trip(x, [("int4", {"group_size": 32})]), x, int4_bound(x.double(), x.dtype, 32, False)
        )


def test_values_near_float32s_largest_decode_finite() -> None:
    top = FP32_MAX
    x = torch.tensor([[top, -top, top / 3], [top / 2, 1.0, -top / 2]])
    assert_within(round_trip(x, ["int8"]), x, int8_bound(x.double(), x.dtype))
    grouped = [("int8", {"group_size": 2})]
    assert_within(round_trip(x, grouped), x, int8_bound(x.double(), x.dtype, 2))
    positive = x.abs()
    assert_within(
        round_trip(positive, [("int4", {"group_size": 32})]),
        positive,
        int4_bound(positive.double(), x.dtype, 32, False),
    )


# -- what gets refused -------------------------------------------------------------------------------------
@pytest.mark.parametrize("chain_id", [c for c in LOSSY_CHAINS if "zstd" not in c])
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan], ids=["inf", "-inf", "nan"])
def test_lossy_codecs_refuse_inf_and_nan(chain_id: str, dtype: torch.dtype, bad: float) -> None:
    x = torch.randn(3, 40).to(dtype)
    x[1, 17] = bad
    with pytest.raises(CodecError, match="finite"):
        encode(x, LOSSY_CHAINS[chain_id])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("value", [65520.0, 1e5, 3e38])
def test_cast_to_float16_refuses_values_beyond_its_range(dtype: torch.dtype, value: float) -> None:
    x = torch.tensor([1.0, -value, 0.5], dtype=dtype)
    with pytest.raises(CodecError):
        encode(x, [("cast", {"to": "float16"})])


def test_cast_to_float16_keeps_its_largest_value() -> None:
    x = torch.tensor([65504.0, -65504.0, 65519.0])
    y = round_trip(x, [("cast", {"to": "float16"})])
    assert y.tolist() == [65504.0, -65504.0, 65504.0]


def test_cast_refuses_values_it_would_round_beyond_the_input_dtype() -> None:
    # float16's 65504 is 65536 in bfloat16, which would decode to inf in float16.
    with pytest.raises(CodecError):
        encode(torch.tensor([65504.0, 1.0], dtype=torch.float16), [("cast", {"to": "bfloat16"})])


@pytest.mark.parametrize("chain_id", ["int8", "int4-g32", "cast-bf16"])
def test_lossy_codecs_refuse_float64_values_beyond_float32s_range(chain_id: str) -> None:
    x = torch.tensor([1.0, 1e39, -2.0], dtype=torch.float64)
    with pytest.raises(CodecError):
        encode(x, LOSSY_CHAINS[chain_id])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_int4_refuses_a_group_spanning_more_than_float32s_range(dtype: torch.dtype) -> None:
    x = torch.tensor([-3e38, 3e38, 1.0], dtype=dtype)
    with pytest.raises(CodecError, match="range"):
        encode(x, [("int4", {"group_size": 32})])


@pytest.mark.parametrize("chain_id", ["cast-fp16", "int8", "int4-g32", "sparse+int4-g32"])
@pytest.mark.parametrize(
    "dtype", [torch.int32, torch.uint8, torch.bool, torch.complex64, *FLOAT8, torch.float8_e8m0fnu], ids=str
)
def test_lossy_codecs_refuse_what_is_not_a_16_to_64_bit_float(chain_id: str, dtype: torch.dtype) -> None:
    x = torch.ones(4, 8).to(dtype)
    with pytest.raises(CodecError):
        encode(x, LOSSY_CHAINS[chain_id])


@pytest.mark.parametrize(
    "chain",
    [
        ["gzip"],
        ["sparse", "lz4"],
        ["sparse", "sparse"],
        ["int8", "int8"],
        ["int8", "sparse", "sparse"],
        ["zstd", "sparse"],
        ["zstd", "zstd"],
        [("cast", {"to": "int8"})],
        [("cast", {"to": "float64"})],
        [("cast", {"to": "bogus"})],
        *([("int4", {"group_size": g})] for g in (0, 16, 31, 33, 258, 64.0, "64")),
    ],
    ids=repr,
)
def test_bad_chains_are_refused(chain: list) -> None:
    with pytest.raises(CodecError):
        encode(torch.randn(4, 64), chain)


def test_unknown_codec_in_the_metadata_is_refused() -> None:
    x = torch.randn(8)
    enc = encode(x, ["sparse"])
    with pytest.raises(CodecError, match="unknown codec"):
        decode(enc.parts, [{**enc.stages[0], "codec": "gzip"}], x.dtype, (8,))


# -- the parts are what the docs say -----------------------------------------------------------------------
@SOME
@given(case=cases(), dtype=st.sampled_from(LOSSLESS_DTYPES))
def test_sparse_stores_a_bitmask_of_the_nonzeros_and_their_values(case: Case, dtype: torch.dtype) -> None:
    x = random_bits(case, dtype)
    enc = encode(x, ["sparse"])
    assert set(enc.parts) == {"mask", "values"} and enc.chain == "sparse"
    mask, values = enc.parts["mask"], enc.parts["values"]
    n = x.numel()
    assert mask.dtype == torch.uint8 and tuple(mask.shape) == (math.ceil(n / 8),)
    # A zero is an element whose bytes are all zero once -0.0 is made +0.0.
    unsigned = with_zeros_unsigned(x).reshape(n, -1) if n else torch.zeros(0, 1, dtype=torch.uint8)
    nonzero = (unsigned != 0).any(dim=1).numpy() | (dtype == torch.float8_e8m0fnu)  # that one has no zero
    assert np.array_equal(np.unpackbits(mask.numpy(), count=n, bitorder="little").astype(bool), nonzero)
    assert values.dtype == dtype and values.dim() == 1 and values.numel() == int(nonzero.sum())


@SOME
@given(case=cases(), dtype=st.sampled_from(FLOATS))
def test_int8_stores_codes_in_minus_127_to_127_and_a_float32_scale_per_row(
    case: Case, dtype: torch.dtype
) -> None:
    x = finite_floats(case, dtype)
    if dtype == torch.float64 and x.numel() and float(x.abs().max()) > FP32_MAX:
        return
    enc = encode(x, ["int8"])
    assert set(enc.parts) == {"q", "scale"} and enc.chain == "int8"
    q, scale = enc.parts["q"], enc.parts["scale"]
    rows = _rows(x)
    assert q.dtype == torch.int8 and q.shape == x.shape
    assert scale.dtype == torch.float32 and tuple(scale.shape) == (rows.shape[0],)
    if q.numel():
        assert int(q.min()) >= -127 and int(q.max()) <= 127
    if rows.numel():
        want = rows.double().abs().amax(dim=1).float().double() / 127
        assert torch.allclose(scale.double(), want, rtol=2.0**-21, atol=2.0**-149)


@pytest.mark.parametrize("flat", [False, True], ids=["rows", "flat"])
@SOME
@given(case=cases(), group_size=st.sampled_from(INT4_GROUPS))
def test_int4_stores_packed_codes_and_a_scale_and_zero_per_group(
    flat: bool, case: Case, group_size: int
) -> None:
    x = finite_floats(case, torch.float32)
    try:
        enc = encode(x, [("int4", {"group_size": group_size, "flat": flat})])
    except CodecError:
        return
    assert set(enc.parts) == {"q4", "scale", "zero"} and enc.chain == "int4"
    n_rows, cols = (1, x.numel()) if flat or x.dim() < 2 else (x.shape[0], math.prod(x.shape[1:]))
    groups = math.ceil(cols / group_size)
    assert enc.parts["q4"].dtype == torch.uint8 and tuple(enc.parts["q4"].shape) == (
        n_rows,
        groups * group_size // 2,
    )
    for side in ("scale", "zero"):
        assert enc.parts[side].dtype in (torch.float16, torch.float32)
        assert tuple(enc.parts[side].shape) == (n_rows, groups)


def test_int4_keeps_scales_of_ordinary_weights_in_float16() -> None:
    enc = encode(torch.randn(16, 256), [("int4", {"group_size": 64})])
    assert enc.parts["scale"].dtype == enc.parts["zero"].dtype == torch.float16


@pytest.mark.parametrize("to", ["float16", "bfloat16"])
def test_cast_stores_one_tensor_of_the_target_dtype(to: str) -> None:
    x = torch.randn(5, 7)
    enc = encode(x.t(), [("cast", {"to": to})])
    assert (
        set(enc.parts) == {""} and enc.parts[""].dtype == getattr(torch, to) and enc.parts[""].shape == (7, 5)
    )


@pytest.mark.parametrize("dtype", LOSSLESS_DTYPES, ids=str)
def test_bytes_stores_the_raw_bytes_and_raw_stores_the_tensor(dtype: torch.dtype) -> None:
    x = random_bits(Case((3, 5), layout="transposed"), dtype)
    enc = encode(x, ["bytes"])
    assert set(enc.parts) == {"bytes"} and enc.parts["bytes"].dtype == torch.uint8
    assert torch.equal(enc.parts["bytes"], bytes_of(x))
    raw = encode(x)
    assert raw.chain == "raw" and raw.stages == [] and set(raw.parts) == {""}
    assert raw.parts[""].is_contiguous() and torch.equal(bytes_of(raw.parts[""]), bytes_of(x))


@SOME
@given(case=cases(), dtype=st.sampled_from(LOSSLESS_DTYPES), chain_id=st.sampled_from(list(ALL_CHAINS)))
def test_zstd_only_keeps_parts_it_shrinks_and_never_grows_an_encoding(
    case: Case, dtype: torch.dtype, chain_id: str
) -> None:
    chain = [item for item in ALL_CHAINS[chain_id] if item != "zstd"]
    x = random_bits(case, dtype) if chain_id in LOSSLESS_CHAINS else finite_floats(case, torch.float32)
    try:
        plain = encode(x, chain)
    except CodecError:
        return
    packed = encode(x, [*chain, "zstd"])
    stage = packed.stages[-1]
    assert stage["codec"] == "zstd" and packed.stages[:-1] == plain.stages
    assert set(packed.parts) == set(plain.parts)
    for role, part in packed.parts.items():
        if role in stage["parts"]:
            assert part.dtype == torch.uint8 and part.dim() == 1
            assert part.numel() <= 0.95 * plain.parts[role].numel() * plain.parts[role].element_size()
        else:
            assert part is plain.parts[role] or torch.equal(bytes_of(part), bytes_of(plain.parts[role]))
    assert packed.nbytes <= plain.nbytes


def test_zstd_leaves_incompressible_parts_alone() -> None:
    x = torch.randint(0, 256, (4096,), dtype=torch.uint8).view(torch.float32)
    enc = encode(x, ["zstd"])
    assert enc.stages[-1]["parts"] == {} and torch.equal(bytes_of(enc.parts[""]), bytes_of(x))


# -- sizes shrink where they should ------------------------------------------------------------------------
@SOME
@given(n=st.integers(800, 6000), seed=st.integers(0, 2**32 - 1))
def test_sparse_float32_with_90_percent_zeros_is_at_most_014x_dense(n: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = torch.zeros(n)
    kept = torch.randperm(n, generator=gen)[: n // 10]
    x[kept] = torch.randn(kept.numel(), generator=gen)
    x[kept[x[kept] == 0]] = 1.0
    assert encode(x, ["sparse"]).nbytes <= 0.14 * x.numel() * 4


def test_lossy_codecs_shrink_a_float32_weight_as_promised() -> None:
    w = torch.randn(64, 256)
    dense = w.numel() * 4
    assert encode(w, [("cast", {"to": "float16"})]).nbytes == dense // 2
    assert encode(w, ["int8"]).nbytes == w.numel() + 4 * 64  # codes + one float32 scale per row
    # 4 bits a value + float16 scale and zero per group of 128
    assert encode(w, [("int4", {"group_size": 128})]).nbytes == w.numel() // 2 + 64 * 2 * 2 * 2
    pruned = w * (torch.rand(64, 256) < 0.1)
    assert encode(pruned, ["int8", "sparse"]).nbytes < 0.3 * encode(pruned, ["int8"]).nbytes
    int4 = [("int4", {"group_size": 128})]
    assert encode(pruned, ["sparse", *int4]).nbytes < 0.4 * encode(pruned, int4).nbytes


def test_zstd_shrinks_a_compressible_part() -> None:
    codes = torch.randint(-2, 3, (64, 256)).float()  # int8 codes from five values: entropy well under 8 bits
    enc = encode(codes, ["int8", "zstd"])
    assert "q" in enc.stages[-1]["parts"]
    assert enc.nbytes < 0.6 * encode(codes, ["int8"]).nbytes


# -- decode refuses parts that do not fit ------------------------------------------------------------------
def _sample(chain: list, shape=(6, 40)) -> tuple[torch.Tensor, object]:
    x = torch.randn(shape)
    x[x.abs() < 0.5] = 0  # some zeros for sparse, but not all
    return x, encode(x, chain)


def _refused(parts, stages, dtype=torch.float32, shape=(6, 40), match: str | None = None) -> None:
    with pytest.raises(CodecError, match=match):
        decode(parts, stages, dtype, shape)


@pytest.mark.parametrize("chain_id", list(ALL_CHAINS))
def test_decode_refuses_when_any_part_is_missing(chain_id: str) -> None:
    _, enc = _sample(ALL_CHAINS[chain_id])
    for role in enc.parts:
        _refused({r: p for r, p in enc.parts.items() if r != role}, enc.stages, match="missing")


@pytest.mark.parametrize("chain_id", list(ALL_CHAINS))
def test_decode_refuses_a_dtype_or_shape_other_than_the_encoded_one(chain_id: str) -> None:
    _, enc = _sample(ALL_CHAINS[chain_id])
    _refused(enc.parts, enc.stages, dtype=torch.float64)
    _refused(enc.parts, enc.stages, shape=(40, 6))
    _refused(enc.parts, enc.stages, shape=(6, 41))


@pytest.mark.parametrize("chain_id", ["sparse", "sparse+zstd", "int8+sparse", "sparse+int4-g32"])
def test_decode_refuses_a_sparse_mask_that_keeps_more_or_fewer_values_than_stored(chain_id: str) -> None:
    chain = [item for item in ALL_CHAINS[chain_id] if item != "zstd"]
    _, enc = _sample(chain)
    parts, stage = enc.parts, enc.stages
    values_role = (
        "values" if "values" in parts else next(r for r in parts if r not in ("mask", "scale", "zero"))
    )
    mask = parts["mask"].numpy()
    bits = np.unpackbits(mask, bitorder="little")
    one_more = bits.copy()
    one_more[int(np.flatnonzero(bits == 0)[0])] = 1
    one_less = bits.copy()
    one_less[int(np.flatnonzero(bits == 1)[0])] = 0
    for bad in (one_more, one_less):
        bad_mask = torch.from_numpy(np.packbits(bad, bitorder="little"))
        _refused({**parts, "mask": bad_mask}, stage)
    _refused({**parts, "mask": parts["mask"][:-1]}, stage, match="mask")
    if values_role == "values" and parts["values"].dtype != torch.uint8:
        _refused({**parts, "values": parts["values"][:-1]}, stage, match="keeps")
        _refused({**parts, "values": parts["values"].double()}, stage)
        _refused({**parts, "mask": parts["mask"].to(torch.int8)}, stage)


def test_decode_refuses_an_int8_scale_of_the_wrong_shape_or_dtype() -> None:
    _, enc = _sample(["int8"])
    scale = enc.parts["scale"]
    for bad in (
        scale[:-1],
        torch.cat([scale, scale[:1]]),
        scale.reshape(1, -1),  # (rows, 1), compressed-tensors' column of scales, is read
        scale.double(),
        scale.half(),
    ):
        _refused({**enc.parts, "scale": bad}, enc.stages)
    _refused({**enc.parts, "q": enc.parts["q"].view(torch.uint8)}, enc.stages)
    _refused({**enc.parts, "q": enc.parts["q"].reshape(40, 6)}, enc.stages)


@pytest.mark.parametrize("flat", [False, True])
def test_decode_refuses_int4_parts_that_do_not_fit(flat: bool) -> None:
    _, enc = _sample([("int4", {"group_size": 32, "flat": flat})])
    p, stages = enc.parts, enc.stages
    for role in ("scale", "zero"):
        _refused({**p, role: p[role][:, :-1]}, stages)
        _refused({**p, role: p[role].to(torch.int32)}, stages)
        _refused({**p, role: p[role].double()}, stages)
    _refused({**p, "q4": p["q4"][:, :-1]}, stages)
    _refused({**p, "q4": p["q4"].view(torch.int8)}, stages)
    for group_size in (16, 31, 33, 64, 258, 32.0, None, True):
        _refused(p, [{**stages[0], "group_size": group_size}])
    _refused(p, [{**stages[0], "flat": not flat}])


def test_decode_refuses_an_odd_int4_group_size_even_when_the_parts_fit_it() -> None:
    # Group 33 over a (1, 33) tensor: 33 codes would need 16.5 bytes; 16 bytes must not reach torch's reshape.
    enc = encode(torch.randn(1, 32), [("int4", {"group_size": 32})])
    parts = {**enc.parts, "q4": torch.zeros(1, 16, dtype=torch.uint8)}
    _refused(
        parts, [{**enc.stages[0], "group_size": 33, "shape": [1, 33]}], shape=(1, 33), match="group size"
    )


@pytest.mark.parametrize("chain_id", ["cast-fp16", "int8", "int4-g32"])
@pytest.mark.parametrize("dtype", ["qint8", "quint4x2", "bits16", "float8_e4m3fn", "int32", "complex64"])
def test_decode_refuses_a_lossy_stage_recorded_with_a_dtype_it_never_encodes(
    chain_id: str, dtype: str
) -> None:
    _, enc = _sample(LOSSY_CHAINS[chain_id])
    _refused(enc.parts, [{**enc.stages[0], "dtype": dtype}], match="cannot decode")


def test_decode_refuses_a_cast_part_of_the_wrong_dtype() -> None:
    x, enc = _sample([("cast", {"to": "float16"})])
    _refused({"": enc.parts[""].bfloat16()}, enc.stages)
    _refused({"": x}, enc.stages)


def test_decode_refuses_bytes_of_the_wrong_size() -> None:
    _, enc = _sample(["bytes"])
    _refused({"bytes": enc.parts["bytes"][:-1]}, enc.stages)
    _refused({"bytes": enc.parts["bytes"].view(torch.int8)}, enc.stages)


def _zstd_sample() -> tuple[dict, list]:
    enc = encode(
        torch.randint(-2, 3, (6, 40)).float(), ["int8", "sparse", "zstd"]
    )  # five values: compressible
    assert enc.stages[-1]["parts"], "nothing got compressed: the sample needs a compressible part"
    return enc.parts, enc.stages


def test_decode_refuses_a_zstd_part_whose_declared_size_is_absurd() -> None:
    parts, stages = _zstd_sample()
    role = next(iter(stages[-1]["parts"]))
    absurd = parts[role].numel() * MAX_RATIO + 1
    for bad_spec in ({"dtype": "uint8", "shape": [absurd]}, {"dtype": "float64", "shape": [absurd // 8 + 1]}):
        bad = [*stages[:-1], {"codec": "zstd", "parts": {**stages[-1]["parts"], role: bad_spec}}]
        _refused(parts, bad, match="absurd")


def test_decode_refuses_a_zstd_part_that_is_corrupt_or_of_another_size() -> None:
    parts, stages = _zstd_sample()
    role, spec = next(iter(stages[-1]["parts"].items()))
    blob = parts[role]
    garbage = torch.randint(0, 256, blob.shape, dtype=torch.uint8)
    for bad_blob in (
        blob[: len(blob) // 2],
        garbage,
        blob.view(torch.int8),
        torch.zeros(0, dtype=torch.uint8),
    ):
        _refused({**parts, role: bad_blob}, stages)
    bigger = {**spec, "shape": [spec["shape"][0] + 1, *spec["shape"][1:]]}
    _refused(parts, [*stages[:-1], {"codec": "zstd", "parts": {**stages[-1]["parts"], role: bigger}}])
    for listing in (None, [], {role: "x"}, {"nope": spec}):
        _refused(parts, [*stages[:-1], {"codec": "zstd", "parts": listing}])


def test_decode_refuses_a_zstd_frame_that_declares_more_than_the_metadata_before_allocating_it() -> None:
    # A 20-byte frame whose header claims 1 TiB: zstandard would allocate the claim, not the metadata's size.
    body = zstandard.ZstdCompressor(write_content_size=False).compress(bytes(1000))
    for claim in (1001, 1 << 40):
        frame = body[:4] + bytes([0xE0]) + struct.pack("<Q", claim) + body[6:]  # single segment, 8-byte size
        blob = torch.frombuffer(bytearray(frame), dtype=torch.uint8)
        stages = [{"codec": "zstd", "parts": {"": {"dtype": "uint8", "shape": [1000]}}}]
        _refused({"": blob}, stages, dtype=torch.uint8, shape=(1000,), match="declares")
    # The same frame declaring the right size decodes.
    frame = body[:4] + bytes([0xE0]) + struct.pack("<Q", 1000) + body[6:]
    blob = torch.frombuffer(bytearray(frame), dtype=torch.uint8)
    stages = [{"codec": "zstd", "parts": {"": {"dtype": "uint8", "shape": [1000]}}}]
    assert torch.equal(decode({"": blob}, stages, torch.uint8, (1000,)), torch.zeros(1000, dtype=torch.uint8))


def test_decode_refuses_a_zstd_part_that_claims_to_be_empty() -> None:
    blob = torch.frombuffer(bytearray(zstandard.ZstdCompressor().compress(b"")), dtype=torch.uint8)
    _refused({"": blob}, [{"codec": "zstd", "parts": {"": {"dtype": "float32", "shape": [0]}}}], shape=(0,))


# Values a hostile or corrupt file could put in a stage's fields.
_HOSTILE_FIELDS = {
    "codec": st.sampled_from(["sparse", "int8", "int4", "cast", "bytes", "zstd", "gzip", "", None, 3]),
    "dtype": st.sampled_from(
        [
            *("float32", "float16", "bfloat16", "float64", "int8", "uint8", "bool", "complex128"),
            *("float8_e4m3fn", "float8_e8m0fnu", "qint8", "quint4x2", "bits16", "bogus", None, 7),
        ]
    ),
    "shape": st.one_of(
        st.lists(st.integers(0, 50), max_size=3),
        st.sampled_from([[1 << 40], [0, 1 << 40], [-1], [1.5], "6,40", None, [True]]),
    ),
    "group_size": st.sampled_from([16, 31, 32, 33, 64, 256, 258, 32.0, True, None, "32"]),
    "flat": st.sampled_from([True, False, None, "yes"]),
    "to": st.sampled_from(["float16", "bfloat16", "float32", "int8", "bogus", None]),
    "parts": st.sampled_from([None, {}, [], {"q": None}, {"q": {"dtype": "int8", "shape": [6, 40]}}]),
}


@st.composite
def corruptions(draw):
    """(chain id, where, what): one field of one stage, or one part, replaced by something hostile."""
    chain_id = draw(st.sampled_from(list(ALL_CHAINS)))
    if draw(st.booleans()):
        field = draw(st.sampled_from(sorted(_HOSTILE_FIELDS)))
        return chain_id, ("stage", draw(st.integers(0, 3)), field), draw(_HOSTILE_FIELDS[field])
    dtype = draw(
        st.sampled_from([torch.uint8, torch.int8, torch.float16, torch.float32, torch.int64, torch.bool])
    )
    shape = draw(st.lists(st.integers(0, 70), max_size=2).map(tuple))
    return chain_id, ("part", draw(st.integers(0, 3)), None), (dtype, shape, draw(st.integers(0, 2**32 - 1)))


@pytest.mark.slow
@settings(max_examples=300, deadline=None, database=None)
@given(corruption=corruptions())
@example(corruption=("int8", ("stage", 0, "dtype"), "qint8"))
@example(corruption=("cast-fp16", ("stage", 0, "dtype"), "qint8"))
@example(corruption=("int4-g32", ("stage", 0, "dtype"), "float8_e8m0fnu"))
@example(corruption=("sparse+zstd", ("part", 1, None), (torch.uint8, (), 0)))
def test_decode_answers_corrupt_metadata_or_parts_with_codec_error_only(corruption) -> None:
    chain_id, (kind, index, field), value = corruption
    x, enc = _sample(ALL_CHAINS[chain_id])
    parts, stages = dict(enc.parts), [dict(s) for s in enc.stages]
    if kind == "stage":
        if not stages:
            return
        stage = stages[index % len(stages)]
        stage[field] = value
    else:
        role = sorted(parts)[index % len(parts)]
        dtype, shape, seed = value
        gen = torch.Generator().manual_seed(seed)
        raw = torch.randint(0, 256, (math.prod(shape) * dtype.itemsize,), dtype=torch.uint8, generator=gen)
        parts[role] = (
            (raw & 1).bool().reshape(shape) if dtype == torch.bool else raw.view(dtype).reshape(shape)
        )
    try:
        y = decode(parts, stages, x.dtype, tuple(x.shape))
    except CodecError:
        return
    assert y.dtype == x.dtype and tuple(y.shape) == tuple(x.shape)


def test_chain_labels_name_the_stages_in_order() -> None:
    x = torch.randn(4, 64)
    assert encode(x).chain == "raw"
    assert encode(x, ["int8", "sparse", "zstd"]).chain == "int8+sparse+zstd"
    assert encode(x, ["sparse", ("int4", {"group_size": 64})]).chain == "sparse+int4"
