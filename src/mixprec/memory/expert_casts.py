"""What the experts' quantized grouped GEMM (``mixprec.experts.grouped``) keeps for its
backward and holds while the backward runs, per route.

A cast of a (rows, cols) operand costs what its format says it holds (the format's
``cast_bytes``: its codes and scales; ``code_bytes``: one code's carrier). On the
``loop`` route (a CPU's eager choice) each expert's slice is cast on its own. On the
sync-free ``grouped`` route (a CPU's choice under ``torch.compile``; ``sync_free_route``
names it) each operand is cast whole
(``mixprec.experts.segments``, the format's ``segment_cast``): per tensor, rowwise
and INT8 rowwise keep the token-dim cast of all ``R`` rows (INT8's wgrad runs in 16
bits on the rows' 16-bit copy), the tile formats (``fp8-block``, MX fp8, NVFP4) one
cast of a buffer of ``padded_rows`` rows where every expert starts on a whole tile;
every route keeps each row's int64 expert id (and the tile routes its place in the
buffer).

Its backward (``sync_free_backward``), per projection of ``I`` inputs and ``O`` outputs
over ``R`` rows, holds beyond the arriving gradient, the input gradient ``dx`` and the
fp32 weight gradient ``dw`` the largest of its stages' live tensors, read off the
layouts of ``mixprec.formats.mm.QuantizedGemm``: the gradient's dgrad cast (``9·R·O``: its
fp32 copy and scaled values, then its codes, their fp32 copy and the dequantized
values), the dgrad GEMM (the dequantized gradient ``4·R·O`` beside its codes (per
tensor, rowwise), its fp32 product and the rows past the last expert zeroed, ``8·R·I``,
and the route's fp32 weights), and wgrad's operands and product (per tensor: dgrad's
cast, its values and their transposed copy, the input's codes upcast and dequantized;
rowwise: the gradient's per-(expert, column) cast with its magnitudes, gathered scales,
fp32 copy and scaled values beside dgrad's codes, ``17·R·O``; INT8: the 16-bit
product; NVFP4: the buffer's Hadamard transform and its cast's fp32 and int64
stochastic-rounding passes, ``57`` bytes per element of the 16-row aligned buffer; the
block formats: ``blocks_backward``).
"""

from __future__ import annotations

from typing import Any

__all__ = ["ROUTES", "cast_bytes", "saved_cast", "token_casts", "sync_free_route", "padded_rows",
           "sync_free_forward", "blocks_backward", "sync_free_backward"]


#: the sync-free routes, by what their casts hold (a format's ``segment_kind``)
TENSOR, ROWS, TILES, INT8, FP4 = "tensor", "rows", "tiles", "int8-rows", "fp4"
ROUTES = (TENSOR, ROWS, TILES, INT8, FP4)


def cast_bytes(q: Any, rows: int, cols: int, role: str, dim: int) -> float:
    """Bytes of one cast of a (rows, cols) tensor by quantizer ``q`` along ``dim``, as
    its format answers them (``LinearFormat.cast_bytes``)."""
    return q.cast_bytes(rows, cols, role, dim)


def saved_cast(q: Any, rows: int, cols: int, role: str) -> float:
    """What a GEMM keeps of its operand for the backward: the forward cast where the
    backward reuses it, else a cast along the other dim (``mixprec.experts.grouped``);
    nothing of the input where wgrad is not quantized (``token_casts`` counts its
    16-bit copy)."""
    if role == "input" and "wgrad" not in q.quantized_gemms:
        return 0.0
    return cast_bytes(q, rows, cols, role, 1 if q.reuses(role) else 0)


def sync_free_route(q: Any, experts_route: str, device: str) -> str | None:
    """The sync-free route experts in quantizer ``q``'s format run on (its
    ``segment_kind``: ``tensor``, ``rows``, ``tiles``, ``int8``, ``fp4``), as
    ``grouped_mm`` picks it on a CPU's ``grouped`` route (the format's grain and
    elements name it); None on the ``loop`` route,
    off a CPU, or for a format that takes the host-read path there (rowwise or tile
    fp8 with wgrad in 16 bits: ``segments_apply``)."""
    if experts_route != "grouped" or device != "cpu" or not q.segments_apply():
        return None
    return q.segment_kind


def padded_rows(q: Any, rows: int, experts: int) -> int:
    """The rows of a tile route's wgrad buffer: every expert (and the rows past the
    last one) starts on a whole tile, ``T + (E + 1)·(tile − 1)``."""
    return rows + (experts + 1) * (q.scales.tile - 1)


def token_casts(q: Any, counts: list[float], cols: int, act_bytes: float,
                route: str | None = None) -> float:
    """What the experts' GEMM keeps of its token operand (``cols`` wide) for wgrad,
    ``counts`` the rows of each expert: on the loop route each expert's cast of its
    rows; on sync-free ``route`` the whole operand's cast (the tile routes': of the
    ``padded_rows`` buffer along the tokens, with each row's place in it) and each
    row's int64 expert id; where wgrad is not quantized, the rows' 16-bit copy."""
    rows = sum(counts)
    hp = 0.0 if "wgrad" in q.quantized_gemms else act_bytes * rows * cols
    if route is None:
        return hp + sum(saved_cast(q, n, cols, "input") for n in counts)
    if route in (TILES, FP4):
        p = padded_rows(q, int(rows), len(counts))
        return cast_bytes(q, p, cols, "input", 0) + 16 * rows
    if route == ROWS:  # one scale per (expert, column), the rows past included
        return q.code_bytes("input") * rows * cols + 4 * (len(counts) + 1) * cols + 8 * rows
    if route == TENSOR:  # each row's inverse scale
        return q.code_bytes("input") * rows * cols + 12 * rows
    return hp + 8 * rows


def sync_free_forward(route: str, q: Any, r: int, e: int, k: int, n: int, b: float
                      ) -> float:
    """Sync-free ``route``'s forward working set for one projection (``K`` inputs,
    ``N`` outputs, ``R`` rows of fp32 tokens, ``E`` experts) beyond its output and what
    it saves (``b``: the saved 16-bit copy's bytes), the larger of its stages: the
    tokens' dequantized cast (``4·R·K``; NVFP4's cast itself holds ``20·R·K``) beside
    the experts' fp32 weights (``4·E·N·K``, INT8's transposed copy too) and the grouped
    kernel's fp32 product with the rows past the last expert zeroed (``8·R·N``; per
    tensor and rowwise, the tokens' codes too); then wgrad's cast along the tokens
    (rowwise: the magnitudes, gathered scales, scaled values and codes, ``13·R·K``; the
    tile routes: the forward's token cast, the ``padded_rows`` buffer and its cast's
    fp32 passes, ``12·P·K``, NVFP4's
    Hadamard transform and rounding passes over the 16-row aligned buffer ``28·P·K``),
    each route's int64 row ids held throughout."""
    rk, w = r * k, e * n * k
    ids = 16 * r if route in (TILES, FP4) else 8 * r
    wq = 0 if route == INT8 else saved_cast(q, n, k, "weight")  # the forward's codes
    stages = [4 * rk + wq + (8 if route == INT8 else 4) * w + 8 * r * n]
    if route in (TENSOR, ROWS):  # the forward's token codes held beside the product
        stages = [rk + s for s in stages]
    if route == ROWS:  # dgrad's weight cast
        stages += [14 * rk + wq + saved_cast(q, n, k, "weight")]
    elif route in (TILES, FP4):
        p = padded_rows(q, r, e)
        if route == FP4:
            p += (-p) % q.scales.token_multiple
        # the forward's token cast, still held: its codes and tile scales
        codes = q.code_bytes("input") * rk + 4 * rk / q.scales.tile
        stages += [codes + wq + (28 if route == FP4 else 12) * p * k]
        stages += [20 * rk] if route == FP4 else []
    saved = token_casts(q, [r / e] * e, k, b, route) + e * saved_cast(q, n, k, "weight")
    return ids + max(stages) - saved


def blocks_backward(q: Any, r: int, e: int, i: int, o: int, b: float) -> float:
    """The sync-free block route's backward scratch for one projection beyond the
    arriving gradient, ``dx`` and ``dw``: the largest of the padded gradient's cast
    along the tokens beside dgrad's tile cast of the gradient, freed once it is made
    (its codes and tile scales, ``(1 + 4/tile)·R·O``; the buffer at ``b`` bytes, the
    cast's fp32 copy of a 16-bit one and its tile scales and scaled values,
    ``(b + 12)·P·O`` over ``P = padded_rows``, ``12·P·O`` in fp32), that cast's
    dequantization (its codes, their fp32 copy, tile scales and values, ``13·P·O``: the
    peak where the gradient is fp32, as on a CPU without bf16 units), the saved input's
    (the gradient's codes and gathered fp32 rows beside the input's ``12·P·I``) and the
    wgrad product (both padded operands' codes and fp32 values, their gathered rows and
    the transposed gradient)."""
    p = padded_rows(q, r, e)
    cast = b + 8 + (4 if b < 4 else 0)
    dgrad_cast = (q.code_bytes("grad_output") + 4 / q.scales.tile) * r * o
    return max(dgrad_cast + cast * p * o, 13 * p * o, p * o + 4 * r * o + 12 * p * i,
               5 * p * o + 8 * r * o + 4 * p * i + 4 * r * i)


def sync_free_backward(route: str, q: Any, r: int, e: int, i: int, o: int, b: float,
                       dx_bytes: float) -> float:
    """Sync-free ``route``'s backward scratch for one projection (``I`` inputs, ``O``
    outputs, ``R`` rows, ``E`` experts; ``b``: the gradient's bytes, ``dx_bytes``: the
    input gradient's) beyond the arriving gradient, ``dx`` and ``dw`` (module doc)."""
    if route == TILES:
        return blocks_backward(q, r, e, i, o, b)
    ro, ri, w, dx = r * o, r * i, e * o * i, dx_bytes * r * i
    # the dgrad GEMM: the gradient's codes and fp32 values, the route's fp32 weights
    # (INT8: two), the fp32 product and its zeroed rows (and dx's own copy below fp32)
    held_w = 8 * w if route == INT8 else 4 * w
    lean = route in (TENSOR, ROWS)  # the gradient's codes held, not its values
    stages = [9 * ro, (5 if lean else 4) * ro + 8 * ri + held_w
              + (dx if dx_bytes < 4 else 0)]
    if route == TENSOR:  # wgrad on dgrad's cast: its values, the input's, the product
        stages += [5 * ro + 8 * ri + dx, 9 * ro + 4 * ri + 4 * w + dx]
    elif route == ROWS:  # wgrad's per-(expert, column) casts beside dgrad's codes
        stages += [17 * ro + dx, 5 * ro + 12 * ri + dx, 9 * ro + 4 * ri + 4 * w + dx]
    elif route == INT8:  # wgrad on the 16-bit gradient and input copy
        stages += [4 * ro + dx + max(b * ro + b * w, 6 * w)]
    elif route == FP4:
        p = padded_rows(q, r, e)
        p += (-p) % q.scales.token_multiple  # the Hadamard transform's 16-row blocks
        cast = 25 + (32 if getattr(q, "stochastic_grads", False) else 0)
        stages += [4 * ro + dx + cast * p * o, 4 * ro + dx + 9 * p * o + 4 * p * i + 4 * w]
        if not q.nvfp4_rht:  # the rows gathered back in place
            stages[-1] += 8 * ro + 4 * ri
    else:
        raise ValueError(f"route={route!r}; valid: " + ", ".join(ROUTES))
    rows = 4 * r if lean else 0  # the gradient's inverse scale per row
    return max(stages) + rows - dx - 4 * w
