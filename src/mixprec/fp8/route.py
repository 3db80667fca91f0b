"""The GEMM route of an fp8 / fp4 Linear: one decision, which every part of mixprec asks.

``gemm_route(device, quantizer, choice)`` answers for the recipe's ``fp8_gemm``
``choice`` (``auto``, ``scaled_mm``, ``dequant``, ``dequant_fp32``) and a scaling's
quantizer (``mixprec.fp8.quantizers``). The engine asks once per scaling
(``mixprec.kernels.choices``): ``engine.kernels`` reports that route, checkpoints record
it, the bench and the doctor read it there, and the Linears are converted onto it. Each
``Float8Linear`` asks again for the route its GEMMs take (``backend``), and the memory
planner for what its backward holds (``mixprec.kernels.fp8_gemm_route``).

The routes: ``scaled_mm`` (torch's scaled matmul: ``torch._scaled_mm`` per tensor and
rowwise, ``mixprec.fp8.scaled_mm.block_scaled_mm`` for the block scalings), ``dequant``
(per tensor and rowwise: the codes in bf16, a bf16 GEMM with fp32 accumulation) and
``dequant_fp32`` (the codes dequantized, an IEEE fp32 GEMM: exact up to summation order;
the only dequantizing route of the block scalings, which ``dequant`` names too).

Where torch has the kernel (``kernel_missing``; NVIDIA compute capability):

====================  ========================================================
per tensor, rowwise   ``_scaled_mm``: sm89 and newer; a CPU build has a reference
                      kernel
``block``             1×128 / 128×128 (DeepSeek): sm90 only (torch checks major 9),
                      e4m3 operands only: ``fp8_format=hybrid``'s e5m2 gradients
                      have none
``mx``, ``nvfp4``     block-scaled, ``32_4_4`` scales: sm100 and newer
====================  ========================================================

The decision: ``dequant`` / ``dequant_fp32`` are taken as asked. ``scaled_mm`` is the
kernel, and raises where it is missing, naming why and the fix (on ``meta`` tensors it is
always taken: the calls are checked against torch's meta kernels). ``auto`` takes the
kernel where this device has it: per tensor at once on CUDA, block-scaled only after
``mixprec.fp8.scaled_mm``'s probe on the device matched it to the exact route and found
it faster. Where the kernel is missing, ``auto`` warns once and takes ``dequant`` (per
tensor and rowwise: the kernel's closest twin, on fast bf16 units) or ``dequant_fp32``
(block scalings). On a CPU ``auto`` measures the per-tensor routes
(``mixprec.kernels.route_reading``) and keeps the block scalings exact.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Protocol

import torch

from mixprec.fp8 import scaled_mm

__all__ = ["gemm_route", "kernel_missing", "GEMM_CHOICES", "KERNEL_CAPABILITY"]

#: the values of a recipe's ``fp8_gemm``
GEMM_CHOICES = ("auto", "scaled_mm", "dequant", "dequant_fp32")

#: the NVIDIA compute capabilities torch's kernel runs on, by kind of scaling:
#: (lowest, highest major or None)
KERNEL_CAPABILITY = {"tensor": ((8, 9), None), "block": ((9, 0), 9),
                     "mx": ((10, 0), None), "nvfp4": ((10, 0), None)}

_KERNEL_NAME = {"tensor": "torch._scaled_mm", "block": "the 1x128/128x128 block kernel",
                "mx": "the MXFP8 block-scaled kernel",
                "nvfp4": "the NVFP4 block-scaled kernel"}


class _Quantizer(Protocol):
    """What the route needs of a quantizer (``mixprec.fp8.quantizers``): its scaling's
    name, the kernel that multiplies its casts, and each role's element dtype."""

    name: str
    kernel: str

    def dtype(self, role: str) -> torch.dtype:
        """The fp8 dtype of ``role``'s codes."""
        ...


def _sm(cap: tuple[int, int]) -> str:
    return f"sm{cap[0]}{cap[1]}"


def kernel_missing(device: torch.device | str, quantizer: _Quantizer) -> str | None:
    """Why torch's scaled-matmul kernel for ``quantizer``'s scaling cannot run on
    ``device`` (a sentence), or None where it can (or may: a non-NVIDIA device's
    per-tensor kernel is left to torch). ``meta`` tensors have every kernel."""
    dev = torch.device(device)
    kind = quantizer.kernel
    if kind == "block" and any(quantizer.dtype(role) != torch.float8_e4m3fn
                               for role in ("input", "weight", "grad_output")):
        return ("torch's 1x128/128x128 block kernels take e4m3 operands only, and "
                "fp8_format=hybrid casts the gradients to e5m2 (fp8_format=e4m3, the "
                "fp8-block preset's, has the kernel)")
    if dev.type == "meta" or kind == "tensor" and dev.type != "cuda":
        return None
    if dev.type != "cuda":
        return f"torch's block-scaled kernels run on CUDA only, not on {dev.type}"
    if torch.version.hip is not None and kind != "tensor":
        return "mixprec wires torch's block-scaled kernels for NVIDIA GPUs only"
    cap = _capability(dev)
    low, top = KERNEL_CAPABILITY[kind]
    if cap < low or top is not None and cap[0] > top:
        need = f"{_sm(low)} only" if top == low[0] else f"{_sm(low)} or newer"
        return f"{_KERNEL_NAME[kind]} needs {need}, this GPU is {_sm(cap)}"
    return None


_CAPABILITY: dict[str, tuple[int, int]] = {}


def _capability(dev: torch.device) -> tuple[int, int]:
    """The GPU's compute capability, read once per device (each Linear asks at every
    GEMM)."""
    key = str(dev)
    if key not in _CAPABILITY:
        _CAPABILITY[key] = tuple(torch.cuda.get_device_capability(dev))
    return _CAPABILITY[key]


def gemm_route(device: torch.device | str, quantizer: _Quantizer, choice: str = "auto"
               ) -> str:
    """The route ``quantizer``'s GEMMs take on ``device`` for ``fp8_gemm`` ``choice``:
    ``scaled_mm``, ``dequant`` or ``dequant_fp32`` (the module doc). Raises for an
    unknown choice, and for ``scaled_mm`` where this device lacks the kernel."""
    if choice not in GEMM_CHOICES:
        raise ValueError(f"fp8_gemm={choice!r}; valid: {', '.join(GEMM_CHOICES)}")
    return _route(str(torch.device(device)), quantizer, choice)


def _route(device: str, quantizer: _Quantizer, choice: str) -> str:
    """``gemm_route``'s decision. Under ``torch.compile`` dynamo calls it once while
    tracing and keeps the answer as a constant (the mark
    ``torch.compiler.assume_constant_result`` sets, set directly below: the decorator
    imports dynamo), so neither the probe nor a warning runs in a graph."""
    dev = torch.device(device)
    kind = quantizer.kernel
    exact = "dequant" if kind == "tensor" else "dequant_fp32"
    if choice in ("dequant", "dequant_fp32"):
        return choice if kind == "tensor" else "dequant_fp32"
    missing = kernel_missing(dev, quantizer)
    if choice == "scaled_mm":
        if missing is not None:
            raise ValueError(
                f"fp8_gemm=scaled_mm with fp8_scaling={quantizer.name} on {device}: "
                f"{missing}. Use fp8_gemm=auto (the dequantizing GEMM where the kernel "
                f"is missing, with a warning) or fp8_gemm={exact}.")
        return "scaled_mm"
    if dev.type == "meta":  # shapes only: nothing to measure or probe
        return exact
    if dev.type != "cuda":
        return _measured(dev) if kind == "tensor" else "dequant_fp32"
    if missing is not None:
        _say_once(device, quantizer.name, missing, exact)
        return exact
    if kind == "tensor":
        return "scaled_mm"
    return "scaled_mm" if scaled_mm._kernel_ok(device, quantizer) else "dequant_fp32"


_route._dynamo_marked_constant = True


#: ``auto`` for the per-tensor routes off CUDA, ``device -> route``: the measured choice,
#: which ``mixprec.kernels`` (where the readings live, above this module) sets when it is
#: imported: the dequant route in the format this device multiplies fast (``dequant``
#: where bf16 is fast, else ``dequant_fp32``: the one bf16 decision ``fp8_rest`` and
#: emulation follow too, or ``MIXPREC_EMULATE``); ``scaled_mm`` only where
#: ``route_reading`` finds it ``SCALED_MM_MARGIN`` faster. The same one-thread
#: alternating readings as every ``auto`` choice: a separate best-of read on a loaded host
#: could flip the route, and the numerics, between two runs.
measured_route: Callable[[torch.device], str] | None = None


def _measured(dev: torch.device) -> str:
    if measured_route is None:  # importing mixprec imports mixprec.kernels, which sets it
        raise RuntimeError("mixprec.fp8.route.measured_route is unset: import mixprec")
    return measured_route(dev)


_SAID: set[tuple[str, str, str]] = set()


def _say_once(device: str, scaling: str, why: str, route: str) -> None:
    """One warning per device, scaling and reason that ``auto`` left the kernel."""
    key = (device, scaling, why)
    if key in _SAID:
        return
    _SAID.add(key)
    what = "exact dequantizing GEMM" if route == "dequant_fp32" else "dequantizing GEMM"
    warnings.warn(f"fp8_gemm=auto, fp8_scaling={scaling} on {device}: {why}; the {what} "
                  f"({route}) runs instead", stacklevel=4)
