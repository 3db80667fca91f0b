"""mixprec.optim: torch's optimizers bit for bit with fp32 states, the quantizers
against float64 references, and the write rules' numerics."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import mixprec.optim as mo
from mixprec.optim.states import BLOCK, BLOCK4, MIN_NUMEL, decode, encode, state_bytes
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
    # torch's other arguments: amsgrad computed, the rest accepted as torch takes them
    ("Adam", dict(lr=1e-2, amsgrad=True)),
    ("AdamW", dict(lr=1e-2, weight_decay=0.1, amsgrad=True, foreach=False)),
    ("Adam", dict(lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True)),
    ("AdamW", dict(lr=1e-2, foreach=True, capturable=False, differentiable=False)),
    ("SGD", dict(lr=1e-2, momentum=0.9, foreach=False)),
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


def _ref_blocks(x: torch.Tensor, w: int = BLOCK) -> list[list[torch.Tensor]]:
    """The documented blocks, one row at a time: each row of ``x`` (dim 0) cut into
    ``max(1, cols // w)`` blocks of ``w`` elements, the last taking the rest of the row
    (a slow, separate path)."""
    rows = x.reshape(x.shape[0], -1)
    cols = rows.shape[1]
    nb = max(1, cols // w)
    return [[row[i * w:(i + 1) * w if i < nb - 1 else cols] for i in range(nb)]
            for row in rows]


def _ref_decode(x: torch.Tensor, quant, w: int = BLOCK) -> torch.Tensor:
    """``quant(block) -> values`` over every documented block of ``x``, put back in
    ``x``'s shape."""
    rows = [torch.cat([quant(b) for b in row]) for row in _ref_blocks(x, w)]
    return torch.stack(rows).view(x.shape)


def _f32(b: torch.Tensor):
    """The block as numpy float32 (an implementation of the documented fp32 arithmetic
    independent of torch's kernels; numpy's float32 sqrt is correctly rounded)."""
    return b.numpy().astype(np.float32)


def _int8_signed(b):
    a = np.abs(_f32(b)).max()
    if a == 0:
        return torch.zeros_like(b)
    y = np.abs(_f32(b)) / a
    q = np.round(np.sqrt(np.sqrt(y)) * np.float32(127))  # half to even, as torch
    val = np.square(np.square(q / np.float32(127))) * a
    return torch.from_numpy(np.copysign(val, _f32(b)))


def test_int8_signed_states_equal_the_documented_fourth_root_grid():
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(40, 300, generator=g) * torch.logspace(-6, 0, 300)).contiguous()
    x[3] = 0  # all-zero blocks
    stored = encode(x, "int8")
    assert stored["q"].dtype == torch.int8 and stored["q"].abs().max() == 127
    got = decode(stored, "int8", x)
    assert torch.equal(got, _ref_decode(x, _int8_signed))
    # in float64 terms: 127 levels of the fourth root keep values down to 4e-6 of the
    # block maximum within 50% (a linear grid rounds everything under 1/254 of it to 0)
    x64, got64 = x.double(), got.double()
    tiny = (x64.abs() > 4e-6 * x64.abs().amax(1, keepdim=True)) & (x64 != 0)
    assert ((got64 - x64).abs() <= 0.5 * x64.abs())[tiny].all()


def test_blocks_lie_along_rows_so_a_dim0_shard_encodes_as_those_rows_do():
    g = torch.Generator().manual_seed(8)
    x = torch.randn(37, 700, generator=g) * torch.logspace(-3, 3, 37)[:, None]
    for fmt, signed in (("int8", True), ("int8", False), ("fp8", True), ("fp8", False),
                        ("int4", True), ("int4", False)):
        full = encode(x.abs() if not signed else x, fmt, signed)
        part = encode((x.abs() if not signed else x)[19:], fmt, signed)  # a rank's rows
        nb, cols = (5, 350) if fmt == "int4" else (2, 700)  # 700 = 256 + 444; 5 x 128+
        assert full["q"].shape == (37, cols) and full["s"].shape == (37, nb)
        assert torch.equal(full["q"][19:].view(torch.uint8), part["q"].view(torch.uint8))
        assert torch.equal(full["s"][19:], part["s"])
    empty = encode(x[:0], "int8")  # a shard with no rows (more ranks than rows)
    assert decode(empty, "int8", x[:0]).shape == (0, 700)


def test_int8_second_moment_is_a_fourth_root_grid_without_zero():
    g = torch.Generator().manual_seed(4)
    v = torch.rand(7, 111, generator=g).pow(6)  # non-negative, wide range; one block
    stored = encode(v, "int8", signed=False)
    assert stored["q"].dtype == torch.uint8

    def grid(b):
        a = _f32(b).max()
        k = np.clip(np.round(np.sqrt(np.sqrt(_f32(b) / a)) * np.float32(256)) - 1, 0, 255)
        return torch.from_numpy(np.square(np.square((k + 1) / np.float32(256))) * a)

    got = decode(stored, "int8", v, signed=False)
    assert torch.equal(got, _ref_decode(v, grid))
    assert (got > 0).all()  # no entry flushed to zero: the update stays bounded


def test_fp8_states_equal_e4m3_of_the_block_scaled_value():
    ml_dtypes = pytest.importorskip("ml_dtypes")

    g = torch.Generator().manual_seed(5)
    x = torch.randn(6, 130, 2, generator=g) * 10  # rows of 260: one block

    def e4m3(b, floor=0.0):
        s = _f32(b.abs()).max() / np.float32(448)
        quot = (_f32(b) / s).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
        if floor:  # a non-negative state: zero codes read as the smallest subnormal
            quot = np.maximum(quot, np.float32(floor))
        return torch.from_numpy(quot * s)

    assert torch.equal(decode(encode(x, "fp8"), "fp8", x), _ref_decode(x, e4m3))
    v = x.square() * torch.logspace(-12, 0, 260).view(130, 2)  # underflows e4m3
    got = decode(encode(v, "fp8", signed=False), "fp8", v, signed=False)
    assert torch.equal(got, _ref_decode(v, lambda b: e4m3(b, 2.0 ** -9)))  # no zero
    assert (got > 0).all()


def test_int4_states_are_packed_nibbles_of_the_documented_grids():
    g = torch.Generator().manual_seed(6)
    x = torch.randn(9, 301, generator=g) * torch.logspace(-4, 0, 301)  # 128 + 173
    stored = encode(x, "int4")
    assert stored["q"].shape == (9, 151) and stored["s"].shape == (9, 2)
    mags = (np.arange(8) / 7.0) ** 3

    def signed(b):  # nearest of a * (k / 7)^3 in linear terms, ties to the smaller
        a = np.abs(_f32(b)).max()
        y = (np.abs(_f32(b)) / a).astype(np.float64)
        mids = ((mags[1:] + mags[:-1]) / 2).astype(np.float32)
        k = (y[:, None] > mids[None, :]).sum(1)
        val = (k.astype(np.float32) ** 3 / np.float32(343)) * a
        return torch.from_numpy(np.where(_f32(b) < 0, -val, val).astype(np.float32))

    assert torch.equal(decode(stored, "int4", x), _ref_decode(x, signed, BLOCK4))
    # the nibbles: column 2j low, 2j + 1 high, the odd row's last high nibble zero
    k = torch.stack([stored["q"] & 15, stored["q"] >> 4], -1).reshape(9, 302)
    assert (k[:, 301] == 0).all() and k.max() <= 15
    v = x.square()
    got = decode(encode(v, "int4", signed=False), "int4", v, signed=False)

    def grid(b):
        a = _f32(b).max()
        k = np.clip(np.round(np.sqrt(np.sqrt(_f32(b) / a)) * np.float32(16)) - 1, 0, 15)
        return torch.from_numpy(np.square(np.square((k + 1) / np.float32(16))) * a)

    assert torch.equal(got, _ref_decode(v, grid, BLOCK4)) and (got > 0).all()


def test_state_bytes_and_the_small_tensor_rule():
    assert state_bytes("int8", (MIN_NUMEL - 1, 1)) == 4 * (MIN_NUMEL - 1)  # small: fp32
    assert state_bytes("int8", (8192,)) == 4 * 8192  # 1-D: fp32
    assert state_bytes("int8", (32, 128)) == 4096 + 32 * 4
    assert state_bytes("fp8", (64, 64)) == 4096 + 64 * 4  # rows of 64: one block each
    assert BLOCK == 256 and BLOCK4 == 128  # torchao's AdamW8bit / AdamWFp8 / AdamW4bit
    assert state_bytes("fp8", (17, 257)) == 17 * (257 + 4)  # one block of 257, unpadded
    assert state_bytes("int8", (17, 767)) == 17 * (767 + 2 * 4)  # 256 + 511
    assert state_bytes("int4", (17, 257)) == 17 * (129 + 2 * 4)  # 128 + 129, in nibbles
    assert state_bytes("int8", 4097) == 4097 + 16 * 4  # a bare count: whole blocks
    assert state_bytes("bf16", (50, 100)) == 10000
    assert state_bytes("bf16", (300,)) == state_bytes("bf16", 30) * 10 == 600  # no blocks
    with pytest.raises(ValueError, match="valid: fp32, bf16, fp8, int8, int4"):
        state_bytes("int2", (10, 10))


@pytest.mark.parametrize("states, tol", [("bf16", 0.02), ("fp8", 0.1), ("int8", 0.1),
                                         ("int4", 0.3)])
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
    ("bf16", "remainder", False), ("int8", "stochastic", True), ("int4", "nearest", False)])
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
    with pytest.raises(ValueError, match="states='int2'; valid: fp32, bf16, fp8, int8, int4"):
        mo.AdamW(p, states="int2")
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


# --- the step in pieces ------------------------------------------------------------------

ODD = ((257, 40), (16, 64, 3, 3), (12, 1000), (9000,), (3, 5000), (1030, 7))


@pytest.mark.parametrize("name, kw", TORCH_TWINS)
def test_a_step_in_pieces_still_equals_torch_bit_for_bit(monkeypatch, name, kw):
    """With pieces of at most 2048 elements every tensor here is stepped in several
    (rows of 257, 3×3 convolutions, a 1-D tensor, rows wider than a piece): the fp32
    result is still torch's own, bit for bit."""
    import mixprec.optim.pieces as pieces

    monkeypatch.setattr(pieces, "CHUNK", 2048)
    assert all(pieces.chunk_rows(s) < s[0] for s in ODD)
    a, b, _, _ = _pair(lambda p: getattr(torch.optim, name)(p, **kw),
                       lambda p: getattr(mo, name)(p, **kw), steps=5, shapes=ODD)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("states", ["bf16", "fp8", "int8", "int4"])
@pytest.mark.parametrize("write, dtype", [("nearest", torch.float32),
                                          ("nearest", torch.bfloat16),
                                          ("stochastic", torch.bfloat16),
                                          ("stochastic", torch.float16),
                                          ("kahan", torch.bfloat16),
                                          ("remainder", torch.bfloat16)])
def test_a_step_in_pieces_equals_the_whole_tensors_step(monkeypatch, states, write, dtype):
    _pieces_equal_whole(monkeypatch, states, write, dtype, sync_free=False)


@pytest.mark.parametrize("states, write, dtype", [("int8", "stochastic", torch.bfloat16),
                                                  ("fp8", "remainder", torch.bfloat16),
                                                  ("int4", "nearest", torch.float32)])
def test_a_skipped_device_step_in_pieces_equals_the_whole_tensors(monkeypatch, states,
                                                                  write, dtype):
    _pieces_equal_whole(monkeypatch, states, write, dtype, sync_free=True)


def _pieces_equal_whole(monkeypatch, states, write, dtype, sync_free):
    """Quantized states and 16-bit writes, in pieces or whole: the same weights, codes,
    scales and buffers, bit for bit (also through a skipped device step), so the bounded
    step changes no checkpoint. The first step, which creates the states, runs in pieces
    too, and creates them in the same order (ranks gather states in that order)."""
    import mixprec.optim.pieces as pieces

    def run(chunk):
        monkeypatch.setattr(pieces, "CHUNK", chunk)
        torch.manual_seed(0)
        ps = [torch.nn.Parameter(torch.randn(s).to(dtype)) for s in ODD]
        opt = mo.AdamW(ps, lr=1e-2, states=states, write=write)
        opt.sync_free = sync_free
        g = torch.Generator().manual_seed(1)
        for i in range(4):
            for p in ps:
                p.grad = torch.randn(p.shape, generator=g).to(dtype)
            if sync_free:
                opt.found_inf = torch.tensor([1.0 if i == 2 else 0.0])
            opt.step()
        return ps, opt.state_dict()

    (pa, sa), (pb, sb) = run(1 << 40), run(2048)
    assert all(torch.equal(x, y) for x, y in zip(pa, pb))
    for i, st in sa["state"].items():
        assert list(st) == list(sb["state"][i])  # created in the same order
        for k, v in st.items():
            assert not isinstance(v, torch.Tensor) or torch.equal(v, sb["state"][i][k]), k


def test_sgd_without_momentum_also_steps_in_pieces(monkeypatch):
    """SGD with momentum 0 keeps no state, so its pieces start at the first step."""
    import mixprec.optim.base as base
    import mixprec.optim.pieces as pieces

    calls = []
    monkeypatch.setattr(pieces, "CHUNK", 1024)
    inner = base.LowPrecisionOptimizer._update_piece
    monkeypatch.setattr(base.LowPrecisionOptimizer, "_update_piece",
                        lambda self, p, *a: calls.append(p.numel()) or inner(self, p, *a))
    p = torch.nn.Parameter(torch.randn(257, 300).to(torch.bfloat16))
    p.grad = torch.randn(p.shape).to(torch.bfloat16)
    mo.SGD([p], lr=0.1, write="stochastic").step()
    assert len(calls) > 1 and max(calls) <= 1024 and sum(calls) == p.numel()


def _round_ups_over_steps(opt_factory, steps: int = 16, n: int = 4096):
    """Each step rounds the same fp32 value, a quarter of bf16's spacing above 1.0,
    through the optimizer's stochastic write (SGD at lr 0 from an fp32 value held by a
    remainder-free weight: the write rounds ``w`` itself). Returns each element's count
    of round-ups over the steps."""
    p = torch.nn.Parameter(torch.ones(n, dtype=torch.bfloat16))
    opt = opt_factory([p])
    ups = torch.zeros(n)
    for _ in range(steps):
        p.data.fill_(1.0)
        p.grad = torch.full((n,), -(2**-9), dtype=torch.bfloat16)  # w + 2^-9 exactly
        opt.step()
        ups += (p.detach().float() > 1.0).float()
    return ups


def test_stochastic_writes_draw_fresh_bits_every_step():
    """Round-ups per element over 16 steps follow Binomial(16, 1/4): mean 4, variance 3.
    A stream that repeats its bits every step gives each element 0 or 16 round-ups
    (variance 48): the variance check is what catches it."""
    ups = _round_ups_over_steps(lambda ps: mo.SGD(ps, lr=1.0, write="stochastic", seed=3))
    assert abs(ups.mean().item() - 4.0) < 0.15
    assert 2.5 < ups.var().item() < 3.6
    assert len(ups.unique()) > 5 and ups.max() < 16


def test_the_fresh_bits_check_fails_on_a_stream_that_repeats(monkeypatch):
    """The same check on a stream whose key ignores the step (bits repeat): unbiased on
    average, so a mean test passes, but the variance is 16x the binomial's."""
    import mixprec.optim.writes as writes

    real = writes.stream_key
    monkeypatch.setattr(writes, "stream_key", lambda seed, index, step: real(
        seed, index, torch.zeros_like(step)))
    ups = _round_ups_over_steps(lambda ps: mo.SGD(ps, lr=1.0, write="stochastic", seed=3))
    assert abs(ups.mean().item() - 4.0) < 0.5
    assert ups.var().item() > 30


def test_the_rounding_counter_of_another_device_resumes_here():
    """A checkpoint whose counter was keyed by ``cuda:1`` loads on this CPU, and the
    next stochastic write draws the bits of that step count, as the uninterrupted run
    does (the count, not the device, is the stream's state)."""
    def make():
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(64, 256).to(torch.bfloat16))
        return p, mo.AdamW([p], lr=1e-2, write="stochastic", seed=5)

    p, opt = make()
    g = torch.Generator().manual_seed(2)
    grads = [torch.randn(64, 256, generator=g).to(torch.bfloat16) for _ in range(6)]
    for gr in grads[:5]:
        p.grad = gr
        opt.step()
    sd = copy.deepcopy(opt.state_dict())  # the live state moves on with the next step
    assert set(sd["mixprec"]["sr_steps"]) == {"cpu"}
    sd["mixprec"]["sr_steps"] = {"cuda:1": sd["mixprec"]["sr_steps"]["cpu"]}
    saved = p.detach().clone()
    p.grad = grads[5]
    opt.step()
    q, fresh = make()
    q.data.copy_(saved)
    fresh.load_state_dict(sd)
    q.grad = grads[5]
    fresh.step()
    assert torch.equal(q, p)


def test_amsgrad_with_quantized_states_keeps_its_maximum_coded_like_the_moment():
    p = torch.nn.Parameter(torch.randn(64, 256))
    # beta2 0.5: the second moment falls after the large first gradient, its max stays
    opt = mo.AdamW([p], lr=1e-2, betas=(0.9, 0.5), amsgrad=True, states="int8")
    q = torch.nn.Parameter(p.detach().clone())
    opt16 = mo.AdamW([q], lr=1e-2, betas=(0.9, 0.5), amsgrad=True, states="bf16")
    for i in range(3):
        p.grad = torch.randn(p.shape) * (3.0 if i == 0 else 1.0)
        q.grad = p.grad.clone()
        opt.step()
        opt16.step()
    assert {"max_exp_avg_sq.q", "max_exp_avg_sq.s"} <= set(opt.state[p])
    vmax, v = (opt16.state[q][k].float() for k in ("max_exp_avg_sq.q", "exp_avg_sq.q"))
    assert (vmax >= v).all() and (vmax > v).float().mean() > 0.5


def test_torch_arguments_that_change_the_maths_or_the_layout_are_refused():
    p = torch.nn.Parameter(torch.randn(64, 256))
    with pytest.raises(NotImplementedError, match="differentiable=True.*torch.optim"):
        mo.Adam([p], differentiable=True)
    with pytest.raises(NotImplementedError, match="SGD\\(fused=True\\)"):
        mo.SGD([p], fused=True)
    with pytest.raises(ValueError, match="param group 1 asks for states='bf16'.*one per "
                                         "optimizer"):
        mo.AdamW([{"params": [p]}, {"params": [torch.nn.Parameter(torch.ones(8))],
                                     "states": "bf16"}], states="int8")


def test_a_torch_checkpoint_is_refused_by_a_quantized_optimizer_before_loading():
    """torch's AdamW state (fp32 moments) into states='int8': refused, naming both
    formats, with the optimizer untouched (it used to load, then fail at the step)."""
    p = torch.nn.Parameter(torch.randn(64, 256))
    torch_opt = torch.optim.AdamW([p])
    p.grad = torch.randn(p.shape)
    torch_opt.step()
    q = torch.nn.Parameter(p.detach().clone())
    ours = mo.AdamW([q], states="int8")
    with pytest.raises(ValueError, match="fp32 states \\(e.g. 'exp_avg'.*states='int8'.*"
                                         "states='fp32'"):
        ours.load_state_dict(torch_opt.state_dict())
    assert not ours.state
    mo.AdamW([q]).load_state_dict(torch_opt.state_dict())  # fp32 states take it
