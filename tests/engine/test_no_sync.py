"""No host synchronisation inside backward() and step() (DESIGN principle 3).

On the CPU there is no device to wait for, so the test stands in for
``torch.cuda.set_sync_debug_mode("error")``: every way a tensor's value reaches Python
(``item``, ``bool``, ``float``, ``int``, ``tolist``) is made to raise while
``backward()`` and ``step()`` run. The CUDA variant runs the real sync debug mode.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys

import pytest
import torch

from helpers.host_reads import reads_replaced
from helpers.models import tiny_gpt
from mixprec import MixedPrecision
from mixprec.engine import checks
from mixprec.engine.watch import HostMirror

pytestmark = pytest.mark.filterwarnings("ignore:fp16 compute on the CPU:UserWarning",
                                        "ignore:fp16 has no fast kernels:UserWarning")

RECIPES = ["bf16", "bf16-master", "bf16-master,wgrad=fp32", "fp16", "fp16-master",
           "fp8", "fp8-current", "fp8-rowwise"]


def no_host_reads():
    def trap(name, original):
        def f(self, *a, **k):
            raise AssertionError(f"host sync: Tensor.{name} called inside the hot path")
        return f

    return reads_replaced(trap)


def _run(recipe, device, guard):
    model = tiny_gpt(d_model=16, seq_len=16).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    engine = MixedPrecision(model, opt, recipe, grad_accum_steps=2, max_grad_norm=1.0)
    idx = torch.randint(0, 64, (4, 17), device=device)
    results = []
    for i in range(6):
        with engine.autocast():
            loss = model(idx[:, :-1], idx[:, 1:])
        if i == 3:
            loss = loss * float("inf")  # a skipped step must not sync either
        with guard():
            engine.backward(loss)
            results.append(engine.step())
    return engine, results


@pytest.mark.parametrize("recipe", RECIPES)
def test_backward_and_step_never_read_device_values(recipe):
    engine, results = _run(recipe, "cpu", no_host_reads)
    assert [r.accumulating for r in results] == [True, False] * 3
    assert bool(results[3].skipped) and not bool(results[1].skipped)  # reading is fine after
    assert engine.steps == 3


def test_the_trap_catches_a_sync():
    with no_host_reads(), pytest.raises(AssertionError, match="host sync"):
        bool(torch.ones(()) > 0)


@pytest.mark.cuda
@pytest.mark.parametrize("recipe", RECIPES)
def test_no_sync_on_cuda(recipe):
    @contextlib.contextmanager
    def sync_errors():
        torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode("default")

    _run(recipe, "cuda", sync_errors)


# --- LR schedulers and torch's default optimizers on CUDA --------------------------------

class DeferredMirror(HostMirror):
    """A CUDA-like ``HostMirror`` on the CPU: its copy lands only when waited on (as a
    copy queued behind the step's work), and ``cuda`` tells the step to defer."""

    def __init__(self):
        super().__init__(1, torch.device("cpu"))
        self.cuda, self.waits = True, 0

    def read(self):
        return None

    def wait(self):
        self.waits += self.pending
        return HostMirror.read(self)


def counted_host_reads(counts):
    """Count mixprec's own reads of tensor values (torch's unfused Adam reads its step
    counts, which live on the CPU also on CUDA: no sync)."""
    def counter(name, original):
        def f(self, *a, **k):
            if f"{os.sep}mixprec{os.sep}" in sys._getframe(1).f_code.co_filename:
                counts.append(name)
            return original(self, *a, **k)
        return f

    return reads_replaced(counter)


BAD = 2  # the skipped step of five


def _lr_run_engine(make_opt, monkeypatch, guard):
    """Five steps (the third skipped) of an engine that believes it is on CUDA:
    optimizers' parameters read as CUDA ones, the found_inf copy deferred."""
    monkeypatch.setattr(checks, "param_device_types", lambda opt: {"cuda"})
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    opt = make_opt(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 0.5 ** k)
    engine = MixedPrecision(model, opt, "bf16-master", scheduler=sched)
    mirror = engine._step._found_host = DeferredMirror()
    seen_lrs = []  # the LR each optimizer call runs with
    opt.register_step_pre_hook(lambda o, a, k: seen_lrs.append(o.param_groups[0]["lr"]))
    x = torch.randn(4, 8)
    stale = []
    for i in range(5):
        with engine.autocast():
            loss = model(x).square().mean() * (math.inf if i == BAD else 1.0)
        with guard():
            engine.backward(loss)
            engine.step()
        stale.append(opt.param_groups[0]["lr"])  # not settled yet: the last step's LR
    return engine, opt, seen_lrs, stale, mirror


def _lr_reference():
    """torch's own loop: GradScaler, and the scheduler stepped only where the scale did
    not drop (the step was applied)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 0.5 ** k)
    scaler = torch.amp.GradScaler("cpu", init_scale=1.0, growth_interval=1000)
    x = torch.randn(4, 8)
    lrs = []
    for i in range(5):
        loss = model(x).square().mean() * (math.inf if i == BAD else 1.0)
        scaler.scale(loss).backward()
        lrs.append(opt.param_groups[0]["lr"])
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        if scaler.get_scale() >= before:
            sched.step()
    return lrs, sched.get_last_lr()


def test_default_adamw_with_a_scheduler_steps_without_a_host_sync_on_cuda(monkeypatch):
    engine, opt, seen, stale, mirror = _lr_run_engine(
        lambda ps: torch.optim.AdamW(ps, lr=1e-2), monkeypatch, no_host_reads)
    assert all(g["fused"] is True for g in opt.param_groups)  # switched at build
    ref_lrs, ref_last = _lr_reference()
    assert seen == ref_lrs == [1e-2, 5e-3, 2.5e-3, 2.5e-3, 1.25e-3]
    assert stale == ref_lrs  # each step's advance waited for the next step
    assert engine.schedulers[0].get_last_lr() == ref_last == [6.25e-4]
    assert opt.param_groups[0]["lr"] == 6.25e-4
    assert mirror.waits == 5  # four at the next step, one on reading engine.schedulers


def test_a_checkpoint_counts_the_last_step_for_the_schedulers(monkeypatch):
    engine, opt, *_ = _lr_run_engine(
        lambda ps: torch.optim.AdamW(ps, lr=1e-2), monkeypatch, contextlib.nullcontext)
    assert engine.state_dict()["schedulers"][0]["last_epoch"] == 4  # 4 applied steps
    assert opt.param_groups[0]["lr"] == 6.25e-4


def test_an_explicit_foreach_adamw_keeps_one_sync_per_step_on_cuda(monkeypatch):
    counts = []
    engine, opt, seen, stale, _ = _lr_run_engine(
        lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True), monkeypatch,
        lambda: counted_host_reads(counts))
    assert all(g["fused"] is None and g["foreach"] is True for g in opt.param_groups)
    assert counts == ["item"] * 5  # the skip decision; none for the scheduler
    ref_lrs, ref_last = _lr_reference()
    assert seen == [lr for i, lr in enumerate(ref_lrs) if i != BAD]  # not called skipped
    assert engine.schedulers[0].get_last_lr() == ref_last


def test_default_optimizers_stay_unfused_on_the_cpu():
    model = torch.nn.Linear(4, 2)
    opts = [torch.optim.AdamW(model.parameters()), torch.optim.SGD(model.parameters())]
    assert checks.fuse_default_optimizers(opts) == []
    assert all(g["fused"] is None for o in opts for g in o.param_groups)
    MixedPrecision(model, opts[0], "bf16-master")
    assert all(g["fused"] is None for g in opts[0].param_groups)


@pytest.mark.parametrize("kind", ["Adam", "AdamW", "SGD"])
def test_only_default_torch_optimizers_on_cuda_are_fused(kind, monkeypatch):
    monkeypatch.setattr(checks, "param_device_types", lambda opt: {"cuda"})
    cls = getattr(torch.optim, kind)
    p = torch.nn.Parameter(torch.ones(3))
    chosen = [cls([p], lr=0.1), cls([p], lr=0.1, foreach=True), cls([p], lr=0.1, fused=False),
              cls([p], lr=0.1, foreach=False), type(kind, (cls,), {})([p], lr=0.1)]
    assert checks.fuse_default_optimizers(chosen) == [0]
    assert checks.takes_found_inf(chosen[0]) and not any(map(checks.takes_found_inf,
                                                             chosen[1:]))


def test_a_started_optimizer_is_fused_with_its_step_count_where_fused_keeps_it(monkeypatch):
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([p], lr=0.1)
    p.grad = torch.ones(3)
    opt.step()
    assert opt.state[p]["step"].dtype == torch.float32 and opt.state[p]["step"] == 1
    monkeypatch.setattr(checks, "param_device_types", lambda opt: {"cuda"})
    assert checks.fuse_default_optimizers([opt]) == [0]
    opt.step()  # torch's fused path accepts the moved state
    assert opt.state[p]["step"] == 2 and opt.state[p]["step"].device == p.device


@pytest.mark.cuda
def test_default_adamw_with_a_scheduler_never_syncs_on_cuda():
    model = tiny_gpt(d_model=16, seq_len=16).to("cuda")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    engine = MixedPrecision(model, opt, "bf16-master", scheduler=sched)
    assert all(g["fused"] is True for g in opt.param_groups)
    idx = torch.randint(0, 64, (4, 17), device="cuda")
    for i in range(5):
        with engine.autocast():
            loss = model(idx[:, :-1], idx[:, 1:]) * (math.inf if i == BAD else 1.0)
        torch.cuda.set_sync_debug_mode("error")
        try:
            engine.backward(loss)
            engine.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert engine.schedulers[0].get_last_lr() == [1e-2 * 0.5 ** 4]
