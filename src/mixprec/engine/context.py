"""The precision context: torch.autocast plus FP32 islands.

``precision_context(recipe, device)`` is what ``MixedPrecision.autocast()`` enters:

- ``torch.autocast`` on the device with the recipe's compute dtype (bf16 / fp16; fp8
  recipes run everything but their Float8 Linears under bf16, or in fp32 where this
  device has no fast bf16: ``mixprec.engine.devices.fp8_rest``);
- FP32 islands for what ``recipe.keep_fp32`` names. Norms (``F.layer_norm``,
  ``F.rms_norm``, ``F.group_norm``, ``F.batch_norm``, ``F.instance_norm``), softmax,
  log_softmax and the loss functions get their floating inputs (and weights) upcast to
  fp32 and run with autocast off. Their outputs are **fp32**, as CUDA autocast already
  does for layer_norm and softmax. The next low-precision op casts them down again.
  CPU autocast leaves layer_norm and softmax in bf16, and these islands fix that. It is
  done with a ``TorchFunctionMode`` at the functional level, so it covers ``nn.LayerNorm``
  and your own code that calls ``F.layer_norm``. Modules from other libraries that
  compute a norm by hand (a ``LlamaRMSNorm``, say) are matched by class name and run
  whole in fp32;
- for ``tf32``: TF32 matmuls and cuDNN convolutions (``mixprec.formats.fp32_precision.tf32``:
  torch's legacy and per-backend settings in step), the user's settings, set through
  either API, restored exactly on exit;
- under emulation (``emulating(recipe, device)``): an ``EmulationMode`` that turns the
  low-precision arithmetic into exact rounding on fp32 kernels (``mixprec.engine.emulate``).

Hardware checks live in ``device_supports`` so tests can monkeypatch one function.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize
from torch.overrides import TorchFunctionMode

from mixprec.engine import attention
from mixprec.engine.devices import emulating, fp8_rest, has_fast_kernels
from mixprec.engine.emulate import EmulationMode, leave_low_precision
from mixprec.engine.wgrad import (
    NOT_ROUTED,
    ROUTED_FUNCS,
    GradSink,
    compile_safe,
    route,
    upcast_param,
)
from mixprec.formats.fp32_precision import tf32
from mixprec.recipe import Recipe

__all__ = ["precision_context", "recompute_context", "run_backward", "PrecisionMode",
           "device_supports", "fp32_island_modules", "wrap_fp32_modules", "has_fast_kernels",
           "emulating",
           "make_emulation_mode", "check_wgrad", "autocast_dtype"]

_NORM_FUNCS: dict[str, tuple[Callable, ...]] = {
    "layer_norm": (F.layer_norm, torch.layer_norm),
    "rms_norm": tuple(f for f in (getattr(F, "rms_norm", None), getattr(torch, "rms_norm", None))
                      if f is not None),
    "group_norm": (F.group_norm, torch.group_norm),
    "batch_norm": (F.batch_norm, torch.batch_norm),
    "instance_norm": (F.instance_norm, torch.instance_norm),
    "softmax": (F.softmax, torch.softmax, torch.Tensor.softmax, torch.special.softmax),
    "log_softmax": (F.log_softmax, torch.log_softmax, torch.Tensor.log_softmax,
                    torch.special.log_softmax),
    "loss": (F.cross_entropy, F.nll_loss, F.mse_loss, F.l1_loss, F.smooth_l1_loss,
             F.huber_loss, F.binary_cross_entropy, F.binary_cross_entropy_with_logits,
             F.kl_div, F.cosine_embedding_loss, F.soft_margin_loss, F.poisson_nll_loss,
             F.gaussian_nll_loss),
}

_ISLAND_FUNCS = frozenset(f for fs in _NORM_FUNCS.values() for f in fs)

# Class-name suffixes of norm modules from other libraries, run whole in fp32.
_MODULE_SUFFIXES = {
    "layer_norm": ("LayerNorm",),
    "rms_norm": ("RMSNorm", "RmsNorm"),
    "group_norm": ("GroupNorm",),
    "batch_norm": ("BatchNorm", "BatchNorm1d", "BatchNorm2d", "BatchNorm3d"),
    "instance_norm": ("InstanceNorm", "InstanceNorm1d", "InstanceNorm2d", "InstanceNorm3d"),
}
_TORCH_NORMS = (nn.LayerNorm, nn.GroupNorm, nn.modules.batchnorm._NormBase,
                getattr(nn, "RMSNorm", nn.LayerNorm))


def check_wgrad(recipe: Recipe, emulate: bool) -> None:
    """Raise ``NotImplementedError`` for ``wgrad=fp32`` with an MX compute format.

    Under fp16/bf16 emulation the weight-gradient GEMM runs ``unrounded`` (the emulated
    ``mm(out_dtype=fp32)``). An MX weight-gradient GEMM would also need its operands
    block-quantized along the token dimension, which the routed backward does not do."""
    if recipe.precision.wgrad == "fp32" and recipe.is_mx:
        raise NotImplementedError(
            f"recipe {str(recipe)!r}: wgrad=fp32 with the MX compute format "
            f"{recipe.precision.compute} is not supported (its weight-gradient GEMM would need "
            "block-quantized operands); drop wgrad, or use compute=bf16 or fp16")


def device_supports(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``device`` can compute in ``dtype`` at all (speed is the doctor's job)."""
    if device.type == "cuda":
        if dtype == torch.bfloat16:
            return torch.cuda.is_bf16_supported()
        if dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            return torch.cuda.get_device_capability(device) >= (8, 9)
        return True
    if device.type == "cpu":
        return dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16,
                         torch.float8_e4m3fn, torch.float8_e5m2)
    return dtype == torch.float32


def _up(x, sink: GradSink | None = None):
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        up = upcast_param(x, sink)  # wgrad=fp32: the parameter's gradient stays fp32
        # under an active EmulationMode this also rounds the gradient coming back
        return up if up is not None else leave_low_precision(x)
    if isinstance(x, (list, tuple)):
        return type(x)(_up(v, sink) for v in x)
    return x


# Ops that CUDA autocast runs in the widest input dtype ("promote") and CPU autocast
# leaves alone, so on a CPU they raise on fp32 activations meeting bf16/fp16 weights
# (nn.Bilinear under a -master recipe, say).
_PROMOTE_FUNCS = frozenset(f for f in (
    F.bilinear, torch.bilinear, torch.cross, torch.linalg.cross, torch.Tensor.cross,
    torch.dot, torch.Tensor.dot, torch.tensordot, torch.index_put, torch.Tensor.index_put,
    torch.scatter_add, torch.Tensor.scatter_add) if f is not None)

# Matrix-vector ops that CUDA autocast runs in the low-precision dtype and CPU autocast
# leaves alone (mm, bmm, matmul and linear it does cast), so on a CPU they raise on fp32
# inputs meeting bf16/fp16 weights (torch.mv(weight, x) under a -master recipe, say).
_LOWER_FUNCS = frozenset((torch.mv, torch.Tensor.mv, torch.addmv, torch.Tensor.addmv,
                          torch.addr, torch.Tensor.addr))

# everything PrecisionMode may touch; any other call passes through after one lookup
_TOUCHED = (_ISLAND_FUNCS | _PROMOTE_FUNCS | _LOWER_FUNCS | ROUTED_FUNCS
            | {attention.ROUTED, torch.lstm})


@functools.cache
def _cpu_runs_fp16_lstm() -> bool:
    """Whether this CPU's oneDNN has an fp16 LSTM (CPU autocast sends fp16 LSTMs there;
    without one it raises "could not create a primitive descriptor")."""
    try:
        with torch.autocast("cpu", dtype=torch.float16):
            torch.nn.LSTM(4, 4)(torch.zeros(1, 1, 4))
    except RuntimeError:
        return False
    return True


def _run_cast(func, args, kwargs, device_type: str, cast):
    """``func`` with autocast off, each argument passed through ``cast`` first: the one
    shape of every rule below (islands, promote, lower)."""
    with torch.autocast(device_type, enabled=False):
        return func(*(cast(a) for a in args), **{k: cast(v) for k, v in kwargs.items()})


def _island(func, args, kwargs, device_type: str, sink: GradSink | None):
    """Run ``func`` in fp32: floating inputs upcast, autocast off, fp32 outputs."""
    if kwargs.get("dtype") is not None:  # softmax(x, dim, dtype=...) asked for a dtype
        kwargs = {**kwargs, "dtype": torch.float32}
    return _run_cast(func, args, kwargs, device_type, lambda x: _up(x, sink))


def _promote(func, args, kwargs, device_type: str, sink: GradSink | None):
    """CUDA autocast's promote rule: with floating inputs of several dtypes, cast all
    of them to the widest and run with autocast off (inner matmuls too), as CUDA does.
    ``NOT_ROUTED`` when the dtypes already agree."""
    dts = {a.dtype for a in (*args, *kwargs.values())
           if isinstance(a, torch.Tensor) and a.is_floating_point()}
    if len(dts) < 2:
        return NOT_ROUTED
    wide = functools.reduce(torch.promote_types, dts)

    def cast(x):
        if not (isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != wide):
            return x
        return _up(x, sink) if wide == torch.float32 else x.to(wide)  # as the islands do

    return _run_cast(func, args, kwargs, device_type, cast)


def _lower(func, args, kwargs, device_type: str):
    """CUDA autocast's cast rule for ``_LOWER_FUNCS``: fp32 inputs go to the autocast
    dtype (fp64 and other dtypes stay), and the op runs with autocast off."""
    dt = torch.get_autocast_dtype(device_type)

    def cast(x):
        return x.to(dt) if isinstance(x, torch.Tensor) and x.dtype == torch.float32 else x

    return _run_cast(func, args, kwargs, device_type, cast)


class PrecisionMode(TorchFunctionMode):
    """The precision context's one function mode (one Python dispatch per torch call):

    - FP32 islands: the ``keep`` families (norms, softmax, losses) run in fp32;
    - ``promote`` (the CPU): CUDA autocast's promote rule for ``_PROMOTE_FUNCS`` and
      its cast rule for ``_LOWER_FUNCS`` (mv, addmv, addr), which CPU autocast lacks;
      and fp16 LSTMs in fp32 where this CPU's oneDNN has no fp16 LSTM;
    - ``wgrad``: ``mixprec.engine.wgrad.route`` (fp32 weight gradients into ``sink``);
    - ``attention`` (the CPU, ``keep_fp32`` with ``attention_backward``): SDPA's
      backward in fp32 (``mixprec.engine.attention``).

    ``only_under_autocast``: act only where autocast is on for ``device_type``, which
    during backward means inside an activation-checkpoint recomputation.
    """

    def __init__(self, device_type: str, keep: tuple[str, ...] = (), *,
                 promote: bool = False, wgrad: bool = False, attention: bool = False,
                 sink: GradSink | None = None, only_under_autocast: bool = False) -> None:
        super().__init__()
        # plain values only: torch.compile guards on the mode's attributes, and a set of
        # functions held by the mode breaks its guard code (torch 2.13)
        self.device_type, self.sink = device_type, sink
        self.keep = tuple(k for k in keep if k in _NORM_FUNCS)
        self.promote, self.wgrad, self.attention = promote, wgrad, attention
        self.only_under_autocast = only_under_autocast

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in _TOUCHED or (self.only_under_autocast and
                                    not torch.is_autocast_enabled(self.device_type)):
            return func(*args, **kwargs)
        if func in _ISLAND_FUNCS and any(func in _NORM_FUNCS[k] for k in self.keep):
            return _island(func, args, kwargs, self.device_type, self.sink)
        out = NOT_ROUTED
        if (self.promote and func in _PROMOTE_FUNCS
                and torch.is_autocast_enabled(self.device_type)):
            out = _promote(func, args, kwargs, self.device_type, self.sink)
        elif (self.promote and func in _LOWER_FUNCS
                and torch.is_autocast_enabled(self.device_type)):
            out = _lower(func, args, kwargs, self.device_type)
        elif self.wgrad and func in ROUTED_FUNCS:
            out = route(func, args, kwargs, self.device_type, self.sink)
        elif (self.promote and func is torch.lstm
                and torch.is_autocast_enabled(self.device_type)
                and torch.get_autocast_dtype(self.device_type) == torch.float16
                and not _cpu_runs_fp16_lstm()):
            # no fp16 LSTM on this CPU: run it in fp32, as CPU autocast runs GRU and RNN
            out = _island(func, args, kwargs, self.device_type, self.sink)
        elif (self.attention and func is attention.ROUTED
              and torch.is_autocast_enabled(self.device_type)):
            out = attention.route_attention(args, kwargs)
            out = NOT_ROUTED if out is attention.NOT_TAKEN else out
        return func(*args, **kwargs) if out is NOT_ROUTED else out


def fp32_island_modules(model: nn.Module, keep: tuple[str, ...]) -> list[nn.Module]:
    """Modules that run whole in fp32: norms from other libraries that ``keep`` names
    by class-name suffix, and with ``parametrizations`` the modules of
    ``torch.nn.utils.parametrize`` (spectral_norm's power iteration keeps fp32 ``u``/``v``
    buffers, which a bf16 working weight could not meet; weight_norm is a norm).

    torch's own norm modules are not listed: the functional islands already cover them.
    """
    suffixes = tuple(s for k in keep for s in _MODULE_SUFFIXES.get(k, ()))
    found = [m for m in model.modules() if suffixes and not isinstance(m, _TORCH_NORMS)
             and type(m).__name__.endswith(suffixes)]
    if "parametrizations" in keep:
        found += [p for m in model.modules() if isinstance(m, parametrize.ParametrizationList)
                  for p in m]
    return found


def wrap_fp32_modules(modules: list[nn.Module], device_type: str) -> Callable[[], None]:
    """Make each module run its forward in fp32 (inputs upcast, autocast off).

    Overrides ``forward`` on the instance; returns a function that undoes it.
    """
    originals = []
    for m in modules:
        orig = m.forward

        @functools.wraps(orig)
        def fwd(*args, __orig=orig, **kwargs):
            with torch.autocast(device_type, enabled=False):
                return __orig(*_up(args), **{k: _up(v) for k, v in kwargs.items()})

        m.forward = fwd
        originals.append((m, orig))

    def undo() -> None:
        for m, _ in originals:
            if "forward" in m.__dict__:
                del m.forward

    return undo


def autocast_dtype(recipe: Recipe, device: torch.device | str,
                   rest: str | None = None) -> torch.dtype | None:
    """The dtype the forward's autocast runs in, or None for no autocast: fp32/tf32
    recipes, and fp8 recipes whose other layers run in fp32 (``rest``, the engine's
    agreed choice, or this device's ``mixprec.engine.devices.fp8_rest``)."""
    if not recipe.uses_autocast:
        return None
    if recipe.linear is not None and (rest or fp8_rest(recipe, device)) == "fp32":
        return None
    return recipe.compute_dtype


def make_emulation_mode(recipe: Recipe) -> EmulationMode | None:
    """The EmulationMode for a recipe (one per engine, so backward sees forward's tags),
    or None when emulation has nothing to do for it."""
    if not recipe.emulatable:
        return None
    if recipe.is_mx:
        return EmulationMode("bf16", torch.bfloat16, mx=recipe.precision.compute)
    return EmulationMode(recipe.precision.compute, recipe.compute_dtype)


def _function_modes(stack: contextlib.ExitStack, r: Recipe, dev: torch.device,
                    sink: GradSink | None, in_backward: bool) -> None:
    """Enter the FP32 islands, the CPU promote rule and the wgrad=fp32 routing."""
    compile_safe()  # under torch.compile, the routed Functions run eagerly
    wgrad = r.precision.wgrad == "fp32" and r.uses_autocast
    promote = r.uses_autocast and dev.type == "cpu"
    cpu_attention = promote and "attention_backward" in r.precision.keep_fp32
    keep = r.precision.keep_fp32 if r.has_fp32_islands else ()
    if keep or promote or wgrad:
        stack.enter_context(PrecisionMode(
            dev.type, keep, promote=promote, wgrad=wgrad, attention=cpu_attention,
            sink=sink if r.precision.wgrad == "fp32" else None,  # only wgrad=fp32 skips .grad
            only_under_autocast=in_backward))


@contextlib.contextmanager
def precision_context(recipe: Recipe | str, device: torch.device | str,
                      emulate: bool | None = None, mode: EmulationMode | None = None,
                      sink: GradSink | None = None, rest: str | None = None
                      ) -> Iterator[None]:
    """Enter the recipe's precision for a forward pass (and the loss).

    ``sink`` (the engine's ``ParamState``) receives the fp32 gradients of low-precision
    parameters under ``wgrad=fp32``; without it only fp32 parameters get them.
    ``emulate`` and ``rest`` (what fp8 recipes' other layers compute in) are the
    engine's choices, the same on every rank; None measures them on this device.

    >>> import torch
    >>> with precision_context("bf16", "cpu"):
    ...     torch.softmax(torch.randn(2, 3).bfloat16(), -1).dtype
    torch.float32
    """
    r = Recipe.coerce(recipe)
    dev = torch.device(device)
    emulate = emulating(r, dev) if emulate is None else emulate  # measured outside autocast
    with contextlib.ExitStack() as stack:
        if r.precision.compute == "tf32":
            stack.enter_context(tf32())
        dtype = autocast_dtype(r, dev, rest)
        if dtype is not None:
            stack.enter_context(torch.autocast(dev.type, dtype=dtype))
        if emulate and mode is None:
            mode = make_emulation_mode(r)
        if emulate and mode is not None:
            stack.enter_context(mode)
        check_wgrad(r, emulate)
        _function_modes(stack, r, dev, sink, in_backward=False)
        yield


@contextlib.contextmanager
def recompute_context(recipe: Recipe | str, device: torch.device | str,
                      sink: GradSink | None = None) -> Iterator[None]:
    """What ``backward`` runs under, so activation checkpointing recomputes a segment
    exactly as the forward pass computed it.

    ``torch.utils.checkpoint`` reruns forward segments during backward with the
    forward's autocast state restored, but not its function modes. Without them the
    recomputed norms would run in bf16 where the forward ran them in fp32, and torch
    raises ``CheckpointError``. Here the FP32 islands and the ``wgrad=fp32`` routing act
    only where autocast is on, which in backward means inside such a recomputation, so
    backward formulas (custom autograd Functions included) are left alone.
    """
    with contextlib.ExitStack() as stack:
        _function_modes(stack, Recipe.coerce(recipe), torch.device(device), sink,
                        in_backward=True)
        yield


def run_backward(loss: torch.Tensor, retain_graph: bool) -> None:
    """``loss.backward()``, with the precision context's function modes still on.

    ``Tensor.backward`` is itself a call that function modes intercept, and torch pops
    the intercepting mode before the autograd engine runs. So activation-checkpoint
    recomputation inside backward would run without the FP32 islands (and raise
    ``CheckpointError``: its norms would come out bf16). Entering the autograd engine
    one level lower keeps the modes on. Falls back to ``loss.backward()`` if that
    entry point ever moves.
    """
    run = getattr(torch.autograd.graph, "_engine_run_backward", None)
    if run is None:
        loss.backward(retain_graph=retain_graph)
        return
    run((loss,), (torch.ones_like(loss),), retain_graph, False, (),
        allow_unreachable=True, accumulate_grad=True)
