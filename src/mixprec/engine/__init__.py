"""The training engine: ``MixedPrecision`` (the facade) and the rooms it is built from:
``build`` (the parts from a model, optimizers and a recipe), ``param_state`` (master
weights and the one owner of every gradient), ``scaler``, ``context`` (autocast and the
fp32 islands), ``emulate`` and ``devices`` (measured device choices), ``step``,
``checks``, ``gradnorm``, ``wgrad``, ``attention``, ``coverage`` and ``watch``."""

from mixprec._imports import lazy_exports

#: public name -> the submodule that defines it
_EXPORTS = {
    "MixedPrecision": "facade",
    "StepResult": "facade",
    "SkipLimitError": "watch",
}

__all__ = list(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
