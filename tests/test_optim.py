"""mixprec.optim: torch's optimizers bit for bit with fp32 states, the quantizers
against float64 references, and the write rules' numerics."""

from __future__ import annotations

import pytest
import torch

import mixprec.optim as mo
from mixprec.optim.states import BLOCK, MIN_NUMEL, decode, encode, state_bytes
from mixprec.optim.writes import join_remainder, split_remainder, stochastic_round

SHAPES = ((64, 32), (32,), (40, 130))


def _pair(make_torch, make_ours, steps=12, shapes=SHAPES, dtype=torch.float32):
    torch.manual_seed(0)
    init = [torch.randn(*s) for s in shapes]
    a = [torch.nn.Parameter(p.clone()) for p in init]
    b = [torch.nn.Parameter(p.clone().to(dtype)) for p in init]
    ot, om = make_torch(a), make_ours(b)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for x, y in zip(a, b):
            grad = torch.randn(x.shape, generator=g)
            x.grad, y.grad = grad.clone(), grad.clone().to(dtype)
        ot.step()
        om.step()
    return a, b, ot, om


TORCH_TWINS = [
    ("AdamW", dict(lr=1e-2, weight_decay=0.1)),
    ("AdamW", dict(lr=3e-3, betas=(0.8, 0.95), eps=1e-6)),
    ("Adam", dict(lr=1e-2, weight_decay=0.1)),
    ("Adam", dict(lr=1e-2, maximize=True)),
    ("SGD", dict(lr=1e-2)),
    ("SGD", dict(lr=1e-2, momentum=0.9, weight_decay=1e-2)),
    ("SGD", dict(lr=1e-2, momentum=0.9, nesterov=True)),
    ("SGD", dict(lr=1e-2, momentum=0.9, dampening=0.1, maximize=True)),
]


@pytest.mark.parametrize("name, kw", TORCH_TWINS)
def test_fp32_states_equal_torch_bit_for_bit(name, kw):
    a, b, _, _ = _pair(lambda p: getattr(torch.optim, name)(p, **kw),
                       lambda p: getattr(mo, name)(p, **kw))
    assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("name", ["AdamW", "Adam"])
def test_fused_fp32_states_equal_torchs_fused_kernel_bit_for_bit(name):
    kw = dict(lr=1e-2, weight_decay=0.1, fused=True)
    a, b, _, _ = _pair(lambda p: getattr(torch.optim, name)(p, **kw),
                       lambda p: getattr(mo, name)(p, **kw))
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def _ref_blocks(x: torch.Tensor) -> list[list[torch.Tensor]]:
    """The documented blocks, one row at a time: each row of ``x`` (dim 0) cut into
    pieces of min(256, cols) elements, the last zero-padded (a slow, separate path)."""
    rows = x.reshape(x.shape[0], -1)
    w = min(BLOCK, rows.shape[1])
    out = []
    for row in rows:
        pieces = [row[i:i + w] for i in range(0, row.numel(), w)]
        out.append([torch.cat([q, q.new_zeros(w - q.numel())]) for q in pieces])
    return out


def _ref_decode(x: torch.Tensor, quant) -> torch.Tensor:
    """``quant(block) -> float64 values`` over every documented block of ``x``, put
    back in ``x``'s shape."""
    cols = x[0].numel()
    rows = [torch.cat([quant(b) for b in row])[:cols] for row in _ref_blocks(x)]
    return torch.stack(rows).view(x.shape)


def _int8_signed(b):
    s = b.abs().max() / 127  # the fp32 scale, as documented
    if s == 0:
        return torch.zeros_like(b, dtype=torch.float64)
    q = torch.round((b / s).double()).clamp(-127, 127)  # fp32 quotient, half to even
    return q * s.double()


def test_int8_signed_states_equal_the_float64_reference():
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(40, 300, generator=g) * torch.logspace(-6, 0, 300)).contiguous()
    x[3] = 0  # all-zero blocks
    got = decode(encode(x, "int8"), "int8", x).double()
    assert torch.equal(got, _ref_decode(x, _int8_signed).float().double())


def test_blocks_lie_along_rows_so_a_dim0_shard_encodes_as_those_rows_do():
    g = torch.Generator().manual_seed(8)
    x = torch.randn(37, 400, generator=g) * torch.logspace(-3, 3, 37)[:, None]
    for fmt, signed in (("int8", True), ("int8", False), ("fp8", True)):
        full = encode(x.abs() if not signed else x, fmt, signed)
        part = encode((x.abs() if not signed else x)[19:], fmt, signed)  # a rank's rows
        assert full["q"].shape == (37, 2, 256) and full["s"].shape == (37, 2, 1)
        assert torch.equal(full["q"][19:].view(torch.uint8), part["q"].view(torch.uint8))
        assert torch.equal(full["s"][19:], part["s"])
    empty = encode(x[:0], "int8")  # a shard with no rows (more ranks than rows)
    assert decode(empty, "int8", x[:0]).shape == (0, 400)


def test_int8_second_moment_is_its_square_root_on_a_grid_without_zero():
    g = torch.Generator().manual_seed(4)
    v = torch.rand(7, 111, generator=g).pow(6)  # non-negative, wide range; w = 111
    stored = encode(v, "int8", signed=False)
    assert stored["q"].dtype == torch.uint8

    def sqrt_grid(b):
        s = b.max() / 256
        k = (torch.round((b / s).double()) - 1).clamp(0, 255)
        return ((k + 1) * s.double()).float().double()

    want = _ref_decode(v.sqrt(), sqrt_grid).float().square()
    got = decode(stored, "int8", v, signed=False)
    assert torch.equal(got, want)
    assert (got > 0).all()  # no entry flushed to zero: the update stays bounded


def test_fp8_states_equal_e4m3_of_the_block_scaled_value():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    import numpy as np

    g = torch.Generator().manual_seed(5)
    x = torch.randn(6, 130, 2, generator=g) * 10  # rows of 260: blocks 256, 4 + pad

    def e4m3(b):
        s = b.abs().max() / 448
        quot = (b / s).numpy().astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
        return torch.from_numpy(quot) * s.double()

    want = _ref_decode(x, e4m3).float()
    assert torch.equal(decode(encode(x, "fp8"), "fp8", x), want)


def test_state_bytes_and_the_small_tensor_rule():
    assert state_bytes("int8", (MIN_NUMEL - 1, 1)) == 4 * (MIN_NUMEL - 1)  # small: fp32
    assert state_bytes("int8", (8192,)) == 4 * 8192  # 1-D: fp32
    assert state_bytes("int8", (32, 128)) == 4096 + 32 * 4
    assert state_bytes("fp8", (64, 64)) == 4096 + 64 * 4  # rows of 64: w = 64
    assert BLOCK == 256  # torchao's AdamW8bit / AdamWFp8 width
    assert state_bytes("fp8", (17, 257)) == 17 * 2 * (256 + 4)  # padded to 2 blocks
    assert state_bytes("int8", 4097) == 17 * 256 + 17 * 4  # a bare count
    assert state_bytes("bf16", (50, 100)) == 10000
    assert state_bytes("bf16", (300,)) == state_bytes("bf16", 30) * 10 == 600  # no blocks
    with pytest.raises(ValueError, match="valid: fp32, bf16, fp8, int8"):
        state_bytes("int4", (10, 10))


@pytest.mark.parametrize("states, tol", [("bf16", 0.02), ("fp8", 0.1), ("int8", 0.1)])
def test_quantized_states_track_fp32_adamw(states, tol):
    a, b, _, om = _pair(lambda p: torch.optim.AdamW(p, lr=1e-3),
                        lambda p: mo.AdamW(p, lr=1e-3, states=states))
    assert "exp_avg.q" in om.state[b[2]]  # 5200 elements in rows: quantized
    # 32 elements: fp32 in the block formats; bf16 has no blocks and takes every tensor
    assert ("exp_avg.q" if states == "bf16" else "exp_avg") in om.state[b[1]]
    torch.manual_seed(0)
    inits = [torch.randn(*sh) for sh in SHAPES]
    # fp32-state tensors step as torch's; quantized ones track them within tol
    for i in (0, 1, 2) if states == "bf16" else (2,):
        rel = ((b[i] - a[i]).norm() / (a[i] - inits[i]).norm()).item()
        assert 0 < rel < tol
    if states != "bf16":
        assert torch.equal(a[1], b[1]) and torch.equal(a[0], b[0])


def test_remainder_is_exact_over_random_bit_patterns_and_edge_cases():
    g = torch.Generator().manual_seed(0)
    bits = torch.randint(-2**31, 2**31, (1 << 20,), generator=g, dtype=torch.int64)
    x = bits.to(torch.int32).view(torch.float32)
    f32 = torch.finfo(torch.float32)
    edge = torch.tensor([0.0, -0.0, f32.tiny, -f32.tiny, 1e-45, -1e-45, f32.max, -f32.max,
                         float("inf"), float("-inf"), float("nan"), 1.0, -1.0])
    x = torch.cat([x, edge])
    w, rem = split_remainder(x)
    back = join_remainder(w, rem)
    nan = torch.isnan(x)
    assert torch.equal(back[~nan].view(torch.int32), x[~nan].view(torch.int32))
    assert torch.isnan(back[nan]).all() and (~torch.isfinite(w[nan].float())).all()
    # the weight is the fp32 value rounded to nearest (ties away from zero)
    fin = torch.isfinite(x)
    assert ((w[fin].float() - x[fin]).abs() <= (x[fin].to(torch.bfloat16).float()
                                                 - x[fin]).abs()).all()


def test_stochastic_rounding_is_unbiased():
    x = torch.full((100_000,), 1.0 + 2**-9)  # a quarter of bf16's spacing at 1.0
    r = stochastic_round(x, torch.bfloat16, torch.Generator().manual_seed(0)).double()
    assert set(r.unique().tolist()) == {1.0, 1.0 + 2**-7}
    p = 0.25
    sigma = 2**-7 * (p * (1 - p) / x.numel()) ** 0.5
    assert abs(r.mean().item() - (1.0 + 2**-9)) < 4 * sigma
    inf = torch.tensor([float("inf"), float("nan")])
    out = stochastic_round(inf, torch.bfloat16, None)
    assert out[0] == float("inf") and torch.isnan(out[1])


@pytest.mark.parametrize("rule, check", [
    ("nearest", lambda w: (w == 1.0).all()),        # every update vanished
    ("kahan", lambda w: (w == 1.1015625).all()),    # the bf16 nearest to 1.1
    ("remainder", lambda w: (w == 1.1015625).all()),
])
def test_a_thousand_small_updates_under_each_write_rule(rule, check):
    p = torch.nn.Parameter(torch.ones(4096, dtype=torch.bfloat16))
    opt = mo.SGD([p], lr=1.0, write=rule)
    for _ in range(1000):
        p.grad = torch.full_like(p, -1e-4)
        opt.step()
    assert check(p.detach().float())


def test_stochastic_writes_keep_small_updates_in_expectation():
    p = torch.nn.Parameter(torch.ones(10_000, dtype=torch.bfloat16))
    opt = mo.SGD([p], lr=1.0, write="stochastic", seed=7)
    for _ in range(1000):
        p.grad = torch.full_like(p, -1e-4)
        opt.step()
    w = p.detach().double()
    exact = 1.0 + 1000 * float(torch.tensor(1e-4))
    assert abs(w.mean().item() - exact) < 4 * w.std().item() / w.numel() ** 0.5


@pytest.mark.parametrize("sync_free", [False, True])
@pytest.mark.parametrize("states, write, fused", [
    ("fp32", "nearest", False), ("int8", "stochastic", False), ("fp8", "kahan", False),
    ("bf16", "remainder", False), ("int8", "stochastic", True)])
def test_a_skipped_step_leaves_every_state_bit_identical(states, write, fused, sync_free,
                                                         monkeypatch):
    monkeypatch.setattr(mo.LowPrecisionOptimizer, "sync_free", sync_free)
    p = torch.nn.Parameter(torch.randn(50, 100).to(torch.bfloat16))
    q = torch.nn.Parameter(torch.randn(16))  # fp32: torch's fused kernel when fused
    opt = mo.AdamW([p, q], lr=1e-2, states=states, write=write, fused=fused)
    for found in (0.0, 1.0):  # one applied step (states exist), then a poisoned one
        p.grad = torch.randn(50, 100).to(torch.bfloat16)
        q.grad = torch.full((16,), float("inf")) if found else torch.randn(16)
        before = [p.detach().clone(), q.detach().clone(),
                  {k: v.clone() for st in opt.state.values() for k, v in st.items()},
                  opt._sr_step(p.device).clone()]
        opt.found_inf = torch.tensor(found)
        opt.step()
        del opt.found_inf
    assert torch.equal(p, before[0]) and torch.equal(q, before[1])
    after = {k: v for st in opt.state.values() for k, v in st.items()}
    assert all(torch.equal(after[k], v) for k, v in before[2].items())
    # the stochastic-rounding counter does not advance, on the device path either
    assert torch.equal(opt._sr_step(p.device), before[3])


def test_grad_scale_divides_the_gradient_as_torchs_fused_kernels_do():
    a = torch.nn.Parameter(torch.randn(64))
    b = torch.nn.Parameter(a.detach().clone())
    g = torch.randn(64)
    a.grad, b.grad = g.clone(), g * 1024
    oa, ob = mo.AdamW([a], lr=1e-2), mo.AdamW([b], lr=1e-2)
    oa.step()
    ob.grad_scale = torch.tensor(1024.0)
    ob.step()
    assert torch.equal(a, b)


def test_state_dict_round_trips_with_weights_only(tmp_path):
    p = torch.nn.Parameter(torch.randn(50, 100).to(torch.bfloat16))
    opt = mo.AdamW([p], lr=1e-2, states="int8", write="stochastic", seed=3)
    for _ in range(3):
        p.grad = torch.randn(50, 100).to(torch.bfloat16)
        opt.step()
    torch.save({"opt": opt.state_dict(), "p": p.detach()}, tmp_path / "s.pt")
    saved = torch.load(tmp_path / "s.pt", weights_only=True)
    p2 = torch.nn.Parameter(saved["p"].clone())
    opt2 = mo.AdamW([p2], lr=1e-2, states="int8", write="stochastic", seed=3)
    opt2.load_state_dict(saved["opt"])
    assert opt2.state[p2]["exp_avg.q"].dtype == torch.int8
    assert opt2.state[p2]["exp_avg.s"].dtype == torch.float32  # not cast to bf16
    grad = torch.randn(50, 100).to(torch.bfloat16)
    p.grad, p2.grad = grad.clone(), grad.clone()
    opt.step()
    opt2.step()
    assert torch.equal(p, p2)
    with pytest.raises(ValueError, match="states='int8'.*build it with the saved"):
        mo.AdamW([p2], states="bf16", write="stochastic").load_state_dict(saved["opt"])


def test_bad_settings_are_refused():
    p = [torch.nn.Parameter(torch.ones(2))]
    with pytest.raises(ValueError, match="states='int4'; valid: fp32, bf16, fp8, int8"):
        mo.AdamW(p, states="int4")
    with pytest.raises(ValueError, match="write='round'; valid: nearest"):
        mo.SGD(p, write="round")
    h = torch.nn.Parameter(torch.ones(2, dtype=torch.float16))
    h.grad = torch.ones_like(h)
    with pytest.raises(ValueError, match="remainder.*fp16.*kahan"):
        mo.SGD([h], write="remainder").step()


def test_counter_bits_are_uniform_and_any_row_slice_draws_the_wholes_bits():
    """The stochastic writes' bits: a hash of (seed, parameter, step) and the element's
    index in the whole tensor. A slice of rows (an FSDP shard) given its offset draws
    exactly the whole tensor's bits there; other steps or parameters draw other bits;
    16-bit values are uniform (mean and per-bit frequency within 5 sigma)."""
    from mixprec.optim.writes import counter_bits, stream_key

    key = stream_key(0, 3, torch.tensor(7))
    whole = counter_bits((300, 64), key)
    part = counter_bits((120, 64), key, offset=129 * 64)
    assert torch.equal(part, whole[129:249])
    assert not torch.equal(counter_bits((300, 64), stream_key(0, 3, torch.tensor(8))), whole)
    assert not torch.equal(counter_bits((300, 64), stream_key(0, 4, torch.tensor(7))), whole)
    assert not torch.equal(counter_bits((300, 64), stream_key(1, 3, torch.tensor(7))), whole)
    n = whole.numel()
    assert whole.min() >= 0 and whole.max() < 1 << 16
    mean, sd = (2**16 - 1) / 2, (2**16) / 12**0.5 / n**0.5
    assert abs(whole.double().mean().item() - mean) < 5 * sd
    for b in range(16):
        freq = ((whole >> b) & 1).double().mean().item()
        assert abs(freq - 0.5) < 5 * 0.5 / n**0.5, b
