"""A transformer's saved activations from its shapes: Korthikanti et al. 2022's
formula, term by term as a run saves them (``TransformerSpec``, ``activation_bytes``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["TransformerSpec", "activation_bytes"]


@dataclass(frozen=True, kw_only=True)
class TransformerSpec:
    """Shapes for the activation formula of Korthikanti et al. 2022 (§4.1).

    With the defaults (16-bit activations, dropout, nothing kept in fp32, no ``vocab``)
    it is the paper's per-layer ``s·b·h·(34 + 5·a·s/h)`` bytes times ``layers``:
    ``34·s·b·h`` = 2 norm inputs (2+2) + QKV input (2) + Q, K, V (6) + projection input
    (2) + MLP input (2) + fc output (8) + GELU output (8) + two dropout masks (1+1), and
    ``5·a·s²·b`` = softmax output (2) + its dropout mask (1) + dropout output (2).

    Each term follows what a run really saves:

    - ``attention="flash"`` (``F.scaled_dot_product_attention``'s fused kernels) saves no
      s×s matrix, only its fp32 log-sum-exp (``4·a·s·b``);
    - ``dropout=False`` drops the masks and the dropout output;
    - ``fp32_norms`` / ``fp32_softmax`` (mixprec's FP32 islands; ``estimate`` sets them
      from the recipe's ``keep_fp32``): the norm inputs are saved as fp32 copies, and the
      fp32 softmax output is saved together with the low-precision copy that the PV
      matmul takes;
    - ``linear_input_bytes`` (1 under fp8 recipes, whose Linears save fp8 copies of their
      inputs); ``vocab``: the output layer's input, and the fp32 logits of the loss
      (``4·s·b·V``), plus the final norm;
    - recomputation: ``selective`` drops the s×s terms, ``full`` keeps each layer's input.
    """

    layers: int
    hidden: int
    heads: int
    seq_len: int
    micro_batch: int = 1
    ffn_mult: int = 4
    vocab: int | None = None
    attention: Literal["materialized", "flash"] = "materialized"
    recompute: Literal["none", "selective", "full"] = "none"
    dropout: bool = True
    fp32_norms: bool | None = None
    fp32_softmax: bool | None = None
    #: tensor-parallel ranks: Q, K, V, the attention and the MLP's hidden values are
    #: split over them (Korthikanti et al. §4.2.2: ``s·b·h·(10 + 24/t + 5·a·s/(h·t))``);
    #: the norms, the Linears' replicated inputs and the head stay whole
    tensor_parallel: int = 1
    #: Linears that read the attention's input: 1 (a fused QKV) or 3 (separate q, k, v);
    #: each casts and saves its own copy where the input is cast (16 bits, fp8)
    qkv_linears: Literal[1, 3] = 1
    #: a transformers mixture-of-experts model's experts route
    #: (``mixprec.experts.grouped``): ``loop``, a CPU's eager choice, or ``grouped``, a
    #: GPU's and a compiled CPU model's (where ``fp8-block`` and ``mxfp8`` take the
    #: sync-free block route with its tile-padded wgrad buffer)
    experts_route: Literal["loop", "grouped"] = "loop"


def activation_bytes(spec: TransformerSpec, bytes_per_value: float = 2.0,
                     linear_input_bytes: float | None = None) -> float:
    """Bytes saved for backward by one forward pass (see TransformerSpec)."""
    s, b, h, a, f = spec.seq_len, spec.micro_batch, spec.hidden, spec.heads, spec.ffn_mult
    v = bytes_per_value
    li = v if linear_input_bytes is None else linear_input_bytes
    sbh = s * b * h
    norm = 4.0 if spec.fp32_norms else v
    total_extra = 0.0
    if spec.vocab:
        total_extra = (norm + li) * sbh + 4.0 * s * b * spec.vocab
    if spec.recompute == "full":
        return spec.layers * v * sbh + total_extra
    # norms, QKV input, Q/K/V, attention output (the projection's input), MLP input,
    # fc output (GELU's input), GELU output (the second Linear's input)
    tp = spec.tensor_parallel
    if not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tensor_parallel={tp!r}: the number of tensor-parallel ranks, "
                         "an integer >= 1")
    split = 3 * v + v + f * v + f * li  # Q/K/V, attention output, fc and GELU outputs
    if li != v:
        split += li  # fp8: the projection saves its own fp8 copy of the attention output
    if spec.qkv_linears not in (1, 3):
        raise ValueError(f"qkv_linears={spec.qkv_linears!r}: 1 (a fused QKV Linear) or 3 "
                         "(separate q, k and v Linears)")
    # separate q, k, v Linears each keep their own cast of the input (none in fp32)
    copies = spec.qkv_linears if li < 4 else 1
    per = (2 * norm + copies * li + li + split / tp) * sbh
    if spec.dropout:
        per += 2 * sbh
    if spec.recompute == "none":
        if spec.attention == "flash":
            per += 4.0 * a * s * b / tp
        else:
            soft = (4.0 + v) if spec.fp32_softmax else v
            per += a * s * s * b * (soft + (1 + v if spec.dropout else 0)) / tp
    return spec.layers * per + total_extra
