"""The experts' forward on ``torch._scaled_grouped_mm`` (CUDA sm90 and sm100).

torch's fp8 grouped GEMM takes e4m3 codes with one inverse scale per row of the tokens
(T,) and per output column of each expert's weight (E, N), the weights column-major.
A per-tensor scale is that row or column scale repeated; rowwise casts are it already.
The kernel writes bf16 and needs K and N multiples of 16; torch builds it for compute
capabilities 9.x and 10.x only (``_scaled_mm_allowed_device(sm90_only, sm100_only)``
in ``aten/src/ATen/native/cuda/GroupedBlas.cpp``: an sm120 GPU is refused). The block
formats (block, MX, NVFP4) have no such kernel here: they take the ``loop`` route on
a GPU. The shapes and scale layouts are checked against torch's meta kernel on any
machine (``device="meta"``).
"""

from __future__ import annotations

import torch

from mixprec.experts.format import ExpertsFormat

__all__ = ["scaled_grouped_applies", "scaled_grouped_refusal", "scaled_grouped_forward"]

_E4M3 = torch.float8_e4m3fn
#: the compute capability majors torch's fp8 grouped kernel is built for
MAJORS = (9, 10)


def _capability(device: torch.device) -> tuple[int, int] | None:
    """The device's CUDA compute capability, None off CUDA (one function tests
    monkeypatch to stand a CPU in for a GPU)."""
    device = torch.device(device)
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else None


def scaled_grouped_refusal(fmt: ExpertsFormat, device: torch.device, k: int = 16,
                           n: int = 16) -> str | None:
    """Why ``fmt``'s forward cannot run on ``torch._scaled_grouped_mm`` on ``device``
    with K = ``k`` and N = ``n`` (None: it can): it needs a per-tensor or rowwise
    format with e4m3 forward codes whose route is ``scaled_mm``, on a GPU of compute
    capability 9.x or 10.x, with K and N multiples of 16 (``device="meta"`` passes
    the device checks, for shapes)."""
    device = torch.device(device)
    q = fmt.quantizer
    if not hasattr(torch, "_scaled_grouped_mm"):
        return f"torch {torch.__version__} has no torch._scaled_grouped_mm"
    if not q.takes_tensor_route or q.kernel is None or q.kernel.scales != "tensor":
        return (f"{fmt.format_name} is not a per-tensor or rowwise fp8 format (torch's "
                "fp8 grouped kernel takes one scale per row and column)")
    if q.dtype("input") != _E4M3 or q.dtype("weight") != _E4M3:
        return f"{fmt.format_name}'s forward codes are not e4m3"
    if k % 16 or n % 16:
        return f"K={k} and N={n} must be multiples of 16"
    if device.type == "meta":
        return None
    cap = _capability(device)
    if cap is None or cap[0] not in MAJORS:
        where = "a CPU" if cap is None else f"compute capability {cap[0]}.{cap[1]}"
        return (f"torch builds the kernel for CUDA compute capability 9.x and 10.x only, "
                f"not {where} ({device})")
    if fmt.backend(device) != "scaled_mm":
        return f"{fmt.format_name}'s GEMM route on {device} is {fmt.backend(device)!r}"
    return None


def scaled_grouped_applies(fmt: ExpertsFormat, device: torch.device, k: int = 16,
                           n: int = 16) -> bool:
    """Whether ``fmt``'s forward can run on ``torch._scaled_grouped_mm`` on ``device``
    (``scaled_grouped_refusal`` says why not)."""
    return scaled_grouped_refusal(fmt, device, k, n) is None


def scaled_grouped_forward(x_codes: torch.Tensor, x_inv: torch.Tensor,
                           w_codes: torch.Tensor, w_inv: torch.Tensor,
                           offs: torch.Tensor) -> torch.Tensor:
    """Each expert's rows of ``x_codes`` (T × K, e4m3, inverse scales ``x_inv`` (T,))
    times its ``w_codes[e]ᵀ`` (E × N × K, inverse scales ``w_inv`` (E × N)) over the
    int32 cumulative counts ``offs``: (T × N) bf16; rows past ``offs[-1]`` unwritten."""
    return torch._scaled_grouped_mm(x_codes, w_codes.transpose(1, 2), x_inv.float(),
                                    w_inv.float(), offs=offs, out_dtype=torch.bfloat16)
