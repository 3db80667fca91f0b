"""The update of one tensor in pieces of rows, so a step's scratch is bounded.

Each piece: the gradient (divided by ``grad_scale`` if given) and the stored states are
decoded to fp32, the subclass's ``_math`` runs on them (torch's single-tensor update, op
for op), and the results are encoded back; the weight is read and written by the write
rule (``mixprec.optim.writes``). A piece holds at most ``CHUNK`` elements (``chunk_rows``
rows), so the decoded states, fp32 weights and gradients and the random bits take a few
MiB, not a copy of the tensor.

Every op is elementwise or per row (blocks lie along rows, the random bits are keyed by
the element's index in the whole tensor), so the result equals the whole tensor's
update bit for bit. The step that creates the states runs in pieces too: each piece
sees none (the first update's rule) and its new states fill their rows of whole-size
ones.

Under a device skip flag (``skip``, from ``found_inf``) every write is
``torch.where(skip, old, new)``: a skipped step leaves every state, the weight and the
step count bit-identical, with no host sync.
"""

from __future__ import annotations

import math

import torch

__all__ = ["PieceLoop", "CHUNK", "chunk_rows", "commit"]

#: elements of a tensor one piece of the step decodes and updates at a time: its
#: scratch (a few fp32 and int64 temporaries per element) stays near 8 MiB
CHUNK = 1 << 17


def chunk_rows(shape: tuple[int, ...]) -> int:
    """Rows of a tensor of ``shape`` per piece of the step: at most ``CHUNK``
    elements, or one row where a row is wider."""
    rows = shape[0] if shape else 1
    cols = math.prod(shape[1:]) if shape else 1
    if cols == 0 or rows == 0:
        return max(rows, 1)
    return max(1, CHUNK // cols)


def commit(dst: torch.Tensor, new: torch.Tensor, skip: torch.Tensor | None) -> None:
    """``dst <- new``, or under a device skip flag, ``dst`` unchanged where it is set."""
    dst.copy_(new if skip is None else torch.where(skip, dst, new))


class PieceLoop:
    """The ``LowPrecisionOptimizer`` part that updates one plain tensor in pieces."""

    def _update_tensor(self, p, shape, g, group, state, skip, offset: int = 0,
                       key: int | None = None) -> None:
        """The update of the plain tensor ``p`` (a parameter, or a shard of one whose
        whole shape is ``shape`` and whose first element is element ``offset`` of the
        whole; ``key``: the parameter's id, for its format and stochastic stream)."""
        fmt = self._weight_format(p)
        key = id(p) if key is None else key
        sfmt = self._stored_format_of(key, shape)
        if not state:
            self._init_state(p, state, fmt)
        step = state.get("step")
        if step is not None:
            new_step = step + 1 if skip is None else step + (~skip).float()
        else:
            new_step = None
        rows = p.shape[0] if p.ndim else 1
        per = chunk_rows(tuple(p.shape))
        if per >= rows:
            self._update_piece(p, g, group, state, skip, new_step, fmt, sfmt, offset, key)
        else:
            self._update_rows(p, g, group, state, skip, new_step, fmt, sfmt, offset, key,
                              rows, per)
        if new_step is not None:
            state["step"].copy_(new_step)

    def _update_rows(self, p, g, group, state, skip, new_step, fmt, sfmt, offset, key,
                     rows: int, per: int) -> None:
        """``_update_piece`` over pieces of ``per`` rows. A state that a piece creates
        (the first step's) is allocated whole once and takes each piece's rows; later
        pieces still see it as absent."""
        cols = math.prod(p.shape[1:])
        before = set(state)
        # 0-d states (flags) are read by every piece as they were before the step
        flags = {k: v for k, v in state.items()
                 if isinstance(v, torch.Tensor) and v.ndim == 0 and k != "step"}
        piece: dict = {}
        for r0 in range(0, rows, per):
            r1 = min(rows, r0 + per)
            piece = {k: (v[r0:r1] if isinstance(v, torch.Tensor) and v.ndim
                         and v.shape[0] == rows else v)
                     for k, v in state.items() if k in before}
            piece.update({k: v.clone() for k, v in flags.items()})
            self._update_piece(p.data[r0:r1], g[r0:r1], group, piece, skip, new_step,
                               fmt, sfmt, offset + r0 * cols, key)
            for k, v in piece.items():  # in creation order, as one piece would add them
                if k in before:
                    continue
                if not (isinstance(v, torch.Tensor) and v.ndim and v.shape[0] == r1 - r0):
                    state[k] = v  # not one per row: the last piece's
                    continue
                if k not in state:
                    state[k] = v.new_empty((rows, *v.shape[1:]))
                state[k][r0:r1].copy_(v)
        for k, v in flags.items():
            v.copy_(piece[k])

    def _update_piece(self, p, g, group, state, skip, new_step, fmt, sfmt, offset,
                      key) -> None:
        """Decode, update and encode the rows ``p`` (a view of the parameter, ``state``
        the same rows of its states), writing the results into them. ``g``: those rows
        of the gradient as stored; unscaled and upcast here, piece by piece."""
        scale = self._grad_scale
        if scale is not None:
            g = g / scale
        if g.dtype != torch.float32:
            g = g.float()
        w = self._read_weight(p, state, fmt, skip)
        values = {n: self._read_state(state, n, p, signed, skip, sfmt)
                  for n, signed in self._STATES if self._has(state, n)}
        new_values = self._math(w, g, values, group, state, new_step, skip)
        for (n, signed) in self._STATES:
            if n in new_values:
                self._write_state(state, n, new_values[n], signed, skip, sfmt)
        self._write_weight(p, w, state, fmt, skip, offset, key)
