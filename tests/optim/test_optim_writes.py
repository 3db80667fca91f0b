"""The write rule objects against torch's own AdamW and float64 references, their
registry and bytes, and the public interface an engine binds an optimizer through."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import mixprec.optim as mo
from mixprec import MixedPrecision
from mixprec.optim.writes import (
    RULES,
    WRITE_RULES,
    Stream,
    counter_bits,
    stream_key,
    write_bytes,
    write_rule,
)

SHAPE = (33, 70)


def _grads(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(SHAPE, generator=g) * 0.1 for _ in range(n)]


def _start():
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(1))


def _torch_adamw(p):
    return torch.optim.AdamW([p], lr=1e-2, foreach=False)


def test_nearest_lands_torchs_fp32_step_rounded_to_nearest():
    """Each step is torch's AdamW from the bf16 weight, rounded to the nearest bf16."""
    w = nn.Parameter(_start().bfloat16())
    ref = nn.Parameter(w.detach().float())
    opt, topt = mo.AdamW([w], lr=1e-2), _torch_adamw(ref)
    for g in _grads(5):
        w.grad, ref.grad = g.bfloat16(), g.bfloat16().float()
        opt.step()
        topt.step()
        with torch.no_grad():
            ref.copy_(ref.bfloat16().float())
        assert torch.equal(w.float(), ref.detach())


def test_kahan_lands_torchs_step_from_the_compensated_value():
    """torch's AdamW steps the compensated value ``w - c``; the weight is its nearest
    bf16 and ``c`` the bf16 of what that rounding added."""
    w = nn.Parameter(_start().bfloat16())
    ref = nn.Parameter(w.detach().float())
    opt, topt = mo.AdamW([w], lr=1e-2, write="kahan"), _torch_adamw(ref)
    for g in _grads(5):
        w.grad, ref.grad = g.bfloat16(), g.bfloat16().float()
        opt.step()
        topt.step()
        with torch.no_grad():
            new = ref.bfloat16()
            c = (new.float() - ref).bfloat16()
            ref.copy_(new.float() - c.float())
        assert torch.equal(w.detach(), new)
        assert torch.equal(opt.state[w]["kahan_comp"], c)
        assert torch.equal(opt.stored_value(w), ref.detach())


def test_remainder_holds_torchs_fp32_adamw_exactly():
    """bf16 weight + remainder is torch's fp32 AdamW weight, bit for bit, and the
    weight is that value rounded to nearest with ties away from zero (float64)."""
    x = _start()
    w = nn.Parameter(x.bfloat16())
    ref = nn.Parameter(x.clone())
    opt, topt = mo.AdamW([w], lr=1e-2, write="remainder"), _torch_adamw(ref)
    opt.init_remainders([w], [x])
    for g in _grads(5):
        w.grad, ref.grad = g.bfloat16(), g.bfloat16().float()
        opt.step()
        topt.step()
    assert torch.equal(opt.stored_value(w), ref.detach())
    v = ref.detach().double()
    lo = v.float().bfloat16().double()  # a neighbour; find the bracketing pair
    up = torch.where(lo <= v, torch.nextafter(lo.bfloat16().float(), torch.tensor(
        float("inf"))).bfloat16().double(), lo)
    down = torch.where(lo <= v, lo, torch.nextafter(lo.bfloat16().float(), torch.tensor(
        float("-inf"))).bfloat16().double())
    nearer_up = (up - v).abs() < (v - down).abs()
    tie = (up - v).abs() == (v - down).abs()
    want = torch.where(nearer_up | (tie & (v.abs() < up.abs())), up, down)
    assert torch.equal(w.detach().double(), want)


def test_stochastic_rounds_up_exactly_when_its_bits_cover_the_dropped_fraction():
    """Given the stream's 16 bits ``r``, the bf16 magnitude rounds up iff
    ``r >= 2^16 * (1 - f)``, ``f`` the dropped fraction of a bf16 step (float64)."""
    x = torch.randn(4096, generator=torch.Generator().manual_seed(2))
    stream = Stream(seed=7, index=3, step=torch.tensor(5), offset=11)
    got, buffers = write_rule("stochastic").land(x, torch.bfloat16, {}, stream)
    r = counter_bits(x.shape, stream_key(7, 3, torch.tensor(5)), 11, 16).double()
    mag = x.abs().double()
    down = (x.abs().view(torch.int32) & ~0xFFFF).view(torch.float32).double()
    ulp = 2.0 ** (torch.floor(torch.log2(down)) - 7)
    frac = (mag - down) / ulp
    want = torch.where(r >= 65536 * (1 - frac), down + ulp, down) * x.sign().double()
    assert buffers == {} and torch.equal(got.double(), want)
    assert 0.3 < (got.double().abs() > down).double().mean() < 0.7  # both ways occur


def test_an_unknown_write_rule_is_refused_naming_the_valid_ones():
    for call in (lambda: write_rule("round"), lambda: write_bytes("round", 8)):
        with pytest.raises(ValueError, match="'round'; valid: nearest, stochastic, kahan, "
                                             "remainder"):
            call()
    assert WRITE_RULES == tuple(RULES) == ("nearest", "stochastic", "kahan", "remainder")


@pytest.mark.parametrize("emulated", [False, True])
@pytest.mark.parametrize("name", WRITE_RULES)
def test_a_rules_bytes_and_checkpoint_entries_are_what_it_keeps(name, emulated):
    """``write_bytes`` (the memory planner's price) equals the bytes of the buffers the
    rule keeps after a step, for a bf16 weight and for an emulated one (an fp32 tensor:
    kahan's compensation is then fp32 too), whose names are ``buffers``, saved and
    loaded with the optimizer state so the weight's value survives."""
    w = nn.Parameter(_start().bfloat16().float() if emulated else _start().bfloat16())
    opt = mo.AdamW([w], lr=1e-2, write=name)
    if emulated:
        opt.bind(mo.EngineBinding(emulated_format="bf16"))
    w.grad = _grads(1)[0].to(w.dtype)
    opt.step()
    rule = write_rule(name)
    kept = set(opt.state[w]) - {"step", "exp_avg", "exp_avg_sq"}
    assert kept == set(rule.buffers)
    assert sum(opt.state[w][k].nbytes for k in kept) == write_bytes(
        name, w.numel(), w.element_size())
    again = mo.AdamW([nn.Parameter(w.detach().clone())], lr=1e-2, write=name)
    again.bind(opt.binding)
    again.load_state_dict(opt.state_dict())
    q = again.param_groups[0]["params"][0]
    assert torch.equal(again.stored_value(q), opt.stored_value(w))


def test_used_alone_it_steps_on_p_grad_and_bound_on_the_engines_fp32_gradients():
    """Without ``bind`` the optimizer reads ``p.grad`` (torch's contract); bound, it
    reads the fp32 gradient the binding maps the parameter to, not the 16-bit one."""
    g32 = _grads(1)[0] * 1e-3
    a, b = (nn.Parameter(_start().bfloat16()) for _ in range(2))
    ref_a, ref_b = (nn.Parameter(a.detach().float()) for _ in range(2))
    oa, ob = mo.SGD([a], lr=1.0), mo.SGD([b], lr=1.0)
    ob.bind(mo.EngineBinding(grads={id(b): g32}))
    a.grad = b.grad = g32.bfloat16()
    oa.step()
    ob.step()
    ref_a.grad, ref_b.grad = g32.bfloat16().float(), g32
    torch.optim.SGD([ref_a, ref_b], lr=1.0).step()
    assert torch.equal(a.detach(), ref_a.detach().bfloat16())
    assert torch.equal(b.detach(), ref_b.detach().bfloat16())
    assert not torch.equal(a, b)
    assert ob.grad_buffers is ob.binding.grads and oa.binding == mo.EngineBinding()


def test_what_an_engine_hands_over_goes_through_bind_with_clear_errors():
    opt = mo.AdamW([nn.Parameter(torch.ones(4))])
    with pytest.raises(AttributeError, match=r"bind\(EngineBinding\(grads="):
        opt.grad_buffers = {}
    with pytest.raises(AttributeError, match=r"bind\(EngineBinding\(emulated_format="):
        opt.emulated_format = "bf16"
    with pytest.raises(TypeError, match=r"EngineBinding, not dict"):
        opt.bind({"grads": {}})
    with pytest.raises(ValueError, match=r"emulated_format='fp8'\); valid: None, 'bf16', "
                                         r"'fp16'"):
        mo.EngineBinding(emulated_format="fp8")
    with pytest.raises(TypeError):
        mo.EngineBinding({})  # keyword-only


def test_an_emulated_fp32_weight_is_written_as_the_bf16_weight_would_be():
    x, g = _start(), _grads(1)[0]
    real = nn.Parameter(x.bfloat16())
    emu = nn.Parameter(x.bfloat16().float())
    oe = mo.AdamW([emu], lr=1e-2, write="kahan")
    oe.bind(mo.EngineBinding(emulated_format="bf16"))
    orl = mo.AdamW([real], lr=1e-2, write="kahan")
    real.grad, emu.grad = g.bfloat16(), g.bfloat16().float()
    orl.step()
    oe.step()
    assert emu.dtype == torch.float32 and torch.equal(emu.detach(), real.detach().float())


def test_found_inf_and_grad_scale_as_keywords_or_as_torchs_attributes():
    """``step(found_inf=, grad_scale=)`` does what the attributes torch's GradScaler
    sets do: a set flag skips the step, the scale divides the gradient."""
    x, g = _start(), _grads(1)[0]
    a, b, c = (nn.Parameter(x.clone()) for _ in range(3))
    ref = nn.Parameter(x.clone())
    for p in (a, b):
        p.grad = g * 1024
    c.grad, ref.grad = g * 1024, g
    oa, ob, oc = mo.AdamW([a]), mo.AdamW([b]), mo.AdamW([c])
    torch.optim.AdamW([ref], foreach=False).step()
    oa.step(grad_scale=torch.tensor(1024.0))
    ob.grad_scale = torch.tensor(1024.0)
    ob.step()
    oc.step(found_inf=torch.tensor(1.0), grad_scale=torch.tensor(1024.0))
    assert torch.equal(a, ref) and torch.equal(b, ref) and torch.equal(c, x)
    assert not oc.state[c]


def test_the_engine_binds_its_fp32_gradients_and_emulated_format():
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = mo.AdamW(model.parameters(), write="stochastic")
        engine = MixedPrecision(model, opt, "bf16-sr")
    ps = engine.param_state
    assert opt.binding.emulated_format == ps.round_to
    if ps.direct:  # emulated: the fp32 working weights' .grad are the fp32 gradients
        assert opt.binding.grads is None
        return
    assert opt.binding.grads is not None
    assert {k: id(v) for k, v in opt.binding.grads.items()} == {
        id(w): id(b) for w, b in zip(ps.working, ps.buffers)}
