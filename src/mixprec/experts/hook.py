"""transformers' experts modules run ``grouped_mm`` through their own interface.

transformers (5.x) decorates each experts class (Mixtral, Qwen3-MoE, DeepSeek-V3,
GPT-OSS, OLMoE, ...) with ``use_experts_implementation``: its forward looks the
model config's ``_experts_implementation`` up in ``ExpertsInterface``. ``convert_experts``
registers ``"mixprec"`` there, points the configs of the model's experts modules at it,
and gives each experts module it converts one ``ExpertsFormat`` per projection; the
registered forward routes the tokens as transformers' ``grouped_mm`` does and multiplies
them with ``mixprec.experts.grouped_mm``. An experts module left in high precision (a
``layer:...=bf16`` rule) runs the implementation the config had before. The layouts the
decorator declares are honoured: ``is_transposed`` (in × out weights), ``has_bias``,
``has_gate`` (a gate-up projection, split by the class's own ``_apply_gate``: the
interleaved GPT-OSS layout too), ``has_post_expert_norm``. The router stays in high
precision: it is a Linear of the recipe's policy, outside the experts.

transformers is imported only for a model whose experts module comes from it.
"""

from __future__ import annotations

import warnings
import zlib

import torch
from torch import nn

from mixprec.experts.format import ExpertsFormat
from mixprec.experts.grouped import grouped_mm
from mixprec.recipe import Recipe

__all__ = ["IMPLEMENTATION", "from_transformers", "is_experts", "experts_modules",
           "convert_experts", "restore_experts", "experts_forward"]

#: the name mixprec's forward is registered under in transformers' ExpertsInterface
IMPLEMENTATION = "mixprec"


def from_transformers(m: nn.Module) -> bool:
    """Whether ``m``'s class is transformers' or a wrapper's subclass of one (FSDP2's
    ``fully_shard`` makes ``FSDP<Class>`` in torch's own module: transformers' expert
    parallelism shards each experts module so, on its expert-data-parallel mesh)."""
    return any(c.__module__.startswith("transformers.") for c in type(m).__mro__)


def is_experts(m: nn.Module) -> bool:
    """A transformers experts module: decorated by ``use_experts_implementation`` (its
    layout flags set) with 3-D expert weights (DTensors where transformers' expert
    parallelism shards them)."""
    if not from_transformers(m):
        return False
    up = getattr(m, "gate_up_proj" if getattr(m, "has_gate", True) else "up_proj", None)
    down = getattr(m, "down_proj", None)
    return (hasattr(m, "is_transposed") and hasattr(m, "config")
            and isinstance(up, torch.Tensor) and up.dim() == 3
            and isinstance(down, torch.Tensor) and down.dim() == 3)


def experts_modules(model: nn.Module) -> dict[str, nn.Module]:
    """The model's transformers experts modules by qualified name."""
    return {n: m for n, m in model.named_modules() if is_experts(m)}


def _projections(m: nn.Module) -> tuple[str, str]:
    return ("gate_up_proj" if m.has_gate else "up_proj", "down_proj")


def _register() -> None:
    """``"mixprec"`` in transformers' ExpertsInterface (once; idempotent)."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(IMPLEMENTATION, experts_forward)


def convert_experts(model: nn.Module, recipe: Recipe, *,
                    routes: dict[str, str] | None = None) -> dict[str, str]:
    """Every transformers experts module of ``model`` runs in ``recipe``'s format (its
    ``layer:`` rule's, matched on the experts module's name: ``layer:*.experts=mxfp8``,
    ``layer:*.experts=bf16``); returns each one's format by name (``bf16``: kept).
    ``routes``: the fp8 GEMM route per ``fp8_scaling`` the engine measured."""
    r = Recipe.coerce(recipe)
    found = experts_modules(model)
    if not found or r.linear is None:
        return {}
    _register()
    out = {}
    for name, m in found.items():
        fmt = r.layer_format(name)
        out[name] = fmt
        prev = m.config._experts_implementation
        if prev != IMPLEMENTATION:
            m._mixprec_previous = prev  # what a module kept in bf16 runs
            m._mixprec_config = (m.config, m.config._experts_implementation_internal)
            m.config._experts_implementation_internal = IMPLEMENTATION
        if fmt == "bf16" or hasattr(m, "down_proj_fp8"):
            continue
        own = r.for_layer(name)
        route = (routes or {}).get(own.linear.name)
        if route and route != own.linear.fp8_gemm:
            with warnings.catch_warnings():  # the recipe's fp8 fields warned once already
                warnings.simplefilter("ignore")
                own = own.replace(fp8_gemm=route)
        for proj in _projections(m):
            w = getattr(m, proj)
            m.add_module(f"{proj}_fp8", ExpertsFormat(
                own, seed=zlib.crc32(f"{name}.{proj}".encode()), device=w.device))
    return out


def restore_experts(model: nn.Module) -> None:
    """The experts configs ``convert_experts`` pointed at ``"mixprec"`` get back the
    implementation they had (the experts then run it, in high precision); twice is
    harmless."""
    for m in experts_modules(model).values():
        config, internal = m.__dict__.pop("_mixprec_config", (None, None))
        if config is not None:
            config._experts_implementation_internal = internal


def _linear(m: nn.Module, proj: str, x: torch.Tensor, offsets: torch.Tensor,
            expert_ids: torch.Tensor) -> torch.Tensor:
    w = getattr(m, proj)
    w = w.transpose(1, 2) if m.is_transposed else w  # (E, out, in)
    y = grouped_mm(x, w, offsets, getattr(m, f"{proj}_fp8"))
    if m.has_bias:  # bias in high precision, per row's expert
        y = (y.float() + getattr(m, f"{proj}_bias")[expert_ids].float()).to(y.dtype)
    return y


def experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """The experts' forward as transformers' ``grouped_mm`` implementation routes it
    (sort the (token, expert) pairs by expert, two grouped projections, weight, sum over
    the top-k), with the projections on ``grouped_mm`` in the module's format."""
    if not hasattr(self, "down_proj_fp8"):
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

        prev = getattr(self, "_mixprec_previous", None) or "grouped_mm"
        fn = ALL_EXPERTS_FUNCTIONS.get_interface(prev, type(self).forward.__wrapped__)
        return fn(self, hidden_states, top_k_index, top_k_weights)
    num_top_k = top_k_index.size(-1)
    num_tokens, hidden_dim = hidden_states.shape
    expert_ids = top_k_index.reshape(-1)
    expert_ids_g, perm = torch.sort(expert_ids)
    x = hidden_states[perm // num_top_k]
    weights_g = top_k_weights.reshape(-1)[perm]
    # ids past the last expert (expert parallelism's sentinels) fall outside the counts
    # (a scatter, not bincount: its output size is known without reading the ids, so
    # torch.compile keeps one graph)
    counts = torch.zeros(self.num_experts + 1, dtype=torch.int64, device=x.device)
    counts = counts.scatter_add(0, expert_ids_g.clamp(max=self.num_experts),
                                torch.ones_like(expert_ids_g))[:self.num_experts]
    offsets = counts.cumsum(0).to(torch.int32)
    ids = expert_ids_g.clamp(max=self.num_experts - 1)
    up, down = _projections(self)
    h = _linear(self, up, x, offsets, ids)
    h = self._apply_gate(h) if self.has_gate else self.act_fn(h)
    h = _linear(self, down, h, offsets, ids)
    if self.has_post_expert_norm:
        h = self.post_expert_norm(h)
    h = h * weights_g.unsqueeze(-1).to(h.dtype)
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    out = h[inv].view(num_tokens, num_top_k, hidden_dim).float().sum(dim=1)
    return out.to(hidden_states.dtype)
