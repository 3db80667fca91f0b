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

    Today's decoder shapes (``mixprec.memory.shapes`` counts their parameters;
    ``mixprec.memory.hf_config.spec_from_config`` reads them off a transformers config):

    - grouped-query attention: ``kv_heads`` K and V heads of ``head_dim`` (default
      ``hidden / heads``) each, so Q saves ``heads·head_dim`` values and K, V
      ``kv_heads·head_dim`` each;
    - ``ffn_hidden``: the MLP's width (default ``ffn_mult·hidden``); ``gated`` (SwiGLU,
      Llama's and Mixtral's): gate, up and down Linears, which save the gate and up
      outputs and the SiLU's (``3·ffn_hidden``), the down input at the Linears' width,
      and the MLP input once per gate and up Linear where it is cast;
    - mixture of experts: ``experts`` experts of ``expert_ffn_hidden`` (default
      ``ffn_hidden``) each, ``top_k`` per token, behind a router (``hidden × experts``):
      every token's ``top_k`` routed rows save what a gated MLP saves, plus the gathered
      input, the down output, an int64 sort index, permutation and inverse and an fp32
      routing weight; the router its input, fp32 probabilities and the top-k ids and
      weights; ``shared_ffn_hidden``: a dense gated MLP beside the experts (a shared
      expert, ``n_shared·width``); ``dense_layers``: that many layers keep a dense MLP
      of ``ffn_hidden`` instead of experts;
    - ``norm``: ``layer`` (weight and bias) or ``rms`` (weight only; and saved as
      transformers' RMSNorm saves it: its fp32 input and normalized values and an fp32
      rsqrt per token, ``8·h + 4``); ``tied_embeddings``: the head shares the
      embedding's matrix.
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
    #: pipeline stages: the spec describes the whole model, only 1 is taken; a stage
    #: is priced by ``estimate(spec, recipe, pipeline=PipelineSchedule(...))``
    pipeline_parallel: int = 1
    #: Linears that read the attention's input: 1 (a fused QKV) or 3 (separate q, k, v);
    #: each casts and saves its own copy where the input is cast (16 bits, fp8)
    qkv_linears: Literal[1, 3] = 1
    #: a transformers mixture-of-experts model's experts route
    #: (``mixprec.experts.grouped``): ``loop``, a CPU's eager choice, or ``grouped``, a
    #: GPU's and a compiled CPU model's (where ``fp8-block`` and ``mxfp8`` take the
    #: sync-free block route with its tile-padded wgrad buffer)
    experts_route: Literal["loop", "grouped"] = "loop"
    #: K and V heads (grouped-query attention; default ``heads``)
    kv_heads: int | None = None
    #: each head's width (default ``hidden / heads``)
    head_dim: int | None = None
    #: the dense MLP's width (default ``ffn_mult·hidden``)
    ffn_hidden: int | None = None
    #: a gated MLP (SwiGLU: gate, up and down Linears), not a GELU MLP
    gated: bool = False
    #: routed experts per MoE layer (0: a dense model)
    experts: int = 0
    #: experts each token is routed to
    top_k: int = 1
    #: each expert's width (default ``ffn_hidden``)
    expert_ffn_hidden: int | None = None
    #: the width of the dense gated MLP beside the experts (shared experts; 0: none)
    shared_ffn_hidden: int = 0
    #: layers (among ``layers``) with a dense MLP instead of experts
    dense_layers: int = 0
    #: ``layer`` (LayerNorm: weight and bias) or ``rms`` (transformers' RMSNorm: weight;
    #: saves fp32 values)
    norm: Literal["layer", "rms"] = "layer"
    #: the head shares the embedding's matrix (counted once)
    tied_embeddings: bool = True
    #: per-head RMSNorms on the queries and keys (Qwen3): ``head_dim`` weights each
    qk_norm: bool = False

    def __post_init__(self) -> None:
        if self.pipeline_parallel != 1:
            raise ValueError(
                f"TransformerSpec pipeline_parallel={self.pipeline_parallel!r}: the spec "
                "describes the whole model. Price its stages with estimate(spec, recipe, "
                "pipeline=mixprec.memory.PipelineSchedule(stages=p, microbatches=m, "
                "schedule='1f1b')), which splits the layers and counts each stage's "
                "micro-batches in flight")
        for name in ("layers", "hidden", "heads", "seq_len", "micro_batch", "top_k"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"TransformerSpec {name}={v!r}: an integer >= 1")
        kv = self.kv_heads
        if kv is not None and (not isinstance(kv, int) or kv < 1 or self.heads % kv):
            raise ValueError(f"TransformerSpec kv_heads={kv!r}: an integer >= 1 that "
                             f"divides heads={self.heads} (grouped-query attention)")
        if self.experts and not 1 <= self.top_k <= self.experts:
            raise ValueError(f"TransformerSpec top_k={self.top_k!r}: between 1 and "
                             f"experts={self.experts}")
        if not 0 <= self.dense_layers <= self.layers:
            raise ValueError(f"TransformerSpec dense_layers={self.dense_layers!r}: "
                             f"between 0 and layers={self.layers}")

    @property
    def dims(self) -> tuple[int, int, int, int, int]:
        """``(Q width, K and V width each, dense MLP width, expert width, MoE
        layers)``."""
        d = self.head_dim or self.hidden // self.heads
        ffn = self.ffn_hidden or self.ffn_mult * self.hidden
        moe = self.layers - self.dense_layers if self.experts else 0
        return (self.heads * d, (self.kv_heads or self.heads) * d, ffn,
                self.expert_ffn_hidden or ffn, moe)


def _mlp_saved(spec: TransformerSpec, width: int, v: float, li: float,
               tp: int) -> tuple[float, float]:
    """``(kept whole, split over tensor-parallel ranks)`` values a dense MLP of
    ``width`` saves per token: its input's casts, and its hidden values."""
    f = width / spec.hidden
    if spec.gated:  # gate and up each cast the input; gate, up, SiLU out; down's input
        return (2 if li < 4 else 1) * li, (3 * f * v + f * li) / tp
    return li, (f * v + f * li) / tp  # fc output (GELU's input), GELU output


def _moe_saved(spec: TransformerSpec, v: float, li: float, tp: int) -> float:
    """Values (in ``hidden`` units) an MoE layer's experts and router save per token."""
    h, k, e = spec.hidden, spec.top_k, spec.experts
    inner = spec.dims[3] / h
    up = 3 * inner * v if spec.gated else inner * v
    # per routed row: the gathered input's cast, the hidden values, the down output,
    # three int64 indices and an fp32 routing weight
    rows = k * (li + (up + inner * li) / tp + v + 28 / h)
    router = v + (4 * e + 12 * k + 4) / h
    shared = sum(_mlp_saved(spec, spec.shared_ffn_hidden, v, li, tp)) if \
        spec.shared_ffn_hidden else 0.0
    return rows + router + shared


def activation_bytes(spec: TransformerSpec, bytes_per_value: float = 2.0,
                     linear_input_bytes: float | None = None) -> float:
    """Bytes saved for backward by one forward pass (see TransformerSpec)."""
    s, b, h, a = spec.seq_len, spec.micro_batch, spec.hidden, spec.heads
    v = bytes_per_value
    li = v if linear_input_bytes is None else linear_input_bytes
    sbh = s * b * h
    norm = 4.0 if spec.fp32_norms else v
    if spec.norm == "rms":  # transformers' RMSNorm: fp32 input and normalized values
        norm = 8.0 + 4.0 / h
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
    qw, kw, _, _, moe = spec.dims
    q, kv = qw / h, kw / h
    split = (q + 2 * kv) * v + q * v  # Q, K, V, the attention output
    if li != v:
        split += q * li  # fp8: the projection saves its own fp8 copy of the attention output
    if spec.qkv_linears not in (1, 3):
        raise ValueError(f"qkv_linears={spec.qkv_linears!r}: 1 (a fused QKV Linear) or 3 "
                         "(separate q, k and v Linears)")
    # separate q, k, v Linears each keep their own cast of the input (none in fp32)
    copies = spec.qkv_linears if li < 4 else 1
    per = (2 * norm + copies * li + split / tp) * sbh
    dense = sum(_mlp_saved(spec, spec.dims[2], v, li, tp)) * sbh
    experts = _moe_saved(spec, v, li, tp) * sbh if moe else 0.0
    if spec.dropout:
        per += 2 * sbh
    if spec.recompute == "none":
        if spec.attention == "flash":
            per += 4.0 * a * s * b / tp
        else:
            soft = (4.0 + v) if spec.fp32_softmax else v
            per += a * s * s * b * (soft + (1 + v if spec.dropout else 0)) / tp
    return (spec.layers * per + (spec.layers - moe) * dense + moe * experts
            + total_extra)
