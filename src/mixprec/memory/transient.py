"""The bytes a training step holds beyond its steady state and saved activations: the
low-precision weight copies saved for backward, and the working set of the widest
Linear's backward (``estimate``'s peak; ``measure(..., peak=True)`` measures it).

Per Linear of ``T`` tokens, ``I`` inputs and ``O`` outputs, with activations of ``b``
bytes (4 in fp32 or under emulation, else 2), the backward holds at once:

- its output's gradient ``T·O·b``, its input's gradient ``T·I·b`` and its weight's
  gradient ``I·O·4``;
- per-tensor and rowwise fp8: the gradient's codes (``T·O``) and, where it arrives in
  16 bits, its fp32 upcast (``4·T·O``); the GEMM's operand copies, bf16 on the
  ``dequant`` route (``2·(T·O + I·O)``), fp32 on ``dequant_fp32`` (``4·(T·O + I·O)``),
  none on ``scaled_mm``, except the padding of a dim ``torch._scaled_mm`` needs a
  multiple of 16 (``mixprec.fp8.padding.backward_padding_bytes``: the padded operand
  copies and output columns of the dgrad or wgrad GEMM, the larger);
- block and MX fp8: the gradient's block cast (``T·O·5``), its fp32 dequantized copy and
  the other operand's (``4·(T·O + I·O)`` for dgrad, ``4·(T·O + T·I)`` for wgrad, while
  the dgrad's cast of the gradient, its codes, is still alive: ``T·O`` more);
- NVFP4: the gradient's cast keeps about seven fp32 copies of it alive at once (its
  fp32 view, the expanded scales, the scaled values, their magnitudes, the grid steps,
  the random draws, the rounded values: ``28·T·O``), plus the dgrad cast's codes
  (``T·O``) and the Hadamard-transformed wgrad operands (``4·(T·O + T·I)``);
- INT8 rowwise: the larger of the gradient's cast (an fp32 copy and the fp32 quotient:
  ``8·T·O``) and the dgrad GEMM (the codes, the int32 sum and its fp32 copy, the scaled
  output counted above: ``T·O + 8·T·I``, plus on the exact route
  ``dequant_fp32`` the fp32 codes of one 1024-wide chunk of each operand,
  ``4·c·(T + I)``, ``c = min(O, 1024)``); wgrad runs in 16 bits on the saved input.

The peak is taken at the widest Linear (the largest sum). The saved weight copies are
what autocast's cast cache keeps (2 bytes per weight element for fp32 weights under a
16-bit autocast, 4 under emulation) and fp8's codes (1 byte). The optimizer step's own
scratch comes after the activations are freed: ``mixprec.optim`` bounds it by its
pieces (``STEP_SCRATCH_PER_ELEMENT`` bytes per element of a piece,
benchmarks/optim_peak.py), torch's fused AdamW has none.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from mixprec.fp8.padding import backward_padding_bytes

__all__ = ["linear_shapes", "saved_weight_bytes", "backward_transient",
           "STEP_SCRATCH_PER_ELEMENT", "step_scratch"]

#: mixprec.optim's scratch per element of one piece of its step (measured on 4096²:
#: ~8.7 MB for 2^17-element pieces under stochastic writes on int8 states)
STEP_SCRATCH_PER_ELEMENT = 66


def linear_shapes(model: nn.Module) -> list[tuple[str, int, int]]:
    """``(qualified name, in_features, out_features)`` of each Linear (``nn.Linear``,
    mixprec's Float8Linear, a GPT-2 ``Conv1D``) of ``model``."""
    from mixprec.fp8.linear import is_conv1d

    out = []
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear):
            out.append((name, m.in_features, m.out_features))
        elif is_conv1d(m):
            i, o = m.weight.shape
            out.append((name, int(i), int(o)))
    return out


def saved_weight_bytes(shapes: Iterable[tuple[int, int, str]]) -> float:
    """Bytes of the weight copies saved for backward: ``(in, out, route)`` per Linear,
    the route as ``backward_transient`` names them."""
    per = {"fp32": 0, "weights16": 0, "autocast16": 2, "autocast_emulated": 4,
           "fp8": 1, "rowwise": 1, "block": 1, "nvfp4": 1, "int8": 1}
    return float(sum(i * o * per[route] for i, o, route in shapes))


def backward_transient(tokens: int, shapes: Iterable[tuple[int, int, str]],
                       act_bytes: float, fp8_gemm: str = "dequant") -> float:
    """The widest Linear's backward working set (see the module docstring), in bytes.

    ``shapes``: ``(in, out, route)`` per Linear, ``route`` one of ``fp32``,
    ``weights16`` (16-bit weights, no cast), ``autocast16``, ``autocast_emulated``,
    ``fp8``, ``rowwise``, ``block``, ``nvfp4``, ``int8``; ``fp8_gemm``: the per-tensor and
    rowwise GEMM route."""
    t = tokens
    best = 0.0
    for i, o, route in shapes:
        to, ti, io = t * o, t * i, i * o
        need = to * act_bytes + ti * act_bytes + io * 4
        if route in ("fp8", "rowwise"):
            copies = {"dequant": 2, "dequant_fp32": 4}.get(fp8_gemm, 0)
            need += (5 if act_bytes < 4 else 1) * to + copies * (to + io)
            if fp8_gemm == "scaled_mm":
                need += backward_padding_bytes(t, i, o, 2 if act_bytes < 4 else 4)
        elif route == "block":
            need += 5 * to + 4 * max(to + io, to + ti) + to
        elif route == "nvfp4":
            need += 29 * to + 4 * (to + ti)
        elif route == "int8":
            chunks = 4 * min(o, 1024) * (t + i) if fp8_gemm == "dequant_fp32" else 0
            need += max(8 * to, to + 8 * ti + chunks)
        best = max(best, need)
    return best


def step_scratch(largest_numel: int, chunk: int) -> float:
    """mixprec.optim's step scratch: one piece of ``min(chunk, largest)`` elements."""
    return float(STEP_SCRATCH_PER_ELEMENT * min(chunk, largest_numel))
