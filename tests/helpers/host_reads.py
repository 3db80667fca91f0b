"""The no-sync tests' instrument: torch.Tensor's value reads (``item``, ``tolist``, ...)
and, where asked, torch functions that build a tensor from Python values, each replaced
by a wrapper for the length of a ``with`` (to trap a read, or to count it)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable

import torch

__all__ = ["READS", "MIXPREC", "reads_replaced"]

#: the Tensor methods that read a value on the host
READS = ("item", "__bool__", "__float__", "__int__", "tolist")
#: a frame whose file path holds this runs mixprec's own code
MIXPREC = f"{os.sep}mixprec{os.sep}"


@contextlib.contextmanager
def reads_replaced(wrap: Callable, names: Iterable[str] = READS,
                   torch_functions: Iterable[str] = ()):
    """Each of ``names`` (torch.Tensor methods) and ``torch_functions`` (``torch.tensor``,
    ``torch.nonzero``) replaced by ``wrap(name, original)``, restored on exit."""
    methods = {n: getattr(torch.Tensor, n) for n in names}
    functions = {n: getattr(torch, n) for n in torch_functions}
    for n, f in methods.items():
        setattr(torch.Tensor, n, wrap(n, f))
    for n, f in functions.items():
        setattr(torch, n, wrap(n, f))
    try:
        yield
    finally:
        for n, f in methods.items():
            setattr(torch.Tensor, n, f)
        for n, f in functions.items():
            setattr(torch, n, f)
