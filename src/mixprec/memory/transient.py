"""The bytes a training step holds beyond its steady state and saved activations: the
low-precision weight copies saved for backward, and the working set of the widest
Linear's backward (``estimate``'s peak; ``measure(..., peak=True)`` measures it).

Per Linear of ``T`` tokens, ``I`` inputs and ``O`` outputs, with activations of ``b``
bytes (4 in fp32 or under emulation, else 2), the backward holds its output's gradient
``T·O·b``, its input's gradient ``T·I·b`` and its weight's gradient ``I·O·4``, plus what
a Linear format's casts and GEMM route hold (its ``backward_bytes``). The peak is taken
at the widest Linear. The saved weight copies are what autocast's cast cache keeps (2
bytes per weight element for fp32 weights under a 16-bit autocast, 4 under emulation)
and a format's casts (its ``saved_weight_bytes``). The optimizer step's own scratch
comes after the activations are freed: ``mixprec.optim`` bounds it by its pieces
(``STEP_SCRATCH_PER_ELEMENT`` bytes per element of a piece, benchmarks/optim_peak.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import nn

from mixprec.modules.linear import is_conv1d

__all__ = ["linear_shapes", "tp_local", "saved_weight_bytes", "backward_transient",
           "STEP_SCRATCH_PER_ELEMENT", "step_scratch"]

#: mixprec.optim's scratch per element of one piece of its step (measured on 4096²:
#: ~8.7 MB for 2^17-element pieces under stochastic writes on int8 states)
STEP_SCRATCH_PER_ELEMENT = 66


def linear_shapes(model: nn.Module) -> list[tuple[str, int, int]]:
    """``(qualified name, in_features, out_features)`` of each Linear (``nn.Linear``,
    mixprec's Float8Linear, a GPT-2 ``Conv1D``) of ``model``."""
    out = []
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear):
            out.append((name, m.in_features, m.out_features))
        elif is_conv1d(m):
            i, o = m.weight.shape
            out.append((name, int(i), int(o)))
    return out


def tp_local(m: nn.Module, i: int, o: int, tp: int) -> tuple[int, int]:
    """A Linear's ``(in, out)`` as this rank computes it: a weight split by a
    tensor-parallel plan (``Shard(0)``: colwise, ``Shard(1)``: rowwise on the mesh's
    last dim, where FSDP x TP keeps TP) holds ``1/tp`` of that dim; FSDP's own shards
    are gathered whole for the GEMMs."""
    w = getattr(m, "weight", None)
    place = getattr(w, "placements", None)
    if tp <= 1 or not place or not getattr(place[-1], "is_shard", lambda: False)():
        return i, o
    dim = place[-1].dim
    return (i // tp, o) if dim == 1 else (i, o // tp)


#: bytes per weight element saved for backward, by the route of a Linear without format
_SAVED = {"fp32": 0, "weights16": 0, "autocast16": 2, "autocast_emulated": 4}


def saved_weight_bytes(shapes: Iterable[tuple[int, int, Any]]) -> float:
    """Bytes of the weight copies saved for backward: ``(in, out, route)`` per Linear,
    the route as ``backward_transient`` names them."""
    return float(sum(i * o * _SAVED[route] if isinstance(route, str)
                     else route.saved_weight_bytes(i, o) for i, o, route in shapes))


def backward_transient(tokens: int, shapes: Iterable[tuple[int, int, Any]],
                       act_bytes: float, fp8_gemm: str = "dequant") -> float:
    """The widest Linear's backward working set (see the module docstring), in bytes.

    ``shapes``: ``(in, out, route)`` per Linear, ``route`` a Linear format
    (``mixprec.formats.gemm``) or, for a Linear without one, ``fp32``, ``weights16``
    (16-bit weights, no cast), ``autocast16`` or ``autocast_emulated``; ``fp8_gemm``:
    the per-tensor and rowwise GEMM route."""
    t = tokens
    best = 0.0
    for i, o, route in shapes:
        need = t * o * act_bytes + t * i * act_bytes + i * o * 4
        if not isinstance(route, str):
            need += route.backward_bytes(t, i, o, act_bytes, fp8_gemm)
        best = max(best, need)
    return best


def step_scratch(largest_numel: int, chunk: int) -> float:
    """mixprec.optim's step scratch: one piece of ``min(chunk, largest)`` elements."""
    return float(STEP_SCRATCH_PER_ELEMENT * min(chunk, largest_numel))
