"""The global gradient norm and the clipping coefficient, as device tensors.

``global_norm`` is the L2 norm over all gradients. It doubles as the non-finite check:
an inf or NaN anywhere makes it non-finite, and so does a sum of squares past fp32's
max (3.4e38). ``clip_coef`` is ``min(1, max_norm / (norm + 1e-6))``, torch's
``clip_grad_norm_`` rule. Neither syncs with the host.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["global_norm", "torch_norm", "sum_of_squares", "clip_coef", "BIG"]

#: tensors of at least this many elements get their own BLAS dot in the CPU norm
BIG = 1 << 16


def global_norm(grads: list[torch.Tensor], device: torch.device,
                cpu_fp32: bool = False,
                all_reduce: Callable[[torch.Tensor], Any] | None = None) -> torch.Tensor:
    """L2 norm of all ``grads`` (an fp32 scalar on ``device``; 0 for no gradients).

    ``all_reduce``: sums the squares across ranks in place before the root, for shards
    of one set of gradients (FSDP's; ``torch.distributed.all_reduce``)."""
    sq = sum_of_squares(grads, device, cpu_fp32)
    if all_reduce is not None:
        all_reduce(sq)
    return sq.sqrt()


def torch_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """L2 norm of all ``grads`` summed as ``torch.nn.utils.clip_grad_norm_`` sums it
    (per-tensor ``_foreach_norm``, then the norm of those), in fp32: on fp32 gradients
    the same bits as torch's, for a framework's clip call that would read torch's."""
    if all(g.dtype == torch.float32 for g in grads):
        norms = torch._foreach_norm(grads, 2.0)
    else:
        norms = torch._foreach_norm(grads, 2.0, dtype=torch.float32)
    return torch.linalg.vector_norm(torch.stack(norms), 2.0)


def sum_of_squares(grads: list[torch.Tensor], device: torch.device,
                   cpu_fp32: bool = False) -> torch.Tensor:
    """Σ g² over all ``grads`` in fp32 (summed across ranks before the square root when
    each rank holds shards).

    ``cpu_fp32`` (fp32 gradients on the CPU): one BLAS dot per large tensor reads it at
    memory speed, 1.7x faster than ``_foreach_norm`` here, and its fp32 sum of squares is
    more exact (2e-7 against 2e-5 relative error on the 6x512 GPT's gradients, against
    float64). Small tensors go in one ``_foreach_norm``, so the Python loop stays short
    on models with thousands of biases (3000 small tensors: 5.8 ms, against 11.8 ms)."""
    if not grads:
        return torch.zeros((), device=device)
    if cpu_fp32:
        big = [g for g in grads if g.numel() >= BIG]
        small = [g for g in grads if g.numel() < BIG]
        parts = [torch.dot(g.reshape(-1), g.reshape(-1)) for g in big]
        if small:
            parts.append(torch.stack(torch._foreach_norm(small, 2.0)).square().sum())
        return torch.stack(parts).sum()
    return torch.stack(torch._foreach_norm(grads, 2.0, dtype=torch.float32)).square().sum()


def clip_coef(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """``min(1, max_norm / (norm + 1e-6))``: the factor that brings ``norm`` to at most
    ``max_norm`` (torch's ``clip_grad_norm_`` rule, ε included)."""
    return (max_norm / (norm + 1e-6)).clamp(max=1.0)
