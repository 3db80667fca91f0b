"""CUDA checks (marked; skipped without a GPU). benchmarks/gpu.sh runs them on a lent GPU."""

from __future__ import annotations

import pytest
import torch

from helpers.models import pattern_losses
from mixprec import MixedPrecision
from mixprec.formats import elements as formats
from mixprec.formats.scaling import cast_to_fp8
from mixprec.formats.tensor_gemm import fp8_gemm
from mixprec.modules.linear import Float8Linear
from mixprec.workbench import GPT, GPTConfig

pytestmark = pytest.mark.cuda

#: what an fp8 tensor-core GEMM may add to the exact sum, as a share of the sum of
#: |products|, for K = 512. Hopper's fp8 tensor cores keep about 14 significant bits of
#: the running sum between promotions to fp32 (DeepSeek-V3 technical report, "Increasing
#: Accumulation Precision": ~2% off at K = 4096 without them), so each of the K / 32 =
#: 16 additions of a 32-product MMA step may err by 2^-13 of the sum of |products| so
#: far: at most 16 * 2^-13 = 2^-9 in all, taken twice for the promotions' fp32
#: roundings and the scales applied after.
FP8_ACCUMULATION_512 = 2.0**-8


@pytest.mark.parametrize("recipe", ["bf16", "bf16-master", "fp16", "fp8", "fp8-rowwise",
                                    "tf32", "fp8-block", "mxfp8", "nvfp4"])
def test_engine_trains_on_cuda(recipe):
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layers=2, d_model=128, n_heads=4, seq_len=128)).cuda()
    engine = MixedPrecision(model, torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True),
                            recipe)
    losses = pattern_losses(engine, model, 40, period=7, device="cuda")
    assert losses[-1] < 0.5 * losses[0]


def test_scaled_mm_on_cuda_matches_exact_rounding():
    """Tensorwise ``_scaled_mm`` (bf16 out) against the float64 product of the same codes
    rounded to bf16: within an ulp plus the fp8 kernel's own accumulation
    (``FP8_ACCUMULATION_512`` of the sum of |products|), not the 1 ulp an exact fp32
    accumulation would give on nearly every element."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(256, 512, generator=g), torch.randn(384, 512, generator=g) * 0.1
    sx, sw = torch.tensor(448.0) / x.abs().max(), torch.tensor(448.0) / w.abs().max()
    x8 = cast_to_fp8(x.cuda(), sx.cuda(), torch.float8_e4m3fn)
    w8 = cast_to_fp8(w.cuda(), sw.cuda(), torch.float8_e4m3fn)
    real = fp8_gemm(x8, w8.t(), (1 / sx).cuda(), (1 / sw).cuda(), torch.bfloat16,
                    "scaled_mm").float().cpu()
    xd, wd = x8.cpu().double(), w8.cpu().double()
    scale = sx.double() * sw.double()
    exact = formats.quantize((xd @ wd.t()) / scale, "bf16").float()
    magnitude = ((xd.abs() @ wd.abs().t()) / scale).float()
    bound = formats.ulp(exact, "bf16") + FP8_ACCUMULATION_512 * magnitude
    assert ((real - exact).abs() <= bound).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rowwise_float8linear_on_cuda_matches_the_cpu_dequant_path(dtype):
    """CUDA's rowwise _scaled_mm (bf16 out) and its unit-scale fp32 path against the
    CPU's dequant backend on the same casts (exact products, fp32 accumulation). Not to
    fp32 summation order: the bound is the fp8 kernel's own accumulation
    (``FP8_ACCUMULATION_512`` of the sum of |products|), plus an ulp of the output
    format on each side (the CPU's bf16 route rounds twice)."""
    from torch import nn

    from mixprec.modules.linear import Float8Linear

    torch.manual_seed(0)
    lin = nn.Linear(512, 384, bias=False)
    x = torch.randn(256, 512) * torch.logspace(-2, 2, 256).reshape(256, 1)
    ref = Float8Linear.from_linear(lin, "fp8-rowwise,fp8_gemm=dequant")
    cpu = ref(x.to(dtype)).float()
    xq, wq = ref.quantize(x.to(dtype), "input", 1), ref.quantize(lin.weight, "weight", 1)
    magnitude = xq.dequant().abs() @ wq.dequant().abs().t()  # the sum of |products|
    gpu = Float8Linear.from_linear(lin.cuda(), "fp8-rowwise,fp8_gemm=scaled_mm")
    got = gpu(x.to(dtype).cuda()).float().cpu()
    fmt = "bf16" if dtype == torch.bfloat16 else "fp32"
    bound = 2 * formats.ulp(cpu, fmt) + FP8_ACCUMULATION_512 * magnitude
    assert ((got - cpu).abs() <= bound).all()


def test_quantize_on_cuda_equals_cpu():
    x = torch.randn(1 << 20) * 1000
    for name in ("fp16", "bf16", "fp8_e4m3", "fp4_e2m1"):
        assert torch.equal(formats.quantize(x.cuda(), name).cpu(), formats.quantize(x, name))


@pytest.mark.parametrize("fmt", ["fp16", "bf16"])
def test_emulation_matches_real_kernels_on_cuda(fmt):
    from torch import nn
    from torch.nn import functional as F

    from mixprec import precision_context

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64), nn.LayerNorm(64),
                          nn.Linear(64, 8)).cuda()
    x = torch.randn(32, 64, device="cuda")

    def run(recipe):
        model.zero_grad(set_to_none=True)
        with precision_context(recipe, "cuda"):
            y = model(x)
            F.mse_loss(y, torch.zeros_like(y)).backward()
        return [y.detach().float()] + [p.grad for p in model.parameters()]

    emulated, real = run(f"{fmt},emulate=true"), run(f"{fmt},emulate=false")
    ok = torch.cat([((e - r.float()).abs() <= formats.ulp(r.float(), fmt)).flatten()
                    for e, r in zip(emulated, real)])
    assert ok.float().mean() >= 0.99


def test_fp32_weight_grads_on_cuda():
    """wgrad=fp32 on CUDA: mm(out_dtype=fp32) gives the float64 sum of the bf16 products
    to fp32 accumulation's precision, where autocast's bf16 weight gradient is ~2^-10
    off (norm-wise). Not to 1e-6: tensor cores add each 16-product step into the fp32
    accumulator truncating, not rounding (Fasi et al., "Numerical behavior of NVIDIA
    tensor cores", 2021), so the K / 16 = 256 additions may each lose up to an fp32 ulp
    of the running sum, 256 * 2^-23 = 2^-15 of it even if every loss had the same sign;
    2^-13 leaves 4x for running sums larger than the result, and stays 8x below bf16."""
    from mixprec.engine.wgrad import _mm_fp32

    g = torch.Generator().manual_seed(0)
    a = torch.randn(64, 4096, generator=g).bfloat16()
    b = torch.randn(4096, 96, generator=g).bfloat16()
    ref = a.double() @ b.double()
    got = _mm_fp32(a.cuda(), b.cuda()).cpu()
    assert got.dtype == torch.float32
    assert ((got.double() - ref).norm() / ref.norm()) < 2.0**-13
    assert (((a.cuda() @ b.cuda()).cpu().double() - ref).norm() / ref.norm()) > 2.0**-12


def test_compiled_model_on_cuda_matches_eager():
    """torch.compile (inductor) on CUDA under the engine's context: same losses as eager
    to bf16 precision over a few steps."""
    def losses(compiled):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = GPT(GPTConfig(n_layers=2, d_model=128, n_heads=4, seq_len=64)).cuda()
        engine = MixedPrecision(model, torch.optim.AdamW(model.parameters(), lr=1e-3,
                                                         fused=True), "bf16")
        f = torch.compile(model) if compiled else model
        idx = torch.randint(0, 256, (8, 65), device="cuda",
                            generator=torch.Generator("cuda").manual_seed(0))
        out = []
        for _ in range(5):
            with engine.autocast():
                loss = f(idx[:, :-1], idx[:, 1:])
            engine.backward(loss)
            engine.step()
            out.append(loss.item())
        return out

    assert losses(True) == pytest.approx(losses(False), rel=2e-2)


@pytest.mark.parametrize("recipe", ["fp8-block", "mxfp8", "nvfp4"])
def test_block_casts_on_cuda_equal_the_cpus(recipe):
    """The block, MX and NVFP4 casts and their dequantizing GEMMs give the CPU's values on
    CUDA (same fp32 ops; the GEMM to fp32 summation order). The GEMM is pinned to the
    exact route on both devices: under ``auto`` a GPU with the kernel takes it, whose
    fp8 tensor cores keep about 14 bits between promotions, far from 1e-5; the kernel
    is compared with the exact route at its own tolerance in
    ``test_cuda_routes_meta.py`` (and by the probe)."""
    g = torch.Generator().manual_seed(0)
    lin = torch.nn.Linear(512, 384, bias=False)
    x = torch.randn(256, 512, generator=g)
    exact = f"{recipe},fp8_gemm=dequant_fp32"
    with torch.no_grad():
        cpu = Float8Linear.from_linear(lin, exact)(x)
        mod = Float8Linear.from_linear(lin.cuda(), exact)
        assert mod.backend == "dequant_fp32"
        gpu = mod(x.cuda()).cpu()
    assert (gpu - cpu).abs().max() <= 1e-5 * cpu.abs().max()
