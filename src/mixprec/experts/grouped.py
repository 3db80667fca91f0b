"""The quantized grouped GEMM: ``y[rows of e] = x[rows of e] @ W[e]ᵀ`` for every expert e.

``x`` (T × K) holds the tokens sorted by expert, ``W`` (E × N × K) the experts' weights
(out × in), ``offsets`` (E,) the cumulative token counts (``torch._grouped_mm``'s
``offs``); rows past ``offsets[-1]`` (tokens routed elsewhere, as expert parallelism
leaves them) get zeros. Forward, dgrad and wgrad run in any linear format of the
quantizer registry, exactly as a converted Linear runs them (``mixprec.modules.linear``;
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
  every format it reads nothing on the host there (``mixprec.experts.segments``: each
  operand cast whole by the format's ``segment_cast``, per-expert scales by segment
  reductions, wgrad's tiles aligned to each expert's first token in a fixed-size
  buffer; bit for bit the per-expert casts), so ``torch.compile`` traces it without a
  graph break; it does not check the offsets.
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
host read (``stream_keys``); the ``loop`` draws as a Linear does. A
dispatch that reaches no expert (no token, or every token past the last expert) gives
zero rows and zero weight gradients on every route.
"""

from __future__ import annotations

import warnings

import torch

from mixprec.experts import adapter
from mixprec.experts.codes_grouped import Codes, bf16_only, codes_apply
from mixprec.experts.format import ExpertsFormat
from mixprec.experts.gather_casts import ExpertsCasts
from mixprec.experts.scaled_grouped import scaled_grouped_refusal
from mixprec.experts.segments import Segmented, wgrad_product
from mixprec.formats.fp4 import NVFP4_BLOCK, counter_key
from mixprec.formats.mm import GemmLayout, QuantizedGemm

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
        sync_free = compiling and fmt.quantizer.segments_apply()
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


def stream_keys(key: torch.Tensor | torch.Generator | None, bounds: list[tuple[int, int]],
                t: int, n: int) -> tuple[list, list]:
    """Each expert's keys (dgrad's cast, wgrad's) in the counter stream of ``key`` for
    a (``t`` × ``n``) gradient: dgrad's from its first row, wgrad's from ``t`` rows on
    plus its first row in the 16-aligned layout (as NVFP4's whole-operand casts draw
    them). A generator (drawn from in turn) or None (no stochastic rounding) serves
    every cast as it is."""
    if not isinstance(key, torch.Tensor):
        return [key] * len(bounds), [key] * len(bounds)
    dgrad, wgrad, start = [], [], 0
    for s, end in bounds:
        dgrad.append(counter_key(key, s * n))
        wgrad.append(counter_key(key, (t + start) * n))
        start += -(-(end - s) // NVFP4_BLOCK) * NVFP4_BLOCK
    return dgrad, wgrad


class PerExpert(GemmLayout):
    """The experts' GEMMs on each expert's own casts (lists, None for an expert
    without tokens): one GEMM per expert on the format's route (``loop``), or the
    casts dequantized and multiplied by ``torch._grouped_mm`` (``grouped`` on a CPU
    for a weight gathered as its casts). ``site``: the ``ExpertsFormat``."""

    def __init__(self, site, route: str, bounds: list | None = None,
                 shape: tuple = (), offs: torch.Tensor | None = None, device=None) -> None:
        super().__init__(site)
        self.route, self.bounds, self.shape = route, bounds, shape
        self.offs, self.device = offs, device

    def bind(self, x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> PerExpert:
        """Each expert's rows (one host read) and the GEMM's sizes."""
        return PerExpert(self.site, self.route, group_bounds(offsets, x.shape[0]),
                         (x.shape[0], w.shape[1], x.shape[1]), offsets.to(torch.int32),
                         x.device)

    def saved(self) -> tuple[object, list[torch.Tensor]]:
        """The offsets (the 16-bit wgrad's grouped kernel takes them)."""
        return None, [self.offs]

    def restore(self, meta: object, tensors: list[torch.Tensor]) -> PerExpert:
        """The offsets back."""
        return PerExpert(self.site, self.route, self.bounds, self.shape, tensors[0],
                         self.device)

    def grad_keys(self, gy: torch.Tensor) -> tuple[object, object]:
        """The loop draws as Linears do (eager: a generator, each cast in turn); the
        grouped route by place in the counter stream, as its sync-free form does."""
        gen = (self.site._sr_generator if self.route == "loop"
               else self.site._sr_key)(gy.device)
        t, n, _ = self.shape
        return stream_keys(gen, self.bounds, t, n)

    def cast_x(self, t, role, dim, record=False, key=None):
        """Each expert's rows cast on their own (``key``: one per expert)."""
        keys = key if isinstance(key, list) else [key] * len(self.bounds)
        return [None if s == e else adapter.cast(self.site, t[s:e], role, dim, record, k)
                for k, (s, e) in zip(keys, self.bounds)]

    def cast_w(self, w, dim, record=False):
        """Each expert's weight with tokens cast on its own."""
        return [None if s == end else adapter.cast(self.site, w[e], "weight", dim, record)
                for e, (s, end) in enumerate(self.bounds)]

    def forward_mm(self, xq, wq, out_dtype):
        """Each expert's rows times its weight's transpose."""
        return _forward(self.route, self.site, xq, wq, self.bounds, self.shape, out_dtype,
                        self.device)

    def dgrad_mm(self, g1, wd, x_dtype):
        """Each expert's gradient rows times its weight."""
        (t, n, k), dev = self.shape, self.device
        if self.route != "loop":
            a, offs_c = _dequant_rows(g1, n, dev, t)
            dx = torch._grouped_mm(a, _stack(wd, (n, k), False, dev), offs=offs_c)[:t]
        else:
            dx_dtype = x_dtype if x_dtype == torch.bfloat16 else torch.float32
            dx = torch.zeros(t, k, dtype=dx_dtype, device=dev)
            for c, w_e, (s, e) in zip(g1, wd, self.bounds):
                if c is not None:
                    dx[s:e] = adapter.mm(self.site, c, w_e, dx_dtype)
        return _zero_tail(dx, self.bounds).to(x_dtype)

    def wgrad_mm(self, g0, xw, w_dtype):
        """Each expert's gradient rows, transposed, times its input rows."""
        (_, n, k), dev = self.shape, self.device
        if self.route != "loop":
            a, offs_c = _dequant_rows(g0, n, dev)
            b, _ = _dequant_rows(xw, k, dev)
            dw = _zero_empty(torch._grouped_mm(a.t().contiguous(), b, offs=offs_c),
                             self.bounds)
        else:
            dw = torch.zeros(len(self.bounds), n, k, device=dev)
            for e, (c, x_e) in enumerate(zip(g0, xw)):
                if c is not None:
                    dw[e] = adapter.mm(self.site, c.t(), x_e, torch.float32)
        return dw.to(w_dtype)

    def hp_wgrad(self, gy, x_hp, w_dtype):
        """wgrad in the gradient's 16 bits on the input as it came."""
        if self.route != "loop":
            return wgrad_product(gy, x_hp.to(gy.dtype), self.offs, w_dtype)
        t, n, k = self.shape
        dw = gy.new_zeros(len(self.bounds), n, k, dtype=w_dtype)
        for e, (s, end) in enumerate(self.bounds):
            if s != end:
                dw[e] = torch.mm(gy[s:end].t(), x_hp[s:end].to(gy.dtype))
        return dw


def _forward(route, site, xq, wq, bounds, shape, out_dtype, dev) -> torch.Tensor:
    t, n, k = shape
    if route != "loop":
        a, offs = _dequant_rows(xq, k, dev, t)
        y = torch._grouped_mm(a, _stack(wq, (k, n), True, dev), offs=offs)[:t]
        return _zero_tail(y, bounds).to(out_dtype)
    y = torch.zeros(t, n, dtype=out_dtype, device=dev)
    for a, b, (s, e) in zip(xq, wq, bounds):
        if a is not None:
            y[s:e] = adapter.mm(site, a, b.t(), out_dtype)
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
    if route == "scaled_grouped" or route == "grouped" and bf16_only(x.device):
        layout, offsets = Codes(fmt, route == "scaled_grouped"), offsets.to(x.device)
    elif (route == "grouped" and not isinstance(weight, ExpertsCasts)
          and fmt.quantizer.segments_apply()):
        layout = Segmented(fmt)
    else:
        layout = PerExpert(fmt, route)
    return QuantizedGemm.apply(x, weight, fmt, out_dtype, torch.is_grad_enabled(), None,
                               offsets, layout)
