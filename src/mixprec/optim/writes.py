"""Writing an fp32 update into a bf16/fp16 weight that has no fp32 master.

The optimizer computes the new value of each weight in fp32 (``new``); the write rule
decides what the 16-bit weight keeps of it. With ``w = 1.0`` in bf16 (spacing 2^-7)
and 1000 updates of ``+1e-4``:

- ``nearest``: round to nearest even. An update below half the spacing is lost every
  time: the weight stays 1.0 (the classic vanishing update).
- ``stochastic``: round up with probability equal to the remainder's share of the
  spacing, so ``E[w_new] = new`` (unbiased): the weight reaches 1.1 in expectation. The
  random bits are counter-based (``counter_bits``): a hash of the optimizer's seed, the
  parameter's position, the applied-step count and the element's index in the *whole*
  tensor. So every data-parallel replica draws the same bits (its weights stay
  equal), an FSDP shard draws exactly the bits of its rows of the whole tensor (sharded
  training equals one process's, bit for bit, at any world size), and the stream's
  state is one step counter, checkpointed, that a skipped step does not advance.
- ``kahan``: a compensation buffer ``c`` in the weight's dtype holds what the last
  rounding dropped (``c = w - true``); the next update starts from ``w - c``. The
  stored weight then follows the exact sum: 1000 updates give the bf16 nearest to 1.1.
  Costs 2 bytes per parameter.
- ``remainder`` (bf16 only): an int16 remainder holds the low 16 bits of the fp32
  value, so bf16 weight + remainder *is* the fp32 master, exactly, for 2 bytes instead
  of 4. The weight is the fp32 value rounded to nearest, ties away from zero: with 16
  bits there is no room to record which way a tie went under ties-to-even (a bf16
  value has 65,537 fp32 values that round to it when it is even), so at the 1-in-2^17
  fp32 values that are ties towards an even bf16 the weight is the other neighbour.

Each rule is a ``WriteRule`` object in the registry ``RULES`` (``write_rule(name)``): it
owns the state it keeps per parameter (its checkpoint form: optimizer state entries
under ``buffers``' names), how it reads the weight into fp32 and lands an update in
it, and its bytes per parameter (``write_bytes``, which the memory planner asks).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

__all__ = ["WriteName", "WriteRule", "Stream", "RULES", "WRITE_RULES", "write_rule",
           "stochastic_round", "counter_bits", "stream_key", "split_remainder",
           "join_remainder", "write_bytes"]

WriteName = Literal["nearest", "stochastic", "kahan", "remainder"]

_LOW = 0xFFFF


_M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``x * c mod 2^32`` for ``x`` in [0, 2^32) (int64), without int64 overflow: the
    constant is split in 16-bit halves, each partial product below 2^48."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _M32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash with full avalanche (Wellons' ``lowbias32``), on int64."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _mix32_int(x: int) -> int:
    """``_mix32`` on a Python int (the same hash, no tensor)."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def stream_key(seed: int, index: int, step: torch.Tensor) -> torch.Tensor:
    """The 32-bit key of one parameter's draw: the optimizer's ``seed``, the
    parameter's ``index`` in it and the applied-step counter ``step`` (a 0-d int64
    tensor, on the device). The seed and index part is hashed on the host as a Python
    int, so a draw makes no host-device transfer."""
    base = _mix32_int(((seed * 0x9E3779B1) ^ index) & _M32)
    return _mix32((step.to(torch.int64) ^ base) & _M32)


def counter_bits(shape: Sequence[int], key: torch.Tensor, offset: int = 0, nbits: int = 16
                 ) -> torch.Tensor:
    """Uniform ``nbits``-bit integers (int32), one per element of a tensor of
    ``shape`` whose first element is element ``offset`` of the whole tensor: a hash of
    the key and each element's global index, so any slice of rows draws exactly the
    bits the whole tensor would there."""
    n = math.prod(shape)
    i = torch.arange(offset, offset + n, dtype=torch.int64, device=key.device)
    h = _mix32((i & _M32) ^ key)
    h = _mix32(h ^ (i >> 32) ^ 0x5BD1E995)  # elements past 2^32 change the stream too
    return (h >> (32 - nbits)).to(torch.int32).view(shape)


def stochastic_round(x: torch.Tensor, dtype: torch.dtype,
                     generator: torch.Generator | None = None, *,
                     bits: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` (fp32) rounded stochastically to ``dtype`` (bf16 or fp16), unbiased.

    bf16: a uniform 16-bit integer is added to the fp32 bit pattern and the low 16 bits
    are dropped, which rounds the magnitude up with probability (dropped bits) / 2^16.
    Non-finite values pass through. fp16: ``mixprec.formats.elements.quantize`` with
    ``rounding="stochastic"`` (its subnormals and overflow included). The random
    integers come from ``bits`` (``counter_bits``: 16 bits for bf16, 24 for fp16,
    whose uniform is bits / 2^24) or, without them, from ``generator``."""
    if dtype == torch.float16:
        from mixprec.formats.elements import quantize

        noise = None if bits is None else bits.to(torch.float32) * 2.0**-24
        return quantize(x, "fp16", rounding="stochastic", generator=generator,
                        noise=noise).to(dtype)
    if dtype != torch.bfloat16:
        raise ValueError(f"stochastic rounding writes bf16 or fp16 weights, not {dtype}")
    r = bits if bits is not None else torch.randint(
        0, 1 << 16, x.shape, dtype=torch.int32, device=x.device, generator=generator)
    bits = (x.view(torch.int32) + r) & ~_LOW
    out = bits.view(torch.float32)
    return torch.where(torch.isfinite(x), out, x).to(dtype)


def split_remainder(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``x`` as (bf16 weight, int16 remainder) with ``join_remainder`` exact.

    The weight's bits are the top 16 of ``x``'s, plus one where the low 16 are 0x8000
    or more (round half away from zero); the remainder is ``x``'s bits minus the
    weight's shifted up, which then lies in [-2^15, 2^15). A NaN whose rounding would
    carry out of the exponent (top 16 bits 0x7FFF or 0xFFFF, low 16 >= 0x8000) keeps
    its top 16 bits as a NaN weight and a zero remainder: the low bits of its payload
    are the one thing not kept (the alternative, a zero weight, would hide it)."""
    bits = x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    hi = (bits >> 16) + ((bits & _LOW) >= 0x8000).to(torch.int64)
    carry_out = torch.isnan(x) & ((hi & 0x7FFF) == 0)  # 0x7FFF + 1 would read as -0
    hi = torch.where(carry_out, bits >> 16, hi)
    rem = torch.where(carry_out, 0, bits - (hi << 16))
    w = _int_to(hi & _LOW, torch.int16).view(torch.bfloat16)
    return w, rem.to(torch.int16)


def join_remainder(w: torch.Tensor, rem: torch.Tensor) -> torch.Tensor:
    """The fp32 value a bf16 weight and its int16 remainder hold."""
    hi = w.view(torch.int16).to(torch.int64) & _LOW
    bits = ((hi << 16) + rem.to(torch.int64)) & 0xFFFFFFFF
    return _int_to(bits, torch.int32).view(torch.float32)


def _int_to(u: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Unsigned values in int64 as the two's-complement ``dtype`` of the same width."""
    width = torch.iinfo(dtype).bits
    return torch.where(u >= (1 << (width - 1)), u - (1 << width), u).to(dtype)


@dataclass(frozen=True)
class Stream:
    """Where a stochastic write's bits come from: the optimizer's ``seed``, the
    parameter's ``index`` in it, the applied-step counter ``step`` (0-d int64, on the
    device) and ``offset``, the index in the whole tensor of the first element written
    (a piece of rows, or an FSDP shard)."""

    seed: int
    index: int
    step: torch.Tensor
    offset: int = 0


class WriteRule:
    """How an fp32 update lands in a bf16/fp16 weight that has no fp32 master (the
    module docstring compares the rules). ``read`` gives the fp32 value the update
    starts from; ``land`` rounds the updated value to the weight's dtype and returns
    the new contents of the rule's buffers."""

    name: ClassVar[str] = ""
    #: the state entries the rule keeps per parameter; they are saved and loaded as
    #: optimizer state under these names
    buffers: ClassVar[tuple[str, ...]] = ()
    #: whether ``land`` draws random bits (the optimizer then passes a ``Stream``)
    draws_bits: ClassVar[bool] = False

    def bytes_per_param(self, weight_bytes: int = 2) -> int:
        """Bytes the rule keeps per element of a weight stored in ``weight_bytes`` bytes
        (2 for bf16/fp16; 4 for the fp32 tensors that hold emulated ones)."""
        return 2 * len(self.buffers)

    def check_weight(self, fmt: str) -> None:
        """Raise unless the rule can write weights of format ``fmt`` (bf16, fp16)."""

    def init_state(self, p: torch.Tensor, state: dict) -> None:
        """Create the rule's buffers for the 16-bit (or emulated) weight ``p``."""
        for name in self.buffers:
            state[name] = torch.zeros_like(p, memory_format=torch.preserve_format)

    def read(self, p: torch.Tensor, state: dict) -> torch.Tensor:
        """The fp32 value of weight ``p`` that the update starts from (a new tensor
        where ``p`` is not fp32)."""
        w = p.data.float()
        return w if w is not p.data else w.clone()

    def land(self, w: torch.Tensor, dtype: torch.dtype, state: dict,
             stream: Stream | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``(weight, buffers)``: the updated fp32 value ``w`` in ``dtype``, and the new
        contents of the rule's buffers by name."""
        return w.to(dtype), {}

    def stored_value(self, p: torch.Tensor, state: dict) -> torch.Tensor:
        """The fp32 value the weight ``p`` and the rule's buffers hold (a copy)."""
        return p.detach().float().clone()

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class Nearest(WriteRule):
    """Round to nearest even; no state."""

    name = "nearest"


class Stochastic(WriteRule):
    """Unbiased stochastic rounding on counter-based bits (16 for bf16, 24 for fp16)."""

    name = "stochastic"
    draws_bits = True

    def land(self, w, dtype, state, stream=None):
        if stream is None:
            raise ValueError("write='stochastic' draws its bits from a Stream (seed, "
                             "parameter index, step counter); pass one")
        key = stream_key(stream.seed, stream.index, stream.step)
        bits = counter_bits(w.shape, key, stream.offset,
                            16 if dtype == torch.bfloat16 else 24)
        return stochastic_round(w, dtype, bits=bits), {}


class Kahan(WriteRule):
    """A compensation buffer in the weight's dtype holds what the last rounding
    dropped; the next update starts from the weight less it."""

    name = "kahan"
    buffers = ("kahan_comp",)

    def bytes_per_param(self, weight_bytes: int = 2) -> int:
        return weight_bytes  # the compensation takes the weight's dtype

    def read(self, p, state):
        return p.data.float() - state["kahan_comp"].float()

    def land(self, w, dtype, state, stream=None):
        new = w.to(dtype)
        return new, {"kahan_comp": (new.float() - w).to(dtype)}

    def stored_value(self, p, state):
        return p.detach().float() - state["kahan_comp"].float()


class Remainder(WriteRule):
    """bf16 weight + int16 remainder = the fp32 value, exactly."""

    name = "remainder"
    buffers = ("remainder",)

    def check_weight(self, fmt):
        if fmt != "bf16":
            raise ValueError("write='remainder' keeps bf16 weights' low 16 bits; this "
                             f"parameter is {fmt}. Use write='kahan' or 'stochastic' for "
                             "fp16 weights.")

    def init_state(self, p, state):
        state["remainder"] = torch.zeros(p.shape, dtype=torch.int16, device=p.device)

    def read(self, p, state):
        return join_remainder(p.data.to(torch.bfloat16), state["remainder"])

    def land(self, w, dtype, state, stream=None):
        new, rem = split_remainder(w)
        return new, {"remainder": rem}

    def stored_value(self, p, state):
        return join_remainder(p.detach().to(torch.bfloat16), state["remainder"])


#: the write rules by name
RULES: dict[str, WriteRule] = {r.name: r for r in (Nearest(), Stochastic(), Kahan(),
                                                   Remainder())}
WRITE_RULES = tuple(RULES)


def write_rule(name: str) -> WriteRule:
    """The write rule called ``name``; an unknown name raises, naming the valid ones."""
    rule = RULES.get(name) if isinstance(name, str) else None
    if rule is None:
        raise ValueError(f"write rule {name!r}; valid: {', '.join(WRITE_RULES)} (pass one "
                         "of them as write=)")
    return rule


def write_bytes(rule: str, numel: int, weight_bytes: int = 2) -> int:
    """Bytes the rule keeps beside a weight of ``numel`` elements stored in
    ``weight_bytes`` bytes each (kahan's compensation, remainder's int16)."""
    return write_rule(rule).bytes_per_param(weight_bytes) * numel
