"""The GEMM route of an fp8 / fp4 Linear: one decision, which a format's ``route`` asks.

Routes: ``scaled_mm`` (torch's scaled kernel for the format), ``dequant`` (per tensor
and rowwise: the codes in bf16, fp32 accumulation) and ``dequant_fp32`` (an IEEE fp32
GEMM on the dequantized operands: exact up to summation order; the block formats' only
dequantizing route). ``dequant*`` are taken as asked; ``scaled_mm`` raises where the
format's kernel is missing on the device (its ``kernel``'s ``capability``, its
``kernel_refusal``; a format without a kernel has none anywhere),
naming why and the fix; ``auto`` takes the kernel where the device has it (block-scaled
ones after ``mixprec.formats.scaled_mm``'s probe agreed), else warns once and takes the
dequantizing route; on a CPU it measures the per-tensor routes (``mixprec.engine.devices``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Protocol

import torch

from mixprec.formats import scaled_mm
from mixprec.formats.padding import KernelSpec

__all__ = ["gemm_route", "kernel_missing", "register_measured_route", "GEMM_CHOICES"]

#: the values of a recipe's ``fp8_gemm``
GEMM_CHOICES = ("auto", "scaled_mm", "dequant", "dequant_fp32")

class _Quantizer(Protocol):
    """What the route needs of a format (``mixprec.formats.gemm``): its name, whether it
    scales per block, its kernel (None: none; else its name and where it runs) and what
    operands the kernel refuses."""

    name: str
    block_scaled: bool
    kernel: KernelSpec | None

    def kernel_refusal(self) -> str | None:
        """Why the kernel cannot take this format's operands, or None."""
        ...


def _sm(cap: tuple[int, int]) -> str:
    return f"sm{cap[0]}{cap[1]}"


def kernel_missing(device: torch.device | str, quantizer: _Quantizer) -> str | None:
    """Why torch's scaled-matmul kernel for ``quantizer``'s scaling cannot run on
    ``device`` (a sentence), or None where it can (or may: a non-NVIDIA device's
    per-tensor kernel is left to torch). ``meta`` tensors have every kernel."""
    dev = torch.device(device)
    kernel = quantizer.kernel
    if kernel is None:
        return (f"fp8_scaling={quantizer.name} has no torch scaled-matmul kernel (its "
                "GEMMs run the exact dequantizing route)")
    refusal = quantizer.kernel_refusal()
    if refusal is not None:
        return refusal
    block = quantizer.block_scaled
    if dev.type == "meta" or not block and dev.type != "cuda":
        return None
    if dev.type != "cuda":
        return f"torch's block-scaled kernels run on CUDA only, not on {dev.type}"
    if torch.version.hip is not None and block:
        return "mixprec wires torch's block-scaled kernels for NVIDIA GPUs only"
    cap = _capability(dev)
    low, top = kernel.capability
    if cap < low or top is not None and cap[0] > top:
        need = f"{_sm(low)} only" if top == low[0] else f"{_sm(low)} or newer"
        return f"{kernel.name} needs {need}, this GPU is {_sm(cap)}"
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
    block = quantizer.block_scaled
    exact = "dequant_fp32" if block else "dequant"
    if choice in ("dequant", "dequant_fp32"):
        return "dequant_fp32" if block else choice
    missing = kernel_missing(dev, quantizer)
    if choice == "scaled_mm":
        if missing is not None:
            auto = ("the exact dequantizing GEMM" if quantizer.kernel is None else
                    "the dequantizing GEMM where the kernel is missing, with a warning")
            raise ValueError(
                f"fp8_gemm=scaled_mm with fp8_scaling={quantizer.name} on {device}: "
                f"{missing}. Use fp8_gemm=auto ({auto}) or fp8_gemm={exact}.")
        return "scaled_mm"
    if dev.type == "meta" or quantizer.kernel is None:  # shapes only, or no kernel
        return exact
    if dev.type != "cuda":
        return "dequant_fp32" if block else _measured(dev)
    if missing is not None:
        _say_once(device, quantizer.name, missing, exact)
        return exact
    if not block:
        return "scaled_mm"
    return "scaled_mm" if scaled_mm._kernel_ok(device, quantizer) else "dequant_fp32"


_route._dynamo_marked_constant = True


#: ``auto`` for the per-tensor routes off CUDA, ``device -> route``: the measured choice,
#: which ``mixprec.engine.devices`` (where the readings live, above this module) registers
#: when it is imported (``register_measured_route``): the dequant route in the format this
#: device multiplies fast (``dequant``
#: where bf16 is fast, else ``dequant_fp32``: the one bf16 decision ``fp8_rest`` and
#: emulation follow too, or ``MIXPREC_EMULATE``); ``scaled_mm`` only where
#: ``route_reading`` finds it ``SCALED_MM_MARGIN`` faster. The same one-thread
#: alternating readings as every ``auto`` choice: a separate best-of read on a loaded host
#: could flip the route, and the numerics, between two runs.
measured_route: Callable[[torch.device], str] | None = None


def register_measured_route(fn: Callable[[torch.device], str]) -> None:
    """Make ``fn`` (``device -> route``) the measured ``auto`` of the per-tensor routes off
    CUDA (``measured_route``)."""
    global measured_route
    measured_route = fn


def _measured(dev: torch.device) -> str:
    if measured_route is None:  # importing mixprec imports mixprec.engine.devices: it registers
        raise RuntimeError("mixprec.formats.route.measured_route is unset: import mixprec")
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
