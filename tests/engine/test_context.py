"""The precision context: FP32 islands on CPU autocast, tf32 knobs, third-party norms."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from helpers.models import LlamaRMSNorm
from helpers.speeds import set_speeds
from mixprec import precision_context
from mixprec.engine.context import fp32_island_modules, wrap_fp32_modules


def test_cpu_autocast_leaves_norm_and_softmax_in_bf16_and_we_fix_it():
    torch.manual_seed(0)
    lin, ln = nn.Linear(8, 8), nn.LayerNorm(8)
    x = torch.randn(4, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = lin(x)
        assert ln(h).dtype == torch.bfloat16          # torch's CPU autocast: bf16
        assert torch.softmax(h, -1).dtype == torch.bfloat16
    with precision_context("bf16,emulate=false", "cpu"):
        h = lin(x)
        assert h.dtype == torch.bfloat16              # matmuls stay low precision
        assert ln(h).dtype == torch.float32
        assert torch.softmax(h, -1).dtype == torch.float32
        assert h.log_softmax(-1).dtype == torch.float32
        assert F.cross_entropy(h, torch.tensor([0, 1, 2, 3])).dtype == torch.float32


def test_islands_compute_in_fp32_not_just_cast():
    """The island's result equals fp32 layer_norm of the bf16 input, not a bf16 one."""
    torch.manual_seed(0)
    h = (torch.randn(64, 256) * 3 + 5).bfloat16()
    ln = nn.LayerNorm(256)
    with precision_context("bf16", "cpu"):
        got = ln(h)
    ref = F.layer_norm(h.float(), (256,), ln.weight, ln.bias)
    assert torch.equal(got, ref)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bf = ln(h)
    assert not torch.equal(bf.float(), ref)


def test_norm_with_bf16_weights_runs_and_grads_flow():
    ln = nn.LayerNorm(8).bfloat16()
    x = torch.randn(2, 8, requires_grad=True)
    with precision_context("bf16-master", "cpu"):
        y = ln(x)
    y.sum().backward()
    assert y.dtype == torch.float32 and ln.weight.grad.dtype == torch.bfloat16


def test_keep_fp32_none_turns_islands_off():
    with precision_context("bf16,keep_fp32=none,emulate=false", "cpu"):
        assert torch.softmax(torch.randn(2, 2).bfloat16(), -1).dtype == torch.bfloat16


def test_tf32_knobs_set_and_restored():
    before = (torch.backends.cuda.matmul.allow_tf32, torch.get_float32_matmul_precision())
    with precision_context("tf32", "cpu"):
        assert torch.backends.cuda.matmul.allow_tf32
        assert torch.get_float32_matmul_precision() == "high"
    assert (torch.backends.cuda.matmul.allow_tf32,
            torch.get_float32_matmul_precision()) == before


def test_third_party_norm_modules_run_in_fp32():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), LlamaRMSNorm(8))
    x = torch.randn(16, 8) * 40
    mods = fp32_island_modules(model, ("rms_norm",))
    assert mods == [model[1]]
    with precision_context("bf16", "cpu"):
        h = model[0](x)
        plain = model[1](h)  # bf16 pow/mean/rsqrt, promoted to fp32 only at the weight
    undo = wrap_fp32_modules(mods, "cpu")
    with precision_context("bf16", "cpu"):
        wrapped = model(x)
    undo()
    ref = model[1](h.float())  # the whole norm in fp32
    assert torch.equal(wrapped, ref)
    assert not torch.equal(plain, ref)
    assert "forward" not in model[1].__dict__  # undo restored the class forward


@pytest.mark.parametrize("recipe", ["bf16,emulate=false", "fp16,emulate=false"])
def test_matmuls_run_in_compute_dtype(recipe):
    with precision_context(recipe, "cpu"):
        y = nn.Linear(4, 4)(torch.randn(2, 4))
    assert y.dtype == {"bf16,emulate=false": torch.bfloat16,
                       "fp16,emulate=false": torch.float16}[recipe]


def test_fp16_emulated_where_slow(monkeypatch, measured):
    from mixprec.formats import elements as formats

    set_speeds(monkeypatch, bf16=0.02, fp16=0.02)
    torch.manual_seed(0)
    lin, x = nn.Linear(16, 16), torch.randn(4, 16)
    with precision_context("fp16", "cpu"):
        y = lin(x)
    assert y.dtype == torch.float32  # fp32 storage ...
    assert torch.equal(y, formats.quantize(y, "fp16"))  # ... holding fp16 values
    with precision_context("fp16,emulate=false", "cpu"):
        assert torch.equal(lin(x).float(), y)  # the same bits as the real fp16 kernel


class _Checkpointed(nn.Module):
    """A block whose body (Linear, LayerNorm, GELU, softmax, Linear) may be recomputed
    in backward by torch.utils.checkpoint."""

    def __init__(self, mode: str | None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.mode = mode
        self.body = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.GELU(),
                                  nn.Softmax(-1), nn.Linear(32, 16))
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        if self.mode is None:
            return self.head(self.body(x))
        from torch.utils.checkpoint import checkpoint

        return self.head(checkpoint(self.body, x, use_reentrant=self.mode == "reentrant"))


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("recipe", ["bf16", "bf16-master", "fp16-master",
                                    "bf16-master,wgrad=fp32", "fp8", "fp16,emulate=true"])
@pytest.mark.parametrize("mode", ["non-reentrant", "reentrant"])
def test_activation_checkpointing_recomputes_with_the_islands(recipe, mode):
    """torch.utils.checkpoint recomputes in backward with autocast restored but not
    function modes; without engine.backward keeping them on, the recomputed LayerNorm
    runs in bf16 and torch raises CheckpointError. With them: identical gradients."""
    from mixprec import MixedPrecision

    x = torch.randn(8, 16, requires_grad=mode == "reentrant")
    y = torch.randint(0, 4, (8,))
    grads = []
    for m in (None, mode):
        model = _Checkpointed(m)
        engine = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.0), recipe)
        with engine.autocast():
            loss = F.cross_entropy(model(x), y)
        engine.backward(loss)
        grads.append([g.clone() for g in engine.param_state.gradients()])
    for a, b in zip(*grads, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("recipe", ["bf16-master", "fp16-master,init_scale=1024",
                                    "bf16-master,wgrad=fp32"])
def test_ops_cpu_autocast_does_not_promote_get_cuda_promotion(recipe):
    """nn.Bilinear (and dot, cross, tensordot, index_put, scatter_add) raise on the CPU when
    fp32 activations meet bf16 weights; CUDA autocast promotes them to the widest dtype,
    and so does mixprec's context on the CPU. The result equals fp32 math on the same
    (rounded) weights."""
    from mixprec import MixedPrecision

    torch.manual_seed(0)
    model = nn.Bilinear(8, 8, 4)
    x1, x2 = torch.randn(5, 8), torch.randn(5, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(RuntimeError):
        model.bfloat16()(x1, x2)  # torch alone: "All tensors must have the same dtype"
    model = nn.Bilinear(8, 8, 4)
    engine = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), recipe)
    with engine.autocast():
        out = model(x1, x2)
        assert torch.dot(x1[0], model.weight[0, 0].to(x1.dtype)).dtype == torch.float32
    want = F.bilinear(x1, x2, model.weight.float(), model.bias.float())
    assert out.dtype == torch.float32 and torch.equal(out, want)
    engine.backward(out.square().mean())
    assert not bool(engine.step().skipped)
    assert all(torch.isfinite(g).all() for g in engine.param_state.gradients())


@pytest.mark.parametrize("recipe", ["bf16", "bf16-master", "fp16-master,init_scale=1024"])
def test_matrix_vector_ops_are_cast_down_as_cuda_autocast_does(recipe):
    recipe += ",emulate=false"  # real kernels: the dtypes are what is checked
    """CUDA autocast runs mv, addmv and addr in the low-precision dtype; CPU autocast
    leaves them alone, so fp32 activations meeting bf16 weights raise there. mixprec's
    context casts them as CUDA does: the result equals the op on the cast inputs, bit for
    bit, and fp64 inputs stay fp64."""
    from mixprec import MixedPrecision

    class MatVec(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w, self.b = nn.Parameter(torch.randn(6, 8)), nn.Parameter(torch.randn(6))

        def forward(self, x):
            return torch.stack([torch.addmv(self.b, self.w, r) + self.w.mv(r) for r in x])

    torch.manual_seed(0)
    x = torch.randn(3, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(RuntimeError):
        torch.mv(torch.randn(6, 8).bfloat16(), x[0])  # torch alone: dtypes must match
    model = MatVec()
    engine = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), recipe)
    low = engine.recipe.compute_dtype
    with engine.autocast():
        out = model(x)
        outer = torch.addr(model.w.float(), x[0][:6], x[1])
        wide = torch.mv(torch.randn(6, 8, dtype=torch.float64), x[0].double())
    w, b = model.w.to(low), model.b.to(low)
    want = torch.stack([torch.addmv(b, w, r.to(low)) + w.mv(r.to(low)) for r in x])
    assert out.dtype == low and torch.equal(out, want)
    assert outer.dtype == low and torch.equal(
        outer, torch.addr(w, x[0][:6].to(low), x[1].to(low)))
    assert wide.dtype == torch.float64
    engine.backward(out.float().square().mean())
    assert all(torch.isfinite(g).all() for g in engine.param_state.gradients())


@pytest.mark.parametrize("recipe", ["fp16", "fp16-master,init_scale=256",
                                    "fp16,emulate=false"])
def test_fp16_lstm_runs_in_fp32_where_the_cpu_has_no_fp16_lstm(recipe):
    """CPU autocast sends fp16 LSTMs to oneDNN; where it has none they raise. The context
    runs them in fp32 then, as CPU autocast already runs GRU and RNN: the output equals
    the fp32 LSTM on the same (rounded) weights."""
    from mixprec import MixedPrecision
    from mixprec.engine.context import _cpu_runs_fp16_lstm

    torch.manual_seed(0)
    x = torch.randn(3, 5, 8)
    if _cpu_runs_fp16_lstm():
        pytest.skip("this CPU has an fp16 LSTM; the context leaves it to autocast")
    with torch.autocast("cpu", dtype=torch.float16), pytest.raises(RuntimeError):
        nn.LSTM(8, 16, batch_first=True)(x)  # torch alone
    model = nn.LSTM(8, 16, batch_first=True)
    engine = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), recipe)
    with engine.autocast():
        out, (h, c) = model(x)
    ref = nn.LSTM(8, 16, batch_first=True)
    ref.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    want, _ = ref(x)
    assert out.dtype == h.dtype == torch.float32
    assert torch.allclose(out, want, rtol=1e-5, atol=1e-6)
    engine.backward(out.square().mean())
    assert not bool(engine.step().skipped)
