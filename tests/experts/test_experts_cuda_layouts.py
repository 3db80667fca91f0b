"""The experts' grouped GEMMs as torch's CUDA kernels take them, for any routing.

A CPU stands in for an sm90 GPU (``bf16_only`` and the capability monkeypatched, the
formats' GEMM route ``scaled_mm``), and ``torch._grouped_mm`` / ``torch._scaled_grouped_mm``
are replaced by a model of the checks torch's CUDA code makes (``cuda_grouped_model``:
host checks, the device asserts of ``prepare_grouped_gemm_data``, each group's base
address, the scales' shapes and dtypes; then torch's meta kernel and a CPU product).
Every route and format that passes a grouped kernel on CUDA runs forward and backward
through it on routings with empty experts, counts that are not multiples of 8, 16 or
32, a single token, tokens routed past the last expert and no token at all."""

from __future__ import annotations

import pytest
import torch

from helpers.cuda_grouped_model import CudaCheckError, CudaGroupedModel, stand_in
from mixprec.experts import ExpertsFormat, grouped_mm
from mixprec.experts.gather_casts import ExpertsCasts, _send_experts

K, N = 64, 48
CODES = ["fp8", "fp8-current", "fp8-rowwise"]  # the formats on CUDA's grouped kernels
LOOPED = ["fp8-block", "mxfp8", "nvfp4", "int8-rowwise"]  # per expert on CUDA
PREDICTED = [28, 0, 511, 1177, 488, 608, 103, 1181]  # benchmarks/grouped_gemm.py's
#: (counts per expert, rows routed past the last expert)
ROUTINGS = {"predicted": (PREDICTED, 0), "odd": ([5, 0, 9, 3], 1), "one token": ([0, 1, 0], 0),
            "last only": ([0, 0, 0, 7], 2), "first only": ([13, 0, 0], 0),
            "all elsewhere": ([0, 0, 0], 3), "no tokens": ([0, 0, 0, 0], 0)}


def _row_major_wgrad_operands(counts, n, k):
    """The weight-gradient operands in the row-major layout (the grouped route's
    before it passed the transpose): the gradient's codes as a row-major (N, tokens)
    tensor, the tokens padded to 8."""
    t = sum(counts)
    tp = t + (-t) % 8
    g = torch.zeros(n, tp, dtype=torch.bfloat16)
    x = torch.zeros(tp, k, dtype=torch.bfloat16)
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    return g, x, offs


def test_the_model_refuses_a_row_major_weight_gradient_on_the_predicted_routing():
    """The row-major (N, tokens) gradient with jagged K: expert 0's 28 tokens move the
    next group's A by 56 bytes, so the kernel asserts (torch 2.13); the older kernel
    refuses expert 1's empty group too."""
    g, x, offs = _row_major_wgrad_operands(PREDICTED, N, K)
    for strict in (False, True):
        with pytest.raises(CudaCheckError, match="byte size to be non-negative multiple "
                                                 "of 16 \\(group 0 of 28 rows\\)"):
            CudaGroupedModel((9, 0), strict_empty=strict).grouped_mm(g, x, offs=offs)
    aligned, _, offs8 = _row_major_wgrad_operands([8, 0, 16], N, K)
    x8 = torch.zeros(24, K, dtype=torch.bfloat16)
    assert CudaGroupedModel((9, 0), strict_empty=False).grouped_mm(aligned, x8, offs=offs8
                                                                    ).shape == (3, N, K)
    with pytest.raises(CudaCheckError, match="greater than 0"):
        CudaGroupedModel((9, 0)).grouped_mm(aligned, x8, offs=offs8)


def test_the_model_takes_the_transposed_gradient_torchs_backward_passes():
    """``g.t()`` of the (tokens, N) gradient (column-major) against the row-major tokens:
    each group starts a whole row of N and K elements on, for any count, empty groups
    included; the product is the per-expert ``gᵀ x``."""
    t = sum(PREDICTED)
    gen = torch.Generator().manual_seed(0)
    g = torch.randn(t, N, generator=gen).bfloat16()
    x = torch.randn(t, K, generator=gen).bfloat16()
    offs = torch.tensor(PREDICTED).cumsum(0).to(torch.int32)
    model = CudaGroupedModel((9, 0), strict_empty=True)
    dw = model.grouped_mm(g.t(), x, offs=offs)
    assert model.calls[0].a_row_major is False and model.calls[0].fast
    start = 0
    for e, c in enumerate(PREDICTED):
        if c == 0:
            assert dw[e].isnan().all()  # unwritten: the caller must zero it
        else:
            want = (g[start:start + c].double().t() @ x[start:start + c].double())
            torch.testing.assert_close(dw[e].double(), want, rtol=2e-2, atol=2e-1)
        start += c


def test_the_models_host_checks_agree_with_torchs_meta_kernels():
    """Controls: what torch's meta kernels refuse, the model refuses too (a 16-byte
    stride, a row-major B for the fp8 kernel, a scale of the wrong length), and a base
    pointer off 16 bytes, which only the CUDA kernel checks."""
    model = CudaGroupedModel((9, 0))
    offs = torch.tensor([3, 7], dtype=torch.int32)
    a = torch.zeros(7, 36, dtype=torch.bfloat16)[:, :30]  # a 72-byte row: refused
    b = torch.zeros(2, 30, 16, dtype=torch.bfloat16)
    for fn in (model.grouped_mm, lambda *args, **kw: torch._grouped_mm(
            *(t.to("meta") for t in args), offs=offs.to("meta"))):
        with pytest.raises((CudaCheckError, RuntimeError), match="16 bytes"):
            fn(a.contiguous()[:, :30], b, offs=offs)
    fa = torch.zeros(7, 32).to(torch.float8_e4m3fn)
    fb = torch.zeros(2, 32, 16).to(torch.float8_e4m3fn)  # row-major (E, K, N)
    sa, sb = torch.ones(7), torch.ones(2, 16)
    for call in (model.scaled_grouped_mm, torch._scaled_grouped_mm):
        meta = call is torch._scaled_grouped_mm
        cast = (lambda t: t.to("meta")) if meta else (lambda t: t)
        with pytest.raises((CudaCheckError, RuntimeError), match="(?i)column major|transposed"):
            call(cast(fa), cast(fb), cast(sa), cast(sb), offs=cast(offs))
        with pytest.raises((CudaCheckError, RuntimeError), match="length|elements"):
            call(cast(fa), cast(fb.transpose(1, 2).contiguous().transpose(1, 2)),
                 cast(torch.ones(6)), cast(sb), offs=cast(offs))
    shifted = torch.zeros(7 * 32 + 1, dtype=torch.bfloat16)[1:].view(7, 32)
    with pytest.raises(CudaCheckError, match="data_ptr to be aligned"):
        model.grouped_mm(shifted, torch.zeros(2, 32, 16, dtype=torch.bfloat16), offs=offs)


@pytest.fixture
def sm90(monkeypatch):
    """A CPU standing in for an sm90 GPU, torch's grouped kernels replaced by the model."""
    return stand_in(monkeypatch)


def _run(recipe, route, counts, tail, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    t = sum(counts) + tail
    x = torch.randn(t, K, generator=gen).to(dtype).requires_grad_()
    w = (torch.randn(len(counts), N, K, generator=gen) / 8).requires_grad_()
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    y = grouped_mm(x, w, offs, ExpertsFormat(recipe), route=route)
    y.backward(torch.randn(t, N, generator=gen).to(y.dtype))
    return x, w, y


@pytest.mark.parametrize("routing", list(ROUTINGS))
@pytest.mark.parametrize("route", ["grouped", "scaled_grouped"])
@pytest.mark.parametrize("recipe", CODES)
def test_every_cuda_route_passes_torchs_cuda_checks(sm90, monkeypatch, recipe, route,
                                                    routing):
    """Forward, dgrad and wgrad all on torch's fast kernels (no host-read fallback),
    every check passed; the output, the input's gradient and the weight's gradient
    finite, with zeros for the rows past the last expert and the experts without
    tokens (which the kernels leave unwritten)."""
    monkeypatch.setattr(ExpertsFormat, "backend", lambda self, d: "scaled_mm")
    counts, tail = ROUTINGS[routing]
    x, w, y = _run(recipe, route, counts, tail)
    ops = [(c.op, c.layout) for c in sm90.calls]
    first = "_scaled_grouped_mm" if route == "scaled_grouped" else "_grouped_mm"
    assert ops == [(first, "2d-3d"), ("_grouped_mm", "2d-3d"), ("_grouped_mm", "2d-2d")]
    assert all(c.fast for c in sm90.calls)
    assert not sm90.calls[2].a_row_major and sm90.calls[2].b_row_major  # gᵀ, x
    end = sum(counts)
    for t in (y, x.grad, w.grad):
        assert t.isfinite().all()
    assert (y[end:] == 0).all() and (x.grad[end:] == 0).all()
    for e, c in enumerate(counts):
        assert (w.grad[e] == 0).all() == (c == 0), e
    if end:
        assert y[:end].abs().sum() > 0 and x.grad[:end].abs().sum() > 0


@pytest.mark.parametrize("recipe", LOOPED)
def test_the_block_and_int8_formats_pass_no_grouped_kernel_on_cuda(sm90, recipe):
    """Their values are not bf16 values: on CUDA they run per expert (``loop``), which
    calls torch's grouped kernels not at all, for any routing."""
    for counts, tail in ROUTINGS.values():
        _, w, y = _run(recipe, "auto", counts, tail, dtype=torch.float32)
        assert y.isfinite().all() and w.grad.isfinite().all()
    assert sm90.calls == []


def test_rowwise_casts_gathered_by_fsdp_take_the_cuda_route_bit_for_bit(sm90, monkeypatch):
    """An experts weight FSDP2 gathered as each expert's rowwise casts (2 ranks'
    inputs, an expert without tokens) on the CUDA route: its stacked casts give the
    output and the input's gradient of the same GEMM on the weight itself, bit for bit,
    without dequantizing the casts; the route passes torch's CUDA checks."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(3, N, K, generator=gen) * torch.logspace(-2, 2, K)
    x = torch.randn(10, K, generator=gen).bfloat16()
    offsets = torch.tensor([3, 3, 10], dtype=torch.int32)

    def run(weight, fmt):
        xx = x.clone().requires_grad_()
        y = grouped_mm(xx, weight, offsets, fmt, route="grouped")
        y.backward(torch.linspace(-2, 2, y.numel()).view_as(y).bfloat16())
        return y, xx.grad

    plain = torch.nn.Parameter(w.clone())
    want = run(plain, ExpertsFormat("fp8-rowwise"))
    fmt = ExpertsFormat("fp8-rowwise")
    ranks = [_send_experts(fmt.quantizer, shard, 2) for shard in (w[:2], w[2:])]
    parts = [torch.cat(col) for col in zip(*(inputs for inputs, _ in ranks))]
    gathered = ExpertsCasts(parts, ranks[0][1], torch.Size([4, N, K]), torch.float32)
    cut = torch.nn.Parameter(torch.as_strided(gathered, (3, N, K), (N * K, K, 1), 0))

    def refuse(self):
        raise AssertionError("a gathered experts weight was dequantized")

    monkeypatch.setattr(ExpertsCasts, "dequantize", refuse)
    got = run(cut, fmt)
    assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])
    assert torch.equal(plain.grad, cut.grad)
    assert len(sm90.calls) == 6 and all(c.fast for c in sm90.calls)
