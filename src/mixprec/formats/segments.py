"""The experts' rows as a format's grouped casts see them, on the device.

A mixture-of-experts GEMM holds its tokens sorted by expert: ``Segments`` gives each
row its expert's id from the cumulative counts (``searchsorted``; a row past the last
expert gets the id E), and the layouts the casts along the tokens need: a buffer of a
fixed ``T + (E + 1)·(tile − 1)`` rows where every expert (and the rows past the last)
starts on a whole tile (``aligned``), as a cast of each expert's slice pads its tiles.
Nothing here reads a tensor's value on the host, so ``torch.compile`` traces it.

A format that casts an experts operand whole, every expert's rows as a cast of that
expert's slice gives them (``LinearFormat.segment_cast``), builds on these helpers.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["Segments", "segment_ids", "tile_aligned_rows", "spread", "segment_amax",
           "stacked_values"]


def segment_ids(offsets: torch.Tensor, rows: int) -> torch.Tensor:
    """The expert id of each of ``rows`` rows from cumulative ``offsets`` (E,), on the
    device; a row past ``offsets[-1]`` gets E."""
    pos = torch.arange(rows, device=offsets.device, dtype=offsets.dtype)
    return torch.searchsorted(offsets.contiguous(), pos, right=True)


def tile_aligned_rows(offsets: torch.Tensor, rows: int, tile: int
                      ) -> tuple[torch.Tensor, int]:
    """Where each of ``rows`` rows goes in a layout where every expert (and the rows
    past ``offsets[-1]``, a group of their own) starts on a multiple of ``tile``, on the
    device, and that layout's fixed number of rows."""
    ends = torch.cat([offsets.long(), offsets.new_full((1,), rows).long()])
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    padded = (counts + tile - 1) // tile * tile
    shift = (torch.cumsum(padded, 0) - padded) - (ends - counts)  # new start - old start
    dest = torch.arange(rows, device=offsets.device) + shift[segment_ids(offsets, rows)]
    return dest, rows + ends.numel() * (tile - 1)


def spread(t: torch.Tensor, dest: torch.Tensor, bound: int) -> torch.Tensor:
    """``t``'s rows at rows ``dest`` of a zero buffer of ``bound`` rows."""
    return t.new_zeros(bound, t.shape[1]).index_copy(0, dest, t)


def segment_amax(amax: torch.Tensor, ids: torch.Tensor, groups: int) -> torch.Tensor:
    """The max of ``amax`` (one per row, or rows × cols) over each group's rows
    (``ids``: each row's group of ``groups``); a group without rows gets 0."""
    shape = (groups,) + tuple(amax.shape[1:])
    index = ids if amax.dim() == 1 else ids.unsqueeze(1).expand_as(amax)
    return amax.new_zeros(shape).scatter_reduce(0, index, amax, "amax", include_self=True)


def stacked_values(c: Any, transposed: bool) -> torch.Tensor:
    """The fp32 values of the experts' weights cast as one E × N × K ``Quantized``
    (``transposed``: E × K × N, contiguous)."""
    v = c.dequant()
    return v.transpose(1, 2).contiguous() if transposed else v


class Segments:
    """The experts' rows of one grouped GEMM: ``offs`` (E,) the cumulative counts
    (int32), ``ids`` each of the ``rows`` rows' expert (E past the last), and the
    layouts derived from them, made once and kept (``saved`` lists them, for the
    backward to take them back by ``restore``)."""

    def __init__(self, offs: torch.Tensor, ids: torch.Tensor, rows: int) -> None:
        self.offs, self.ids, self.rows = offs, ids, rows
        self.experts = offs.shape[0]
        self._made: dict[str, torch.Tensor | None] = {}
        self._bounds: dict[int, int] = {}

    @classmethod
    def of(cls, offsets: torch.Tensor, rows: int) -> Segments:
        """The segments of ``rows`` rows delimited by cumulative ``offsets``."""
        offs = offsets.to(torch.int32)
        return cls(offs, segment_ids(offs, rows), rows)

    def _keep(self, name: str, make) -> torch.Tensor:
        if self._made.get(name) is None:
            self._made[name] = make()
        return self._made[name]

    @property
    def has_rows(self) -> torch.Tensor:
        """Whether each expert has a row (E,)."""
        return self._keep("has_rows", lambda: torch.diff(
            self.offs, prepend=self.offs.new_zeros(1)) > 0)

    def aligned(self, tile: int) -> tuple[torch.Tensor, int]:
        """Each row's place in the layout where every expert starts on a whole
        ``tile`` (``tile_aligned_rows``), and that layout's rows."""
        bound = self.rows + (self.experts + 1) * (tile - 1)
        dest = self._keep(f"dest{tile}",
                          lambda: tile_aligned_rows(self.offs, self.rows, tile)[0])
        self._bounds[tile] = bound
        return dest, bound

    def aligned_ends(self, tile: int) -> tuple[torch.Tensor, torch.Tensor]:
        """In the ``aligned`` layout: each expert's padded end (E,, int32) and each
        ``tile``-row block's group (E: past the last expert)."""
        def ends() -> torch.Tensor:
            counts = torch.diff(self.offs.long(), prepend=self.offs.new_zeros(1).long())
            return torch.cumsum((counts + tile - 1) // tile * tile, 0)

        long_ends = self._keep(f"ends{tile}", ends)
        _, bound = self.aligned(tile)
        blocks = self._keep(f"blocks{tile}", lambda: torch.searchsorted(
            long_ends, torch.arange(0, bound, tile, device=self.offs.device), right=True))
        return long_ends.to(torch.int32), blocks

    def saved(self) -> tuple[tuple, list[torch.Tensor]]:
        """What the backward needs to make these segments again (``saved_again``):
        metadata, and the counts, row ids and derived layouts made so far."""
        names = [n for n, t in self._made.items() if t is not None]
        return ((tuple(names), self.rows),
                [self.offs, self.ids, *(self._made[n] for n in names)])

    @classmethod
    def saved_again(cls, meta: tuple, tensors: list[torch.Tensor]) -> Segments:
        """The segments ``saved`` gave ``meta`` and ``tensors`` of."""
        (names, rows), (offs, ids, *made) = meta, tensors
        seg = cls(offs, ids, rows)
        seg._made.update(zip(names, made))
        return seg
