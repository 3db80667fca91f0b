"""The optimizer-state format registry: every format's codes and values against numpy
references (ml_dtypes for bf16/e4m3 rounding, float64 for the scales and maps, each
operation rounded to fp32 as IEEE fp32 arithmetic rounds it), its priced bytes against
the stored tensors' own ``nbytes``, and the lists that name state formats."""

from __future__ import annotations

import math
import typing

import numpy as np
import pytest
import torch

from mixprec import Recipe
from mixprec.formats import state_formats
from mixprec.formats.state_formats import MIN_NUMEL, STATE_CODECS, lookup, state_bytes
from mixprec.optim.states import STATE_FORMATS, StateFormat
from mixprec.recipe.layer_rules import STATE_RULE_FORMATS, LayerRule

ml_dtypes = pytest.importorskip("ml_dtypes")

#: rows narrower than a block, a last block taking the rest, whole blocks, a 3-D state
SHAPES = ((64, 64), (17, 767), (8, 1024), (3, 5, 300))
f32 = np.float32


def _state(shape, signed: bool, seed: int = 0) -> torch.Tensor:
    """Values over many decades, a block of zeros and a signed zero."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp(3 * torch.randn(shape, generator=g))
    x = x if signed else x.square()
    r = x.view(x.shape[0], -1)
    r[1, :] = 0.0  # a row of zeros: every block of it has scale 0
    r[2, 0] = -0.0 if signed else 0.0
    return x


def _blocks(cols: int, w: int) -> list[tuple[int, int]]:
    """(start, stop) of each block in a row: ``max(1, cols // w)`` of them, the last
    taking the rest."""
    nb = max(1, cols // w)
    return [(k * w, cols if k == nb - 1 else (k + 1) * w) for k in range(nb)]


def _root4_times(y: np.ndarray, k: int) -> np.ndarray:
    """``k * y^(1/4)`` from two correctly rounded fp32 square roots (float64 roots of
    fp32 values, rounded to fp32: correctly rounded), times ``k`` in fp32."""
    r = np.sqrt(np.sqrt(y.astype(np.float64)).astype(f32).astype(np.float64)).astype(f32)
    return (r * f32(k)).astype(f32)


def _pow4(y: np.ndarray) -> np.ndarray:
    return ((y * y).astype(f32) ** 2).astype(f32)


def _reference(name: str, x: np.ndarray, signed: bool) -> tuple[np.ndarray, np.ndarray]:
    """(codes as integers, decoded fp32 values) of ``x`` (2-D, fp32) in format ``name``."""
    if name == "fp32":
        return x.view(np.int32), x
    if name == "bf16":
        q = x.astype(ml_dtypes.bfloat16)
        return q.view(np.int16), q.astype(f32)
    w = lookup(name).block
    codes, out = np.zeros(x.shape, np.int64), np.zeros(x.shape, f32)
    for lo, hi in _blocks(x.shape[1], w):
        b = x[:, lo:hi]
        a = np.abs(b).max(1, keepdims=True)
        safe = np.where(a > 0, a, f32(1))
        y = (np.abs(b).astype(np.float64) / safe).astype(f32)  # |b| / a, correctly rounded
        neg = np.signbit(b)
        if name == "fp8":
            s = (a.astype(np.float64) / 448).astype(f32)
            ratio = np.where(s > 0, (b.astype(np.float64) / np.where(s > 0, s, 1)), 0)
            q = ratio.astype(f32).astype(ml_dtypes.float8_e4m3fn)
            c = q.astype(f32)
            if not signed:
                c = np.maximum(c, f32(2.0**-9))
            codes[:, lo:hi] = q.view(np.uint8)
            out[:, lo:hi] = (c.astype(np.float64) * s).astype(f32)
            continue
        if name == "int8" and signed:
            k = np.rint(_root4_times(y, 127)).astype(np.int64)
            v = _pow4((k.astype(np.float64) / 127).astype(f32))
            codes[:, lo:hi] = np.where(neg, -k, k)
        elif name == "int8":
            k = np.clip(np.rint(_root4_times(y, 256)) - 1, 0, 255).astype(np.int64)
            v = _pow4(((k + 1) / 256).astype(f32))
            codes[:, lo:hi] = k
        elif signed:  # int4: the nearest of (j / 7)^3, in float64
            grid = (np.arange(8) / 7.0) ** 3
            k = np.abs(y.astype(np.float64)[..., None] - grid).argmin(-1)
            v = (k.astype(np.float64) ** 3 / 343).astype(f32)
            neg = b < 0  # the sign bit: -0.0 has none
            codes[:, lo:hi] = k | (neg << 3)
        else:
            k = np.clip(np.rint(_root4_times(y, 16)) - 1, 0, 15).astype(np.int64)
            v = _pow4(((k + 1) / 16).astype(f32))
            codes[:, lo:hi] = k
        val = (v.astype(np.float64) * a).astype(f32)
        if signed and name == "int8":  # the code's sign: a zero code reads +0
            neg = neg & (k > 0)
        out[:, lo:hi] = np.where(neg, -val, val) if signed else val
    return codes, out


def _codes(name: str, stored: dict[str, torch.Tensor], cols: int) -> np.ndarray:
    """The stored codes as integers, one per element (int4's unpacked, low nibble
    first)."""
    q = stored["v" if name == "fp32" else "q"]
    if q.dtype.itemsize == 1 and q.dtype.is_floating_point:
        q = q.view(torch.uint8)
    elif q.dtype == torch.bfloat16:
        q = q.view(torch.int16)
    elif q.dtype == torch.float32:
        q = q.view(torch.int32)
    q = q.numpy().astype(np.int64)
    if name != "int4":
        return q.reshape(q.shape[0], -1)
    return np.stack([q & 15, q >> 4], -1).reshape(q.shape[0], -1)[:, :cols]


@pytest.mark.parametrize("signed", [True, False], ids=["signed", "non-negative"])
@pytest.mark.parametrize("name", list(STATE_CODECS))
def test_every_state_format_round_trips_as_its_reference(name, signed):
    codec = lookup(name)
    for i, shape in enumerate(SHAPES):
        x = _state(shape, signed, seed=i)
        flat = x.reshape(shape[0], -1).numpy()
        stored = codec.encode(x, signed)
        got = codec.decode(stored, x, signed)
        want_codes, want = _reference(name, flat, signed)
        assert got.dtype == torch.float32 and got.shape == x.shape
        np.testing.assert_array_equal(_codes(name, stored, flat.shape[1]), want_codes)
        np.testing.assert_array_equal(got.reshape(shape[0], -1).numpy().view(np.int32),
                                      want.view(np.int32), err_msg=f"{name} {shape}")
        if codec.blocked:  # the fp32 scales: the blocks' maxima (fp8: over 448)
            a = np.stack([np.abs(flat[:, lo:hi]).max(1)
                          for lo, hi in _blocks(flat.shape[1], codec.block)], 1)
            s = (a.astype(np.float64) / 448).astype(f32) if name == "fp8" else a
            np.testing.assert_array_equal(stored["s"].numpy(), s)


@pytest.mark.parametrize("name", list(STATE_CODECS))
def test_the_priced_bytes_are_the_stored_tensors_nbytes(name):
    codec = lookup(name)
    shapes = (*SHAPES, (63, 65), (MIN_NUMEL - 1, 1), (MIN_NUMEL,), (2, 5000), (1, 4097))
    for shape in shapes:
        x = torch.randn(shape)
        stored = codec.stored_as(shape).encode(x)
        real = sum(t.nbytes for t in stored.values())
        assert state_bytes(name, shape) == codec.nbytes(shape) == real, (name, shape)
    # rows of whole blocks: the nominal bytes per element, the scales included
    w = codec.block or 256
    shape = (32, 3 * w)
    real = sum(t.nbytes for t in codec.encode(torch.randn(shape)).values())
    assert codec.bytes_per_element * math.prod(shape) == real
    want = {"fp32": 4, "bf16": 2, "fp8": 1 + 4 / 256, "int8": 1 + 4 / 256, "int4": 0.5 + 4 / 128}
    assert codec.bytes_per_element == want[name]


def test_the_memory_estimate_prices_states_at_the_stored_bytes():
    from mixprec.memory import estimate

    model = torch.nn.Sequential(torch.nn.Linear(300, 200), torch.nn.Linear(200, 7))
    params = list(model.parameters())
    base = estimate(model, "bf16-master")["optimizer"]  # torch's AdamW: fp32 states
    for name in STATE_CODECS:
        got = estimate(model, f"bf16-master,states={name}")["optimizer"]
        stored = sum(t.nbytes for p in params
                     for t in lookup(name).stored_as(p.shape).encode(p.detach()).values())
        # AdamW: two states per parameter, each as stored instead of in fp32
        assert got - base == 2 * (stored - 4 * sum(p.numel() for p in params)), name


def test_every_list_of_state_formats_is_the_registrys():
    assert STATE_FORMATS == STATE_RULE_FORMATS == state_formats.names() == tuple(STATE_CODECS)
    assert state_formats.names() == ("fp32", "bf16", "fp8", "int8", "int4")
    assert typing.get_args(StateFormat) == state_formats.names()  # the type hint agrees
    valid = ", ".join(STATE_CODECS)
    with pytest.raises(ValueError, match=f"'int2'; valid: {valid}"):
        lookup("int2")
    with pytest.raises(ValueError, match=f"unknown format 'int2'.*valid: {valid}"):
        LayerRule("states", "emb", "int2")
    with pytest.raises(ValueError, match=f"'int2'; valid: {valid}"):
        Recipe.parse("bf16,states=int2")
    # element formats come from the element table
    assert lookup("fp8").element.torch_dtype is torch.float8_e4m3fn
    assert lookup("bf16").element.torch_dtype is torch.bfloat16
    assert lookup("int8").element is None and lookup("int4").code_bits == 4
