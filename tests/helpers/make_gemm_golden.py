"""The quantized GEMMs' outputs on fixed seeded operands, for ``test_gemm_golden``.

Every Linear format the recipes offer (each preset with a Linear format, and a few
field variants) runs a ``Float8Linear``'s forward and backward on every GEMM route
this CPU takes, and the experts' grouped GEMM (``mixprec.experts.grouped_mm``) its
forward and backward on each route: ``loop``, ``grouped`` (the sync-free segmented
casts on a CPU) and, on the CPU standing in for a GPU (``cuda_grouped_model``), the
``grouped`` route on bf16 codes and ``scaled_grouped``. The shapes are odd on purpose
(3 tokens of 40 features into 24; experts with uneven routing, one without a token
and rows routed past the last expert).

``python tests/helpers/make_gemm_golden.py`` writes ``tests/data/gemm_golden.pt``; the test
recomputes ``cases()`` and compares each tensor bit for bit.
"""

from __future__ import annotations

import hashlib
import pathlib
import warnings

import pytest
import torch

from helpers.cuda_grouped_model import stand_in
from mixprec.experts import ExpertsFormat, grouped_mm
from mixprec.formats.gemm import FORMATS
from mixprec.modules.linear import Float8Linear
from mixprec.recipe import LINEAR_PRESETS, Recipe

__all__ = ["cases", "RECIPES", "PATH", "pack", "digest"]

PATH = pathlib.Path(__file__).resolve().parents[1] / "data" / "gemm_golden.pt"

#: every preset with a Linear format, and variants of the fields that change the casts
RECIPES = (*LINEAR_PRESETS, "nvfp4,nvfp4_sr=false", "nvfp4,nvfp4_rht=false",
           "fp8-current,fp8_format=e4m3", "fp8-rowwise,margin=1", "mxfp8,mx_rounding=floor",
           "fp8-block,block_scales=pow2")

ROUTES = ("auto", "scaled_mm", "dequant", "dequant_fp32")

#: (tokens, in, out, dtype, bias, autocast)
LINEAR_SHAPES = ((3, 40, 24, torch.float32, False, False),
                 (16, 64, 32, torch.float32, True, True))

#: (per-expert counts, rows past the last expert, in, out, input dtype)
EXPERTS_SHAPES = (([5, 0, 9, 3], 1, 32, 16, torch.float32),
                  ([0, 11, 2], 2, 40, 24, torch.bfloat16))


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _steps(fmt) -> int:
    """Two steps where the second differs in kind (delayed scaling reads its updated
    history; stochastic rounding draws the next backward's numbers), else one."""
    return 2 if fmt.has_history or fmt.stochastic_grads else 1


def _linear(recipe: str, route: str, shape, seed: int) -> dict[str, torch.Tensor]:
    t, i, o, dtype, bias, autocast = shape
    g = _gen(seed)
    lin = Float8Linear(i, o, bias=bias, recipe=f"{recipe},fp8_gemm={route}")
    with torch.no_grad():
        lin.weight.copy_(torch.randn(o, i, generator=g) / 4)
        if bias:
            lin.bias.copy_(torch.randn(o, generator=g))
    out = {}
    for step in range(_steps(lin.quantizer)):
        x = (torch.randn(t, i, generator=g) * 3).to(dtype).requires_grad_()
        lin.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            y = lin(x)
        y.backward(torch.randn(y.shape, generator=g).to(y.dtype))
        lin.update_scales()
        out.update({f"y{step}": y.detach(), f"dx{step}": x.grad,
                    f"dw{step}": lin.weight.grad})
        if bias:
            out[f"db{step}"] = lin.bias.grad
    return out


def _experts(recipe: str, route: str, shape, seed: int) -> dict[str, torch.Tensor]:
    counts, past, k, n, dtype = shape
    g = _gen(seed)
    t = sum(counts) + past
    fmt = ExpertsFormat(recipe, seed=seed)
    w = (torch.randn(len(counts), n, k, generator=g) / 4).requires_grad_()
    offs = torch.tensor(counts).cumsum(0)
    out = {}
    for step in range(_steps(fmt.quantizer)):
        x = (torch.randn(t, k, generator=g) * 3).to(dtype).requires_grad_()
        gy = torch.randn(t, n, generator=g).to(dtype)
        w.grad = None
        y = grouped_mm(x, w, offs, fmt, route=route)
        y.backward(gy.to(y.dtype))
        fmt.update_scales()
        out.update({f"y{step}": y.detach(), f"dx{step}": x.grad, f"dw{step}": w.grad})
    return out


def _run(fn, *args) -> dict[str, torch.Tensor] | str:
    """The outputs, or the error's type where this format refuses the case."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return fn(*args)
    except (ValueError, RuntimeError, NotImplementedError) as err:
        return f"error: {type(err).__name__}"


def cases() -> dict[str, dict[str, torch.Tensor] | str]:
    """Every case by name: its outputs, or ``error: TYPE`` where it is refused."""
    covered = {Recipe.coerce(r).linear.name for r in RECIPES}
    missing = set(FORMATS) - covered
    if missing:
        raise ValueError(f"formats without a golden case: {sorted(missing)}")
    out = {}
    for recipe in RECIPES:
        for route in ROUTES:
            for s, shape in enumerate(LINEAR_SHAPES):
                out[f"linear/{recipe}/{route}/{s}"] = _run(_linear, recipe, route, shape, s)
        for route in ("loop", "grouped"):
            for s, shape in enumerate(EXPERTS_SHAPES):
                out[f"experts/{recipe}/{route}/{s}"] = _run(_experts, recipe, route, shape, s)
        with pytest.MonkeyPatch.context() as mp:  # the GPU routes, modeled on the CPU
            stand_in(mp)
            for route in ("grouped", "scaled_grouped"):
                for s, shape in enumerate(EXPERTS_SHAPES):
                    out[f"experts-gpu/{recipe}/{route}/{s}"] = _run(
                        _experts, recipe, route, shape, s)
    return out


def digest(t: torch.Tensor) -> str:
    """A name for ``t``'s dtype, shape and bytes (the file stores equal outputs once)."""
    raw = t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    return hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode() + raw).hexdigest()[:20]


def pack(data: dict) -> dict:
    """``cases()`` as the file holds it: each case's outputs by digest, and each
    distinct tensor once."""
    pool, named = {}, {}
    for case, out in data.items():
        if isinstance(out, str):
            named[case] = out
            continue
        named[case] = {}
        for key, t in out.items():
            d = digest(t)
            pool.setdefault(d, t.detach().clone())
            named[case][key] = d
    return {"cases": named, "tensors": pool}


if __name__ == "__main__":
    data = cases()
    PATH.parent.mkdir(exist_ok=True)
    packed = pack(data)
    torch.save(packed, PATH)
    errors = sorted(k for k, v in data.items() if isinstance(v, str))
    print(f"{len(data)} cases, {len(packed['tensors'])} distinct tensors, {len(errors)} "
          f"refused, {PATH.stat().st_size} bytes")
    for k in errors:
        print("  ", k, data[k])
