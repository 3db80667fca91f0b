"""A serving schema: how one quantized weight lies on disk for a loader (transformers,
vLLM) and the ``quantization_config`` that tells the loader so.

A schema takes a weight's cast (``mixprec.export.sites.WeightCast``: codes, each
element's inverse scale, the outer factor) out × in and writes the tensors its loader
reads, named after the weight's module (``<module>.weight``, ``<module>.weight_scale``,
...). The scales it writes are the trained ones, on the schema's grid: ``on_grid``
checks that the cast's scales are constant over each of the grid's blocks (a fused
projection split off the middle of a block would not be) and raises where they are not.
``loader_error`` measures what the loader's own arithmetic makes of the written scales
against the trained values (0 where it reads them back exactly).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mixprec.formats.quantized import expand_blocks

__all__ = ["Schema", "on_grid", "relative_error"]


def on_grid(scale: torch.Tensor, rows: int, cols: int, what: str) -> torch.Tensor:
    """The per-block values of ``scale`` (each element's, 2-D) on a grid of ``rows ×
    cols`` blocks (0: the whole dim), ``(⌈R/rows⌉, ⌈C/cols⌉)``; ``ValueError`` where
    ``scale`` is not constant over each block."""
    r = rows or scale.shape[0]
    c = cols or scale.shape[1]
    grid = scale[::r, ::c]
    back = expand_blocks(grid, r, c, scale.shape)
    back = back.expand(scale.shape)
    if not torch.equal(torch.nan_to_num(back, nan=0.0), torch.nan_to_num(scale, nan=0.0)):
        raise ValueError(
            f"{what}: the trained scales are not constant over the schema's {r}x{c} "
            "blocks (a fused projection split off the middle of a block, or a recipe "
            "whose weight cast does not match the schema); export it with "
            "quantized=False")
    return grid


def relative_error(read: torch.Tensor, trained: torch.Tensor) -> float:
    """The largest ``|read - trained| / |trained|`` over the non-zero trained values, in
    float64 (0.0 where every value is read back exactly)."""
    read, trained = read.double(), trained.double()
    nz = trained != 0
    if not bool(nz.any()):
        return 0.0
    return float(((read - trained).abs()[nz] / trained.abs()[nz]).max())


@dataclass(frozen=True)
class Schema:
    """One family's on-disk layout and config (subclasses fill the methods)."""

    #: what the docs and the JSON description call it (``float-tensor``, ``nvfp4``, ...)
    name: str
    #: the ``quant_method`` its loader reads (``compressed-tensors``, ``fp8``)
    quant_method: str

    def encode(self, module: str, codes: torch.Tensor, scale_inv: torch.Tensor,
               outer: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """The tensors of module ``module``'s weight (2-D cast: codes, each element's
        inverse scale, the outer factor as a 0-d tensor or None) by their names."""
        raise NotImplementedError(type(self).__name__)

    def loader_values(self, tensors: dict[str, torch.Tensor], module: str) -> torch.Tensor:
        """The weight the loader's arithmetic makes of ``encode``'s tensors, fp32,
        before it casts to the model's dtype."""
        raise NotImplementedError(type(self).__name__)

    def quantization_config(self, ignore: list[str]) -> dict:
        """``config.json``'s ``quantization_config``, ``ignore``: the modules kept in 16
        bits (on-disk names)."""
        raise NotImplementedError(type(self).__name__)

    def loader_warning(self, shape: tuple[int, ...]) -> str | None:
        """Why a loader would read a weight of ``shape`` wrongly (None: it reads it)."""
        return None

    def experts_warning(self) -> str | None:
        """Why a loader would read MoE experts in this schema wrongly (None: it reads
        them)."""
        return None
