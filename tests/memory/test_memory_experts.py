"""The experts' sync-free grouped routes as the memory planner prices them
(``mixprec.memory.expert_casts``): the route it names is the one ``grouped_mm`` runs,
and one projection's forward and backward hold what it predicts, measured by the CPU
allocator's events (``high_water``)."""

from __future__ import annotations

import pytest
import torch

from mixprec.experts import ExpertsFormat, grouped, grouped_mm
from mixprec.memory import high_water
from mixprec.memory.expert_casts import (
    saved_cast,
    sync_free_backward,
    sync_free_forward,
    sync_free_route,
    token_casts,
)

#: the kind of whole-operand casts each format's sync-free route runs
_ROUTES = {"fp8": "tensor", "fp8-current": "tensor", "fp8-rowwise": "rows",
           "fp8-block": "tiles", "mxfp8": "tiles", "int8-rowwise": "int8-rows", "nvfp4": "fp4"}


@pytest.mark.parametrize("name", list(_ROUTES))
def test_the_named_sync_free_route_is_the_one_grouped_mm_runs(name, monkeypatch):
    q = ExpertsFormat(name).quantizer
    ran = []

    class Spy(grouped.Segmented):
        def bind(self, *args):
            ran.append(self.fmt.segment_kind)
            return super().bind(*args)

    monkeypatch.setattr(grouped, "Segmented", Spy)
    x, w = torch.randn(64, 32), torch.randn(4, 16, 32)
    grouped_mm(x, w, torch.tensor([16, 32, 48, 64]), ExpertsFormat(name), route="grouped")
    assert ran == [_ROUTES[name]] == [sync_free_route(q, "grouped", "cpu")]
    assert sync_free_route(q, "loop", "cpu") is None
    assert sync_free_route(q, "grouped", "cuda") is None


@pytest.mark.parametrize("name", ["fp8-current", "fp8-rowwise", "int8-rowwise", "nvfp4",
                                  "mxfp8", "fp8-block"])
@pytest.mark.parametrize("k,n", [(64, 256), (128, 64)])
def test_one_sync_free_projection_holds_what_is_priced(name, k, n):
    """1024 rows over 4 experts, fp32 tokens under a bf16 autocast (a gate-up
    projection's: a bf16 output, an fp32 input gradient): the forward's high-water mark
    (its output, what it saves and ``sync_free_forward``) and the backward's (``dx``,
    ``dw`` and ``sync_free_backward``) within 5%."""
    torch.manual_seed(0)
    r, e = 1024, 4
    fmt = ExpertsFormat(name)
    q = fmt.quantizer
    route = sync_free_route(q, "grouped", "cpu")
    x = torch.randn(r, k, requires_grad=True)
    w = (torch.randn(e, n, k) * 0.05).requires_grad_()
    offsets = torch.tensor([256, 512, 768, 1024])
    out = {}

    def forward():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out["y"] = grouped_mm(x, w, offsets, fmt, route="grouped")

    fwd = high_water(forward)
    y = out.pop("y")
    gy = torch.randn_like(y)
    bwd = high_water(lambda: torch.autograd.grad(y, (x, w), gy))
    saved = token_casts(q, [r / e] * e, k, 2, route) + e * saved_cast(q, n, k, "weight")
    want_fwd = 2 * r * n + saved + sync_free_forward(route, q, r, e, k, n, 2)
    want_bwd = 4 * r * k + 4 * e * n * k + sync_free_backward(route, q, r, e, k, n, 2, 4)
    assert abs(want_fwd / fwd - 1) <= 0.05, (name, want_fwd / 2**20, fwd / 2**20)
    assert abs(want_bwd / bwd - 1) <= 0.05, (name, want_bwd / 2**20, bwd / 2**20)
