"""The parameter state owns the gradients in every mode: the same public methods
(accumulate, the check input, unscale, the hand-over, the reductions, clearing) over
buffers (``fp16-master``) and over autograd's own ``.grad`` (``fp16``, direct), checked
against torch's GradScaler and optimizer, and the step, comm and engine modules reach
gradients only through them."""

from __future__ import annotations

import ast
import copy
from pathlib import Path

import pytest
import torch
from torch import nn

from mixprec.engine.grad_storage import BufferGrads, DirectGrads
from mixprec.engine.param_state import ParamState
from mixprec.recipe import Recipe

SRC = Path(__file__).resolve().parents[2] / "src" / "mixprec"
SCALE = 2.0 ** 10
#: recipe -> its storage: fp16's fp32 parameters accumulate in .grad, fp16-master's in
#: fp32 buffers beside fp16 working weights; both scale the loss
MODES = {"fp16": DirectGrads, "fp16-master": BufferGrads}


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 6), nn.Tanh(), nn.Linear(6, 3))


def _batches(n: int, bad: int | None = None) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    xs = [torch.randn(5, 8, generator=g) for _ in range(n)]
    if bad is not None:
        xs[bad][0, 0] = torch.inf
    return xs


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    w = next(model.parameters())
    return model(x.to(w.dtype)).float().square().mean()


def _engine_side(recipe: str, xs: list[torch.Tensor]):
    """The parameter state's methods only: a window of micro-batches, the check input,
    the unscale pass, the hand-over and an SGD step over ``opt_params``."""
    model = _model()
    state = ParamState(list(model.parameters()), Recipe.coerce(recipe))
    for x in xs:
        state.drop_stray_grads(fresh=x is xs[0])
        (_loss(model, x) * torch.tensor(SCALE)).backward()
        state.accumulate()
    found = not all(torch.isfinite(g).all() for g in state.gradients())
    state.unscale_(torch.tensor(SCALE).reciprocal())
    unscaled = [g.clone() for g in state.gradients()]
    opt = torch.optim.SGD(state.opt_params, lr=0.1, momentum=0.9)
    state.hand_to_optimizer()
    if not found:
        opt.step()
    return state, model, found, unscaled


def _torch_side(recipe: str, xs: list[torch.Tensor]):
    """Torch's own GradScaler and SGD on fp32 parameters whose gradients are the
    working model's, summed in fp32 by hand (autograd sums them there for fp32
    parameters; for fp16 working weights each micro-batch's fp16 gradient is added in
    fp32, as a buffer holds it)."""
    ref = _model()
    work = copy.deepcopy(ref)
    if recipe == "fp16-master":
        work.half()
    acc = [torch.zeros_like(p) for p in ref.parameters()]
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE)
    for x in xs:
        scaler.scale(_loss(work, x)).backward()
        for a, p in zip(acc, work.parameters()):
            a.add_(p.grad.float())
            p.grad = None
    for p, a in zip(ref.parameters(), acc):
        p.grad = a
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    scaler.unscale_(opt)
    unscaled = [p.grad.clone() for p in ref.parameters()]
    scaler.step(opt)  # skipped where the unscale found an inf or NaN
    scaler.update()
    found = scaler.get_scale() < SCALE  # backed off: it found one
    return ref, found, unscaled


@pytest.mark.parametrize("bad", [None, 1])
@pytest.mark.parametrize("recipe", list(MODES))
def test_both_storages_match_torch_grad_scaler_and_optimizer(recipe, bad):
    xs = _batches(3, bad)
    state, model, found, unscaled = _engine_side(recipe, xs)
    ref, ref_found, ref_unscaled = _torch_side(recipe, xs)
    assert isinstance(state.storage, MODES[recipe])
    assert state.direct == (recipe == "fp16")
    assert found == ref_found == (bad is not None)
    if found:
        return  # torch's scaler skipped the step; so does a caller reading the check
    for got, want in zip(unscaled, ref_unscaled):
        assert got.dtype == torch.float32 and torch.equal(got, want)
    for q, p in zip(state.opt_params, ref.parameters()):
        assert torch.equal(q, p)  # the optimizer read the unscaled gradients as .grad


@pytest.mark.parametrize("recipe", list(MODES))
def test_zero_grad_clears_like_torch_set_to_none(recipe):
    state, model, _, _ = _engine_side(recipe, _batches(2))
    stray = torch.ones_like(state.working[0])
    state.working[0].grad = stray  # another backward's gradient, not accumulated
    state.zero_grad()
    assert all(p.grad is None for p in state.working)
    if state.direct:  # torch's optimizer.zero_grad(set_to_none=True)
        assert all(q.grad is None for q in state.opt_params)
        assert state.gradients() == []
    else:  # the buffers stay, zeroed in place, and stay the masters' .grad
        assert all(q.grad is b for q, b in zip(state.opt_params, state.buffers))
        assert all(not g.any() for g in state.gradients())


@pytest.mark.parametrize("recipe", list(MODES))
def test_a_reduction_puts_the_mean_back_for_every_parameter(recipe):
    """``reduce`` hands all accumulated gradients to the collective flattened in one
    tensor and puts its result back, a parameter without a gradient sending zeros."""
    model = _model()
    state = ParamState(list(model.parameters()), Recipe.coerce(recipe))
    _loss(model, _batches(1)[0]).backward()
    model[2].bias.grad = None  # a parameter the window did not reach
    state.accumulate()
    before = [torch.zeros_like(q, dtype=torch.float32) if g is None else g.clone()
              for q, g in zip(state.opt_params, state.aligned_gradients())]
    sent = []

    def mean(flat):
        sent.append(flat.clone())
        return flat * 0.25

    state.reduce(mean)
    assert torch.equal(sent[0], torch.cat([b.flatten() for b in before]))
    got = state.aligned_gradients()
    assert all(g is not None for g in got)
    for g, b in zip(got, before):
        assert torch.equal(g, b * 0.25)
    assert all(p.grad is None for p in state.working) or state.direct


class _Bucket:
    """The part of DDP's ``GradBucket`` a comm hook reads: one flat buffer whose views
    are the parameters' fresh gradients."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        self.params = params
        self.flat = torch.cat([p.grad.flatten() for p in params])
        self.views = [v.view_as(p) for v, p in
                      zip(self.flat.split([p.numel() for p in params]), params)]

    def parameters(self):
        return self.params

    def gradients(self):
        return self.views

    def buffer(self):
        return self.flat


def test_a_bucket_joins_the_buffers_in_fp32_and_its_mean_replaces_them():
    model = _model()
    state = ParamState(list(model.parameters()), Recipe.coerce("fp16-master"))
    xs = _batches(2)
    _loss(model, xs[0]).backward()
    state.accumulate()  # the first micro-batch is in the buffers
    _loss(model, xs[1]).backward()  # the last one is in .grad (DDP's bucket)
    bucket = _Bucket(state.working)
    want_sent = torch.cat([(b + g.float()).flatten()
                           for b, g in zip(state.buffers, bucket.gradients())])
    send, done = state.bucket_reduction(bucket)
    assert send.dtype == torch.float32 and torch.equal(send, want_sent)
    assert done(send * 0.5) is bucket.buffer()  # DDP's bucket is left as it is
    for b, w in zip(state.buffers, want_sent.split([b.numel() for b in state.buffers])):
        assert torch.equal(b, w.view_as(b) * 0.5)
    state.accumulate()  # the settled parameters' .grad are dropped unread
    for b, w in zip(state.buffers, want_sent.split([b.numel() for b in state.buffers])):
        assert torch.equal(b, w.view_as(b) * 0.5)
    assert all(p.grad is None for p in state.working)


def test_a_direct_bucket_is_ddps_own_and_its_mean_goes_back_in_its_dtype():
    model = _model()
    state = ParamState(list(model.parameters()), Recipe.coerce("fp16"))
    _loss(model, _batches(1)[0]).backward()
    bucket = _Bucket(state.working)
    send, done = state.bucket_reduction(bucket)
    assert send is bucket.buffer()
    back = done(send.half())
    assert back.dtype == torch.float32 and torch.equal(back, send.half().float())


# --- the structure: nothing else writes or reads .grad -------------------------------

GRAD_FREE = ["engine/step.py", "parallel/comm.py", "engine/facade.py", "parallel/layouts.py"]


def _grad_uses(path: Path) -> list[str]:
    """Each ``.grad`` attribute (read or write), in-place foreach op, ``set_to_none``
    and reach into the state's buffers (an attribute read, not a module's
    ``.buffers()`` call) in ``path``, as ``line: source``."""
    tree = ast.parse(path.read_text())
    lines = path.read_text().splitlines()
    called = {id(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
    found = []
    for node in ast.walk(tree):
        bad = (isinstance(node, ast.Attribute)
               and (node.attr == "grad"
                    or (node.attr in ("buffers", "compensations") and id(node) not in called)
                    or (node.attr.startswith("_foreach_") and node.attr.endswith("_"))))
        bad |= isinstance(node, ast.keyword) and node.arg == "set_to_none"
        if bad:
            found.append(f"{node.lineno}: {lines[node.lineno - 1].strip()}")
    return found


@pytest.mark.parametrize("name", GRAD_FREE)
def test_the_step_comm_and_engine_reach_gradients_only_through_the_param_state(name):
    uses = _grad_uses(SRC / name)
    assert uses == [], f"{name} touches gradients itself: {uses}"


def test_the_scan_sees_grad_writes():
    """The scan above would be empty if it missed them: the storage module has some."""
    uses = _grad_uses(SRC / "engine" / "grad_storage.py")
    assert any("p.grad = " in u for u in uses)
    assert any("_foreach_zero_" in u for u in uses)
