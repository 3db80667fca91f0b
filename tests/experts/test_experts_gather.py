"""FSDP2's ``fp8_all_gather`` and transformers MoE experts: per-tensor formats (``fp8``,
``fp8-current``) gather the experts' 3-D weights as e4m3 codes with one agreed scale
per expert, which the grouped GEMM takes as its casts; the other formats gather them
as FSDP holds them, and that is reported, not silent."""

from __future__ import annotations

import os
import tempfile
import warnings

import pytest
import torch

pytest.importorskip("transformers")


@pytest.fixture
def one_rank_group():
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _one_step(recipe):
    """One FSDP2 step of a tiny Mixtral on one rank: the model, the engine, the
    warnings, the weights' all-gather bytes by dtype and the trained weights."""
    from helpers.moe_models import model
    from mixprec import MixedPrecision

    m = model("mixtral")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = MixedPrecision(m, torch.optim.SGD(m.parameters(), lr=0.1), recipe,
                                parallel="fsdp")
    before = engine.comm_stats.totals()
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    with engine.autocast():
        loss = engine.model(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    sent = {k[2]: v - before.get(k, 0) for k, v in engine.comm_stats.totals().items()
            if k[:2] == ("all_gather", "weights")}
    params = [p.full_tensor().clone() for p in engine.master_params]
    return m, engine, caught, sent, params


def test_fp8_all_gather_notes_the_experts_weights_it_gathers_whole(one_rank_group):
    """FSDP2 with ``fp8_all_gather`` on one rank in a format whose casts are gathered
    (MXFP8: several inputs, which FSDP2's one-rank copy does not pass on): the experts'
    3-D weights are gathered as FSDP holds them; each projection is a ``CommStats``
    fallback (one warning, saying why) and the doctor's ``comm-fallback`` finding
    names it."""
    from mixprec.diagnostics import audit_comm

    m, engine, caught, sent, params = _one_step("mxfp8,fp8_all_gather=true")
    falls = [f for f in engine.comm_stats.fallbacks if f.what.startswith("experts:")]
    assert sorted(f.what for f in falls) == [
        f"experts:model.layers.{i}.mlp.experts.{p}" for i in (0, 1)
        for p in ("down_proj", "gate_up_proj")]
    assert {f.sent for f in falls} == {torch.float32}
    said = [w for w in caught if "experts:" in str(w.message)]
    assert len(said) == 1 and "not as codes and scales: one rank" in str(said[0].message)
    # each gather of an experts weight is recorded (fp32, whole on one rank): the
    # forward's and the backward's (FSDP reshards after the forward)
    experts = sum(p.numel() * 4 for p in m.parameters() if p.dim() == 3)
    assert sent == {torch.float32: 2 * experts}  # one rank: the Linears gather nothing
    (finding,) = audit_comm(engine)
    assert finding.code == "comm-fallback" and "experts:model.layers.0" in finding.evidence
    # the recording hooks gather what FSDP gathers: the step is bit for bit the same
    *_, plain = _one_step("mxfp8")
    assert all(torch.equal(a, b) for a, b in zip(params, plain))


@pytest.mark.parametrize("recipe", ["fp8-current", "fp8"])
def test_fp8_all_gather_sends_the_experts_weights_as_codes(one_rank_group, recipe):
    """A per-tensor format: the experts' weights cross as one byte per element (the
    forward's gather and the backward's), no fallback, no warning, and the step is bit
    for bit the step without ``fp8_all_gather``."""
    from mixprec.modules.linear import fp8_modules
    from mixprec.parallel.gather import gathers_fp8

    m, engine, caught, sent, params = _one_step(recipe + ",fp8_all_gather=true")
    assert not engine.comm_stats.fallbacks
    assert not [w for w in caught if "experts:" in str(w.message)]
    experts = sum(p.numel() for p in m.parameters() if p.dim() == 3)
    linears = sum(mod.weight.numel() for mod in fp8_modules(m).values()
                  if gathers_fp8(mod))
    assert sent == {torch.uint8: 2 * (experts + linears)}
    *_, plain = _one_step(recipe)
    assert all(torch.equal(a, b) for a, b in zip(params, plain))


def _gathered_weight(fmt, w):
    """``w`` (E × N × K) as FSDP's gather of its per-expert casts hands it over: an
    ``Fp8Weight`` of the codes, each expert's scale and amax (a parameter, as FSDP's)."""
    from mixprec.experts import adapter
    from mixprec.parallel.gather import Fp8Weight

    amax = w.abs().amax(dim=(1, 2))
    scale = adapter.segment_scales(fmt, amax, "weight")
    codes = adapter.cast_scaled(fmt, w, scale.view(-1, 1, 1), "weight")
    return torch.nn.Parameter(Fp8Weight(codes, scale, amax, w.dtype))


@pytest.mark.parametrize("route", ["loop", "grouped"])
@pytest.mark.parametrize("recipe", ["fp8-current", "fp8"])
@pytest.mark.parametrize("transposed", [False, True])
def test_grouped_gemm_takes_gathered_codes_as_its_casts(monkeypatch, route, recipe,
                                                        transposed):
    """The grouped GEMM on a gathered experts weight (codes, one scale per expert) gives
    the output, the input's and the weight's gradients and the delayed amaxes of the
    same GEMM on the weight itself, bit for bit, without dequantizing the codes (an
    expert without tokens included; an in × out weight through its transpose)."""
    from mixprec.experts import ExpertsFormat, grouped_mm
    from mixprec.parallel.gather import Fp8Weight

    g = torch.Generator().manual_seed(0)
    shape = (4, 32, 16) if transposed else (4, 16, 32)  # K = 32, N = 16
    w = torch.randn(*shape, generator=g) * torch.tensor([1.0, 3.0, 0.1, 7.0]).view(-1, 1, 1)
    x = torch.randn(10, 32, generator=g)
    offsets = torch.tensor([3, 3, 7, 10])

    def run(weight):
        fmt = ExpertsFormat(recipe)
        xx = x.clone().requires_grad_()
        y = grouped_mm(xx, weight.transpose(1, 2) if transposed else weight, offsets, fmt,
                       route=route)
        y.backward(torch.linspace(-2, 2, y.numel()).view_as(y))
        return y, xx.grad, fmt.state_dict()

    plain = torch.nn.Parameter(w.clone())
    want = run(plain)
    fw = _gathered_weight(ExpertsFormat(recipe), w)

    def refuse(self):
        raise AssertionError("a gathered experts weight was dequantized")

    monkeypatch.setattr(Fp8Weight, "dequantize", refuse)
    got = run(fw)
    for a, b in zip(want[:2], got[:2]):
        assert torch.equal(a, b)
    assert torch.equal(plain.grad, fw.grad) and type(fw.grad) is torch.Tensor
    assert all(torch.equal(want[2][k], got[2][k]) for k in want[2])


def test_gathered_experts_weight_keeps_each_experts_scale():
    """FSDP's views of a padded gather (as_strided to the first E experts), ``w[e]``
    and the last dims' transpose keep each expert's codes with its own scale and amax;
    any other use sees the dequantized value (codes times each expert's inverse scale)."""
    from mixprec.experts import ExpertsFormat

    w = torch.randn(3, 4, 8) * torch.tensor([1.0, 100.0, 0.01]).view(-1, 1, 1)
    fw = _gathered_weight(ExpertsFormat("fp8-current"), w).detach()
    padded = type(fw)(torch.cat([fw._codes, fw._codes[:1]]), torch.cat(
        [fw._scale, fw._scale.new_ones(1)]), torch.cat([fw._amax, fw._amax[:1]]),
        torch.float32)
    cut = torch.as_strided(padded, (3, 4, 8), (32, 8, 1), 0)
    assert torch.equal(cut._scale, fw._scale) and torch.equal(cut._amax, fw._amax)
    second = cut.transpose(1, 2)[1]
    assert second._scale.dim() == 0 and second._scale == fw._scale[1]
    assert torch.equal(second._codes, fw._codes[1].t())
    want = fw._codes.float() * torch.reciprocal(fw._scale).view(-1, 1, 1)
    assert torch.equal(cut * 1, want)  # a multiply: the dequantized value
    assert torch.allclose(want, w, rtol=0.07)
    assert torch.equal(cut.transpose(0, 1) * 1, want.transpose(0, 1))  # across experts


_CAST_FORMATS = ["fp8-rowwise", "fp8-block", "mxfp8", "nvfp4", "nvfp4,nvfp4_2d=false"]


@pytest.mark.parametrize("route", ["loop", "grouped"])
@pytest.mark.parametrize("recipe", _CAST_FORMATS)
def test_grouped_gemm_takes_each_experts_gathered_casts(monkeypatch, route, recipe):
    """The grouped GEMM on an experts weight gathered as each expert's casts (2 ranks'
    inputs, the second's expert padded) gives the output and both gradients of the
    same GEMM on the weight itself, bit for bit, without dequantizing the casts (an
    expert without tokens included)."""
    from mixprec.experts import ExpertsFormat, grouped_mm
    from mixprec.experts.gather_casts import ExpertsCasts, _send_experts

    g = torch.Generator().manual_seed(0)
    w = torch.randn(3, 64, 32, generator=g) * torch.logspace(-2, 2, 32)
    x = torch.randn(10, 32, generator=g)
    offsets = torch.tensor([3, 3, 10])

    def run(weight, fmt):
        xx = x.clone().requires_grad_()
        y = grouped_mm(xx, weight, offsets, fmt, route=route)
        y.backward(torch.linspace(-2, 2, y.numel()).view_as(y))
        return y, xx.grad

    plain = torch.nn.Parameter(w.clone())
    want = run(plain, ExpertsFormat(recipe))
    fmt = ExpertsFormat(recipe)
    ranks = [_send_experts(fmt.quantizer, shard, 2) for shard in (w[:2], w[2:])]
    parts = [torch.cat(col) for col in zip(*(inputs for inputs, _ in ranks))]
    gathered = ExpertsCasts(parts, ranks[0][1], torch.Size([4, 64, 32]), torch.float32)
    cut = torch.nn.Parameter(torch.as_strided(gathered, (3, 64, 32), (2048, 32, 1), 0))
    assert type(cut.detach()) is ExpertsCasts and cut.shape == (3, 64, 32)
    monkeypatch.setattr(ExpertsCasts, "dequantize", _refuse)
    got = run(cut, fmt)
    assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])
    assert torch.equal(plain.grad, cut.grad)


def _refuse(self):
    raise AssertionError("a gathered experts weight was dequantized")


def _spawn(world, cases):
    import torch.multiprocessing as mp

    from helpers import moe_dist_workers as w

    tmp = tempfile.mkdtemp(prefix="mixprec-moe-gather-")
    mp.start_processes(w.gathered, args=(world, tmp, cases), nprocs=world, join=True,
                       start_method="forkserver")
    return [torch.load(os.path.join(tmp, f"gathered_rank{r}.pt"), weights_only=False)
            for r in range(world)]


_ON = ",fp8_all_gather=true"


def _hand_count(recipe: str, n: int, k: int) -> int:
    """Bytes one expert's (n × k) weight crosses the wire as under ``fp8_all_gather``."""
    return {"fp8-current": n * k, "fp8": n * k,
            # forward codes + fp32 row scales; dgrad codes + fp32 column scales
            "fp8-rowwise": 2 * n * k + 4 * n + 4 * k,
            # codes + fp32 128x128 block scales (one cast serves forward and dgrad)
            "fp8-block": n * k + 4 * -(-n // 128) * -(-k // 128),
            # forward and dgrad codes, each with an e8m0 scale per 32
            "mxfp8": 2 * (n * k + n * k // 32),
            # e2m1 codes two a byte + e4m3 16x16 scales + the fp32 descale
            "nvfp4": n * k // 2 + (n // 16) * (k // 16) + 4,
            # forward 1x16 and dgrad 16x1 casts, each with its descale
            "nvfp4,nvfp4_2d=false": 2 * (n * k // 2 + n * k // 16 + 4)}[recipe]


_ON = ",fp8_all_gather=true"
_TWO_RANKS = [("mixtral", r) for r in ["fp8-current", "fp8", *_CAST_FORMATS]] + [
    ("gpt_oss", "fp8-current"), ("qwen3_moe", "fp8-current")]


@pytest.mark.long
@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("world,cases", [
    (2, _TWO_RANKS + [("gpt_oss", "mxfp8")]),
    # 4 experts on 3 ranks: 2, 2 and none (a padded gather of zero experts)
    (3, [("mixtral", "fp8-current"), ("mixtral", "mxfp8")]),
])
def test_ranks_gathering_experts_codes_train_as_without_fp8_all_gather(world, cases):
    """Tiny MoE models under FSDP2 on gloo ranks with ``fp8_all_gather``: the experts'
    weights cross as their codes and scales (each step's experts gathers, forward and
    backward, carry the hand count of the format's bytes for the rank's padded experts),
    no gathered weight is dequantized, and the losses and trained weights are bit for
    bit those without ``fp8_all_gather``; a checkpoint of FSDP's shards resumes the
    last step bit for bit in an engine built from other weights. GPT-OSS's in × out
    experts in MXFP8 are gathered whole instead: warned once, recorded, and the same."""
    from helpers import moe_dist_workers as w

    ranks = _spawn(world, [(k, r + _ON) for k, r in cases] + cases)
    per = -(-4 // world)  # experts a rank sends (the tiny models have 4)
    for r in ranks:
        for kind, recipe in cases:
            on, off = r[(kind, recipe + _ON)], r[(kind, recipe)]
            assert on["losses"] == off["losses"], (kind, recipe)
            assert all(torch.equal(a, b) for a, b in zip(on["params"], off["params"]))
            assert on["resumed_loss"] == on["losses"][-1]
            assert all(torch.equal(a, b) for a, b in zip(on["resumed"], on["params"]))
            if kind == "gpt_oss" and recipe == "mxfp8":
                assert len(on["fallbacks"]) == 4 and len(on["said"]) == 1
                assert "stored in × out" in on["said"][0]
                fp32 = 2 * 2 * per * (128 * 64 + 64 * 64) * 4
                assert on["experts_sent"] == [fp32] * w.GATHER_STEPS
                continue
            assert not on["fallbacks"] and not on["said"] and not on["dequantized"]
            # 2 layers x (gate-up 128 x 64 + down 64 x 64), forward and backward
            want = 2 * 2 * per * (_hand_count(recipe, 128, 64) + _hand_count(recipe, 64, 64))
            assert on["experts_sent"] == [want] * w.GATHER_STEPS, (kind, recipe)
