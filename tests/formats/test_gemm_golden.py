"""The quantized GEMMs (a Linear's, the experts' on every CPU route and on the modeled
GPU routes), in every Linear format the recipes offer, bit for bit the outputs stored
in ``tests/data/gemm_golden.pt`` (made by ``tests/helpers/make_gemm_golden.py`` from the code
as it was before the GEMMs shared one autograd Function)."""

from __future__ import annotations

import pytest
import torch

from helpers import make_gemm_golden as golden
from helpers.speeds import set_speeds
from mixprec.engine.devices import EMULATE_ENV
from mixprec.formats.gemm.int8 import cpu_int_mm_exact

STORED = torch.load(golden.PATH, weights_only=True)


@pytest.fixture(scope="module")
def computed():
    # the device choices of the machine the file was made on (bf16 twice fp32's speed, no
    # fast scaled_mm, real 16-bit kernels), so that ``auto`` routes alike on any CPU
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(EMULATE_ENV, "off")
        set_speeds(mp, bf16=2.0, fp16=0.031)
        return golden.cases()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(-1).view(torch.uint8)


def test_every_case_is_stored_and_every_format_covered(computed):
    assert sorted(computed) == sorted(STORED["cases"])
    assert len(STORED["cases"]) > 150


@pytest.mark.parametrize("kind", ["linear", "experts", "experts-gpu"])
def test_outputs_are_the_stored_ones_bit_for_bit(computed, kind):
    checked = 0
    for case, want in STORED["cases"].items():
        if case.split("/")[0] != kind:
            continue
        got = computed[case]
        if isinstance(want, str):  # a refused case stays refused, with the same error
            assert got == want, case
            continue
        if (isinstance(got, str) and "int8" in case and "scaled_mm" in case
                and not cpu_int_mm_exact()):
            continue  # a CPU without VNNI/AMX refuses torch._int_mm: a fact of the chip
        assert not isinstance(got, str), f"{case}: {got}"
        assert sorted(got) == sorted(want), case
        for key, d in want.items():
            ref, t = STORED["tensors"][d], got[key]
            assert t.dtype == ref.dtype and t.shape == ref.shape, (case, key)
            assert torch.equal(_bits(t), _bits(ref)), (
                f"{case} {key}: max |diff| {(t.double() - ref.double()).abs().max()}")
            checked += 1
    assert checked > 100


def _quantized_nodes(y: torch.Tensor) -> set[type]:
    """The classes of the autograd nodes behind ``y`` that a custom Function made."""
    found, todo = set(), [y.grad_fn]
    while todo:
        node = todo.pop()
        if isinstance(node, torch.autograd.function.BackwardCFunction):
            found.add(node._forward_cls)
        todo += [n for n, _ in node.next_functions if n is not None]
    return found


@pytest.mark.parametrize("route", ["loop", "grouped"])
def test_one_autograd_function_serves_the_linear_and_the_experts(route, monkeypatch):
    from mixprec.experts import ExpertsFormat, grouped_mm
    from mixprec.modules.linear import Float8Linear

    lin = Float8Linear(32, 16, bias=False, recipe="fp8-current")
    y_lin = lin(torch.randn(5, 32, requires_grad=True))
    x, w = torch.randn(6, 32, requires_grad=True), torch.randn(3, 16, 32, requires_grad=True)
    ys = [grouped_mm(x, w, torch.tensor([2, 2, 6]), ExpertsFormat(r), route=route)
          for r in ("fp8-current", "fp8-rowwise", "mxfp8", "int8-rowwise", "nvfp4")]
    with monkeypatch.context() as mp:  # the GPU route on bf16 codes, modeled on the CPU
        golden.stand_in(mp)
        ys.append(grouped_mm(x, w, torch.tensor([2, 2, 6]), ExpertsFormat("fp8-rowwise"),
                             route="grouped", out_dtype=torch.bfloat16))
    want = _quantized_nodes(y_lin)
    assert len(want) == 1 and issubclass(next(iter(want)), torch.autograd.Function)
    for y in ys:
        assert _quantized_nodes(y) == want
        assert type(y.grad_fn).__name__ == next(iter(want)).__name__ + "Backward"
