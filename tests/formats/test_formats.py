"""formats.quantize against independent references: ml_dtypes, torch casts, bit tricks."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers.references import ml_dtypes_formats
from mixprec.formats import elements as formats

pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in cast:RuntimeWarning")

ML = ml_dtypes_formats()
NO_NAN = {"fp6_e3m2", "fp6_e2m3", "fp4_e2m1"}  # ml_dtypes maps NaN to ±0 there


def all_values(name: str) -> np.ndarray:
    """Every finite value of a <=16-bit format, decoded by ml_dtypes from its bit patterns."""
    t = np.dtype(ML[name])
    n = 1 << (8 * t.itemsize)
    pats = np.arange(n, dtype=np.uint16 if t.itemsize == 2 else np.uint8)
    v = pats.view(t).astype(np.float64)
    if name.startswith(("fp6", "fp4")):  # stored one per byte: keep the valid patterns
        v = np.arange(n, dtype=np.uint8)[: 1 << formats.get(name).total_bits].view(t)
        v = v.astype(np.float64)
    return np.unique(v[np.isfinite(v)])


def edge_values(name: str) -> np.ndarray:
    """Each representable value, each midpoint and the fp32 floats just around it,
    max + half ulp, subnormal boundaries, ±0 and ±inf (as float32)."""
    vals = all_values(name)
    mids = (vals[1:] + vals[:-1]) / 2
    f = formats.get(name)
    extra = [0.0, -0.0, math.inf, -math.inf, f.max, f.max * (1 + f.eps / 2),
             f.max * (1 + f.eps), f.min_normal, f.min_subnormal, f.min_subnormal / 2,
             f.min_subnormal * 0.75, f.min_normal - f.min_subnormal]
    base = np.concatenate([vals, mids, np.array(extra)]).astype(np.float32)
    up = np.nextafter(base, np.float32(np.inf))
    down = np.nextafter(base, np.float32(-np.inf))
    out = np.concatenate([base, up, down])
    return np.concatenate([out, -out])


def random_fp32(n: int, seed: int) -> np.ndarray:
    """Random bit patterns: every exponent of fp32 equally likely, NaN removed."""
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 2**32, size=n + n // 50, dtype=np.uint64).astype(np.uint32)
    x = x.view(np.float32)
    return x[~np.isnan(x)][:n]


def assert_same_bits(got: torch.Tensor, want: np.ndarray, inputs: np.ndarray) -> None:
    g = got.numpy().astype(np.float32)
    w = want.astype(np.float32)
    same = (g.view(np.uint32) == w.view(np.uint32)) | (np.isnan(g) & np.isnan(w))
    if not same.all():
        bad = np.flatnonzero(~same)[:8]
        pytest.fail(
            f"{(~same).sum()} mismatches, e.g. "
            + ", ".join(f"{inputs[i]!r}: got {g[i]!r} want {w[i]!r}" for i in bad)
        )


@pytest.mark.parametrize("name", list(ML))
def test_quantize_matches_ml_dtypes_bit_for_bit(name):
    x = np.concatenate([random_fp32(1_000_000, seed=len(name)), edge_values(name)])
    if name in NO_NAN:
        x = x[~np.isnan(x)]
    assert x.size >= 1_000_000
    want = x.astype(ML[name]).astype(np.float32)
    got = formats.quantize(torch.from_numpy(x), name)
    assert_same_bits(got, want, x)


def nearest_even_reference(x: np.ndarray, name: str) -> np.ndarray:
    """Round |x| <= max to the nearest entry of the format's value table, ties to the
    even mantissa (even index in the table of non-negative values): no arithmetic of
    mixprec's, no double rounding (ml_dtypes rounds float64 inputs via float32)."""
    table = all_values(name)
    table = table[table >= 0]
    a = np.abs(x)
    hi = np.clip(np.searchsorted(table, a), 1, table.size - 1)
    lo = hi - 1
    dlo, dhi = a - table[lo], table[hi] - a
    pick = np.where(dlo < dhi, lo, np.where(dhi < dlo, hi, np.where(lo % 2 == 0, lo, hi)))
    return np.copysign(table[pick], x)


@pytest.mark.parametrize("name", [n for n in ML if n != "e8m0"])
def test_quantize_float64_inputs_round_once(name):
    rng = np.random.default_rng(7)
    f = formats.get(name)
    x = np.concatenate([rng.uniform(-f.max, f.max, 200_000),
                        rng.standard_normal(50_000) * f.min_normal * 4])
    got = formats.quantize(torch.from_numpy(x), name).numpy()
    np.testing.assert_array_equal(got, nearest_even_reference(x, name))


@pytest.mark.parametrize(
    "name,dtype,saturate",
    [
        ("fp16", torch.float16, False),
        ("bf16", torch.bfloat16, False),
        ("fp8_e5m2", torch.float8_e5m2, False),
        # torch clamps every out-of-range value (inf too) to ±448 for e4m3fn
        ("fp8_e4m3", torch.float8_e4m3fn, True),
    ],
)
def test_quantize_matches_torch_casts(name, dtype, saturate):
    x = np.concatenate([random_fp32(1_000_000, seed=3), edge_values(name)])
    t = torch.from_numpy(x)
    want = t.to(dtype).float().numpy()
    got = formats.quantize(t, name, saturate=saturate)
    assert_same_bits(got, want, x)


def test_e4m3_both_overflow_behaviours():
    x = torch.tensor([464.0, 464.1, 1e6, math.inf, -math.inf])
    # ml_dtypes / OCP conversion: 464 ties to 448 (even); anything above is NaN
    assert formats.quantize(x, "e4m3").tolist()[0] == 448.0
    assert all(math.isnan(v) for v in formats.quantize(x, "e4m3").tolist()[1:])
    assert formats.quantize(x, "e4m3", saturate=True).tolist() == [448, 448, 448, 448, -448]


@pytest.mark.parametrize("name", formats.names())
def test_saturate_clamps_everything_beyond_max(name):
    f = formats.get(name)
    x = torch.tensor([math.inf, f.max * 4, f.max, -math.inf] if f.signed else [math.inf, f.max])
    got = formats.quantize(x, name, saturate=True)
    want = [f.max, f.max, f.max, -f.max] if f.signed else [f.max, f.max]
    assert got.tolist() == want


@pytest.mark.parametrize("name", formats.names())
def test_nan_inputs_stay_nan(name):
    """Documented: NaN in, NaN out, for every format (fp6/fp4 have no NaN encoding;
    mixprec keeps the NaN visible rather than mapping it to 0 as ml_dtypes does)."""
    for sat in (False, True):
        assert torch.isnan(formats.quantize(torch.tensor([math.nan]), name, saturate=sat)).all()


def test_tf32_against_integer_rounding():
    """tf32 has no ml_dtypes type: compare with round-half-even on the fp32 bit pattern."""
    x = np.concatenate([random_fp32(1_000_000, seed=11), edge_values("fp16")])
    b = x.view(np.uint32).astype(np.uint64)
    drop = 13
    lsb = (b >> drop) & 1
    r = ((b + (1 << (drop - 1)) - 1 + lsb) >> drop) << drop
    want = r.astype(np.uint32).view(np.float32)
    want = np.where(np.isinf(x), x, want)  # the bit trick is only valid for finite x
    got = formats.quantize(torch.from_numpy(x), "tf32")
    assert_same_bits(got, want, x)


@pytest.mark.parametrize(
    "name,max_,min_normal,min_sub",
    [
        ("fp32", 3.4028234663852886e38, 2**-126, 2**-149),
        ("fp16", 65504.0, 2**-14, 2**-24),
        ("bf16", 3.3895313892515355e38, 2**-126, 2**-133),
        ("fp8_e4m3", 448.0, 2**-6, 2**-9),
        ("fp8_e5m2", 57344.0, 2**-14, 2**-16),
        ("fp6_e3m2", 28.0, 0.25, 0.0625),
        ("fp6_e2m3", 7.5, 1.0, 0.125),
        ("fp4_e2m1", 6.0, 1.0, 0.5),
        ("e8m0", 2.0**127, 2**-127, 2**-127),
    ],
)
def test_format_limits(name, max_, min_normal, min_sub):
    f = formats.get(name)
    assert (f.max, f.min_normal, f.min_subnormal) == (max_, min_normal, min_sub)
    if name in ML:
        fi = ml_dtypes.finfo(ML[name])
        assert float(fi.max) == f.max
        assert float(fi.eps) == f.eps


def test_worked_examples_of_range_and_spacing():
    # 2^-30 underflows to 0 in fp16, survives in bf16
    g = torch.tensor([2.0**-30])
    assert formats.quantize(g, "fp16").item() == 0.0
    assert formats.quantize(g, "bf16").item() == 2.0**-30
    # a common claim says 2048 + 1e-4 is kept in fp32. It is not: fp32's spacing at 2048
    # is 2^-12 ~ 2.44e-4, and 1e-4 is less than half of it. All three lose it there;
    # just below 2048 (spacing 2^-13) fp32 keeps it while fp16 and bf16 still lose it.
    w = torch.tensor([2048.0], dtype=torch.float64) + 1e-4
    for name in ("fp16", "bf16", "fp32"):
        assert formats.quantize(w, name).item() == 2048.0
    assert formats.ulp(torch.tensor([2048.0]), "fp32").item() == 2.0**-12
    w = torch.tensor([1024.0], dtype=torch.float64) + 1e-4
    assert formats.quantize(w, "fp32").item() > 1024.0
    assert formats.quantize(w, "fp16").item() == formats.quantize(w, "bf16").item() == 1024.0
    # fp16 max 65504
    assert formats.quantize(torch.tensor([65504.0, 65520.0]), "fp16").tolist() == [65504, math.inf]


def test_signed_zero_kept():
    x = torch.tensor([-0.0, -1e-30, 1e-30])
    q = formats.quantize(x, "fp16")
    assert torch.signbit(q).tolist() == [True, True, False]


def test_lookup_aliases_and_errors():
    assert formats.get("bfloat16") is formats.get(torch.bfloat16) is formats.get("BF16")
    assert formats.get("e4m3") is formats.get(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="unknown format 'fp7'.*fp16"):
        formats.get("fp7")
    with pytest.raises(TypeError, match="float32 or float64"):
        formats.quantize(torch.ones(2, dtype=torch.float16), "fp8_e4m3")


@pytest.mark.parametrize("name", ["fp16", "bf16", "fp8_e4m3", "fp8_e5m2", "fp4_e2m1"])
def test_ulp(name):
    f = formats.get(name)
    assert formats.ulp(torch.tensor([1.0]), name).item() == f.eps
    assert formats.ulp(torch.tensor([0.0]), name).item() == f.min_subnormal
    assert formats.ulp(torch.tensor([f.max * 10]), name).item() == f.max * f.eps / (2 - f.eps) \
        or name == "fp8_e4m3"
    assert formats.ulp(torch.tensor(2048.0), "fp16").item() == 2.0


def test_bits_fields():
    assert formats.bits(1.0, "fp16") == [(0, 15, 0)]
    assert formats.bits(-65504.0, "fp16") == [(1, 30, 1023)]
    assert formats.bits(2.0**-24, "fp16") == [(0, 0, 1)]  # smallest subnormal
    assert formats.bits(448.0, "e4m3") == [(0, 15, 6)]
    assert formats.bits(math.nan, "e4m3") == [(0, 15, 7)]
    assert formats.bits(6.0, "fp4_e2m1") == [(0, 3, 1)]


# --- stochastic rounding --------------------------------------------------------------

SR_FORMATS = ["fp16", "bf16", "fp8_e4m3", "fp8_e5m2", "fp4_e2m1"]


def neighbours(x: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The representable values just below and above x (x within range), by float64."""
    xd = x.double()
    q = formats.quantize(xd, name)
    step = formats.ulp(xd, name)
    lo = torch.where(q <= xd, q, formats.quantize(q - step / 2, name, saturate=True))
    lo = torch.where(q > xd, formats.quantize(xd - step, name), lo)
    hi = torch.where(q >= xd, q, q + formats.ulp(q, name))
    return torch.minimum(lo, q), torch.maximum(hi, q)


@settings(max_examples=200, deadline=None)
@given(
    name=st.sampled_from(SR_FORMATS),
    v=st.floats(min_value=-1e4, max_value=1e4, allow_nan=False, width=32),
    seed=st.integers(0, 2**31 - 1),
)
def test_stochastic_rounding_picks_a_neighbour(name, v, seed):
    f = formats.get(name)
    v = max(min(v, f.max), -f.max)
    x = torch.full((64,), v, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    r = formats.quantize(x, name, rounding="stochastic", generator=g).double()
    below = formats.quantize(x.double(), name)
    # both neighbours: the nearest value and the one on the other side of x
    assert torch.equal(formats.quantize(r, name), r)  # representable
    gap = formats.ulp(torch.tensor([abs(v)], dtype=torch.float64), name).item()
    assert ((r - v).abs() <= gap * (1 + 1e-12)).all()
    if below.eq(x.double()).all():
        assert torch.equal(r, below)  # exactly representable: never moves


@pytest.mark.parametrize("name", SR_FORMATS)
def test_stochastic_rounding_is_unbiased(name):
    f = formats.get(name)
    g = torch.Generator().manual_seed(0)
    for v in [1.0 + f.eps / 3, -(2.0 + f.eps * 0.9), f.min_subnormal * 0.3, f.max * 0.71]:
        n = 100_000
        x = torch.full((n,), v, dtype=torch.float64)
        r = formats.quantize(x, name, rounding="stochastic", generator=g)
        vals = torch.unique(r)
        assert len(vals) <= 2
        p = (r == vals[-1]).double().mean().item()
        spread = (vals[-1] - vals[0]).item()
        se = math.sqrt(max(p * (1 - p), 1e-12) / n) * spread
        assert abs(r.mean().item() - v) <= 4 * se + 1e-300, (name, v, r.mean().item())


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_e8m0_rounds_fp32_subnormals_between_its_two_smallest_values(rounding):
    """e8m0's smallest values, 2^-127 and 2^-126, straddle fp32's subnormal range, where
    fp32 holds them exactly but its exponent field cannot tell them apart: every fp32
    subnormal went to 2^-126's binade, and (2^-127, 1.5·2^-127) rounded to 2^-126.
    Against float64, with no ml_dtypes: nearest takes the closer power of two (ties
    up), stochastic rounds up with probability (a - 2^-127) / 2^-127."""
    lo, hi = 2.0**-127, 2.0**-126
    g = torch.Generator().manual_seed(0)
    a = (torch.rand(20_000, generator=g, dtype=torch.float64) * (hi - lo) + lo).float()
    a = a[(a > lo) & (a < hi)]
    if rounding == "nearest":
        want = torch.where(a.double() < 1.5 * lo, lo, hi).float()
        assert torch.equal(formats.quantize(a, "e8m0"), want)
        below = torch.tensor([1e-45, 1e-40], dtype=torch.float32)  # under 2^-127: clamped
        assert torch.equal(formats.quantize(below, "e8m0"), torch.full((2,), lo).float())
    else:
        x = torch.full((200_000,), 1.25 * lo, dtype=torch.float32)
        up = (formats.quantize(x, "e8m0", "stochastic", generator=g) == hi).double().mean()
        assert abs(up.item() - 0.25) < 4 * (0.25 * 0.75 / x.numel()) ** 0.5
