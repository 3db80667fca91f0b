"""The experts' grouped GEMM reads nothing on the host for the per-tensor, rowwise,
``fp8-block``, MX, INT8 rowwise and NVFP4 formats, so ``torch.compile`` traces it (and
a transformers MoE model's experts) as one graph: the compiled forward and backward
equal eager's and the host-read path's, and ``auto`` takes the sync-free route under
compile."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo as dynamo
from torch._dynamo.testing import CompileCounterWithBackend

from mixprec.experts import ExpertsFormat, grouped, grouped_mm
from mixprec.experts.grouped import PerExpert
from mixprec.experts.segments import segment_ids
from mixprec.formats.fp4 import counter_key, counter_uniform
from mixprec.formats.mm import QuantizedGemm
from mixprec.formats.segments import tile_aligned_rows

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


ROW_TILE = ["fp8-rowwise", "fp8-block", "mxfp8"]
#: NVFP4 as the recipe has it (16x16 weight blocks, wgrad's Hadamard transform over 16
#: tokens, stochastic rounding of the gradients) and with neither transform nor 2-D blocks
NVFP4 = ["nvfp4", "nvfp4,nvfp4_rht=false,nvfp4_2d=false"]
#: int8-rowwise: the forward's and dgrad's casts whole; wgrad in 16 bits on the grouped kernel
SYNC_FREE = [*ROW_TILE, "int8-rowwise", NVFP4[0],
             pytest.param(NVFP4[1], marks=pytest.mark.long)]  # 10-15 s each
LONG = [5, 0, 139, 3]  # expert 2 spans several wgrad tiles (128 tokens: fp8-block)


def _long_operands(dtype=torch.float32):
    g = torch.Generator().manual_seed(1)
    t = sum(LONG) + 1
    return (torch.randn(t, K, generator=g).to(dtype),
            (torch.randn(len(LONG), N, K, generator=g) / 8).to(dtype),
            torch.randn(t, N, generator=g).to(dtype), torch.tensor(LONG).cumsum(0))


def _host_read(x, w, offs, fmt):
    """The grouped route as it reads the token counts on the host (per-expert casts)."""
    return QuantizedGemm.apply(x, w, fmt, x.dtype, True, None, offs,
                               PerExpert(fmt, "grouped"))


def _sync_free(monkeypatch):
    """``grouped_mm`` on the ``grouped`` route, refusing the host read of the counts."""
    def refused(offsets, rows):
        raise AssertionError("the token counts were read on the host")

    monkeypatch.setattr(grouped, "group_bounds", refused)
    return lambda *a: grouped_mm(*a, route="grouped")


def test_tile_aligned_rows_start_every_expert_on_a_tile():
    dest, bound = tile_aligned_rows(torch.tensor(COUNTS).cumsum(0), T, 4)
    assert dest.tolist() == [0, 1, 2, 3, 4, 8, 9, 10, 11, 12, 13, 14, 15, 16,
                             20, 21, 22, 24]
    assert bound == T + 5 * 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("recipe", SYNC_FREE)
def test_row_and_tile_formats_compile_as_one_graph_and_equal_the_host_read(recipe, dtype):
    """fullgraph=True traces forward and backward (wgrad's per-expert scales along the
    tokens: segment reductions, or tiles aligned to each expert's first token; NVFP4's
    per-expert global scales, Hadamard transform and random numbers by place);
    compiled, eager ``grouped`` and the per-expert casts of the host-read path agree
    bit for bit, and advance the same state (NVFP4's stream count)."""
    dynamo.reset()
    x, w, gy, offs = _long_operands(dtype)
    ref = _run(_host_read, ExpertsFormat(recipe), x, w, gy, offs)
    eager = _run(lambda *a: grouped_mm(*a, route="grouped"), ExpertsFormat(recipe),
                 x, w, gy, offs)
    compiled = torch.compile(lambda *a: grouped_mm(*a), fullgraph=True, backend="aot_eager")
    got = _run(compiled, ExpertsFormat(recipe), x, w, gy, offs)
    for a, b, c in zip(ref[:3], eager[:3], got[:3]):
        assert a.dtype == dtype and torch.equal(a, b) and torch.equal(a, c)
    assert torch.equal(got[1][-1], torch.zeros(K, dtype=dtype))
    assert torch.equal(got[2][1], torch.zeros(N, K, dtype=dtype))
    for name, t in ref[3].items():
        assert torch.equal(t, eager[3][name]) and torch.equal(t, got[3][name]), name


@pytest.mark.parametrize("recipe", [*ROW_TILE, *NVFP4])
def test_wgrad_scales_along_the_tokens_are_per_expert(recipe, monkeypatch):
    """An inf in one token of expert 2 makes that expert's wgrad NaN in its column only,
    and expert 0's and 3's gradients stay finite (no scale, tile or transform spans two
    experts), exactly as the per-expert casts do."""
    x, w, gy, offs = _long_operands()
    x[8, 3] = float("inf")
    ref = _run(_host_read, ExpertsFormat(recipe), x, w, gy, offs)
    got = _run(_sync_free(monkeypatch), ExpertsFormat(recipe), x, w, gy, offs)
    for a, b in zip(ref[:3], got[:3]):
        torch.testing.assert_close(b, a, rtol=0, atol=0, equal_nan=True)
    dw = got[2]
    assert dw[2, :, 3].isnan().all() and dw[[0, 3]].isfinite().all()


@pytest.mark.slow
@pytest.mark.parametrize("recipe", [  # 15-30 s each: the later formats in CI's long pass
    "fp8-current", "fp8-rowwise", *(pytest.param(r, marks=pytest.mark.long) for r in (
        "fp8-block", "mxfp8", "nvfp4",
        # int8's Linears under fp8_gemm=auto read their CPU speeds in the graph: pinned
        "int8-rowwise,fp8_gemm=dequant_fp32"))])
def test_a_transformers_moe_model_compiles_as_one_graph(recipe, monkeypatch):
    """A tiny Qwen3-MoE (one layer) under the engine's ``recipe`` compiles to one graph
    (no break, so none from the experts: the counting backend sees one frame), and the
    compiled loss and gradients are eager's on the same route, bit for bit (NVFP4's
    stochastic rounding from the same stream state: the Linears' eager twin of their
    compiled stream, the experts' own in both)."""
    transformers = pytest.importorskip("transformers")
    from mixprec import MixedPrecision
    from mixprec.modules.linear import Float8Linear

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

    rng = {k: v.clone() for k, v in model.state_dict().items() if k.endswith("nvfp4_rng")}
    dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = grads(torch.compile(loss_fn, backend=counter))
    assert counter.frame_count == 1
    route = grouped._route  # eager on the route compile takes (auto: the loop on a CPU)
    monkeypatch.setattr(grouped, "_route", lambda *a: route(*a[:5], True))
    monkeypatch.setattr(Float8Linear, "_sr_generator", Float8Linear._sr_key)
    assert not model.load_state_dict(rng, strict=False).unexpected_keys
    eager = grads(loss_fn)
    for a, b in zip(eager, compiled):
        assert torch.equal(a, b)
    assert eager[1].abs().sum() > 0 and eager[2].abs().sum() > 0


def test_counter_key_moves_the_stream_by_its_offset():
    """``counter_key(k, o)``'s numbers are ``k``'s from the ``o``-th on (the experts'
    casts draw at their place in one stream)."""
    key = torch.tensor(5 * 1_000_003 + 2)
    for offset in (0, 1, 577, 100_003):
        got = counter_uniform(counter_key(key, offset), (64,))
        ref = counter_uniform(key, (offset + 64,))[offset:]
        assert torch.equal(got, ref), offset


@pytest.mark.parametrize("recipe,same", [("nvfp4", False), ("nvfp4,nvfp4_sr=false", True)])
def test_nvfp4_experts_round_with_their_own_random_numbers(recipe, same, monkeypatch):
    """Experts 0 and 2 get the same 16 gradient rows and the same weight: rounded to
    nearest, their input gradients are equal; rounded stochastically they differ
    (each row draws its own numbers), on the host-read and the sync-free route alike,
    which agree bit for bit."""
    x, w, gy, _ = _operands()
    offs = torch.tensor([16, 16, 32, 32])
    x, gy = torch.cat([x[:16], x[:16]]), torch.cat([gy[:16], gy[:16]])
    w = torch.stack([w[0], w[1], w[0], w[3]])
    ref = _run(_host_read, ExpertsFormat(recipe), x, w, gy, offs)[1]
    got = _run(_sync_free(monkeypatch), ExpertsFormat(recipe), x, w, gy, offs)[1]
    assert torch.equal(ref, got) and torch.equal(got[:16], got[16:]) == same
