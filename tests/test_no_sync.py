"""No host synchronisation inside backward() and step() (DESIGN principle 3).

On the CPU there is no device to wait for, so the test stands in for
``torch.cuda.set_sync_debug_mode("error")``: every way a tensor's value reaches Python
(``item``, ``bool``, ``float``, ``int``, ``tolist``) is made to raise while
``backward()`` and ``step()`` run. The CUDA variant runs the real sync debug mode.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from conftest import tiny_gpt
from mixprec import MixedPrecision

pytestmark = pytest.mark.filterwarnings("ignore:fp16 compute on the CPU:UserWarning",
                                        "ignore:fp16 has no fast kernels:UserWarning")

RECIPES = ["bf16", "bf16-master", "bf16-master,wgrad=fp32", "fp16", "fp16-master",
           "fp8", "fp8-current", "fp8-rowwise"]


@contextlib.contextmanager
def no_host_reads():
    names = ["item", "__bool__", "__float__", "__int__", "tolist"]
    saved = {n: getattr(torch.Tensor, n) for n in names}

    def trap(name):
        def f(self, *a, **k):
            raise AssertionError(f"host sync: Tensor.{name} called inside the hot path")
        return f

    for n in names:
        setattr(torch.Tensor, n, trap(n))
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(torch.Tensor, n, f)


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
