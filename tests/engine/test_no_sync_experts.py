"""The experts' grouped GEMMs read nothing on the host on CUDA's routes (DESIGN
principle 3), checked on a CPU standing in for an sm90 GPU.

The stand-in is ``test_experts_cuda_layouts``'s: the device checks monkeypatched so
that the CUDA routes run on CPU tensors, torch's grouped kernels replaced by the model
of their CUDA checks (which reads the offsets itself, as the GPU's own threads do).
Every way a tensor's value reaches Python from mixprec's code is counted, as
``test_no_sync`` counts it (``item``, ``bool``, ``float``, ``int``, ``index``,
``tolist``, ``nonzero``, ``cpu``, ``numpy``), and so is a tensor built from Python
values (``torch.tensor``: a host-to-device copy on a GPU). The formats whose CUDA
route is the per-expert loop read the token counts once per projection, as
docs/guides/moe.md says."""

from __future__ import annotations

import contextlib
import sys

import pytest
import torch

from helpers import moe_models
from helpers.cuda_grouped_model import stand_in
from helpers.host_reads import MIXPREC, reads_replaced
from mixprec.experts import ExpertsFormat, grouped_mm
from mixprec.experts import grouped as gr
from mixprec.experts.hook import convert_experts
from mixprec.parallel import gather_casts

_READS = ["item", "__bool__", "__float__", "__int__", "__index__", "tolist", "nonzero",
          "cpu", "numpy"]


def _from_mixprec() -> bool:
    return MIXPREC in sys._getframe(2).f_code.co_filename


def counted_host_reads(counts: list[str]):
    """Each of mixprec's reads of a tensor's value, and each tensor it builds from
    Python values, appended to ``counts`` by name."""
    def wrap(name, original):
        def f(*a, **k):
            if _from_mixprec():
                counts.append(name)
            return original(*a, **k)
        return f

    return reads_replaced(wrap, _READS, ("tensor", "nonzero"))


def test_the_counter_sees_a_read_and_a_built_tensor():
    """The control: mixprec's ``group_bounds`` reads the offsets (``tolist``), and
    ``torch.tensor`` from mixprec's code counts; the test's own reads do not."""
    counts = []
    with counted_host_reads(counts):
        gr.group_bounds(torch.tensor([2, 5]), 5)
        torch.ones(2).tolist()
    assert counts == ["tolist"]


@pytest.fixture
def sm90(monkeypatch):
    """A CPU standing in for an sm90 GPU, torch's grouped kernels replaced by the model."""
    return stand_in(monkeypatch)


def _step(recipe, route, counts_per_expert, reads):
    """Two steps of one projection, the second's reads counted (nvfp4 reads its
    rounding stream's counter once after construction)."""
    gen = torch.Generator().manual_seed(0)
    t = sum(counts_per_expert) + 1
    x = torch.randn(t, 64, generator=gen).bfloat16().requires_grad_()
    w = torch.randn(len(counts_per_expert), 48, 64, generator=gen).requires_grad_()
    offs = torch.tensor(counts_per_expert).cumsum(0).to(torch.int32)
    gy = torch.randn(t, 48, generator=gen).bfloat16()
    fmt = ExpertsFormat(recipe)
    for counting in (contextlib.nullcontext(), counted_host_reads(reads)):
        w.grad = None
        with counting:
            y = grouped_mm(x, w, offs, fmt, route=route)
            y.backward(gy)
    return w.grad


@pytest.mark.parametrize("route", ["auto", "grouped", "scaled_grouped"])
@pytest.mark.parametrize("recipe", ["fp8", "fp8-current", "fp8-rowwise"])
def test_the_cuda_routes_read_nothing_on_the_host(sm90, monkeypatch, recipe, route):
    """Forward and backward of the per-tensor and rowwise formats on torch's grouped
    kernels (``auto`` on sm90: ``scaled_grouped``): 0 reads, 0 tensors from Python,
    every GEMM one launch on the kernels' fast path."""
    monkeypatch.setattr(ExpertsFormat, "backend", lambda self, d: "scaled_mm")
    reads = []
    dw = _step(recipe, route, [28, 0, 51, 17], reads)
    assert reads == []
    assert len(sm90.calls) == 6 and all(c.fast for c in sm90.calls)
    assert sm90.calls[0].op == ("_grouped_mm" if route == "grouped" else "_scaled_grouped_mm")
    assert (dw[1] == 0).all() and dw[0].abs().sum() > 0


@pytest.mark.parametrize("recipe", ["fp8-block", "mxfp8", "nvfp4", "int8-rowwise"])
def test_the_looped_formats_read_the_counts_once_per_projection(sm90, recipe):
    """The block formats and int8 run per expert on CUDA (their values are not bf16
    values): one read of the counts in the forward (``group_bounds``), none in the
    backward, which keeps the bounds it read."""
    reads = []
    _step(recipe, "auto", [28, 0, 51, 17], reads)
    assert reads == ["tolist"]
    assert sm90.calls == []


@pytest.mark.parametrize("recipe", ["fp8-current", "fp8-rowwise"])
def test_a_transformers_moe_step_reads_nothing_on_the_host_in_its_experts(
        sm90, monkeypatch, recipe):
    """A config-built Qwen3-MoE's experts (routing, two grouped projections per layer,
    forward and backward) on the CUDA stand-in: mixprec's code reads nothing."""
    pytest.importorskip("transformers")
    monkeypatch.setattr(ExpertsFormat, "backend", lambda self, d: "scaled_mm")
    model = moe_models.model("qwen3_moe")
    assert convert_experts(model, recipe)
    idx = torch.randint(0, moe_models.VOCAB, (2, 17), generator=torch.Generator().manual_seed(0))
    reads = []
    with counted_host_reads(reads), torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(input_ids=idx[:, :-1], labels=idx[:, 1:]).loss
        loss.backward()
    assert reads == []
    layers = moe_models.config("qwen3_moe").num_hidden_layers
    assert [c.op for c in sm90.calls].count("_scaled_grouped_mm") == 2 * layers
    assert len(sm90.calls) == 6 * layers and all(c.fast for c in sm90.calls)


def test_fp4_tables_reach_a_device_once(monkeypatch):
    """NVFP4's gathered codes pack and unpack through lookup tables: copied to a device
    once (here the meta device), not on every call."""
    gather_casts._tables_on.cache_clear()
    copies = []
    for name in ("_ENCODE", "_DECODE"):
        table = getattr(gather_casts, name).clone()
        real = table.to
        table.to = lambda *a, real=real, name=name, **k: (copies.append(name),
                                                          real(*a, **k))[1]
        monkeypatch.setattr(gather_casts, name, table)
    codes = torch.empty(4, 32, dtype=torch.float8_e4m3fn, device="meta")
    for _ in range(3):
        packed = gather_casts.pack_fp4(codes)
        assert gather_casts.unpack_fp4(packed, 32).shape == (4, 32)
    assert copies == ["_ENCODE", "_DECODE"]
    assert gather_casts.fp4_tables("meta")[0] is gather_casts.fp4_tables(
        torch.device("meta"))[0]
    gather_casts._tables_on.cache_clear()
    values = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.5, -6.0, -2.0])
    cpu = values.repeat(3, 1).to(torch.float8_e4m3fn)  # an odd number of columns
    back = gather_casts.unpack_fp4(gather_casts.pack_fp4(cpu), cpu.shape[1])
    assert torch.equal(back.float(), cpu.float())


@pytest.mark.parametrize("recipe", ["fp8", "fp8-current", "fp8-rowwise"])
def test_the_gpu_grouped_route_compiles_as_one_graph(monkeypatch, recipe):
    """Nothing read on the host, nothing to break a graph: the GPU form of ``grouped``
    (bf16 codes on ``torch._grouped_mm``, here its CPU kernel) compiles with
    ``fullgraph=True`` (AOT autograd, the backward too) and equals eager bit for bit."""
    monkeypatch.setattr(gr, "bf16_only", lambda device: True)
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(0)
    x0 = torch.randn(30, 64, generator=gen).bfloat16()
    w0 = torch.randn(4, 48, 64, generator=gen)
    offs = torch.tensor([5, 0, 12, 29], dtype=torch.int32)

    def run(compiled):
        fmt = ExpertsFormat(recipe)
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()

        def loss(x, w):
            return grouped_mm(x, w, offs, fmt, route="grouped").float().square().sum()

        fn = torch.compile(loss, backend="aot_eager", fullgraph=True) if compiled else loss
        fn(x, w).backward()
        return x.grad, w.grad

    for a, b in zip(run(True), run(False)):
        assert torch.equal(a, b)
