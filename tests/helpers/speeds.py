"""Readings that stand in for measured speeds (``mixprec.engine.devices``'s GFLOP/s per dtype
and ``torch._scaled_mm``'s), the figures read on the project's CPU, and a skip for CPUs
where ``torch._scaled_mm`` does not run."""

from __future__ import annotations

import pytest
import torch

import mixprec.engine.devices as k

__all__ = ["EPYC_ONE_THREAD", "EPYC_LOADED", "set_speeds", "require_cpu_scaled_mm"]


#: GFLOP/s on the AMD EPYC with AVX-512 BF16 and no fp16 units, one thread (quiet), and
#: multi-threaded while another process held a core: read in back-to-back runs
EPYC_ONE_THREAD = {torch.float32: 100.0, torch.bfloat16: 200.0, torch.float16: 2.3}
EPYC_LOADED = {torch.float32: 1.4, torch.bfloat16: 2.8, torch.float16: 2.3}


def set_speeds(monkeypatch, rates: dict | None = None, scaled_mm: float = 0.0,
               bf16: float = 1.0, fp16: float = 1.0) -> None:
    """Make every reading of ``mixprec.engine.devices`` (each round alike) see these rates:
    GFLOP/s by torch dtype (fp32, bf16, fp16; else ``bf16`` and ``fp16`` against fp32's
    1.0) and ``torch._scaled_mm``'s."""
    rates = rates or {torch.float32: 1.0, torch.bfloat16: bf16, torch.float16: fp16}
    names = {torch.bfloat16: "bf16", torch.float16: "fp16"}
    monkeypatch.setattr(k, "speed_reading", lambda dev, dt: k.SpeedReading(
        name=names[dt], base="fp32", rounds=(rates[dt] / rates[torch.float32],)))
    monkeypatch.setattr(k, "route_reading", lambda dev, route: k.SpeedReading(
        name="scaled_mm", base=route, rounds=(scaled_mm / rates[
            torch.bfloat16 if route == "dequant" else torch.float32],)))


def require_cpu_scaled_mm() -> None:
    """Skip the calling test unless torch._scaled_mm runs on this CPU now. Under
    ``ONEDNN_MAX_CPU_ISA=AVX2`` on an AVX-512 chip (the mimic of a CPU without bf16
    units) oneDNN stops creating its fp8 matmul once a 16-bit matmul has run."""
    a = torch.ones(16, 16).to(torch.float8_e4m3fn)
    one = torch.ones(())
    try:
        torch._scaled_mm(a, a.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError) as e:
        pytest.skip(f"torch._scaled_mm does not run on this CPU here: {str(e)[:80]}")
