"""The experts' grouped GEMM reads nothing on the host for the per-tensor and rowwise
formats, so ``torch.compile`` traces it (and a transformers MoE model's experts) as one
graph: the compiled forward and backward equal eager's, and ``auto`` takes the
sync-free route under compile."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo as dynamo
from torch._dynamo.testing import CompileCounterWithBackend

from mixprec.experts import ExpertsFormat, grouped_mm
from mixprec.experts.grouped import _GroupedQuantizedMM
from mixprec.experts.segments import segment_ids

pytestmark = pytest.mark.filterwarnings("ignore")

COUNTS = [5, 0, 9, 3]  # expert 1 receives no token; one row (17) is routed elsewhere
T, K, N = 18, 64, 32


def _operands():
    g = torch.Generator().manual_seed(0)
    return (torch.randn(T, K, generator=g), torch.randn(len(COUNTS), N, K, generator=g) / 8,
            torch.randn(T, N, generator=g), torch.tensor(COUNTS).cumsum(0))


def _run(fn, fmt, x, w, gy, offs):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = fn(x, w, offs, fmt)
    y.backward(gy)
    return y.detach(), x.grad, w.grad, fmt.state_dict()


def test_segment_ids_from_cumulative_counts():
    ids = segment_ids(torch.tensor(COUNTS).cumsum(0), T)
    assert ids.tolist() == [0] * 5 + [2] * 9 + [3] * 3 + [4]


@pytest.mark.parametrize("recipe", ["fp8", "fp8-current"])
def test_grouped_route_compiles_as_one_graph_and_equals_eager(recipe):
    """fullgraph=True raises on any graph break (a host read of the counts is one);
    ``auto`` under compile is the grouped route, bit for bit, history included."""
    dynamo.reset()
    x, w, gy, offs = _operands()
    eager = _run(lambda *a: grouped_mm(*a, route="grouped"), ExpertsFormat(recipe),
                 x, w, gy, offs)
    compiled = torch.compile(lambda *a: grouped_mm(*a), fullgraph=True, backend="aot_eager")
    got = _run(compiled, ExpertsFormat(recipe), x, w, gy, offs)
    for a, b in zip(eager[:3], got[:3]):
        assert torch.equal(a, b)
    assert torch.equal(got[1][17], torch.zeros(K)) and torch.equal(got[2][1], torch.zeros(N, K))
    for name, t in eager[3].items():
        assert torch.equal(t, got[3][name]), name


def _host_read(x, w, offs, fmt):
    """The grouped route as it reads the token counts on the host (per-expert casts)."""
    return _GroupedQuantizedMM.apply(x, w, offs, fmt, x.dtype, True, "grouped")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rowwise_grouped_route_compiles_as_one_graph_and_equals_the_host_read(dtype):
    """fp8-rowwise: fullgraph=True traces forward and backward (wgrad's per-(expert,
    column) scales are segment reductions); compiled, eager ``grouped`` and the
    per-expert casts of the host-read path agree bit for bit."""
    dynamo.reset()
    x, w, gy, offs = (t.to(dtype) if t.is_floating_point() else t for t in _operands())
    ref = _run(_host_read, ExpertsFormat("fp8-rowwise"), x, w, gy, offs)
    eager = _run(lambda *a: grouped_mm(*a, route="grouped"), ExpertsFormat("fp8-rowwise"),
                 x, w, gy, offs)
    compiled = torch.compile(lambda *a: grouped_mm(*a), fullgraph=True, backend="aot_eager")
    got = _run(compiled, ExpertsFormat("fp8-rowwise"), x, w, gy, offs)
    for a, b, c in zip(ref[:3], eager[:3], got[:3]):
        assert a.dtype == dtype and torch.equal(a, b) and torch.equal(a, c)
    assert torch.equal(got[1][17], torch.zeros(K, dtype=dtype))
    assert torch.equal(got[2][1], torch.zeros(N, K, dtype=dtype))


def test_rowwise_wgrad_scales_are_per_expert_column():
    """An inf in one token of expert 2 makes only that expert's columns' wgrad scales
    NaN (expert 0's and 3's gradients stay finite), exactly as the per-expert casts do."""
    x, w, gy, offs = _operands()
    x[8, 3] = float("inf")
    ref = _run(_host_read, ExpertsFormat("fp8-rowwise"), x, w, gy, offs)
    got = _run(lambda *a: grouped_mm(*a, route="grouped"), ExpertsFormat("fp8-rowwise"),
               x, w, gy, offs)
    for a, b in zip(ref[:3], got[:3]):
        torch.testing.assert_close(b, a, rtol=0, atol=0, equal_nan=True)
    dw = got[2]
    assert dw[2, :, 3].isnan().all() and dw[[0, 3]].isfinite().all()


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["fp8-current", "fp8-rowwise"])
def test_a_transformers_moe_model_compiles_as_one_graph(recipe, monkeypatch):
    """A tiny Qwen3-MoE (one layer) under the engine's ``recipe`` compiles to one graph
    (no break, so none from the experts: the counting backend sees one frame), and the
    compiled loss and gradients are eager's on the same route, bit for bit."""
    transformers = pytest.importorskip("transformers")
    from mixprec import MixedPrecision
    from mixprec.experts import grouped

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.Qwen3MoeConfig(
        hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=128, max_position_embeddings=64, num_experts_per_tok=2,
        intermediate_size=64, moe_intermediate_size=64, num_experts=4, head_dim=16),
        dtype=torch.float32)
    engine = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.0),
                            recipe)
    idx = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    experts = model.model.layers[0].mlp.experts

    def grads(fn):
        model.zero_grad(set_to_none=True)
        loss = fn(idx)
        loss.backward()
        return loss.detach(), experts.gate_up_proj.grad.clone(), experts.down_proj.grad

    def loss_fn(idx):
        with engine.autocast():
            return model(input_ids=idx, labels=idx).loss

    dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = grads(torch.compile(loss_fn, backend=counter))
    assert counter.frame_count == 1
    route = grouped._route  # eager on the route compile takes (auto: the loop on a CPU)
    monkeypatch.setattr(grouped, "_route", lambda *a: route(*a[:5], True))
    eager = grads(loss_fn)
    for a, b in zip(eager, compiled):
        assert torch.equal(a, b)
    assert eager[1].abs().sum() > 0 and eager[2].abs().sum() > 0
