"""The CUDA GEMM calls, checked on any machine against torch's own meta kernels
(``device="meta"``): the shapes, dtypes, strides and scale layouts that
``torch._scaled_mm`` accepts, for token counts that are not multiples of 16. A GPU runs
the same calls; here only their signatures are checked, not their numbers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from helpers.meta_linear import meta_linear_step
from mixprec.formats.tensor_gemm import fp8_gemm
from mixprec.modules.linear import Float8Linear

ROUTES = ["fp8,fp8_gemm=scaled_mm", "fp8-current,fp8_gemm=scaled_mm",
          "fp8-rowwise,fp8_gemm=scaled_mm", "fp8,fp8_format=e4m3,fp8_gemm=scaled_mm"]


def test_the_meta_kernel_refuses_a_contraction_of_30():
    """The control: torch's checks run on meta tensors, so these tests can fail."""
    a = torch.empty(64, 30, dtype=torch.float8_e4m3fn, device="meta")
    b = torch.empty(48, 30, dtype=torch.float8_e4m3fn, device="meta").t()
    one = torch.empty((), device="meta")
    with pytest.raises(RuntimeError, match="divisible by 16"):
        torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)


@pytest.mark.parametrize("tokens", [1, 30, 1000])
@pytest.mark.parametrize("recipe", ROUTES)
def test_float8_linear_forward_and_backward_pass_the_meta_kernels(recipe, tokens):
    """Forward ``x @ wᵀ`` (K = in), dgrad ``g @ w`` (K = out) and wgrad ``gᵀ @ x``
    (K = tokens: padded with zero rows to a multiple of 16)."""
    f8 = Float8Linear.from_linear(nn.Linear(64, 48), recipe).to("meta")
    assert f8.backend == "scaled_mm"
    x = torch.empty(tokens, 64, device="meta", dtype=torch.bfloat16, requires_grad=True)
    y = f8(x)
    y.sum().backward()
    assert (y.shape, y.dtype) == ((tokens, 48), torch.bfloat16)
    assert (x.grad.shape, x.grad.dtype) == ((tokens, 64), torch.bfloat16)
    assert (f8.weight.grad.shape, f8.weight.grad.dtype) == ((48, 64), torch.float32)


@pytest.mark.parametrize("m, k, n", [(30, 64, 48), (48, 30, 64), (64, 1000, 40), (1, 17, 1)])
@pytest.mark.parametrize("rowwise", [False, True])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_fp8_gemm_pads_any_shape_for_the_meta_kernel(m, k, n, rowwise, out_dtype):
    a = torch.empty(m, k, dtype=torch.float8_e4m3fn, device="meta")
    b = torch.empty(k, n, dtype=torch.float8_e5m2, device="meta")
    ia = torch.empty(m, 1, device="meta") if rowwise else torch.empty((), device="meta")
    ib = torch.empty(1, n, device="meta") if rowwise else torch.empty((), device="meta")
    y = fp8_gemm(a, b, ia, ib, out_dtype, "scaled_mm")
    assert (y.shape, y.dtype) == ((m, n), out_dtype)


def test_padding_changes_no_number_on_the_cpu_reference_kernel():
    """The same padded call on CPU ``_scaled_mm`` (a slow reference kernel) against the
    dequantizing fp32 route: K = 30 tokens, N = 40."""
    g = torch.Generator().manual_seed(0)
    a = (torch.randn(24, 30, generator=g) * 8).to(torch.float8_e4m3fn)
    b = (torch.randn(30, 40, generator=g) * 8).to(torch.float8_e4m3fn)
    ia, ib = torch.tensor(0.5), torch.tensor(0.25)
    try:
        got = fp8_gemm(a, b, ia, ib, torch.float32, "scaled_mm")
    except (RuntimeError, NotImplementedError) as e:  # a build without the CPU kernel
        pytest.skip(f"no CPU _scaled_mm here: {e}")
    want = fp8_gemm(a, b, ia, ib, torch.float32, "dequant_fp32")
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-5)


# --- the block-scaled kernels: fp8-block (sm90), mxfp8 and nvfp4 (sm100) ----------------

BLOCK_ROUTES = ["fp8-block,fp8_gemm=scaled_mm", "fp8-block,block_scales=pow2,fp8_gemm=scaled_mm",
                "mxfp8,fp8_gemm=scaled_mm", "nvfp4,fp8_gemm=scaled_mm",
                "nvfp4,nvfp4_2d=false,nvfp4_rht=false,fp8_gemm=scaled_mm"]


@pytest.mark.parametrize("shape", [(64, 48), (384, 272)])
@pytest.mark.parametrize("tokens", [1, 30, 1000])
@pytest.mark.parametrize("recipe", BLOCK_ROUTES)
def test_block_scaled_linear_passes_the_meta_kernels(recipe, tokens, shape):
    """torch.nn.functional.scaled_mm's meta kernel checks the scale dtypes, shapes,
    strides (1×128: outer-dim-major; 128×128: (L4, N/128)) and swizzled sizes of
    every GEMM: K and N not multiples of 128, tokens of 1, 30 and 1000."""
    meta_linear_step(recipe, shape, tokens)


@pytest.mark.parametrize("tokens", [1, 30, 1000])
@pytest.mark.parametrize("recipe", ["fp8-block,fp8_gemm=scaled_mm",
                                    "fp8-block,block_scales=pow2,fp8_gemm=scaled_mm"])
def test_tile_scales_have_16_byte_aligned_rows_at_any_token_count(recipe, tokens,
                                                                   monkeypatch):
    """cuBLASLt needs every matrix's leading dimension 16-byte aligned. A 1×128 tile
    scale is laid out outer-dim-major, so its leading dimension is its row count (M
    fp32 values): M is padded to a multiple of 4. torch's meta kernel does not check
    this, so the test reads each call's scales itself (tokens of 1 and 30 are the
    forward's and dgrad's M)."""
    import mixprec.formats.scaled_mm as route

    seen = []
    real = route.F.scaled_mm

    def spy(a, b, scale_a, recipe_a, scale_b, recipe_b, **kw):
        for s, r in ((scale_a, recipe_a), (scale_b, recipe_b)):
            if r == route.F.ScalingType.BlockWise1x128:
                seen.append((s.shape, s.stride()))
        return real(a, b, scale_a, recipe_a, scale_b, recipe_b, **kw)

    monkeypatch.setattr(route.F, "scaled_mm", spy)
    f8 = Float8Linear.from_linear(nn.Linear(384, 272), recipe).to("meta")
    x = torch.empty(tokens, 384, device="meta", dtype=torch.bfloat16, requires_grad=True)
    y = f8(x)
    y.sum().backward()
    assert y.shape == (tokens, 272) and x.grad.shape == (tokens, 384)
    assert len(seen) == 4  # forward, dgrad: a's tiles; wgrad: both operands' tiles
    for shape, stride in seen:
        assert stride[0] == 1 and shape[0] % 4 == 0, (shape, stride)


@pytest.mark.parametrize("recipe", ["fp8-block", "mxfp8", "nvfp4,nvfp4_sr=false"])
def test_the_probe_runs_a_token_count_that_is_not_a_multiple_of_4(recipe, monkeypatch):
    """The probe's three GEMMs of a Linear run at 200 and at 30 tokens (an M the 1×128
    route must pad), here on a CPU model of the kernels' layouts
    (``_reference_scaled_mm``) and a small timed GEMM: it accepts a kernel that agrees
    and is faster; a kernel that raises (as torch's do on a GPU without them) is
    refused with one warning naming the error."""
    import mixprec.formats.scaled_mm as route
    from mixprec.recipe.linear_format import quantizer_for

    q = quantizer_for(recipe)
    ms = []
    real = route.block_scaled_mm

    def spy(a, b, out_dtype, kind):
        ms.append(a.codes.shape[0])
        return real(a, b, out_dtype, kind)

    times = iter([1.0, 2.0])  # the kernel, then the dequantizing GEMM
    monkeypatch.setattr(route.F, "scaled_mm", _reference_scaled_mm)
    monkeypatch.setattr(route, "block_scaled_mm", spy)
    monkeypatch.setattr(route, "PROBE_TIMED", 256)
    monkeypatch.setattr(route, "_seconds", lambda fn: (fn(), next(times))[1])
    assert route._probe.__wrapped__("cpu", q) is True
    assert {200, 30} <= set(ms)

    def missing(*args, **kwargs):
        raise NotImplementedError("only supported in CUDA for SM90")

    monkeypatch.setattr(route.F, "scaled_mm", missing)
    with pytest.warns(UserWarning, match="is not used on cpu.*SM90.*dequantizing GEMM"):
        assert route._probe.__wrapped__("cpu", q) is False


def test_the_meta_kernel_refuses_row_major_tile_scales():
    """The control: a 1×128 scale in row-major strides is refused, so the layout the
    route builds is what passes."""
    import torch.nn.functional as F

    a = torch.empty(64, 256, dtype=torch.float8_e4m3fn, device="meta")
    b = torch.empty(256, 256, dtype=torch.float8_e4m3fn, device="meta").t()
    sa = torch.empty(64, 2, device="meta")  # row-major: stride (2, 1)
    sb = torch.empty(2, 256, device="meta").t()
    with pytest.raises(RuntimeError, match="1x128 x 1x128"):
        F.scaled_mm(a, b, sa, F.ScalingType.BlockWise1x128, sb,
                    F.ScalingType.BlockWise1x128, output_dtype=torch.bfloat16)


def test_the_swizzle_is_torchaos_blocked_layout_on_odd_shapes():
    """cuBLAS's 32_4_4 scale layout, against torchao's ``to_blocked`` (which its MX and
    NVFP4 GEMMs feed to the same kernels), on shapes that need padding."""
    utils = pytest.importorskip("torchao.prototype.mx_formats.utils")
    from mixprec.formats.scaled_mm import swizzle_32_4_4

    g = torch.Generator().manual_seed(0)
    for rows, cols in [(1, 1), (30, 3), (128, 4), (200, 7), (257, 33)]:
        s = torch.rand(rows, cols, generator=g)
        assert torch.equal(swizzle_32_4_4(s, pad_value=0.0), utils.to_blocked(s))


def test_fp4_packing_is_torchaos_on_every_e2m1_value():
    """Every e2m1 value with both signs (−0 included) packed two per byte, the first in
    the low nibble, against torchao's ``f32_to_f4_unpacked`` + ``pack_uint4``."""
    kernels = pytest.importorskip("torchao.prototype.mx_formats.kernels")
    from mixprec.formats.scaled_mm import pack_e2m1

    mags = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    vals = torch.cat([mags, -mags])
    g = torch.Generator().manual_seed(1)
    v = vals[torch.randint(0, 16, (6, 64), generator=g)]
    v[0, :16] = vals  # each code once, in order, in both nibble positions
    v[1, 1:17] = vals
    ours = pack_e2m1(v.to(torch.float8_e4m3fn)).view(torch.uint8)
    theirs = kernels.pack_uint4(kernels.f32_to_f4_unpacked(v))
    assert torch.equal(ours, theirs)


def _reference_scaled_mm(a, b, scale_a, recipe_a, scale_b, recipe_b, swizzle_a=None,
                         swizzle_b=None, output_dtype=torch.bfloat16, **_):
    """What torch's block-scaled kernels compute, from the layouts its meta kernel
    documents and torchao's decoders: codes times expanded scales, an fp32 GEMM."""
    utils = pytest.importorskip("torchao.prototype.mx_formats.utils")
    kernels = pytest.importorskip("torchao.prototype.mx_formats.kernels")
    import torch.nn.functional as F

    st = F.ScalingType

    def values(t, rows_major):  # (rows, K) fp32 from row-major codes
        if t.dtype == torch.float4_e2m1fn_x2:
            u = kernels.unpack_uint4(t.view(torch.uint8).contiguous())
            return kernels.f4_unpacked_to_f32(u)
        return t.float()

    av = values(a, True)                     # (M, K)
    bv = values(b.t(), True)                 # (N, K): b is column-major (K, N)
    m, k, n = av.shape[0], av.shape[1], bv.shape[0]

    def scales(s, recipe, rows):
        if recipe == st.BlockWise1x128:
            return s.float().repeat_interleave(128, 1)[:, :k]
        if recipe == st.BlockWise128x128:  # (L4, rows / 128): [K block, row block]
            s = s.float()[:-(-k // 128)].t()
            return s.repeat_interleave(128, 0).repeat_interleave(128, 1)[:rows, :k]
        tile = 32 if recipe == st.BlockWise1x32 else 16
        s = utils.from_blocked(s.float(), rows, k // tile)
        return s.repeat_interleave(tile, 1)

    sa, sb = scales(scale_a, recipe_a, m), scales(scale_b, recipe_b, n)
    return ((av * sa) @ (bv * sb).t()).to(output_dtype)


@pytest.mark.parametrize("recipe", ["fp8-block", "fp8-block,block_scales=pow2", "mxfp8",
                                    "nvfp4,nvfp4_sr=false", "nvfp4,nvfp4_2d=false"])
@pytest.mark.parametrize("tokens", [1, 30, 200])
def test_block_scaled_route_computes_the_dequantizing_gemm(recipe, tokens, monkeypatch):
    """The operands, scales and layouts the route hands the kernel mean the same
    product as the exact dequantizing GEMM, for the three GEMMs of a Linear (forward,
    dgrad, wgrad over the tokens): checked through a CPU model of the kernels'
    documented layouts (``_reference_scaled_mm``)."""
    import mixprec.formats.scaled_mm as route
    from mixprec.recipe.linear_format import quantizer_for

    q = quantizer_for(recipe)
    monkeypatch.setattr(route.F, "scaled_mm", _reference_scaled_mm)
    g = torch.Generator().manual_seed(tokens)
    x, w = torch.randn(tokens, 272, generator=g), torch.randn(208, 272, generator=g)
    gy = torch.randn(tokens, 208, generator=g)
    x[0, 3] = 40.0  # an outlier: blocks with different scales
    pairs = {"forward": (q.cast(x, "input", 1, {}), q.cast(w, "weight", 1, {}).t()),
             "dgrad": (q.cast(gy, "grad_output", 1, {}), q.cast(w, "weight", 0, {})),
             "wgrad": (q.cast(gy, "grad_output", 0, {}).t(), q.cast(x, "input", 0, {}))}
    for name, (a, b) in pairs.items():
        want = a.dequant() @ b.dequant()
        for dt in (torch.float32, torch.bfloat16):
            got = route.block_scaled_mm(a, b, dt, q.kernel)
            assert got.shape == want.shape and got.dtype == dt, name
            tol = dict(rtol=1e-5, atol=1e-4) if dt == torch.float32 else \
                dict(rtol=1e-2, atol=1e-2)
            assert torch.allclose(got.float(), want, **tol), (name, dt)


def test_block_routes_by_device_and_choice():
    """CPU keeps the exact dequantizing GEMM under auto and refuses an explicit
    scaled_mm, naming why and the fix; meta tensors take the kernel when asked."""
    from mixprec.formats.route import gemm_route
    from mixprec.recipe.linear_format import quantizer_for

    for recipe in ("fp8-block", "mxfp8", "nvfp4"):
        q = quantizer_for(recipe)
        assert gemm_route("cpu", q, "auto") == "dequant_fp32"
        assert gemm_route("cpu", q, "dequant") == "dequant_fp32"
        assert gemm_route("meta", q, "scaled_mm") == "scaled_mm"
        with pytest.raises(ValueError, match="CUDA only.*fp8_gemm=auto"):
            gemm_route("cpu", q, "scaled_mm")
        with pytest.raises(ValueError, match="valid: auto, scaled_mm"):
            gemm_route("cpu", q, "fast")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("recipe", ["fp8-block", "mxfp8", "nvfp4,nvfp4_sr=false"])
def test_block_scaled_kernels_match_the_dequantizing_gemm_on_cuda(recipe):
    """On a GPU with the kernel (sm90 for block, sm100 for MX / NVFP4): the forward
    GEMM, at 200 and 30 tokens, against the exact dequantizing GEMM on the device (with
    IEEE fp32 pinned). The bound is norm-wise and loose on purpose: the fp8 tensor
    cores keep about 14 bits of the running sum between promotions (a few 2^-13 over
    K = 384) and the output is bf16 (2^-9); a wrong scale or layout is off by O(1)."""
    from mixprec.engine.devices import ieee_fp32_matmul
    from mixprec.formats.route import kernel_missing
    from mixprec.formats.scaled_mm import block_scaled_mm
    from mixprec.recipe.linear_format import quantizer_for

    q = quantizer_for(recipe)
    why = kernel_missing("cuda", q)
    if why is not None:
        pytest.skip(why)
    g = torch.Generator("cuda").manual_seed(0)
    w = torch.randn(256, 384, device="cuda", generator=g)
    b = q.cast(w, "weight", 1, {}).t()
    for tokens in (200, 30):
        x = torch.randn(tokens, 384, device="cuda", generator=g)
        a = q.cast(x, "input", 1, {})
        with ieee_fp32_matmul():
            want = a.dequant() @ b.dequant()
        got = block_scaled_mm(a, b, torch.bfloat16, q.kernel).float()
        assert got.shape == (tokens, 256)
        assert ((got - want).norm() / want.norm()) < 1e-2


def test_the_probe_runs_outside_compiled_graphs(monkeypatch):
    """A compiled forward reads the route on CUDA: dynamo calls the probe's answer once
    while tracing and keeps it as a constant (no graph break, the probe's GEMMs never
    traced)."""
    from torch._dynamo.utils import counters

    import mixprec.formats.scaled_mm as route
    from mixprec.recipe.linear_format import quantizer_for

    calls = []

    def probe(device, quantizer):
        calls.append(device)
        torch.manual_seed(0)  # something dynamo could not put in a graph
        return True

    monkeypatch.setattr(route, "_probe", probe)
    q = quantizer_for("mxfp8")

    def f(x):
        return x * 2 if route._kernel_ok("cuda:0", q) else x

    torch._dynamo.reset()
    counters.clear()
    g = torch.compile(f, backend="eager", fullgraph=True)
    assert torch.equal(g(torch.ones(3)), torch.full((3,), 2.0))
    assert g(torch.ones(3)).sum() == 6 and calls == ["cuda:0"]
    assert dict(counters["graph_break"]) == {}
