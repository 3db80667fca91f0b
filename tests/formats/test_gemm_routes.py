"""The one fp8 GEMM-route decision (``mixprec.formats.route``) on each GPU generation, run
on a CPU: ``torch.cuda``'s compute capability is monkeypatched, and the block-scaled
kernels' probe is a stand-in that records which scalings it was asked about and answers
yes or no. What ``engine.kernels`` reports (``kernels.choices``, which the engine builds
its Linears on, checkpoints record and the bench reads), what a Linear's quantizer
runs (``Quantizer.route``, ``Float8Linear.backend``'s question) and the memory
planner's per-tensor route (``kernels.fp8_gemm_route``) are all that one answer."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from mixprec.engine import devices as kernels
from mixprec.engine.build import _swap_fp8
from mixprec.formats import route, scaled_mm
from mixprec.modules.linear import Float8Linear, fp8_modules
from mixprec.recipe import Recipe
from mixprec.recipe.linear_format import quantizer_for

PER_TENSOR = ["fp8", "fp8-current", "fp8-rowwise"]
SCALING = {"fp8": "delayed", "fp8-current": "current", "fp8-rowwise": "rowwise",
           "fp8-block": "block", "mxfp8": "mx", "nvfp4": "nvfp4"}


@pytest.fixture
def gpu(monkeypatch):
    """``gpu(capability, probe=True)``: ``cuda:0`` reads that compute capability, and
    the probe answers ``probe``; returns the list of scalings the probe is asked about.
    Each test starts with no fallback said yet and ``MIXPREC_EMULATE`` unset."""
    def set_gpu(capability: tuple[int, int], probe: bool = True) -> list[str]:
        asked: list[str] = []

        def fake_probe(device, quantizer):
            asked.append(quantizer.name)
            return probe

        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_device_capability",
                            lambda device=None: capability)
        monkeypatch.setattr(torch.version, "hip", None)
        monkeypatch.setattr(scaled_mm, "_probe", fake_probe)
        monkeypatch.setattr(route, "_SAID", set())
        monkeypatch.setattr(route, "_CAPABILITY", {})
        monkeypatch.delenv(kernels.EMULATE_ENV, raising=False)
        return asked

    return set_gpu


def _choices(recipe: str) -> kernels.KernelChoices:
    return kernels.choices(Recipe.parse(recipe), "cuda:0")


def _fallbacks(record) -> list[str]:
    return [str(w.message) for w in record if "fp8_gemm=auto" in str(w.message)]


@pytest.mark.parametrize("recipe", ["mxfp8", "nvfp4"])
def test_mx_and_nvfp4_on_sm90_take_the_exact_route_and_report_it(gpu, recipe):
    """Hopper has no MX / NVFP4 kernel (torch's need sm100): ``auto`` takes
    ``dequant_fp32`` without probing, warns once, ``engine.kernels`` and what
    checkpoints record say so, and the engine converts the Linears onto it; an
    explicit ``scaled_mm`` is refused, naming the capability and the fix."""
    asked = gpu((9, 0))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        k = _choices(recipe)
        again = quantizer_for(recipe).route("cuda:0", "auto")
    assert (k.fp8_gemm, k.gemm_for(SCALING[recipe]), again) == ("dequant_fp32",) * 3
    assert k.as_dict()["fp8_gemm"] == "dequant_fp32"
    assert "fp8_gemm=dequant_fp32" in k.describe()
    said = _fallbacks(seen)
    assert len(said) == 1 and "needs sm100 or newer, this GPU is sm90" in said[0]
    assert asked == []  # no probe of a kernel this GPU does not have
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)])
    _swap_fp8(model, Recipe.parse(recipe), k, None)  # the head (nvfp4: 2 Linears) stays
    routes = [m.gemm_choice for m in fp8_modules(model).values()]
    assert routes and set(routes) == {"dequant_fp32"}
    with pytest.raises(ValueError, match="sm100 or newer, this GPU is sm90.*fp8_gemm=auto"):
        quantizer_for(recipe).route("cuda:0", "scaled_mm")


@pytest.mark.parametrize("probe", [True, False])
@pytest.mark.parametrize("recipe", ["mxfp8", "nvfp4"])
def test_sm100_takes_the_mx_and_nvfp4_kernels_where_the_probe_agrees(gpu, recipe, probe):
    """On Blackwell ``auto`` asks the probe on the device, and reports its answer."""
    asked = gpu((10, 0), probe)
    k = _choices(recipe)
    assert k.fp8_gemm == ("scaled_mm" if probe else "dequant_fp32")
    assert asked == [SCALING[recipe]]
    assert quantizer_for(recipe).route("cuda:0", "scaled_mm") == "scaled_mm"


@pytest.mark.parametrize("cap, probe, want, why", [
    ((9, 0), True, "scaled_mm", None),
    ((9, 0), False, "dequant_fp32", None),
    ((10, 0), True, "dequant_fp32", "needs sm90 only, this GPU is sm100"),
    ((8, 9), True, "dequant_fp32", "needs sm90 only, this GPU is sm89"),
    ((8, 0), True, "dequant_fp32", "needs sm90 only, this GPU is sm80")])
def test_fp8_block_runs_torchs_kernel_on_hopper_only(gpu, cap, probe, want, why):
    """torch's 1x128/128x128 kernels check for compute capability 9.x: Hopper takes them
    where the probe agrees, every other GPU the exact route, said once, unprobed."""
    asked = gpu(cap, probe)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert _choices("fp8-block").fp8_gemm == want
    said = _fallbacks(seen)
    assert asked == ([] if why else ["block"])
    assert len(said) == (1 if why else 0) and (why is None or why in said[0])


@pytest.mark.parametrize("recipe", PER_TENSOR)
def test_per_tensor_scalings_take_scaled_mm_from_sm89(gpu, recipe):
    """``torch._scaled_mm`` needs sm89 (Ada) or newer: no probe is asked; the memory
    planner's route is the same answer."""
    for cap in ((8, 9), (9, 0), (10, 0)):
        asked = gpu(cap)
        assert _choices(recipe).fp8_gemm == "scaled_mm"
        assert kernels.fp8_gemm_route("cuda:0") == "scaled_mm"
        assert asked == []


def test_an_sm80_gpu_gets_dequant_for_every_fp8_scaling(gpu):
    """Ampere has no fp8 kernel: the per-tensor scalings take ``dequant`` (bf16 GEMM of
    the exact codes, its units' fast format), the block scalings ``dequant_fp32``; each
    said once; an explicit ``scaled_mm`` is refused before anything runs."""
    asked = gpu((8, 0))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        got = {r: _choices(r).fp8_gemm for r in SCALING}
        assert kernels.fp8_gemm_route("cuda:0") == "dequant"
    assert got == {"fp8": "dequant", "fp8-current": "dequant", "fp8-rowwise": "dequant",
                   "fp8-block": "dequant_fp32", "mxfp8": "dequant_fp32",
                   "nvfp4": "dequant_fp32"}
    assert asked == []
    said = _fallbacks(seen)
    assert len(said) == len(SCALING)  # one per scaling: delayed, current, rowwise, ...
    assert all("sm80" in s for s in said)
    with pytest.raises(ValueError, match="_scaled_mm needs sm89 or newer, this GPU is sm80"):
        _choices("fp8-current,fp8_gemm=scaled_mm")


def test_layer_rules_route_each_scaling_on_its_own(gpu):
    """Under ``layer:`` rules on Hopper each scaling gets its own answer: per tensor the
    kernel, MX the exact route, block the kernel once the probe agrees."""
    asked = gpu((9, 0))
    with pytest.warns(UserWarning, match="fp8_scaling=mx on cuda:0: the MXFP8"):
        k = _choices("fp8-current,layer:a=mxfp8,layer:b=fp8-block")
    assert k.fp8_gemm_routes == {"current": "scaled_mm", "mx": "dequant_fp32",
                                 "block": "scaled_mm"}
    assert asked == ["block"]


def test_hybrid_block_scaled_mm_is_refused_and_auto_keeps_the_exact_route(gpu):
    """torch's 1x128/128x128 kernels take e4m3 operands only; ``fp8_format=hybrid``
    casts the gradients to e5m2. An explicit ``scaled_mm`` is refused (also on meta
    tensors, whose kernel does not check it); ``auto`` keeps the exact route on Hopper
    without probing."""
    lin = Float8Linear.from_linear(
        nn.Linear(256, 256), "fp8-block,fp8_format=hybrid,fp8_gemm=scaled_mm").to("meta")
    with pytest.raises(ValueError, match="e4m3 operands only.*hybrid.*fp8_gemm=auto"):
        lin(torch.empty(30, 256, device="meta"))
    asked = gpu((9, 0))
    with pytest.raises(ValueError, match="e4m3 operands only"):
        _choices("fp8-block,fp8_format=hybrid,fp8_gemm=scaled_mm")
    with pytest.warns(UserWarning, match=r"e5m2 \(fp8_format=e4m3.*\); the exact dequant"):
        assert _choices("fp8-block,fp8_format=hybrid").fp8_gemm == "dequant_fp32"
    assert asked == []


def test_meta_tensors_take_the_kernel_only_when_asked():
    """``meta`` checks the calls against torch's meta kernels: ``scaled_mm`` on any
    scaling; ``auto`` neither measures nor probes there."""
    for recipe in SCALING:
        q = quantizer_for(recipe)
        assert route.gemm_route("meta", q, "scaled_mm") == "scaled_mm"
        assert route.gemm_route("meta", q, "auto") == (
            "dequant" if recipe in PER_TENSOR else "dequant_fp32")
