"""The exact fp32 routes stay exact when the user lowers fp32 matmul precision:
``torch.set_float32_matmul_precision("medium")`` runs fp32 GEMMs in bf16 on AMX /
AVX-512 BF16 CPUs (and TF32 on NVIDIA GPUs). mixprec pins IEEE fp32 around the
dequantizing fp8, block, MX and NVFP4 GEMMs and under emulation, and restores the
user's setting."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mixprec import MixedPrecision
from mixprec.engine.devices import ieee_fp32_matmul
from mixprec.modules.linear import Float8Linear


def _knobs():
    return (torch.get_float32_matmul_precision(), torch.backends.mkldnn.matmul.fp32_precision,
            torch.backends.cuda.matmul.fp32_precision)


@pytest.fixture(autouse=True)
def restore_precision():
    """Each test leaves the process's matmul settings as it found them."""
    saved = _knobs()
    yield
    torch.set_float32_matmul_precision(saved[0])
    torch.backends.mkldnn.matmul.fp32_precision = saved[1]
    torch.backends.cuda.matmul.fp32_precision = saved[2]


@pytest.fixture
def medium():
    torch.set_float32_matmul_precision("medium")


def _lowers_precision_here() -> bool:
    a, b = torch.randn(64, 256), torch.randn(256, 64)
    torch.set_float32_matmul_precision("medium")
    try:
        low = a @ b
    finally:
        torch.set_float32_matmul_precision("highest")
    return not torch.equal(low, a @ b)


def _float8_grads(recipe: str):
    torch.manual_seed(0)
    lin = nn.Linear(96, 80)
    f8 = Float8Linear.from_linear(lin, recipe)
    x = torch.randn(30, 96, requires_grad=True)  # 30 tokens
    y = f8(x)
    y.square().sum().backward()
    return [y.detach(), x.grad, f8.weight.grad]


# (per-tensor fp8 is exact either way: its GEMM takes bare e4m3 / e5m2 codes, which bf16
# holds exactly, and applies the scales after)
EXACT_ROUTES = ["fp8-rowwise,fp8_gemm=dequant_fp32", "fp8-block", "mxfp8", "nvfp4"]


@pytest.mark.parametrize("recipe", EXACT_ROUTES)
def test_exact_fp8_routes_are_exact_under_medium_matmul_precision(recipe, medium):
    torch.set_float32_matmul_precision("highest")
    want = _float8_grads(recipe)
    torch.set_float32_matmul_precision("medium")
    got = _float8_grads(recipe)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert torch.get_float32_matmul_precision() == "medium"  # the user's, restored
    assert torch.backends.mkldnn.matmul.fp32_precision == "bf16"


def test_emulation_is_exact_under_medium_matmul_precision(medium):
    def run():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 16))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        # fp16's 11-bit significands do not fit bf16: an unpinned GEMM would round them
        engine = MixedPrecision(model, opt, "fp16,emulate=true")
        x = torch.randn(32, 64)
        for _ in range(2):
            with engine.autocast():
                loss = model(x).float().square().mean()
            engine.backward(loss)
            engine.step()
            engine.zero_grad()
        return [p.detach().clone() for p in model.parameters()]

    torch.set_float32_matmul_precision("highest")
    want = run()
    torch.set_float32_matmul_precision("medium")
    got = run()
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert torch.backends.mkldnn.matmul.fp32_precision == "bf16"


def test_the_pin_restores_every_setting_and_is_needed_here():
    torch.backends.mkldnn.matmul.fp32_precision = "bf16"
    torch.backends.cuda.matmul.fp32_precision = "tf32"
    with ieee_fp32_matmul():
        assert torch.backends.mkldnn.matmul.fp32_precision == "ieee"
        assert torch.backends.cuda.matmul.fp32_precision == "ieee"
    assert torch.backends.mkldnn.matmul.fp32_precision == "bf16"
    assert torch.backends.cuda.matmul.fp32_precision == "tf32"
    with pytest.raises(RuntimeError), ieee_fp32_matmul():
        raise RuntimeError("restored on errors too")
    assert torch.backends.mkldnn.matmul.fp32_precision == "bf16"
    torch.backends.mkldnn.matmul.fp32_precision = "none"
    if not _lowers_precision_here():
        pytest.skip("this CPU runs fp32 matmuls in full precision under 'medium' "
                    f"({torch.backends.cpu.get_cpu_capability()}): the pin changes nothing")
    # the control: unpinned, the same route's GEMM really is lower precision here
    a, b = torch.randn(64, 256), torch.randn(256, 64)
    torch.set_float32_matmul_precision("medium")
    try:
        low = a @ b
        with ieee_fp32_matmul():
            pinned = a @ b
    finally:
        torch.set_float32_matmul_precision("highest")
    assert not torch.equal(low, pinned) and torch.equal(pinned, a @ b)
