"""CommStats: each collective kept with its op, purpose, dtype and bytes; a 16-bit
fallback of a low-precision format warned once per cause and kept."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from mixprec.parallel import comm_stats
from mixprec.parallel.comm_stats import CommFallback, CommRecord, CommStats


def test_records_sum_by_op_purpose_and_dtype():
    s = CommStats()
    s.record(torch.zeros(10, dtype=torch.bfloat16))
    s.record(torch.zeros(3, 4, dtype=torch.uint8), op="all_gather", what="weights")
    s.record(torch.zeros(6, dtype=torch.uint8), op="all_gather", what="weights")
    assert s.bytes_sent == 20 + 12 + 6 and s.calls == 3 and s.per_call == [20, 12, 6]
    assert s.records[1] == CommRecord("all_gather", "weights", torch.uint8, 12)
    assert s.totals() == {("all_reduce", "grads", torch.bfloat16): 20,
                          ("all_gather", "weights", torch.uint8): 18}


def test_a_long_run_keeps_the_recent_calls_and_every_sum(monkeypatch):
    monkeypatch.setattr(comm_stats, "KEEP", 4)
    s = CommStats()
    for i in range(1, 11):
        s.record(torch.zeros(i, dtype=torch.uint8), op="all_gather", what="weights")
    assert s.calls == 10 and s.bytes_sent == 55
    assert s.totals() == {("all_gather", "weights", torch.uint8): 55}
    assert 4 <= len(s.records) <= 8 and s.per_call[-4:] == [7, 8, 9, 10]
    assert [r.nbytes for r in s.records[-4:]] == [7, 8, 9, 10]


def test_a_fallback_warns_once_per_cause_and_is_kept_each_time(monkeypatch):
    monkeypatch.setattr(comm_stats, "_WARNED", set())
    s = CommStats()
    with pytest.warns(UserWarning, match=r"weight:fc1 is communicated in torch.bfloat16 "
                                         r"although 'mxfp8' asked"):
        s.fallback("weight:fc1", "mxfp8", torch.bfloat16, "shard cut not on a block")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s.fallback("weight:fc2", "mxfp8", torch.bfloat16, "shard cut not on a block")
        s.fallback("weight:fc2", "mxfp8", torch.bfloat16, "shard cut not on a block")
    assert s.fallbacks == [
        CommFallback("weight:fc1", "mxfp8", torch.bfloat16, "shard cut not on a block"),
        CommFallback("weight:fc2", "mxfp8", torch.bfloat16, "shard cut not on a block")]
    with pytest.warns(UserWarning, match="nvfp4"):
        s.fallback("weight:fc1", "nvfp4", torch.bfloat16, "shard cut not on a block")


class _SumsInBackward(torch.autograd.Function):
    """Records an all-reduce of its gradient in backward, as the TP Functions do."""

    @staticmethod
    def forward(ctx, x, stats):
        ctx.stats = stats
        return x * 2

    @staticmethod
    def backward(ctx, g):
        g = g.float().contiguous()
        ctx.stats.record(g, op="all_reduce", what="input_grads")
        return g * 2, None


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_code_records_each_run_without_recompiling(backend):
    """``record`` in a compiled forward and in an autograd.Function's backward: each of
    5 runs of one compiled frame records what eager records (op, purpose, dtype,
    bytes, in order), and the frame is compiled once (no counter guarded on)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    def step(x, stats):
        stats.record(x, op="all_gather", what="activations")
        return _SumsInBackward.apply(x, stats).sum()

    torch._dynamo.reset()
    eager, compiled = CommStats(), CommStats()
    counter = CompileCounterWithBackend(backend)
    f = torch.compile(step, backend=counter)
    for _ in range(5):
        x = torch.randn(4, 3, dtype=torch.bfloat16, requires_grad=True)
        step(x, eager).backward()
        f(x, compiled).backward()
    torch._dynamo.reset()
    assert counter.frame_count == 1
    want = [CommRecord("all_gather", "activations", torch.bfloat16, 24),
            CommRecord("all_reduce", "input_grads", torch.float32, 48)] * 5
    assert eager.records == want and compiled.records == want
    assert compiled.calls == 10 and compiled.bytes_sent == 5 * 72
    assert compiled.totals() == eager.totals()
    twin = copy.deepcopy(compiled)  # a copy counts for itself, in compiled code too
    f(x, twin).backward()
    torch._dynamo.reset()
    assert twin.calls == 12 and compiled.calls == 10


def test_inductors_cuda_graph_check_finds_the_record_op_in_a_compiled_graph(monkeypatch):
    """A forward that records a collective, compiled by inductor with CUDA graphs on
    and graph partitions off (the setting in which inductor asks this of the whole
    graph): inductor's own check, ``get_first_incompatible_cudagraph_node`` on the
    post-grad graph (whose ``is_cudagraph_unsafe_fx_node`` is also where graph
    partitions cut, torch's default), returns the ``record_comm`` node, so the op
    runs outside CUDA graphs and the rest is captured. Untagged, the check returned
    None, leaving the op's mutated CPU counter to inductor's mutation and device checks
    and a captured op to replays that do not count. The count is made as eager makes
    it."""
    import torch._inductor.compile_fx as compile_fx

    found = []
    check = compile_fx.get_first_incompatible_cudagraph_node

    def spy(gm):
        node = check(gm)
        found.append(node)
        return node

    monkeypatch.setattr(compile_fx, "get_first_incompatible_cudagraph_node", spy)

    def step(x, stats):
        stats.record(x, op="all_gather", what="activations")
        return x * 2

    torch._dynamo.reset()
    stats = CommStats()
    # caches off: a cached graph is loaded without being checked again
    with torch._inductor.config.patch({"graph_partition": False, "triton.cudagraphs": True,
                                       "force_disable_caches": True}):
        f = torch.compile(step, backend="inductor")
        f(torch.randn(4, 3), stats)
    torch._dynamo.reset()
    assert stats.records == [CommRecord("all_gather", "activations", torch.float32, 48)]
    assert len(found) == 1 and found[0] is not None
    assert found[0].target is torch.ops.mixprec.record_comm.default
    assert torch.Tag.cudagraph_unsafe in torch.ops.mixprec.record_comm.default.tags
