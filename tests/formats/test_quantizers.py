"""The quantizer interface: one object per scaling, one registry, one autograd Function,
state only where a scaling has some, and the casts and checkpoints of mixprec 0.2."""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest
import torch
from torch import nn

import mixprec
from helpers.paths import DATA
from mixprec.formats.blocks import cast_blocks, cast_mx, cast_tiles
from mixprec.formats.fp4 import cast_nvfp4
from mixprec.formats.scaling import cast_rowwise
from mixprec.modules.linear import Float8Linear
from mixprec.recipe import Recipe
from mixprec.recipe import linear_format as Q

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
PRESETS = ("fp8", "fp8-current", "fp8-rowwise", "fp8-block", "mxfp8", "nvfp4")


@pytest.fixture(scope="module")
def old():
    """What mixprec 0.2.0 computed and saved (``tests/data/fp8_0_2.py``)."""
    return torch.load(DATA / "fp8_0_2.pt", weights_only=False)


def _generator():
    import importlib.util

    spec = importlib.util.spec_from_file_location("fp8_0_2", DATA / "fp8_0_2.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_casts_equal_mixprec_0_2_bit_for_bit(old):
    """Every cast (rowwise, 1×128 tiles, 128×128 pow2 blocks, MX under each rounding,
    NVFP4 1×16 / 16×16 / stochastic) on magnitudes over 10^±4 with a zero row, an
    outlier, −0 and subnormals: the same bytes and scales as 0.2.0's."""
    want = old["casts"]
    x = want["x"]

    def same(key, got_codes, got_inv):
        codes, inv = want[key]
        assert torch.equal(got_codes.view(torch.uint8), codes), key
        assert torch.equal(got_inv.view(torch.int32), inv.view(torch.int32)), key

    for dim in (0, 1):
        for dt, name in ((E4M3, "e4m3"), (E5M2, "e5m2")):
            same(f"rowwise/{name}/{dim}", *cast_rowwise(x, dim, dt, 0))
            t = cast_tiles(x, dim, dt)
            same(f"tiles/{name}/{dim}", t.codes, t.inv)
            for rounding in ("rceil", "floor", "ceil", "even"):
                m = cast_mx(x, dim, dt, rounding)
                same(f"mx/{rounding}/{name}/{dim}", m.codes, m.inv)
        got = cast_nvfp4(x, dim).dequant()
        assert torch.equal(got.view(torch.int32), want[f"nvfp4/{dim}"].view(torch.int32))
    b = cast_blocks(x, E4M3, pow2=True)
    same("blocks/pow2", b.codes, b.inv)
    assert torch.equal(cast_nvfp4(x, square=True).dequant(), want["nvfp4/square"])
    sr = cast_nvfp4(x, 1, generator=torch.Generator().manual_seed(3)).dequant()
    assert torch.equal(sr, want["nvfp4/sr"])


def test_float8linear_steps_equal_mixprec_0_2(old):
    """Three steps of a Float8Linear under every scaling (20 tokens: no multiple of 16;
    the middle step under bf16 autocast): outputs and both gradients as 0.2.0's. The
    GEMMs are fp32 (``fp8_gemm=dequant_fp32``), so a CPU other than the one that wrote
    the record may differ by summation order only (and the bf16 step by its rounding)."""
    gen = _generator()
    for recipe in gen.LINEARS:
        torch.manual_seed(0)
        lin = nn.Linear(32, 48)
        f = Float8Linear.from_linear(lin, f"{recipe},fp8_gemm=dequant_fp32", seed=11)
        got = []
        for step in range(3):
            x = gen.hard_tensor(20, 32, step + 1).requires_grad_()
            with torch.autocast("cpu", torch.bfloat16, enabled=step == 1):
                y = f(x)
            y.float().backward(gen.hard_tensor(20, 48, step + 7) * 1e-3)
            got += [y.detach().float(), x.grad, lin.weight.grad, lin.bias.grad]
            lin.weight.grad = lin.bias.grad = None
            f.update_scales()
        for i, (a, b) in enumerate(zip(got, old["linears"][recipe], strict=True)):
            tol = 1e-2 if i // 4 == 1 else 1e-5
            torch.testing.assert_close(a, b, rtol=tol, atol=tol * b.abs().max().item(),
                                       msg=f"{recipe}: step {i // 4}, tensor {i % 4}")


@pytest.mark.parametrize("recipe", ["fp8-current", "nvfp4", "fp8"])
def test_checkpoints_of_mixprec_0_2_resume(old, recipe, monkeypatch):
    """0.2.0's Float8Linears carried delayed-scaling buffers under every scaling; a
    checkpoint of theirs loads strictly here (a scaling without history drops them,
    NVFP4 keeps its stochastic-rounding counter) and the next two steps reach 0.2.0's
    losses and weights. The record was written on a chip with fast bf16, where the
    layers around the fp8 Linears run under bf16 autocast; the real 16-bit path is
    pinned so a chip without bf16 units (which would run them in fp32) takes it too."""
    from mixprec.engine.devices import EMULATE_ENV

    monkeypatch.setenv(EMULATE_ENV, "off")
    gen = _generator()
    rec = old["checkpoints"][recipe]
    model = gen.model()
    engine = mixprec.MixedPrecision(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                                    f"{recipe},emulate=false,fp8_gemm=dequant_fp32")
    engine.load_state_dict(torch.load(io.BytesIO(rec["state"]), weights_only=False))
    losses = []
    for step in (2, 3):
        with engine.autocast():
            loss = model(gen.batch(step)).float().square().mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    assert losses == pytest.approx(rec["losses"][2:], rel=1e-5)
    for k, v in rec["weights"].items():
        torch.testing.assert_close(model.state_dict()[k].float(), v, rtol=1e-4, atol=1e-6)
    if recipe != "fp8":
        assert not any(k.endswith(("fp8_amax_history", "fp8_scale"))
                       for k in engine.state_dict()["model"])


def test_state_exists_only_where_the_scaling_has_it():
    keys = {}
    for recipe in PRESETS:
        m = Float8Linear(32, 16, recipe=recipe)
        keys[recipe] = set(m.state_dict()) - {"weight", "bias"}
    assert keys == {"fp8": {"fp8_amax_history", "fp8_scale"}, "fp8-current": set(),
                    "fp8-rowwise": set(), "fp8-block": set(), "mxfp8": set(),
                    "nvfp4": {"nvfp4_rng"}}
    assert dict(Float8Linear(32, 16, recipe="fp8").named_buffers()).keys() == {
        "fp8_amax_history", "fp8_scale", "fp8_max"}


def test_ranks_all_reduce_amaxes_only_for_a_scaling_with_history(monkeypatch):
    from mixprec.parallel import comm
    from mixprec.parallel.gather import agree_amaxes_

    calls = []
    monkeypatch.setattr(comm, "all_reduce_max_", lambda t: calls.append(t.numel()) or t)
    stateless = [Float8Linear(32, 16, recipe=r) for r in PRESETS[1:]]
    comm.agree_amax_(stateless)
    agree_amaxes_(stateless, lambda t: calls.append(t.numel()) or t)
    assert calls == []
    delayed = Float8Linear(32, 16, recipe="fp8")
    comm.agree_amax_([*stateless, delayed])
    agree_amaxes_([*stateless, delayed], lambda t: calls.append(t.numel()) or t)
    assert calls == [3, 3]  # this step's amax of the three roles, once


def test_the_registry_holds_every_scaling_and_nothing_else_switches_on_it():
    assert tuple(Q.QUANTIZERS) == ("delayed", "current", "rowwise", "block", "mx", "nvfp4",
                                   "int8", "mxfp6")
    for name, cls in Q.QUANTIZERS.items():
        q = Q.quantizer_for(Recipe.parse(f"fp8,fp8_scaling={name}"))
        assert type(q) is cls and q.name == name
    q = Q.quantizer_for("mxfp8,mx_rounding=floor")
    assert q == Q.MXScaling(fp8_format="e4m3", mx_rounding="floor")
    switch = re.compile(r"(fp8_scaling|\.scaling)\s*(==|!=|\bin\b|\bnot in\b)")
    src = Path(mixprec.__file__).parent
    allowed = {"recipe.py", "rules.py"}
    found = [f"{p.relative_to(src)}:{i}" for p in src.rglob("*.py") if p.name not in allowed
             for i, line in enumerate(p.read_text().splitlines(), 1) if switch.search(line)]
    assert found == []


@pytest.mark.parametrize("recipe", PRESETS)
def test_one_autograd_function_runs_every_scaling(recipe):
    f = Float8Linear(32, 48, recipe=recipe)
    y = f(torch.randn(5, 32, requires_grad=True))
    names, todo = set(), [y.grad_fn]
    while todo:
        node = todo.pop()
        names.add(type(node).__name__)
        todo += [n for n, _ in node.next_functions if n is not None]
    assert {n for n in names if n.startswith("_")} == {"_QuantizedMatmulBackward"}


def test_a_transposed_cast_is_the_same_bytes_read_the_other_way():
    x = torch.randn(40, 300)
    for c in (cast_blocks(x, E4M3), cast_tiles(x, 0, E5M2), cast_mx(x, 1),
              cast_nvfp4(x, 1), Q.RowwiseScaling().cast(x, "input", 1, {})):
        t = c.t()
        assert t.codes.data_ptr() == c.codes.data_ptr() and t.codes.shape == (300, 40)
        assert torch.equal(t.dequant(), c.dequant().t())
        assert torch.equal(t.t().dequant(), c.dequant())
