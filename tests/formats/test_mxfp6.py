"""MXFP6 (``fp8_scaling=mxfp6``): e3m2 elements under MX's 1×32 e8m0 scales, checked
against independent references: ml_dtypes' ``float6_e3m2fn`` for the element rounding,
float64 for the scales, the blocks and the GEMMs; its refused kernel and the bytes the
memory planner reads of it."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
import torch

from mixprec.formats.gemm import FORMATS, MXFP6Scaling
from mixprec.memory.expert_casts import cast_bytes
from mixprec.modules.linear import Float8Linear
from mixprec.recipe import PRESETS, Recipe

E3M2 = ml_dtypes.float6_e3m2fn
MAX = 28.0


def _operand(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Gaussian rows whose magnitudes span 2^-12..2^12, with an outlier and a zero tile."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(rows, cols, generator=g, dtype=torch.float64)
    t *= torch.exp2(torch.randint(-12, 13, (rows, 1), generator=g).double())
    t[0, 5] = 1e4
    t[1, :32] = 0.0
    return t.float()


def _reference(t: torch.Tensor, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """The cast in float64 and ml_dtypes: each 32-element tile along ``dim`` (zero padded)
    scaled by ``X = 2^ceil(log2(amax / 28))`` (``rceil``), its elements ``t / X`` rounded
    to e3m2 by ml_dtypes; the codes and each element's ``X``."""
    a = t.double().numpy()
    a = a if dim == 1 else a.T
    rows, cols = a.shape
    pad = np.zeros((rows, -(-cols // 32) * 32))
    pad[:, :cols] = a
    amax = np.abs(pad).reshape(rows, -1, 32).max(axis=2)
    exp = np.where(amax > 0, np.ceil(np.log2(np.where(amax > 0, amax, 1) / MAX)), -127)
    x = np.repeat(np.exp2(exp), 32, axis=1)[:, :cols]
    codes = (a / x).astype(E3M2).astype(np.float64)
    return (codes, x) if dim == 1 else (codes.T, x.T)


@pytest.mark.parametrize("dim", [1, 0])
def test_the_cast_is_ml_dtypes_e3m2_under_float64_mx_scales(dim):
    t = _operand(37, 70, seed=dim)  # partial tiles along both dims
    q = MXFP6Scaling().cast(t, "input", dim, {})
    codes, x = _reference(t, dim)
    assert q.data.dtype == torch.float8_e4m3fn  # one byte per code: e3m2 values, exactly
    assert np.array_equal(q.data.double().numpy(), codes)
    assert np.array_equal(q.dequant().double().numpy(), codes * x)
    assert set(np.abs(codes).ravel()) <= set(np.abs(
        np.arange(64, dtype=np.uint8).view(E3M2).astype(np.float64)))  # e3m2's grid only
    assert np.abs(codes).max() == MAX  # the outlier's tile reaches the top code
    # not e4m3's rounding: a third mantissa bit would keep more of the values
    e4m3 = torch.tensor(t.double().numpy() / x).to(torch.float8_e4m3fn).double().numpy()
    assert not np.array_equal(e4m3, codes)


def test_the_linear_gemms_are_the_float64_products_of_the_casts():
    """Forward, dgrad and wgrad of a Linear against float64 products of the
    reference casts (each GEMM's contracted dim cut in 32-element tiles)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(24, 96, generator=g).requires_grad_()
    gy = torch.randn(24, 40, generator=g)
    lin = Float8Linear(96, 40, bias=False, recipe="mxfp6")
    with torch.no_grad():
        lin.weight.copy_(torch.randn(40, 96, generator=g) / 8)
    y = lin(x)
    y.backward(gy)

    def deq(t, dim):
        c, s = _reference(t.detach(), dim)
        return c * s

    want_y = deq(x, 1) @ deq(lin.weight, 1).T
    want_dx = deq(gy, 1) @ deq(lin.weight, 0)
    want_dw = deq(gy, 0).T @ deq(x, 0)
    for got, want in ((y, want_y), (x.grad, want_dx), (lin.weight.grad, want_dw)):
        got = got.detach().double().numpy()
        assert np.allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    exact = (x.detach().double() @ lin.weight.detach().double().T).numpy()
    assert not np.allclose(y.detach().double().numpy(), exact, rtol=1e-2)  # it is fp6


def test_the_kernel_is_refused_and_auto_takes_the_exact_route():
    q = Recipe.coerce("mxfp6").linear
    assert q.kernel is None and q.block_scaled and not q.takes_tensor_route
    assert q.route("cpu") == q.route("cpu", "dequant") == "dequant_fp32"
    for device in ("cpu", "meta"):
        with pytest.raises(ValueError, match="mxfp6 has no torch scaled-matmul kernel.*"
                                             "fp8_gemm=dequant_fp32"):
            q.route(device, "scaled_mm")


def test_the_format_is_one_registry_entry_a_preset_and_recipe_fields():
    assert FORMATS["mxfp6"] is MXFP6Scaling
    assert isinstance(PRESETS["mxfp6"].linear, MXFP6Scaling)
    q = Recipe.coerce("mxfp6,mx_rounding=floor").linear
    assert q.mx_rounding == "floor" and q.segment_kind == "tiles" and q.flush_view == ""
    with pytest.raises(ValueError, match="mx_rounding"):
        Recipe.coerce("mxfp6,mx_rounding=up")


@pytest.mark.parametrize("rows,cols,role,dim", [(100, 70, "input", 1),
                                                (100, 70, "grad_output", 0),
                                                (64, 96, "weight", 1)])
def test_the_planner_prices_what_the_cast_holds(rows, cols, role, dim):
    """A byte per code (its e4m3 carrier) and an fp32 scale per 32-element tile, as the
    cast's own tensors hold them."""
    q = MXFP6Scaling()
    c = q.cast(torch.randn(rows, cols), role, dim, {})
    held = c.data.numel() * c.data.element_size() + c.scale_inv.numel() * 4
    tiles = rows * math.ceil(cols / 32) if dim == 1 else math.ceil(rows / 32) * cols
    assert cast_bytes(q, rows, cols, role, dim) == rows * cols + 4 * tiles == held
