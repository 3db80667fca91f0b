"""formats.survival_bound against ml_dtypes rounding w + update for every stored w."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch

from helpers.references import ml_dtypes_formats
from mixprec.cli import main
from mixprec.formats import elements as formats

ML = {k: v for k, v in ml_dtypes_formats().items() if k != "e8m0"}  # floats only


def stored_values(name: str) -> np.ndarray:
    """Every finite value of a <=16-bit format (ml_dtypes decodes the bit patterns);
    for fp32, each binade's first three values, its last value and a few random ones."""
    if name == "fp32":
        rng = np.random.default_rng(0)
        exps = np.arange(-149, 128, dtype=np.float64)
        first = np.concatenate([2.0**exps * k for k in (1.0, 1 + 2.0**-23, 1 + 2.0**-22)])
        last = 2.0 ** (exps + 1) - 2.0 ** np.maximum(exps - 23, -149)
        rand = rng.integers(0, 0x7F800000, 20_000).astype(np.uint32).view(np.float32)
        v = np.concatenate([first, last, rand, [0.0, 2.0**-149 * 3]]).astype(np.float32)
    else:
        t = np.dtype(ML[name])
        bits = min(8 * t.itemsize, formats.get(name).total_bits)
        pats = np.arange(1 << bits, dtype=np.uint16 if t.itemsize == 2 else np.uint8)
        v = pats.view(t)
    with np.errstate(invalid="ignore"):
        v = v.astype(np.float64)
    v = np.unique(np.abs(v[np.isfinite(v)]))
    return v[v < math.inf]


def rounded(x: np.ndarray, name: str) -> np.ndarray:
    """``x`` rounded to ``name`` by numpy/ml_dtypes, as float64 (fp32: numpy's cast)."""
    if name == "fp32":
        with np.errstate(over="ignore"):
            return x.astype(np.float32).astype(np.float64)
    with np.errstate(over="ignore"):
        return x.astype(np.float32).astype(ML[name]).astype(np.float64)


def round_sum(w: np.ndarray, u: float, name: str) -> np.ndarray:
    """The exact ``w + u`` rounded into ``name``. ml_dtypes rounds float64 through
    float32, so the exact sum is bracketed by float32 values and rounded at both ends
    (rounding is monotone; sums that float32 holds, ties among them, go straight in).
    Where the ends differ the sum lies within a float32 step of their midpoint but not
    on it: an exact comparison with that midpoint picks the end."""
    s = w + u
    bb = s - w
    exact = ((w - (s - bb)) + (u - bb)) == 0  # TwoSum: float64 holds w + u exactly
    lo = np.where(exact, s, np.nextafter(s, -np.inf))
    hi = np.where(exact, s, np.nextafter(s, np.inf))
    if name != "fp32":
        with np.errstate(over="ignore"):
            lo32, hi32 = lo.astype(np.float32), hi.astype(np.float32)
        lo = np.where(lo32 > lo, np.nextafter(lo32, np.float32(-np.inf)), lo32)
        hi = np.where(hi32 < hi, np.nextafter(hi32, np.float32(np.inf)), hi32)
        lo, hi = lo.astype(np.float64), hi.astype(np.float64)
    a, b = rounded(lo, name), rounded(hi, name)
    for i in np.flatnonzero(~((a == b) | (np.isnan(a) & np.isnan(b)))):
        assert np.isfinite([a[i], b[i]]).all(), (w[i], u)
        mid = Fraction(a[i]) / 2 + Fraction(b[i]) / 2
        a[i] = a[i] if Fraction(w[i]) + Fraction(u) < mid else b[i]
    return a


def spacing_above(v: np.ndarray, name: str) -> np.ndarray:
    """Distance from each stored |w| to the next larger stored value (ml_dtypes' table;
    numpy's nextafter for fp32); at max, to the one below (the spacing of its binade)."""
    if name == "fp32":
        x = v.astype(np.float32)
        with np.errstate(over="ignore"):
            up = np.nextafter(x, np.float32(np.inf)).astype(np.float64)
        down = np.nextafter(x, np.float32(0)).astype(np.float64)
        return np.where(np.isfinite(up), up - v, v - down)
    table = stored_values(name)
    nxt = np.append(table[1:], 2 * table[-1] - table[-2])
    return nxt[np.searchsorted(table, v)] - v


def updates(name: str) -> list[float]:
    """1e-4 and a few ordinary sizes, the exact ties at the bottom (half the smallest
    subnormal) and in a middle and the top binade, and updates just off those ties."""
    f = formats.get(name)
    s0, m = f.min_subnormal, f.mantissa_bits
    mid = math.ldexp(1.0, (f.emin + f.emax) // 2 - m - 1)
    top = math.ldexp(1.0, f.emax - m - 1)
    ties = [s0 / 2, s0, mid, top]
    near = [t * k for t in ties for k in (0.75, 1.25)]
    return [1e-4, 3e-3, 0.7, 1e-7, 2.0**-10, *ties, *near, 2 * f.max]


def reference_bound(name: str, u: float) -> float:
    """From ml_dtypes alone: the smallest nonzero stored |w| that a step of |u| away from
    zero leaves as it is; 0.0 when no w moves, inf when every finite w does."""
    v = stored_values(name)
    lost = v[(v > 0) & ~moves(v, abs(u), name)]
    if not lost.size:
        return math.inf
    if not (moves(v, abs(u), name).any() or moves(-v, abs(u), name).any()):
        return 0.0
    return float(lost.min())


CASES = [(n, u) for n in ["fp32", *ML] for u in updates(n)]


@pytest.mark.parametrize(("name", "u"), CASES, ids=[f"{n}-{u:.3g}" for n, u in CASES])
def test_survival_bound_is_exactly_where_ml_dtypes_stops_moving_w(name, u):
    f = formats.get(name)
    v = stored_values(name)
    b = reference_bound(name, u)
    for sign in (1.0, -1.0):
        assert formats.survival_bound(sign * u, name) == b
        if b == 0.0:
            continue
        away = moves(sign * v, sign * u, name)  # the update moves |w| up (w = 0 too)
        toward = moves(-sign * v, sign * u, name)  # the update moves |w| down
        zero_tie = u == f.min_subnormal / 2  # 0 + u is a tie: rounds back to 0
        below = (v < b) & ~((v == 0) & zero_tie)
        assert away[below].all() and toward[below].all()
        assert not (zero_tie and away[v == 0].any())
        if b == math.inf:
            assert f.nan != "none"  # the top value overflows to inf/NaN: a change too
            continue
        # above the bound a step away from zero moves a value only at an exact tie
        moved = v[away & (v > b)]
        assert (2 * u == spacing_above(moved, name)).all(), moved[:4]


def moves(w: np.ndarray, u: float, name: str) -> np.ndarray:
    """Whether ``w + u`` rounds to anything but ``w`` (inf and NaN included)."""
    return ~(round_sum(w, u, name) == w)


def last_column(out: str) -> dict[str, str]:
    return {cells[0]: cells[-1] for line in out.splitlines()
            if (cells := [c.strip() for c in line.strip("│ ").split("│")])[0]
            in formats.names()}


@pytest.mark.parametrize("u", [1e-4, 3e-3, 2.0**-10, 0.7])
def test_formats_cli_prints_the_reference_bound(u, capsys):
    """The table's last column is the boundary ml_dtypes shows, "never" where no stored
    w moves (1e-4 in e4m3, fp6 and fp4: below half their smallest subnormal)."""
    names = ["fp32", *ML]
    assert main(["formats", "--value", "0.001", "--update", repr(u),
                 "--formats", ",".join(names)]) == 0
    got = last_column(capsys.readouterr().out)
    for name in names:
        b = reference_bound(name, u)
        if b == 0 or b == math.inf:
            assert got[name] == ("never" if b == 0 else "every w"), name
        else:  # printed to 5 or 6 digits
            assert float(got[name]) == pytest.approx(b, rel=1e-4), name
        if b == 0:
            assert formats.quantize(torch.tensor([0.001 + u]), name) == \
                formats.quantize(torch.tensor([0.001]), name)


def test_1e_4_never_survives_in_e4m3_fp6_fp4():
    for name in ("fp8_e4m3", "fp6_e3m2", "fp6_e2m3", "fp4_e2m1"):
        assert reference_bound(name, 1e-4) == 0.0 == formats.survival_bound(1e-4, name)
    assert reference_bound("fp32", 1e-4) == 2048 and reference_bound("bf16", 1e-4) == 0.03125


def test_bad_update_is_an_error():
    with pytest.raises(ValueError, match="update must be a finite number, got nan"):
        formats.survival_bound(math.nan, "fp16")
