"""Every public function and method is fully annotated (the package ships py.typed)."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Iterator

from helpers.source import modules_with_all


def _public_functions() -> Iterator[tuple[str, Callable]]:
    """``(qualified name, function)`` for each public function of the public modules
    (``__all__``) and each non-underscore method, property and ``__init__`` of their
    public classes; only objects defined in the module itself, not re-exports."""
    for m in modules_with_all():
        mod = importlib.import_module(m)
        for n in mod.__all__:
            obj = getattr(mod, n)
            if inspect.isfunction(obj) and obj.__module__ == m:
                yield f"{m}.{n}", obj
            elif inspect.isclass(obj) and obj.__module__ == m:
                for k, v in vars(obj).items():
                    if k.startswith("_") and k != "__init__":
                        continue
                    if k == "__init__" and getattr(obj, "_is_protocol", False):
                        continue  # a Protocol's __init__ is typing's, not the module's
                    f = v.fget if isinstance(v, property) else getattr(v, "__func__", v)
                    if inspect.isfunction(f):
                        yield f"{m}.{n}.{k}", f


def _missing(name: str, fn: Callable) -> list[str]:
    """Each parameter (but ``self`` / ``cls``) without an annotation, and the return
    type unless it is an ``__init__``."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return []
    out = [f"{name}({p.name})" for p in sig.parameters.values()
           if p.name not in ("self", "cls") and p.annotation is inspect.Parameter.empty]
    if sig.return_annotation is inspect.Signature.empty and not name.endswith("__init__"):
        out.append(f"{name} -> ?")
    return out


def test_every_public_function_and_method_is_annotated():
    missing = [item for name, fn in _public_functions() for item in _missing(name, fn)]
    assert not missing, (f"{len(missing)} missing annotation(s), add them:\n"
                         + "\n".join(missing))


def test_the_walk_finds_the_public_api():
    """The check would pass on nothing if the walk found nothing."""
    names = {name for name, _ in _public_functions()}
    assert "mixprec.engine.facade.MixedPrecision.__init__" in names
    assert "mixprec.checkpoint.core.save_atomic" in names
