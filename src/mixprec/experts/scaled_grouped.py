"""The experts' forward on ``torch._scaled_grouped_mm`` (CUDA sm90+).

torch's fp8 grouped GEMM takes e4m3 codes with one inverse scale per row of the tokens
(T,) and per output column of each expert's weight (E, N), the weights column-major.
A per-tensor scale is that row or column scale repeated; rowwise casts are it already.
The kernel writes bf16 and needs K and N multiples of 16. The block formats (block, MX,
NVFP4) have no such grouped kernel in torch: they take the ``grouped`` route. The shapes
and scale layouts here are checked against torch's meta kernel on any machine
(``device="meta"``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from mixprec.experts.format import ExpertsFormat

__all__ = ["scaled_grouped_applies", "scaled_grouped_forward"]

_E4M3 = torch.float8_e4m3fn


def _capability(device: torch.device) -> tuple[int, int]:
    """The CUDA device's compute capability (one function tests can monkeypatch)."""
    return torch.cuda.get_device_capability(device)


def scaled_grouped_applies(fmt: ExpertsFormat, device: torch.device, k: int = 16,
                           n: int = 16) -> bool:
    """Whether ``fmt``'s forward can run on ``torch._scaled_grouped_mm`` on ``device``:
    a per-tensor or rowwise format whose route is ``scaled_mm`` on an sm90+ GPU, with
    K and N multiples of 16 (``device="meta"`` passes the device check, for shapes)."""
    device = torch.device(device)
    if not fmt.quantizer.takes_tensor_route or not hasattr(torch, "_scaled_grouped_mm"):
        return False
    if k % 16 or n % 16:
        return False
    if device.type == "meta":
        return True
    return (device.type == "cuda" and _capability(device) >= (9, 0)
            and fmt.backend(device) == "scaled_mm")


def _rows(inv: torch.Tensor, count: int) -> torch.Tensor:
    """Per-row inverse scales: a scalar repeated, or a (count, 1) / (1, count) vector."""
    return inv.float().reshape(-1).expand(count) if inv.numel() == 1 else inv.float().reshape(-1)


def scaled_grouped_forward(xq: list, wq: list, bounds: list[tuple[int, int]], t: int,
                           n: int) -> torch.Tensor:
    """The forward product from per-expert casts (None for an expert with no token):
    ``xq[e]`` (rows, K) cast along K, ``wq[e]`` (N, K) cast along K; (t, n) bf16."""
    some = next(c for c in xq if c is not None)
    dev, k = some.data.device, some.data.shape[1]
    a = torch.zeros(t, k, dtype=_E4M3, device=dev)
    scale_a = torch.ones(t, device=dev)
    b = torch.zeros(len(wq), n, k, dtype=_E4M3, device=dev)
    scale_b = torch.ones(len(wq), n, device=dev)
    for e, (x_e, w_e, (s, end)) in enumerate(zip(xq, wq, bounds)):
        if x_e is None:
            continue
        a[s:end] = x_e.codes
        scale_a[s:end] = _rows(x_e.inv, end - s)
        b[e] = w_e.codes
        scale_b[e] = _rows(w_e.inv, n)
    offs = torch.tensor([e for _, e in bounds], dtype=torch.int32, device=dev)
    return torch._scaled_grouped_mm(a, b.transpose(1, 2), scale_a, scale_b, offs=offs,
                                    out_dtype=torch.bfloat16)
