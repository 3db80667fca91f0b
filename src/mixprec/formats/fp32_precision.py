"""torch's fp32 matmul and convolution precision, whichever of its two APIs set it.

torch lets fp32 GEMMs and convolutions run in TF32 (NVIDIA tensor cores) or bf16
(oneDNN on AMX / AVX-512 BF16 CPUs) through two APIs:

- the legacy one: ``torch.set_float32_matmul_precision("highest" | "high" | "medium")``,
  ``torch.backends.cuda.matmul.allow_tf32`` and ``torch.backends.cudnn.allow_tf32``;
- the per-backend one (torch 2.9+): ``fp32_precision`` on ``torch.backends.cuda.matmul``,
  ``torch.backends.cudnn.conv`` and ``.rnn``, ``torch.backends.mkldnn.matmul`` (and their
  parents ``torch.backends.cudnn``, ``torch.backends.mkldnn``, ``torch.backends``): one
  of ``ieee``, ``tf32``, ``bf16``, or ``none`` (follow the parent).

The legacy setters write the per-backend settings too; the per-backend setters leave the
legacy state alone. torch's legacy readers (``get_float32_matmul_precision``, the two
``allow_tf32``, and the one cuBLAS asks for every handle it hands out on CUDA) raise
"mix of the legacy and new APIs" when the two disagree. Training scripts use the legacy
API, libraries the new one (transformers' ``tf32=True``), so mixprec changes both in step
and puts back exactly what it found:

- ``ieee_fp32_matmul()``: fp32 matmuls in IEEE fp32 (the exact routes, emulation);
- ``tf32()``: TF32 matmuls and cuDNN convolutions (the ``tf32`` recipe);
- ``Fp32Precision.read()`` / ``restore()``: the whole state, read without raising
  whatever mix the user left;
- ``fp32_matmul_is_ieee()``: whether fp32 matmuls run in IEEE fp32 now.

A per-backend setting that equals its parent's is read as ``none`` (torch reports the
value a setting resolves to, not whether it was set), which resolves the same.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import torch

__all__ = ["Fp32Precision", "ieee_fp32_matmul", "tf32", "fp32_matmul_is_ieee"]

#: torch 2.9 brought the per-backend settings with ``ieee`` / ``none`` values and the
#: checks between the two APIs; before it only the legacy API is touched
_PER_BACKEND = tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 9)

_MATMUL = ("cuda.matmul", "mkldnn.matmul")
_CUDNN = ("cuda.conv", "cuda.rnn")


@functools.cache
def _knobs() -> dict:
    """``name -> (setting, parent)``: each per-backend setting mixprec changes and the
    module whose ``fp32_precision`` reads the backend-wide value it follows when
    ``none`` (looked up once: these are module-level singletons)."""
    b = torch.backends
    return {"cuda.matmul": (b.cuda.matmul, b.cudnn), "mkldnn.matmul": (b.mkldnn.matmul, b.mkldnn),
            "cuda.conv": (b.cudnn.conv, b.cudnn), "cuda.rnn": (b.cudnn.rnn, b.cudnn)}


def _knob(name: str):
    return _knobs()[name]


def _own(name: str) -> str:
    knob, parent = _knob(name)
    value = knob.fp32_precision
    return "none" if value == parent.fp32_precision else value


def _set(values: dict[str, str]) -> None:
    for name, value in values.items():
        _knob(name)[0].fp32_precision = value


def _legacy_matmul(knobs: dict[str, str]) -> str:
    """``torch.get_float32_matmul_precision()``, read with the per-backend matmul
    settings at ``ieee``, which agrees with every legacy value (as the user left them,
    torch raises where they disagree with it, and an exception costs ~50 us)."""
    if not knobs:
        return torch.get_float32_matmul_precision()
    _set(dict.fromkeys(_MATMUL, "ieee"))
    try:
        return torch.get_float32_matmul_precision()
    finally:
        _set({k: knobs[k] for k in _MATMUL})


def _legacy_cudnn(knobs: dict[str, str]) -> bool:
    """``torch.backends.cudnn.allow_tf32``; where conv / rnn disagree with it (torch
    raises), read with both at ``tf32``, where torch answers only if it is True."""
    try:
        return torch.backends.cudnn.allow_tf32
    except RuntimeError:
        if not knobs:
            raise
    _set(dict.fromkeys(_CUDNN, "tf32"))
    try:
        return torch.backends.cudnn.allow_tf32
    except RuntimeError:
        return False
    finally:
        _set({k: knobs[k] for k in _CUDNN})


@dataclass(frozen=True)
class Fp32Precision:
    """The fp32 precision state: the legacy matmul precision, the legacy cuDNN flag
    (None when not read) and the per-backend settings, ``(name, value)``."""

    matmul: str
    cudnn: bool | None = None
    knobs: tuple[tuple[str, str], ...] = ()

    @classmethod
    def read(cls, *, conv: bool = True) -> Fp32Precision:
        """The current state, whatever mix of the APIs set it (never raises for a mix);
        ``conv=False`` leaves out cuDNN's (what ``ieee_fp32_matmul`` changes)."""
        names = _MATMUL + (_CUDNN if conv else ())
        knobs = {n: _own(n) for n in names} if _PER_BACKEND else {}
        return cls(_legacy_matmul(knobs), _legacy_cudnn(knobs) if conv else None,
                   tuple(knobs.items()))

    def restore(self) -> None:
        """Put this state back: the legacy settings first (their setters write the
        per-backend ones), then the per-backend settings as they were."""
        torch.set_float32_matmul_precision(self.matmul)
        if self.cudnn is not None:
            torch.backends.cudnn.allow_tf32 = self.cudnn
        _set(dict(self.knobs))


def fp32_matmul_is_ieee() -> bool:
    """Whether fp32 matmuls run in IEEE fp32 on every backend now, read from the
    per-backend settings (which both APIs write), so a mix never raises."""
    if not _PER_BACKEND:
        return torch.get_float32_matmul_precision() == "highest"
    return all(_knob(n)[0].fp32_precision in ("ieee", "none") for n in _MATMUL)


def _warn_inexact_under_compile() -> bool:
    """Warn, once per process, that compiled exact routes follow the user's setting."""
    if not _WARNED_COMPILE:
        _WARNED_COMPILE.append(True)
        warnings.warn(
            "torch.compile: the fp32 matmul precision is not 'highest', so the exact "
            "fp32 GEMMs of the dequantizing fp8/block/MX/NVFP4 routes run in reduced "
            "precision inside compiled graphs (eager pins IEEE fp32 around them); call "
            "torch.set_float32_matmul_precision('highest') to make them exact",
            stacklevel=2)
    return True


_WARNED_COMPILE: list[bool] = []

# What ``torch.compiler.assume_constant_result`` marks (dynamo calls the function once
# while tracing and keeps the answer as a constant), set here directly: the decorator
# imports dynamo, which importing mixprec must not. tests/engine/test_compile.py counts 0
# graph breaks through these under inductor.
fp32_matmul_is_ieee._dynamo_marked_constant = True
_warn_inexact_under_compile._dynamo_marked_constant = True


@contextlib.contextmanager
def ieee_fp32_matmul() -> Iterator[None]:
    """fp32 matmuls inside run in full IEEE fp32, whatever the user set and through
    whichever API, and the user's setting is restored exactly on exit.

    ``torch.set_float32_matmul_precision("medium")`` (or ``"high"``, ``allow_tf32``, or
    the per-backend ``fp32_precision``) lets fp32 GEMMs run in bf16 on AMX / AVX-512 BF16
    CPUs (oneDNN) and in TF32 on NVIDIA GPUs: about 3 significant digits. mixprec's exact
    routes (the dequantizing fp8, block, MX and NVFP4 GEMMs, and emulation) compute
    products of low-precision values that fp32 holds exactly, so they pin IEEE around
    their GEMMs (both APIs at once, so no legacy reader inside sees a mix); everything
    else keeps the user's choice.

    Under ``torch.compile`` the setting cannot change inside a graph: the GEMMs run in
    whatever precision is set when the graph runs, and a setting other than IEEE warns
    once (``torch.set_float32_matmul_precision("highest")`` makes them exact)."""
    if torch.compiler.is_compiling():
        if not fp32_matmul_is_ieee():
            _warn_inexact_under_compile()
        yield
        return
    # IEEE already, and the legacy reading agrees (it cannot raise with these settings)
    if fp32_matmul_is_ieee() and torch.get_float32_matmul_precision() == "highest":
        yield
        return
    saved = Fp32Precision.read(conv=False)
    torch.set_float32_matmul_precision("highest")  # legacy and per-backend: IEEE
    try:
        yield
    finally:
        saved.restore()


@contextlib.contextmanager
def tf32() -> Iterator[None]:
    """TF32 for fp32 matmuls and cuDNN convolutions inside (``set_float32_matmul_precision
    ("high")`` and ``cudnn.allow_tf32``, which write both APIs), the user's settings
    restored exactly on exit, whichever API set them."""
    saved = Fp32Precision.read()
    torch.set_float32_matmul_precision("high")
    torch.backends.cudnn.allow_tf32 = True
    try:
        yield
    finally:
        saved.restore()
