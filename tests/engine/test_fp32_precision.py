"""torch's fp32 precision settings under mixprec's pins, whichever API the user set.

torch (2.9+) has a legacy API (``set_float32_matmul_precision``, ``allow_tf32``) and a
per-backend one (``fp32_precision``); its legacy readers, among them the one cuBLAS asks
for every handle on CUDA, raise "mix of the legacy and new APIs" when the two disagree.
Here the CPU build's own checks stand in for CUDA's: the oneDNN settings
(``torch.backends.mkldnn.matmul``) and the CUDA ones exist, and are checked, on CPU
builds too. Each test compares every reading torch offers before and after (read
through torch's own getters, not through the module under test)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from mixprec import MixedPrecision, precision_context
from mixprec.formats.fp32_precision import Fp32Precision, fp32_matmul_is_ieee, ieee_fp32_matmul
from mixprec.modules.linear import Float8Linear

pytestmark = pytest.mark.skipif(
    tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 9),
    reason="the per-backend fp32_precision API and its checks came with torch 2.9")

_SETTINGS = [(b, op) for b, ops in (("generic", ("all",)),
                                    ("cuda", ("all", "matmul", "conv", "rnn")),
                                    ("mkldnn", ("all", "matmul", "conv", "rnn")))
             for op in ops]
_DEFAULTS = {("cuda", "conv"): "tf32", ("cuda", "rnn"): "tf32"}  # torch's, else none


def _observed() -> dict:
    """Every per-backend setting as torch reads it, and what each legacy reader says
    (its value, or that it raises)."""
    out = {f"{b}.{op}": torch._C._get_fp32_precision_getter(b, op) for b, op in _SETTINGS}
    for name, read in (("get_float32_matmul_precision", torch.get_float32_matmul_precision),
                       ("cuda.matmul.allow_tf32", lambda: torch.backends.cuda.matmul.allow_tf32),
                       ("cudnn.allow_tf32", lambda: torch.backends.cudnn.allow_tf32)):
        try:
            out[name] = read()
        except RuntimeError as e:
            assert "mix of" in str(e) or "legacy" in str(e), e
            out[name] = "raises"
    return out


def _torch_defaults() -> None:
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.allow_tf32 = True
    for b, op in _SETTINGS:
        torch._C._set_fp32_precision_setter(b, op, _DEFAULTS.get((b, op), "none"))


@pytest.fixture(autouse=True)
def defaults():
    """Each test starts from and leaves torch's default settings."""
    _torch_defaults()
    fresh = _observed()
    yield
    _torch_defaults()
    assert _observed() == fresh


def _legacy_high():
    torch.set_float32_matmul_precision("high")


def _legacy_medium():
    torch.set_float32_matmul_precision("medium")


def _legacy_allow_tf32():
    torch.backends.cuda.matmul.allow_tf32 = True


def _legacy_medium_no_cudnn_tf32():
    torch.set_float32_matmul_precision("medium")
    torch.backends.cudnn.allow_tf32 = False


def _new_cuda_tf32():  # what transformers' TrainingArguments(tf32=True) does
    torch.backends.cuda.matmul.fp32_precision = "tf32"


def _new_onednn_bf16():
    torch.backends.mkldnn.matmul.fp32_precision = "bf16"


def _new_global_tf32():
    torch.backends.fp32_precision = "tf32"


def _new_exact_convs():
    torch.backends.cudnn.conv.fp32_precision = "ieee"


def _legacy_then_new():
    torch.set_float32_matmul_precision("high")
    torch.backends.cuda.matmul.fp32_precision = "ieee"


LEGACY = [_legacy_high, _legacy_medium, _legacy_allow_tf32, _legacy_medium_no_cudnn_tf32]
NEW = [_new_cuda_tf32, _new_onednn_bf16, _new_global_tf32, _new_exact_convs,
       _legacy_then_new]


def _ids(fns):
    return [f.__name__.strip("_") for f in fns]


def _assert_ieee_inside():
    """IEEE on every backend, and every legacy reader agrees (none raises)."""
    assert torch.backends.cuda.matmul.allow_tf32 is False  # what cuBLAS reads per handle
    assert torch.get_float32_matmul_precision() == "highest"
    # ("none" as read: nothing set on the chain up to torch.backends, so IEEE)
    assert torch.backends.cuda.matmul.fp32_precision in ("ieee", "none")
    assert torch.backends.mkldnn.matmul.fp32_precision in ("ieee", "none")


@pytest.mark.parametrize("user", LEGACY + NEW, ids=_ids(LEGACY + NEW))
def test_an_ieee_region_raises_nothing_and_restores_the_users_setting(user):
    user()
    before = _observed()
    with ieee_fp32_matmul():
        _assert_ieee_inside()
        with ieee_fp32_matmul():  # nested (an exact route under emulation)
            _assert_ieee_inside()
        _assert_ieee_inside()
    assert _observed() == before
    with pytest.raises(ValueError), ieee_fp32_matmul():
        raise ValueError("restored on errors too")
    assert _observed() == before


_GEMMS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}


class _ReadsLikeCuBLAS(TorchDispatchMode):
    """Reads ``allow_tf32`` at every GEMM kernel (forward and backward), as cuBLAS does
    when it hands out a handle."""

    def __init__(self):
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in _GEMMS:
            torch.backends.cuda.matmul.allow_tf32  # noqa: B018 (raises on a mix)
            self.reads += 1
        return func(*args, **(kwargs or {}))


def _float8_run(recipe: str):
    torch.manual_seed(0)
    f8 = Float8Linear.from_linear(nn.Linear(96, 80), recipe)
    x = torch.randn(30, 96, requires_grad=True)
    f8(x).square().sum().backward()
    return [x.grad, f8.weight.grad]


@pytest.mark.parametrize("recipe", ["mxfp8", "fp8-block", "fp8-rowwise,fp8_gemm=dequant_fp32"])
@pytest.mark.parametrize("user", [_legacy_high, _legacy_medium], ids=_ids([_legacy_high,
                                                                          _legacy_medium]))
def test_exact_fp8_routes_under_a_legacy_tf32_setting(recipe, user):
    """A training script's ``set_float32_matmul_precision("high")``: the dequantizing
    GEMMs run pinned, no matmul's precision reading raises, the result is the one under
    "highest", and the script's setting is back afterwards."""
    want = _float8_run(recipe)
    user()
    before = _observed()
    with _ReadsLikeCuBLAS() as mode:
        got = _float8_run(recipe)
    assert mode.reads >= 3  # the forward GEMM and the two backward ones
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert _observed() == before


def test_emulation_under_a_legacy_tf32_setting():
    def run():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 8))
        engine = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                "fp16,emulate=true")
        with engine.autocast():
            loss = model(torch.randn(16, 32)).float().square().mean()
        engine.backward(loss)
        engine.step()
        return [p.detach().clone() for p in model.parameters()]

    want = run()
    _legacy_high()
    before = _observed()
    with _ReadsLikeCuBLAS() as mode:
        got = run()
    assert mode.reads > 0
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert _observed() == before


ALL = [None, *LEGACY, *NEW]


@pytest.mark.parametrize("user", ALL, ids=["default", *_ids(LEGACY + NEW)])
def test_the_tf32_recipe_under_settings_of_either_api(user):
    """The ``tf32`` recipe turns TF32 on through both APIs (no reader raises inside)
    and leaves exactly what the user had, legacy, per-backend or a mix."""
    if user is not None:
        user()
    before = _observed()
    with precision_context("tf32", "cpu"):
        assert torch.backends.cuda.matmul.allow_tf32 is True
        assert torch.get_float32_matmul_precision() == "high"
        assert torch.backends.cudnn.allow_tf32 is True
        assert torch.backends.cuda.matmul.fp32_precision == "tf32"
        assert torch.backends.cudnn.conv.fp32_precision == "tf32"
        with ieee_fp32_matmul():  # an exact route inside a tf32 region
            _assert_ieee_inside()
        assert torch.backends.cuda.matmul.allow_tf32 is True
    assert _observed() == before


@pytest.mark.parametrize("user,ieee", [(None, True), (_legacy_high, False),
                                       (_legacy_medium, False), (_new_onednn_bf16, False),
                                       (_new_global_tf32, False), (_new_exact_convs, True),
                                       (_legacy_then_new, False)])
def test_fp32_matmul_is_ieee_reads_either_api(user, ieee):
    """What the compiled exact routes check: read without raising on a mix (torch's
    ``get_float32_matmul_precision`` raises for the oneDNN bf16 and global tf32 ones)."""
    if user is not None:
        user()
    assert fp32_matmul_is_ieee() is ieee


@pytest.mark.parametrize("user", ALL, ids=["default", *_ids(LEGACY + NEW)])
def test_a_read_state_restores_itself_after_any_change(user):
    if user is not None:
        user()
    before = _observed()
    saved = Fp32Precision.read()
    assert _observed() == before  # reading changed nothing
    torch.set_float32_matmul_precision("medium")
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.mkldnn.matmul.fp32_precision = "ieee"
    saved.restore()
    assert _observed() == before
