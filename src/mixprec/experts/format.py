"""ExpertsFormat: the low-precision format of one experts projection and its state.

An experts module holds its weights as 3-D parameters (experts × out × in), one per
projection (``gate_up_proj``, ``down_proj``). Each projection that runs in a
low-precision format gets one ``ExpertsFormat`` child: the recipe's quantizer
(``mixprec.recipe.linear_format``), its GEMM route and its buffers, as a ``Float8Linear``
keeps them. Delayed scaling's amax history is one per projection of the experts module
(its scale serves every expert's slice); the stateless formats scale each expert's
slice on its own. The buffers are in the model's ``state_dict``, so a checkpoint
carries them and a resumed run continues bit-identically; the engine's step updates
them as it does the Float8Linears'.
"""

from __future__ import annotations

import torch
from torch import nn

from mixprec.modules.linear import Float8Linear
from mixprec.recipe import Recipe
from mixprec.recipe.linear_format import quantizer_for

__all__ = ["ExpertsFormat", "experts_formats"]


class ExpertsFormat(nn.Module):
    """The format (``recipe``'s fp8 scaling) and scaling state of one projection.

    >>> f = ExpertsFormat("fp8")
    >>> f.scaling, sorted(f.scaling_state())
    ('delayed', ['fp8_amax_history', 'fp8_max', 'fp8_scale'])
    """

    def __init__(self, recipe: Recipe | str = "fp8", *, seed: int = 0,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        r = Recipe.coerce(recipe)
        if r.linear is None:
            raise ValueError(f"ExpertsFormat needs an fp8/fp4 recipe (compute=fp8), got "
                             f"{str(r)!r}; use fp8, fp8-current, fp8-rowwise, fp8-block, "
                             "mxfp8 or nvfp4")
        self.fp8_recipe = r
        self.quantizer = quantizer_for(r)
        self.gemm_choice = self.quantizer.fp8_gemm
        state = self.quantizer.buffers(device or "cpu", seed)
        for name, (t, persistent) in state.items():
            self.register_buffer(name, t, persistent=persistent)
        self._state_names = tuple(state)

    # the scaling state and its step are Float8Linear's: one definition of each
    scaling_state = Float8Linear.scaling_state
    update_scales = Float8Linear.update_scales
    _sr_generator = Float8Linear._sr_generator
    _sr_stream_shift = Float8Linear._sr_stream_shift
    # the grouped routes' stream: every gradient element's number by its place
    # (``grouped.stream_keys``), eager and compiled alike
    _sr_key = Float8Linear._sr_key
    _rng_host = None

    @property
    def scaling(self) -> str:
        """The quantizer's name: the recipe's ``fp8_scaling``."""
        return self.quantizer.name

    @property
    def format_name(self) -> str:
        """The fp8 preset this format is (``fp8``, ``mxfp8``, ...)."""
        return self.fp8_recipe.fp8_name or "fp8"

    def backend(self, device: torch.device | str) -> str:
        """The GEMM route on ``device`` (``mixprec.formats.route.gemm_route``)."""
        return self.quantizer.route(device, self.gemm_choice)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        self._rng_host = None  # a loaded nvfp4_rng is read again on the next backward
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def extra_repr(self) -> str:
        """The format and its route choice."""
        return f"{self.format_name}, scaling={self.scaling}, gemm={self.gemm_choice}"


def experts_formats(model: nn.Module) -> dict[str, ExpertsFormat]:
    """The model's ExpertsFormats by qualified name (the step updates their state)."""
    return {n: m for n, m in model.named_modules() if isinstance(m, ExpertsFormat)}
