"""The training engine: ``MixedPrecision`` (the facade) and the rooms it is built from:
``build`` (the parts from a model, optimizers and a recipe), ``param_state`` (master
weights and the one owner of every gradient), ``scaler``, ``context`` (autocast and the
fp32 islands), ``emulate`` and ``devices`` (measured device choices), ``step``,
``checks``, ``gradnorm``, ``wgrad``, ``attention``, ``coverage`` and ``watch``."""

import importlib

#: public name -> the submodule that defines it
_EXPORTS = {
    "MixedPrecision": "facade",
    "StepResult": "facade",
    "SkipLimitError": "watch",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    """The public names, imported on first use: the package's own submodules are imported
    by rooms below the facade, which must not pull the facade in with them."""
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
