"""QuantizedLinear (also importable as Float8Linear): a drop-in nn.Linear whose three
GEMMs run on the casts of a Linear format (fp8 or fp4; ``mixprec.formats.gemm``).

The module holds the format, the format's state as buffers (checkpointed, so a resumed
run continues bit-identically) and the GEMM route its format chose on this device; the
GEMMs are ``mixprec.formats.mm``'s. The bias is added in fp32; the output follows the
surrounding autocast dtype, else the input's.
"""

from __future__ import annotations

import torch
from torch import nn

from mixprec.formats.gemm.int8 import Int8Rowwise
from mixprec.formats.mm import _QuantizedMatmul
from mixprec.formats.quantized import Quantized
from mixprec.parallel.gather_casts import CastWeight
from mixprec.parallel.presharded import carry_forward
from mixprec.parallel.tensor_parallel import is_dtensor, read_layout, tp_linear, watch_sums
from mixprec.parallel.tp_agree import STREAM_STRIDE, agreement, sr_stream
from mixprec.recipe import Recipe
from mixprec.recipe.linear_format import quantizer_for


def _coerce(recipe: Recipe | str) -> Recipe:
    """``Recipe.coerce``."""
    return Recipe.coerce(recipe)

__all__ = ["Int8Linear", "QuantizedLinear", "Float8Linear", "fp8_modules", "scaling_buffers",
           "legacy_scaling_keys", "linear_class"]


def is_conv1d(m: nn.Module) -> bool:
    """A GPT-2-style ``Conv1D`` (transformers): ``y = x @ weight + bias``, with weight of
    shape (in, out) and ``nf`` = out. Matched by name: mixprec does not import
    transformers."""
    w = getattr(m, "weight", None)
    return (type(m).__name__ == "Conv1D" and isinstance(w, torch.Tensor) and w.dim() == 2
            and getattr(m, "nf", None) == w.shape[1])


class Float8Linear(nn.Linear):
    """nn.Linear whose three GEMMs run on fp8 (or fp4) operands cast by the recipe's
    quantizer (``mixprec.recipe.linear_format``); build with ``from_linear``.

    Buffers are the quantizer's state only (in ``state_dict``, so a resumed run continues
    bit-identically): delayed scaling's ``fp8_amax_history`` (3 roles ×
    ``amax_history_len``: input, weight, grad_output) and ``fp8_scale`` (3,); NVFP4's
    ``nvfp4_rng``. Any dims: the GEMM routes pad where a kernel needs it
    (``mixprec.formats.padding``).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 recipe: Recipe | str = "fp8", device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self._configure(_coerce(recipe))

    def _configure(self, r: Recipe, seed: int = 0) -> None:
        self.fp8_recipe = r
        self.quantizer = quantizer_for(r)
        if type(self) in (Float8Linear, *_NAMED.values()):  # a user's subclass stays
            self.__class__ = linear_class(self.quantizer)  # named for its format
        self.gemm_choice = self.quantizer.fp8_gemm
        state = self.quantizer.buffers(self.weight.device, seed)
        for name, (t, persistent) in state.items():
            self.register_buffer(name, t, persistent=persistent)
        self._state_names = tuple(state)

    #: the weight is stored (in_features, out_features), as in a GPT-2 ``Conv1D``
    transposed = False

    @property
    def scaling(self) -> str:
        """The quantizer's name: the recipe's ``fp8_scaling``."""
        return self.quantizer.name

    @property
    def grad_dtype(self) -> torch.dtype:
        """The output gradient's fp8 dtype."""
        return self.quantizer.grad_dtype

    @property
    def margin(self) -> int:
        """Scales are ``max / amax / 2^margin``."""
        return getattr(self.quantizer, "margin", 0)

    @property
    def block_pow2(self) -> bool:
        """Block scales rounded to powers of two (``block_scales=pow2``)."""
        return getattr(self.quantizer, "block_scales", None) == "pow2"

    @property
    def mx_rounding(self) -> str | None:
        """The format's ``mx_rounding`` (None for a format without one)."""
        return getattr(self.quantizer, "mx_rounding", None)

    def scaling_state(self) -> dict[str, torch.Tensor]:
        """The quantizer's buffers by name (empty for a scaling without history)."""
        return {n: getattr(self, n) for n in self._state_names}

    def quantize(self, t: torch.Tensor, role: str, dim: int, record: bool = False,
                 generator: torch.Generator | None = None) -> Quantized:
        """``t`` (2-D) cast for ``role`` along ``dim`` by this module's quantizer.
        ``record``: part of a training step (delayed scaling records the amax). A
        forward that builds no graph (an evaluation) does not record: it is not part of
        the step, and a checkpoint taken after it must resume like an uninterrupted run.
        A weight FSDP2 gathered as its casts (``CastWeight``) hands over its cast. On a
        tensor-parallel shard the cast's amaxes are the whole tensor's
        (``mixprec.parallel.tensor_parallel``)."""
        if isinstance(t, CastWeight):
            return t.cast(dim)
        if self._tp_layout is None:
            return self.quantizer.cast(t, role, dim, self.scaling_state(), record,
                                       generator)
        if role == "input" and dim == 1 and self._given_input is not None:
            given, self._given_input = self._given_input, None  # gathered as codes
            return given
        return self.quantizer.cast(t, role, dim, self.scaling_state(), record, generator,
                                   agree=agreement(self._tp_layout, role,
                                                   self.tp_comm_stats))

    #: the input's cast, gathered as codes by ``tensor_parallel`` (sequence parallel)
    _given_input = None

    #: the weight's tensor-parallel layout, set by a forward on DTensor weights
    _tp_layout = None
    #: where the tensor-parallel amax all-reduces are recorded (the engine's CommStats)
    tp_comm_stats = None

    def _sr_generator(self, device) -> torch.Generator | torch.Tensor | None:
        """Stochastic rounding of the gradients: a generator for this backward, seeded
        from ``nvfp4_rng`` (seed, calls) and advancing it; None where the quantizer
        rounds to nearest.

        A compiled backward cannot make a generator: there the key ``seed · 1000003 +
        calls`` (a tensor) is returned for ``nvfp4.counter_uniform``, and the count
        advances on the device, inside the graph. Under data parallelism the key moves
        by this rank's stream (``tp_agree.sr_stream``): each data-parallel rank rounds
        its own gradients with its own numbers, the ranks of one tensor-parallel group
        (which see the same data) with the same, on sharded and whole weights alike.
        Compiled and eager runs draw different random bits, each reproducible and
        resumable from the same buffer (a module that switches between the two within
        one run continues its eager count from its last eager backward; a checkpoint
        or ``load_state_dict`` re-reads it)."""
        if not self.quantizer.stochastic_grads or torch.device(device).type == "meta":
            return None  # (meta tensors: shapes only, rounded to nearest)
        shift = self._sr_stream_shift()
        if torch.compiler.is_compiling():
            return self._sr_key(device)
        if self._rng_host is None:  # once after construction or a load: one host read
            self._rng_host = [int(v) for v in self.nvfp4_rng.tolist()]
        seed, calls = self._rng_host
        self._rng_host[1] += 1
        self.nvfp4_rng[1] += 1  # the checkpointed copy, on the device: no host sync
        return torch.Generator(device).manual_seed(seed * 1_000_003 + calls + shift)

    def _sr_stream_shift(self) -> int:
        """``sr_stream · STREAM_STRIDE``: data-parallel ranks draw apart. The engine
        fixes it by the ranks that share this rank's data (``tp_agree.share_streams``);
        a module it did not build takes its weight's tensor-parallel group, if any."""
        shift = getattr(self, "_sr_shift", None)
        if shift is None:
            layout = getattr(self, "_tp_layout", None)
            shift = sr_stream(None if layout is None else layout.group) * STREAM_STRIDE
            if not torch.compiler.is_compiling():  # (a graph keeps no side effect)
                self._sr_shift = shift
        return shift

    #: ``sr_stream · STREAM_STRIDE``, fixed by the engine at its build (else by this
    #: rank at the first backward)
    _sr_shift: int | None = None

    def _sr_key(self, device) -> torch.Tensor | None:
        """This backward's key of the counter stream, ``seed · 1000003 + calls`` from
        ``nvfp4_rng`` (a tensor) plus this rank's stream, the count advanced on the
        device; None where the quantizer rounds to nearest."""
        if not self.quantizer.stochastic_grads or torch.device(device).type == "meta":
            return None
        rng = self.nvfp4_rng
        key = rng[0] * 1_000_003 + rng[1] + self._sr_stream_shift()
        rng[1:] += 1
        return key

    _rng_host: list[int] | None = None

    #: buffers every Float8Linear of mixprec 0.2 saved, whatever its scaling
    _V02_BUFFERS = ("fp8_amax_history", "fp8_scale")

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        """Also loads a state dict saved by mixprec 0.2, whose Float8Linears held
        delayed-scaling buffers under every scaling: a scaling without history reads
        nothing from them, so they are dropped."""
        self._rng_host = None  # the loaded nvfp4_rng is read again on the next backward
        own = self.scaling_state()
        for name in self._V02_BUFFERS:
            if name not in own:
                state_dict.pop(prefix + name, None)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    @classmethod
    def from_linear(cls, linear: nn.Module, recipe: Recipe | str = "fp8",
                    seed: int = 0) -> Float8Linear:
        """A Float8Linear that shares ``linear``'s weight and bias Parameters (so an
        optimizer built over the model still holds them).

        ``linear`` is an ``nn.Linear``, or a GPT-2-style ``Conv1D`` (``y = x @ W + b``
        with ``W`` of shape (in, out)): its weight keeps that layout, so the state dict
        stays loadable by the original model, and the GEMM uses its transpose."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        if is_conv1d(linear):
            new.in_features, new.out_features = linear.weight.shape
            new.transposed = True
        else:
            new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight = linear.weight
        new.bias = linear.bias
        # the module it replaces, kept outside the module tree, for ``to_linear``
        new.__dict__["_source"] = linear
        new._configure(_coerce(recipe), seed)
        for hooks in _HOOK_DICTS:  # torch's tensor-parallel plans live in these hooks
            setattr(new, hooks, getattr(linear, hooks))
        carry_forward(linear, new)  # transformers' plans replace forward instead
        if is_dtensor(new.weight):  # a plan's shards: rounds its sums after the plan
            watch_sums(new)
            read_layout(new)
        return new

    def to_linear(self) -> nn.Module:
        """The module ``from_linear`` replaced (an ``nn.Linear``, a ``Conv1D``), holding
        this module's weight and bias Parameters (the same objects, so an optimizer
        still holds them), to put back in its place; a plain ``nn.Linear`` over them for
        a module built otherwise. The format's scaling state stays here."""
        old = self.__dict__.get("_source")
        if old is None and self.transposed:
            raise ValueError(f"{type(self).__name__} with a (in, out) weight was not built "
                             "by from_linear: the module to put back is unknown")
        if old is None:
            old = nn.Linear.__new__(nn.Linear)
            nn.Module.__init__(old)
            old.in_features, old.out_features = self.in_features, self.out_features
        old.weight = self.weight
        old.bias = self.bias
        return old

    @property
    def backend(self) -> str:
        """The GEMM route that runs (``mixprec.formats.route.gemm_route`` for ``fp8_gemm``):
        ``"scaled_mm"`` (torch's scaled matmul: ``torch._scaled_mm`` per tensor and
        rowwise, the block-scaled kernels for block, MX and NVFP4), ``"dequant"`` (fp8
        values in bf16, whose products are exact, fp32 accumulation) or
        ``"dequant_fp32"``."""
        return self.quantizer.route(self.weight.device, self.gemm_choice)

    def update_scales(self, found_inf: torch.Tensor | None = None) -> None:
        """Once per optimizer step: the quantizer's update (delayed scaling advances its
        history; a no-op for the others)."""
        self.quantizer.update(self.scaling_state(), found_inf)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T + b`` with x, W and (in backward) the gradient cast by the
        quantizer; the output is in the autocast dtype."""
        dev = x.device.type
        out_dtype = (torch.get_autocast_dtype(dev) if dev != "meta"
                     and torch.is_autocast_enabled(dev) else x.dtype)
        x2d = x.reshape(-1, x.shape[-1])
        w = self.weight.t() if self.transposed else self.weight  # (out, in) either way
        if is_dtensor(w):  # torch's ColwiseParallel / RowwiseParallel: the local shards
            return tp_linear(self, x, w, out_dtype)
        # whether to record amaxes is decided here: inside the Function, grad is off
        y = _QuantizedMatmul.apply(x2d, w, self, out_dtype, torch.is_grad_enabled())
        if self.bias is not None:
            y = (y.float() + self.bias.float()).to(out_dtype)  # bias in high precision
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        """Linear's repr plus the scaling, the weight layout and the gradient's cast
        (the format's dtype for it: ``e5m2``, ``e4m3``, ``int8``)."""
        layout = "weight=(in, out), " if self.transposed else ""
        grad = str(self.quantizer.dtype("grad_output")).removeprefix("torch.")
        return (f"{super().extra_repr()}, scaling={self.scaling}, {layout}"
                f"grad={grad.removeprefix('float8_').removesuffix('fn')}, "
                f"gemm={self.gemm_choice}")


class Int8Linear(Float8Linear):
    """A ``Float8Linear`` whose format is int8 (``linear_class``): the same
    module, shown as what it computes in reprs and reports (``type(m).__name__``);
    ``isinstance(m, Float8Linear)`` holds. ``Float8Linear.from_linear`` and
    ``convert`` build it for an int8 recipe."""


#: the Linear class a format's Linears are shown as, by the format's class (its
#: subclasses too); every other format's is ``Float8Linear``
_NAMED: dict[type, type[Float8Linear]] = {Int8Rowwise: Int8Linear}


def linear_class(fmt: object) -> type[Float8Linear]:
    """The Linear class of format ``fmt``'s Linears: named for what it computes."""
    return next((c for f, c in _NAMED.items() if isinstance(fmt, f)), Float8Linear)


#: a module's hooks that ``from_linear`` carries over (``parallelize_module``'s input and
#: output redistributions among them)
_HOOK_DICTS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
               "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
               "_backward_pre_hooks", "_backward_hooks")

#: the name of what it is: it runs fp4 formats too
QuantizedLinear = Float8Linear


def fp8_modules(model: nn.Module) -> dict[str, Float8Linear]:
    """The model's Float8Linears by qualified name: the one test for "converted to fp8"
    (by ``convert``, or by hand)."""
    return {n: m for n, m in model.named_modules() if isinstance(m, Float8Linear)}


def legacy_scaling_keys(model: nn.Module, state: dict) -> set[str]:
    """Keys of ``state`` (a ``model.state_dict()`` saved by mixprec 0.2) that name the
    delayed-scaling buffers every Float8Linear held there, for modules whose scaling
    keeps no history now; ``load_state_dict`` drops them."""
    out = set()
    for name, m in fp8_modules(model).items():
        own = m.scaling_state()
        for b in Float8Linear._V02_BUFFERS:
            key = f"{name}.{b}" if name else b
            if b not in own and key in state:
                out.add(key)
    return out


def scaling_buffers(m: Float8Linear) -> dict[str, torch.Tensor]:
    """The module's fp8 scaling state by buffer name: amax history, scales, fp8 maxima,
    and NVFP4's stochastic-rounding counter (not weights: ``fp32_state_dict`` leaves
    them out; the memory ledger counts them as ``fp8``)."""
    out = m.scaling_state()
    for name in ("fp8_gather_scale", "fp8_gather_amax"):
        if getattr(m, name, None) is not None:
            out[name] = getattr(m, name)
    return out
