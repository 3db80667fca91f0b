"""What ``MixedPrecision`` refuses, decided before it touches the model.

Every check here runs before the fp8 swap, the sharding and the cast to the working
dtype, so a refused engine leaves the model exactly as it was (nothing lost on
failure); ``check_backward`` refuses a misused loop before backward runs. Each error
names the bad value and the fix.
"""

from __future__ import annotations

import functools
import inspect
import warnings

import torch
from torch import nn

from mixprec.engine.context import check_wgrad, device_supports
from mixprec.engine.convert import layer_formats
from mixprec.engine.param_state import ParamState, updated_dtype
from mixprec.modules.linear import Float8Linear, fp8_modules
from mixprec.optim import recipe_settings
from mixprec.optim.base import LowPrecisionOptimizer
from mixprec.optim.kinds import fuses_over_dtensors
from mixprec.recipe import PRESETS, Recipe

__all__ = ["warn_low_precision_loss", "check_model", "check_device", "check_optimizers",
           "check_parallel_kwargs",
           "check_fsdp_units", "check_fp8_filter", "check_fp8_all_gather", "param_counts",
           "takes_found_inf", "fuses_by_default", "fuse_default_optimizers",
           "param_device_types",
           "fused_updates", "check_backward", "check_optimizer_precision"]


def check_model(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """The model's trainable and frozen parameters, or an error: nothing to train,
    lazy (uninitialized) parameters, or sparse gradients (``sparse=True`` embeddings;
    the fp32 buffers, the non-finite check and the global norm are dense)."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("model has no parameters that require grad")
    lazy = [n for n, p in model.named_parameters() if nn.parameter.is_lazy(p)]
    if lazy:
        raise ValueError(
            f"parameter {lazy[0]!r} (and {len(lazy) - 1} more) is uninitialized: the "
            "model has lazy modules (nn.LazyLinear, ...). Run one forward pass on a "
            "dummy batch to materialize them, then build the optimizer and "
            "MixedPrecision.")
    for name, m in model.named_modules():
        if (isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse
                and m.weight.requires_grad):
            raise NotImplementedError(
                f"{name or 'the model'} is {type(m).__name__}(sparse=True): mixprec "
                "handles dense gradients only (its fp32 buffers, non-finite check and "
                "gradient norm are dense). Build it with sparse=False (and a dense "
                "optimizer such as AdamW instead of SparseAdam).")
    return params, [p for p in model.parameters() if not p.requires_grad]


def check_device(device: torch.device, r: Recipe, emulating: bool) -> None:
    """The device can run the recipe's dtypes (compute only where not emulated), and
    the recipe's options suit how it runs (no wgrad=fp32 with MX compute)."""
    check_wgrad(r, emulating)
    if r.linear is not None and not device_supports(device, torch.float8_e4m3fn):
        raise ValueError(
            f"recipe {str(r)!r}: device {device} has no fp8 GEMM (CUDA needs "
            "compute capability 8.9+, e.g. L4/H100); use 'bf16', or run fp8 on the "
            "CPU, where mixprec computes fp8 products exactly with bf16 kernels")
    needed = {r.param_dtype, r.grad_dtype}
    if not emulating:
        needed.add(r.compute_dtype)
    for dt in needed:
        if not device_supports(device, dt):
            raise ValueError(
                f"recipe {str(r)!r} needs {dt} but device {device} cannot compute "
                "in it; use a recipe with "
                + ("fp16 (bf16 needs Ampere or newer)" if dt == torch.bfloat16
                   else "bf16 or fp32"))


def check_optimizers(optimizers: list[torch.optim.Optimizer], params: list[nn.Parameter],
                     frozen: list[nn.Parameter], r: Recipe, parallel: str | None,
                     emulating: bool) -> None:
    """The optimizers hold only the model's parameters (frozen ones allowed) and, when
    fused, can update the dtype they will be given."""
    ids = {id(p) for p in params} | {id(p) for p in frozen}
    for o in optimizers:
        closure = inspect.signature(o.step).parameters.get("closure")
        if closure is not None and closure.default is inspect.Parameter.empty:
            raise NotImplementedError(
                f"{type(o).__name__}.step needs a closure that re-evaluates the loss; "
                "MixedPrecision.step() calls the optimizer without one (the loss must "
                "go through engine.autocast() and engine.backward()). Use an optimizer "
                "that steps on the gradients alone.")
        for g in o.param_groups:
            for p in g["params"]:
                if id(p) not in ids:
                    raise ValueError(
                        "an optimizer holds a parameter that is not a parameter of "
                        f"the model (shape {tuple(p.shape)}); build the optimizer "
                        "over model.parameters()")
    if parallel != "fsdp":
        ParamState.check_masterable(params, r)
    check_optimizer_precision(optimizers, r, parallel)
    updated = updated_dtype(r, emulating, sharded=parallel == "fsdp")
    if updated not in (torch.float16, torch.bfloat16):
        return
    for o in optimizers:
        if not takes_found_inf(o) or getattr(o, "takes_found_inf", False) is True:
            continue
        for dev in {p.device.type for g in o.param_groups for p in g["params"]}:
            if not fused_updates(type(o), updated, dev):
                raise ValueError(
                    f"{type(o).__name__}(fused=True) does not update {updated} parameters "
                    f"on {dev} in torch {torch.__version__} (a torch bug: the step leaves "
                    "them unchanged). Use fused=False, or a -master recipe so that the "
                    "optimizer updates fp32 masters.")


def takes_found_inf(opt: torch.optim.Optimizer) -> bool:
    """Whether ``opt`` skips a step itself given ``found_inf`` on the device (torch's
    fused Adam, AdamW and SGD; every ``mixprec.optim`` optimizer), so the engine's step
    needs no host sync."""
    if getattr(opt, "takes_found_inf", False) is True:
        return True
    return bool(getattr(opt, "_step_supports_amp_scaling", False)) and all(
        g.get("fused") for g in opt.param_groups)


def param_device_types(opt: torch.optim.Optimizer) -> set[str]:
    """The device types of the parameters ``opt`` updates."""
    return {p.device.type for g in opt.param_groups for p in g["params"]}


def fuses_by_default(opt: torch.optim.Optimizer) -> bool:
    """Whether the engine makes ``opt`` fused: torch's own Adam, AdamW or SGD left at
    its default implementation (every group ``fused=None, foreach=None``, not
    ``differentiable``), updating CUDA parameters. torch would run its foreach kernels,
    which cannot take ``found_inf``: the engine would read it on the host every step.
    The fused kernels skip on the device. An optimizer configured explicitly
    (``foreach=True``, ``fused=False``) or of another type is left alone and keeps its
    one host sync per step, as under torch's GradScaler."""
    if type(opt) not in (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD):
        return False
    if param_device_types(opt) != {"cuda"}:
        return False
    if not fuses_over_dtensors(opt):  # SGD over DTensors: no DTensor rule for its kernel
        return False
    return all(g.get("fused", False) is None and g.get("foreach", False) is None
               and not g.get("differentiable", False) for g in opt.param_groups)


def fuse_default_optimizers(optimizers: list) -> list[int]:
    """Switch the optimizers ``fuses_by_default`` picks to ``fused=True`` (their state's
    ``step`` counts moved to float32 on the parameter's device, where torch's fused
    path keeps them); returns their indices."""
    switched = []
    for i, o in enumerate(optimizers):
        if not fuses_by_default(o):
            continue
        for g in o.param_groups:
            g["fused"] = True
        o.defaults["fused"] = True
        o._step_supports_amp_scaling = True
        for p, st in o.state.items():
            if torch.is_tensor(st.get("step")):
                st["step"] = st["step"].to(device=p.device, dtype=torch.float32)
        switched.append(i)
    return switched


def check_optimizer_precision(optimizers: list, r: Recipe, parallel: str | None) -> None:
    """A recipe that stores optimizer states below fp32 (its ``states``, or a
    ``states:`` rule's for some parameters) or writes 16-bit weights by a rule needs
    ``mixprec.optim`` optimizers built with the same settings (the engine applies the
    rules to them)."""
    lean = r.needs_mixprec_optim
    want = recipe_settings(r)
    for i, o in enumerate(optimizers):
        ours = isinstance(o, LowPrecisionOptimizer)
        if ours and (o.states, o.write) != (want["states"], want["write"]):
            raise ValueError(
                f"optimizer {i} ({type(o).__name__}) has states={o.states!r}, "
                f"write={o.write!r}, but recipe {str(r)!r} says states={want['states']!r}, "
                f"write={want['write']!r}; build it with the recipe's (or change the recipe)")
        if lean and not ours:
            name = type(o).__name__
            alt = f"mixprec.optim.{name}" if name in ("Adam", "AdamW", "SGD") else \
                "mixprec.optim.AdamW (or Adam, SGD)"
            rules = [str(x) for x in r.state_rules if x.value != "fp32"]
            if want == {"states": "fp32", "write": "nearest"} and rules:
                raise ValueError(
                    f"recipe {str(r)!r}: its rule{'s' * (len(rules) > 1)} "
                    f"{', '.join(rules)} store{'s' * (len(rules) == 1)} the matched "
                    f"parameters' optimizer states below fp32, which torch's {name} "
                    f"cannot do. Use {alt}(params, ..., states={want['states']!r}, "
                    f"write={want['write']!r}): MixedPrecision applies the rules to it.")
            raise ValueError(
                f"recipe {str(r)!r} stores optimizer states in {want['states']} and writes "
                f"weights by {want['write']!r}, which torch's {name} cannot do. Use "
                f"{alt}(params, ..., states={want['states']!r}, write={want['write']!r}).")


@functools.cache
def fused_updates(cls: type, dtype: torch.dtype, device: str) -> bool:
    """Whether ``cls(fused=True)`` really moves a 32-element ``dtype`` parameter. torch
    2.13's fused SGD on the CPU leaves fp16/bf16 parameters of >= 16 elements untouched."""
    p = nn.Parameter(torch.ones(32, dtype=dtype, device=device))
    p.grad = torch.ones_like(p)
    try:
        cls([p], lr=0.1, fused=True).step()
    except Exception:
        return True  # not this optimizer's kind of failure; let the real step report it
    return bool((p.detach() != 1).all())


def param_counts(optimizers: list[torch.optim.Optimizer]) -> list[int]:
    """How many parameters each optimizer holds; the engine compares this at every
    step, since a group added later (``add_param_group``) would bypass the masters and
    buffers."""
    return [sum(len(g["params"]) for g in o.param_groups) for o in optimizers]


#: what the engine sets itself: from the recipe (mp_policy) or for its comm hook
_RESERVED = {"ddp": {"module", "gradient_as_bucket_view"},
             "fsdp": {"module", "mp_policy"}}


def check_parallel_kwargs(parallel: str | None, kwargs: dict | None) -> dict:
    """``parallel_kwargs`` as a dict, refused without ``parallel`` or where it would
    override what the recipe decides."""
    kwargs = dict(kwargs or {})
    if kwargs and parallel is None:
        raise ValueError(f"parallel_kwargs {sorted(kwargs)} given without parallel; set "
                         "parallel='ddp' or 'fsdp', or drop them")
    bad = sorted(set(kwargs) & _RESERVED.get(parallel, set()))
    if bad:
        raise ValueError(
            f"parallel_kwargs {bad}: set by mixprec for parallel={parallel!r} (from the "
            "recipe, or for its gradient hook); change the recipe instead")
    return kwargs


def check_fp8_filter(fp8_filter, recipe, model: nn.Module) -> None:
    """``fp8_filter`` is a callable, given with an fp8 recipe, to a model not converted
    by hand already (whose conversion it could no longer change)."""
    if fp8_filter is None:
        return
    if recipe.linear is None:
        raise ValueError(f"fp8_filter given with recipe {str(recipe)!r}, which has no fp8 "
                         "Linears: use an fp8 recipe ('fp8', 'fp8-current', "
                         "'fp8-rowwise'), or drop fp8_filter")
    if not callable(fp8_filter):
        raise TypeError(f"fp8_filter must be a callable (module, fqn) -> bool, got "
                        f"{type(fp8_filter).__name__}")
    done = list(fp8_modules(model))
    if done:
        raise ValueError(f"fp8_filter given, but the model holds Float8Linears already "
                         f"({', '.join(done[:3])}): the engine converts nothing more. "
                         "Convert by hand or pass fp8_filter, not both.")


def check_fp8_all_gather(recipe, model: nn.Module, fp8_filter=None) -> None:
    """``fp8_all_gather`` gathers the weight casts of every format but INT8's: an error
    where the recipe's ``layer:`` rules would convert a Linear of ``model`` to a format
    whose casts cannot be gathered."""
    if not recipe.layout.fp8_all_gather or not recipe.layer_rules:
        return
    if fp8_modules(model):
        return  # converted by hand: the engine converts nothing
    formats = layer_formats(model, recipe, fp8_filter)
    bad = [f"{name} ({fmt})" for name, fmt in formats.items()
           if fmt != "bf16" and not PRESETS[fmt].linear.gathers_casts]
    if bad:
        raise NotImplementedError(
            f"recipe {str(recipe)!r}: fp8_all_gather, but its layer: rules convert "
            f"{', '.join(bad[:4])}{' and more' if len(bad) > 4 else ''} to a format "
            "whose weight casts the all-gather cannot carry. Give those Linears another "
            "format (fp8, fp8-current, fp8-rowwise, fp8-block, mxfp8, nvfp4) or bf16 in "
            "the rules, or drop fp8_all_gather.")


def check_fsdp_units(parallel: str | None, units, model: nn.Module):
    """``fsdp_units`` as a predicate on modules (or None for the default choice):
    a module class, a tuple of them, or a callable ``module -> bool``. Refused without
    ``parallel="fsdp"``, and when classes are given that no module of the model has."""
    if units is None:
        return None
    if parallel != "fsdp":
        raise ValueError(f"fsdp_units given with parallel={parallel!r}; it chooses FSDP's "
                         "units: set parallel='fsdp', or drop it")
    if isinstance(units, type):
        units = (units,)
    if isinstance(units, tuple) and units and all(
            isinstance(u, type) and issubclass(u, nn.Module) for u in units):
        found = {type(m) for m in model.modules()}
        if nn.Linear in found:  # fp8 recipes swap Linears for Float8Linears before FSDP
            found.add(Float8Linear)
        if not any(issubclass(t, units) for t in found):
            raise ValueError(
                f"fsdp_units={tuple(u.__name__ for u in units)}: the model has no module "
                f"of these classes (it has {sorted(t.__name__ for t in found)[:8]}...); "
                "name the class of its repeated blocks")
        return lambda m: isinstance(m, units)
    if callable(units) and not isinstance(units, type):
        return units
    raise TypeError(f"fsdp_units={units!r}: give an nn.Module subclass, a tuple of them, "
                    "or a callable module -> bool (or None for each ModuleList element)")


def warn_low_precision_loss(loss: torch.Tensor, recipe) -> bool:
    """Warn (and return True) where the loss reached ``backward`` in fp16 or bf16: it was
    computed outside ``engine.autocast()`` (where losses run in fp32) on 16-bit outputs.
    It has lost precision, and under fp16 loss scaling the scaled gradient that enters
    it (the scale itself, 65536 at the start) overflows fp16: steps are skipped until
    the scale drops below 65504."""
    if loss.dtype not in (torch.float16, torch.bfloat16):
        return False
    fp16_scaled = loss.dtype == torch.float16 and recipe.loss.kind != "none"
    scaled = (" Under loss scaling its scaled gradient overflows fp16, so the first "
              "steps are skipped." if fp16_scaled else "")
    warnings.warn(
        f"the loss reached backward() as {loss.dtype} (recipe {str(recipe)!r}): it was "
        "computed outside engine.autocast() on 16-bit outputs, so it ran in 16 bits, not "
        f"in fp32.{scaled} Compute the loss under engine.autocast() (losses run in fp32 "
        "there), or upcast the logits first: F.cross_entropy(logits.float(), y).",
        stacklevel=3)
    return True


def check_backward(loss, micro: int, grad_accum_steps: int, param_state,
                   closed: bool = False, last: bool | None = None) -> None:
    """``engine.backward(loss)`` can run: a scalar loss with a graph, no more
    micro-batches than ``grad_accum_steps``, none after a window ended with
    ``last=True``, nothing cleared mid-accumulation."""
    if last is not None and not isinstance(last, bool):
        raise TypeError(f"backward(last={last!r}): expected True, False or None")
    if closed:
        raise RuntimeError(
            f"backward() after backward(last=True) ended the window at {micro} "
            f"micro-batch(es) (of grad_accum_steps={grad_accum_steps}); call step() "
            "first, which applies the update")
    if last is False and micro == grad_accum_steps - 1:
        raise ValueError(
            f"backward(last=False) on micro-batch {micro + 1} of grad_accum_steps="
            f"{grad_accum_steps}: the window cannot grow past grad_accum_steps; pass "
            "last=None (or True), or raise grad_accum_steps")
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ValueError("backward() takes the scalar loss tensor; reduce it first "
                         "(e.g. loss.mean())")
    if not loss.requires_grad:
        raise ValueError("the loss does not require grad: was it computed under "
                         "torch.no_grad(), or from detached outputs?")
    if micro >= grad_accum_steps:
        raise RuntimeError(
            f"backward() called {micro + 1} times since the last update but "
            f"grad_accum_steps={grad_accum_steps}; call step() after each backward. "
            "For several losses in one step, backward their sum "
            "(engine.backward(loss0 + loss1)).")
    if micro and param_state.accumulation_cleared():
        raise RuntimeError(
            f"the gradients of the {micro} micro-batch(es) accumulated since the "
            "last update were cleared outside the engine (optimizer.zero_grad() or "
            "model.zero_grad() after a step() that returned accumulating?). step() "
            f"applies the update once grad_accum_steps={grad_accum_steps} "
            "micro-batches are in and zeroes the gradients itself: zero nothing in "
            "between.")
