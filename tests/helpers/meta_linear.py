"""One Float8Linear step on meta tensors, checked by torch's own meta kernels: the CUDA
GEMM calls' shapes and dtypes, on any machine."""

from __future__ import annotations

import torch
from torch import nn

from mixprec.modules.linear import Float8Linear

__all__ = ["meta_linear_step"]


def meta_linear_step(recipe: str, shape: tuple[int, int], tokens: int) -> Float8Linear:
    """A Float8Linear of ``shape`` (in, out) on meta tensors on the ``scaled_mm`` route:
    forward and backward of ``tokens`` tokens, every output's shape and dtype checked."""
    d_in, d_out = shape
    f8 = Float8Linear.from_linear(nn.Linear(d_in, d_out), recipe).to("meta")
    assert f8.backend == "scaled_mm"
    x = torch.empty(tokens, d_in, device="meta", dtype=torch.bfloat16, requires_grad=True)
    y = f8(x)
    y.sum().backward()
    assert (y.shape, y.dtype) == ((tokens, d_out), torch.bfloat16)
    assert (x.grad.shape, x.grad.dtype) == ((tokens, d_in), torch.bfloat16)
    assert (f8.weight.grad.shape, f8.weight.grad.dtype) == ((d_out, d_in), torch.float32)
    return f8
