"""The quantized GEMMs (a Linear's, the experts' on every CPU route and on the modeled
GPU routes), in every Linear format the recipes offer, bit for bit the outputs stored
in ``tests/data/gemm_golden.pt`` (made by ``tests/make_gemm_golden.py`` from the code
as it was before the GEMMs shared one autograd Function)."""

from __future__ import annotations

import pytest
import torch

import make_gemm_golden as golden

STORED = torch.load(golden.PATH, weights_only=True)


@pytest.fixture(scope="module")
def computed():
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
        assert not isinstance(got, str), f"{case}: {got}"
        assert sorted(got) == sorted(want), case
        for key, d in want.items():
            ref, t = STORED["tensors"][d], got[key]
            assert t.dtype == ref.dtype and t.shape == ref.shape, (case, key)
            assert torch.equal(_bits(t), _bits(ref)), (
                f"{case} {key}: max |diff| {(t.double() - ref.double()).abs().max()}")
            checked += 1
    assert checked > 100
