"""The quantized grouped GEMM: ``y[rows of e] = x[rows of e] @ W[e]ᵀ`` for every expert e.

``x`` (T × K) holds the tokens sorted by expert, ``W`` (E × N × K) the experts' weights
(out × in), ``offsets`` (E,) the cumulative token counts (``torch._grouped_mm``'s
``offs``); rows past ``offsets[-1]`` (tokens routed elsewhere, as expert parallelism
leaves them) get zeros. Forward, dgrad and wgrad run in any linear format of the
quantizer registry, exactly as a converted Linear runs them (``mixprec.fp8.linear``;
a GEMM the format leaves out of its ``quantized_gemms``, ``int8-rowwise``'s wgrad,
runs in the gradient's 16-bit dtype on the input as it came), per expert: each
expert's slice of ``x``, ``W`` and the gradient is cast on its own (per-tensor
formats: one scale per slice, or the projection's delayed scale; row and
block formats: the rows and blocks of that expert only), with fp32 accumulation. An
expert with no token costs nothing and gets a zero weight gradient.

Routes (``route=``):

- ``loop``: one quantized GEMM per expert on the format's own route: the exact
  reference, bit for bit what a ``Float8Linear`` holding ``W[e]`` computes on its rows
  (NVFP4's stochastic rounding aside: one generator serves every expert's casts);
- ``grouped``: on a CPU the casts dequantized to fp32 and multiplied by
  ``torch._grouped_mm`` (a CPU kernel since torch 2.9): the same products, one fp32
  rounding per element where the scale is not a power of two; it needs K and N
  multiples of 4 (16-byte strides) and falls back to ``loop`` per call where they are
  not (``int8-rowwise``'s 16-bit wgrad: the same kernel on the 16-bit operands). For
  every format it reads nothing on the host there (``mixprec.experts.segments``,
  ``segments_rowwise``: per-expert scales by segment reductions; ``segments_blocks``,
  ``segments_nvfp4``: wgrad's tiles aligned to each expert's first token in a
  fixed-size buffer; ``segments_int8``: every int8 cast whole; bit for bit the
  per-expert casts), so ``torch.compile`` traces it without a graph break; it does not
  check the offsets.
  On a GPU, whose grouped kernel takes bf16 only, the per-tensor and rowwise formats
  pass their codes widened to bf16 and apply the scales after the GEMM
  (``mixprec.experts.codes_grouped``: the ``dequant`` route's rounding; K and N
  multiples of 8), casts and GEMMs on the device without a host read, in the layouts
  torch's CUDA kernel takes for any routing; the block formats, NVFP4 and int8 take
  ``loop`` there (said once where asked for);
- ``scaled_grouped``: the forward on ``torch._scaled_grouped_mm`` (CUDA compute
  capability 9.x and 10.x, e4m3 codes with per-tensor or rowwise scales, bf16
  output), the backward on ``grouped``;
- ``auto``: ``scaled_grouped`` where it applies, else ``grouped`` on a GPU (``loop``
  for the block formats), ``loop`` on
  a CPU (where the casts dominate and ``grouped``'s extra dequantize pass measured
  slower: ``benchmarks/grouped_gemm.py``); under ``torch.compile``, ``grouped`` for the
  formats above on a CPU too (the loop reads the counts on the host).

An explicit route that cannot apply (``scaled_grouped`` off sm90/sm100 or on a block
format, ``grouped`` with K or N off 16-byte strides) warns once, saying why, and takes
the route ``auto`` would. The ``loop`` route (and ``grouped`` on a CPU for a weight
FSDP2 gathered as its casts) reads the token counts to the host once per call (as
transformers' own fallback reads them): each expert's casts are sized by them, and
``torch.compile`` breaks the graph there. NVFP4's
stochastic rounding draws each gradient element's number by its place in one counter
stream per backward on the ``grouped`` route, eager and compiled, with or without the
host read (``segments_nvfp4.stream_keys``); the ``loop`` draws as a Linear does. A
dispatch that reaches no expert (no token, or every token past the last expert) gives
zero rows and zero weight gradients on every route.
"""

from __future__ import annotations

import warnings

import torch

from mixprec.experts import adapter
from mixprec.experts.codes_grouped import bf16_only, codes_apply, codes_grouped_mm
from mixprec.experts.format import ExpertsFormat
from mixprec.experts.gather_casts import ExpertsCasts
from mixprec.experts.scaled_grouped import scaled_grouped_refusal
from mixprec.experts.segments import segmented_mm, wgrad_product
from mixprec.experts.segments_blocks import blocks_apply, segmented_blocks_mm
from mixprec.experts.segments_int8 import int8_applies, segmented_int8_mm
from mixprec.experts.segments_nvfp4 import nvfp4_applies, segmented_nvfp4_mm, stream_keys
from mixprec.experts.segments_rowwise import rowwise_applies, segmented_rowwise_mm

__all__ = ["grouped_mm", "ROUTES", "group_bounds"]

ROUTES = ("auto", "loop", "grouped", "scaled_grouped")


def group_bounds(offsets: torch.Tensor | list[int], rows: int) -> list[tuple[int, int]]:
    """(start, end) of each expert's rows from cumulative ``offsets`` (one host read)."""
    ends = offsets.tolist() if isinstance(offsets, torch.Tensor) else list(offsets)
    out, start = [], 0
    for end in ends:
        end = int(end)
        if end < start or end > rows:
            raise ValueError(f"offsets must be non-decreasing and at most the {rows} rows "
                             f"of the input, got {ends}; pass cumulative token counts "
                             "(torch.cumsum of the per-expert counts)")
        out.append((start, end))
        start = end
    return out


def _route(route: str, fmt: ExpertsFormat, device: torch.device, k: int, n: int,
           compiling: bool = False) -> str:
    """The route a call takes (see the module doc); ``compiling``: under
    ``torch.compile``, where ``auto`` prefers a route without a host read. An explicit
    route that cannot apply warns once (per format, device kind and cause) and takes
    the route ``auto`` would."""
    if route not in ROUTES:
        raise ValueError(f"route={route!r}; valid: {', '.join(ROUTES)}")
    device = torch.device(device)
    if route == "loop":
        return "loop"
    why = scaled_grouped_refusal(fmt, device, k, n)
    if why is None and route in ("auto", "scaled_grouped"):
        return "scaled_grouped"
    asked, route = route, "auto" if route == "scaled_grouped" else route
    stride = 8 if bf16_only(device) else 4  # 16-byte strides: bf16 or fp32 operands
    if not hasattr(torch, "_grouped_mm"):
        why_grouped = f"torch {torch.__version__} has no torch._grouped_mm"
    elif k % stride or n % stride:
        why_grouped = (f"K={k} and N={n} must be multiples of {stride} (16-byte strides "
                       f"of the {'bf16' if stride == 8 else 'fp32'} operands)")
    elif bf16_only(device) and not codes_apply(fmt):
        why_grouped = ("torch's grouped GEMM there takes bf16 operands only, and only "
                       "the per-tensor and rowwise fp8 formats pass it theirs (fp8 codes "
                       "widened to bf16, the scales applied after)")
    else:
        why_grouped = None
    if why_grouped is not None or (route == "auto" and device.type == "meta"):
        chosen = "loop"
    elif route == "grouped":
        chosen = "grouped"
    else:
        # auto on a CPU: the per-expert casts dominate, and the grouped route's extra
        # dequantize-and-stack pass made it slower than the loop on every format
        # measured (benchmarks/grouped_gemm.py); on a GPU one launch replaces one per
        # expert, and reads nothing on the host
        sync_free = compiling and (fmt.quantizer.per_tensor or rowwise_applies(fmt)
                                   or blocks_apply(fmt) or int8_applies(fmt)
                                   or nvfp4_applies(fmt))
        chosen = "grouped" if bf16_only(device) or sync_free else "loop"
    if asked == "scaled_grouped":
        _say_once(fmt, device, asked, why, chosen)
    elif asked == "grouped" and chosen != "grouped":
        _say_once(fmt, device, asked, why_grouped, chosen)
    return chosen


_SAID: set[tuple[str, str, str, str]] = set()


def _say_once(fmt, device, asked: str, why: str, chosen: str) -> None:
    key = (fmt.format_name, torch.device(device).type, asked, why)
    if key not in _SAID:
        _SAID.add(key)
        warnings.warn(f"route={asked!r} with {fmt.format_name} on {key[1]} cannot apply: "
                      f"{why}; the {chosen} route runs instead (route={chosen!r} "
                      "chooses it without this warning)", stacklevel=4)


def _dequant_rows(casts, cols: int, device, least: int = 0
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp32 values of per-expert row casts (None: no rows) stacked into one
    (rows, cols) tensor, and the cumulative row counts. A cast may hold more rows than
    its expert's tokens (NVFP4's Hadamard transform pads the tokens to whole 16-blocks);
    the rows are rounded up to a multiple of 4 for 16-byte strides, and to at least
    ``least`` (the input's rows, those past the last expert's included)."""
    vals = [c.dequant() if c is not None else None for c in casts]
    counts = [v.shape[0] if v is not None else 0 for v in vals]
    rows = sum(counts)
    out = torch.zeros(max(rows + (-rows) % 4, least), cols, device=device)
    start = 0
    for v, c in zip(vals, counts):
        if v is not None:
            out[start:start + c] = v
        start += c
    offs = torch.tensor(counts, device=device).cumsum(0).to(torch.int32)
    return out, offs


def _stack(casts, shape, transpose: bool, device) -> torch.Tensor:
    """Per-expert weight casts dequantized into one (E, *shape) fp32 tensor."""
    out = torch.zeros(len(casts), *shape, device=device)
    for e, c in enumerate(casts):
        if c is not None:
            out[e] = c.dequant().t() if transpose else c.dequant()
    return out


class _GroupedQuantizedMM(torch.autograd.Function):
    """The grouped GEMM and its two backward GEMMs on ``fmt``'s casts, per expert (the
    ``loop`` route; ``grouped`` on a CPU for a weight gathered as its casts)."""

    @staticmethod
    def forward(ctx, x, w, offsets, fmt, out_dtype, record, route):
        t, n = x.shape[0], w.shape[1]
        bounds = group_bounds(offsets, t)
        need_dx, need_dw = ctx.needs_input_grad[:2]
        hp_wgrad = "wgrad" not in fmt.quantizer.quantized_gemms  # wgrad on x as it came
        xq, wq, xw, wd = [], [], [], []
        with adapter.no_autocast(x), fmt.quantizer.gemm_context():
            for e, (s, end) in enumerate(bounds):
                if s == end:
                    xq.append(None), wq.append(None), xw.append(None), wd.append(None)
                    continue
                a = adapter.cast(fmt, x[s:end], "input", 1, record)
                b = adapter.cast(fmt, w[e], "weight", 1, record)
                xq.append(a), wq.append(b)
                wd.append(None if not need_dx else b if adapter.reuses(fmt, "weight")
                          else adapter.cast(fmt, w[e], "weight", 0))
                xw.append(None if not need_dw or hp_wgrad else a
                          if adapter.reuses(fmt, "input")
                          else adapter.cast(fmt, x[s:end], "input", 0))
            y = _forward(route, fmt, xq, wq, bounds, x, n, out_dtype)
        tensors, ctx.casts = adapter.pack(xw + wd)
        # wgrad's operand in the output's dtype (bf16 under autocast), as a Linear saves it
        ctx.save_for_backward(*tensors, x.to(out_dtype) if need_dw and hp_wgrad else None,
                              offsets.to(torch.int32))
        ctx.fmt, ctx.bounds, ctx.route = fmt, bounds, route
        ctx.x_dtype, ctx.w_dtype, ctx.shape = x.dtype, w.dtype, (t, n, x.shape[1])
        return y

    @staticmethod
    def backward(ctx, gy):
        *saved, x_hp, offs = ctx.saved_tensors
        casts = adapter.unpack(saved, ctx.casts)
        fmt, bounds = ctx.fmt, ctx.bounds
        xw, wd = casts[:len(bounds)], casts[len(bounds):]
        t, n, k = ctx.shape
        grouped = ctx.route != "loop"
        # the loop draws as Linears do (eager: a generator, each cast in turn); the
        # grouped route by place in the counter stream, as its sync-free form does
        gen = (fmt._sr_generator if ctx.route == "loop" else fmt._sr_key)(gy.device)
        keys, wkeys = stream_keys(gen, bounds, t, n)
        dx = dw = None
        with adapter.no_autocast(gy), fmt.quantizer.gemm_context():
            g1 = [None] * len(bounds)
            if ctx.needs_input_grad[0]:
                dx_dtype = ctx.x_dtype if ctx.x_dtype == torch.bfloat16 else torch.float32
                g1 = [None if s == e else adapter.cast(fmt, gy[s:e], "grad_output", 1,
                                                       True, key)
                      for key, (s, e) in zip(keys, bounds)]
                if grouped:
                    a, offs_c = _dequant_rows(g1, n, gy.device, t)
                    dx = torch._grouped_mm(a, _stack(wd, (n, k), False, gy.device),
                                           offs=offs_c)[:t]
                else:
                    dx = gy.new_zeros(t, k, dtype=dx_dtype)
                    for c, w_e, (s, e) in zip(g1, wd, bounds):
                        if c is not None:
                            dx[s:e] = adapter.mm(fmt, c, w_e, dx_dtype)
                dx = _zero_tail(dx, bounds).to(ctx.x_dtype)
            if ctx.needs_input_grad[1] and x_hp is not None and grouped:  # gy's 16 bits
                dw = wgrad_product(gy, x_hp.to(gy.dtype), offs, ctx.w_dtype)
            elif ctx.needs_input_grad[1] and x_hp is not None:
                dw = gy.new_zeros(len(bounds), n, k, dtype=ctx.w_dtype)
                for e, (s, end) in enumerate(bounds):
                    if s != end:
                        dw[e] = torch.mm(gy[s:end].t(), x_hp[s:end].to(gy.dtype))
            elif ctx.needs_input_grad[1]:
                reuse = adapter.reuses(fmt, "grad_output")
                g0 = [None if s == e else c if c is not None and reuse
                      else adapter.cast(fmt, gy[s:e], "grad_output", 0, c is None, key)
                      for c, key, (s, e) in zip(g1, wkeys, bounds)]
                if grouped:
                    a, offs_c = _dequant_rows(g0, n, gy.device)
                    b, _ = _dequant_rows(xw, k, gy.device)
                    dw = torch._grouped_mm(a.t().contiguous(), b, offs=offs_c)
                    dw = _zero_empty(dw, bounds)
                else:
                    dw = gy.new_zeros(len(bounds), n, k, dtype=torch.float32)
                    for e, (c, x_e) in enumerate(zip(g0, xw)):
                        if c is not None:
                            dw[e] = adapter.mm(fmt, c.t(), x_e, torch.float32)
                dw = dw.to(ctx.w_dtype)
        return dx, dw, None, None, None, None, None


def _forward(route, fmt, xq, wq, bounds, x, n, out_dtype) -> torch.Tensor:
    t, k = x.shape
    if route == "grouped":
        a, offs = _dequant_rows(xq, k, x.device, t)
        y = torch._grouped_mm(a, _stack(wq, (k, n), True, x.device), offs=offs)[:t]
        return _zero_tail(y, bounds).to(out_dtype)
    y = x.new_zeros(t, n, dtype=out_dtype)
    for a, b, (s, e) in zip(xq, wq, bounds):
        if a is not None:
            y[s:e] = adapter.mm(fmt, a, b.t(), out_dtype)
    return y


def _zero_tail(y: torch.Tensor, bounds) -> torch.Tensor:
    """Rows past the last expert's (the kernels leave them unwritten) set to zero."""
    end = bounds[-1][1] if bounds else 0
    if end < y.shape[0]:
        y[end:] = 0
    return y


def _zero_empty(dw: torch.Tensor, bounds) -> torch.Tensor:
    """An expert with no token has a zero weight gradient (the kernel may not write it)."""
    for e, (s, end) in enumerate(bounds):
        if s == end:
            dw[e] = 0
    return dw


def grouped_mm(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor,
               fmt: ExpertsFormat, *, route: str = "auto",
               out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x`` (T × K, tokens sorted by expert) times each expert's ``weight[e]ᵀ``
    (``weight``: E × N × K, out × in; pass ``w.transpose(1, 2)`` for an in × out
    layout) over the rows ``offsets`` (E,), the cumulative token counts, delimit; T × N
    in ``out_dtype`` (default: the autocast dtype, else ``x``'s). Differentiable in
    ``x`` and ``weight``; ``fmt``'s delayed scaling records its amaxes when grad is on.

    >>> import torch
    >>> from mixprec.experts import ExpertsFormat, grouped_mm
    >>> x, w = torch.randn(6, 32), torch.randn(3, 16, 32)
    >>> y = grouped_mm(x, w, torch.tensor([2, 2, 6]), ExpertsFormat("fp8-current"))
    >>> y.shape, bool(y[2:].abs().sum() > 0)
    (torch.Size([6, 16]), True)
    """
    if x.dim() != 2 or weight.dim() != 3 or x.shape[1] != weight.shape[2]:
        raise ValueError(f"grouped_mm takes x (T, K) and weight (E, N, K), got x "
                         f"{tuple(x.shape)} and weight {tuple(weight.shape)}; transpose "
                         "an (E, K, N) weight with weight.transpose(1, 2)")
    if offsets.numel() != weight.shape[0]:
        raise ValueError(f"offsets has {offsets.numel()} entries for {weight.shape[0]} "
                         "experts; give one cumulative count per expert")
    dev = x.device.type
    if out_dtype is None:
        out_dtype = (torch.get_autocast_dtype(dev) if dev != "meta"
                     and torch.is_autocast_enabled(dev) else x.dtype)
    route = _route(route, fmt, x.device, x.shape[1], weight.shape[1],
                   torch.compiler.is_compiling())
    record = torch.is_grad_enabled()
    if route == "scaled_grouped" or route == "grouped" and bf16_only(x.device):
        return codes_grouped_mm(x, weight, offsets.to(x.device), fmt, out_dtype, record,
                                route == "scaled_grouped")
    if route == "grouped" and not isinstance(weight, ExpertsCasts):
        if fmt.quantizer.per_tensor:
            return segmented_mm(x, weight, offsets, fmt, out_dtype, torch.is_grad_enabled())
        if rowwise_applies(fmt):
            return segmented_rowwise_mm(x, weight, offsets, fmt, out_dtype)
        if blocks_apply(fmt):
            return segmented_blocks_mm(x, weight, offsets, fmt, out_dtype)
        if int8_applies(fmt):
            return segmented_int8_mm(x, weight, offsets, fmt, out_dtype)
        if nvfp4_applies(fmt):
            return segmented_nvfp4_mm(x, weight, offsets, fmt, out_dtype)
    return _GroupedQuantizedMM.apply(x, weight, offsets, fmt, out_dtype,
                                     torch.is_grad_enabled(), route)
