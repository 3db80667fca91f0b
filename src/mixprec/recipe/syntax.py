"""The short-string syntax of a recipe: ``"preset[,key=value...][,kind:PATTERN=FORMAT...]"``
read into flat ``key -> value`` fields, and flat fields written back as the shortest
such string (the preset they differ least from, then the differences in field order).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from mixprec.formats.gemm import DEFAULT_FORMAT, FORMATS
from mixprec.recipe.configs import DEFAULT_KEEP_FP32
from mixprec.recipe.layer_rules import LayerRule, parse_rule
from mixprec.recipe.presets import PRESET_FIELDS, preset_names

__all__ = ["FLAT_DEFAULTS", "parse_text", "format_text", "preset_flat"]

#: every key a recipe string may set, in the order ``str()`` writes them, with its
#: default (the Linear format's keys apply to the format that has them, the last-layers
#: and layout keys to any Linear format; a format's key not listed here follows, from
#: the registry: ``_format_keys``)
FLAT_DEFAULTS: dict[str, Any] = {
    "compute": "fp32", "params": "fp32", "master": "none", "states": "fp32",
    "write": "nearest", "grads": "fp32", "grad_accum": "plain", "wgrad": "compute",
    "comm": "fp32", "loss_scale": "none", "init_scale": 2.0**16, "growth_factor": 2.0,
    "backoff_factor": 0.5, "growth_interval": 2000, "hysteresis": 1, "min_scale": 1.0,
    "max_scale": 2.0**24, "skip_limit": 100, "on_skip_limit": "warn",
    "keep_fp32": DEFAULT_KEEP_FP32, "emulate": None,
    "fp8_scaling": DEFAULT_FORMAT, "fp8_format": "hybrid", "amax_history_len": 16,
    "amax_compute_algo": "max", "margin": 0, "fp8_gemm": "auto", "block_scales": "fp32",
    "mx_rounding": "rceil", "nvfp4_2d": True, "nvfp4_rht": True, "nvfp4_sr": True,
    "bf16_last_layers": 0, "bf16_last_fraction": 0.0, "fp8_all_gather": False,
    "tp_reduce": "fp32",
}


def _format_keys() -> dict[str, Any]:
    """The fields of the registry's formats that ``FLAT_DEFAULTS`` does not list, each
    with the default of the class that declares it."""
    out: dict[str, Any] = {}
    for cls in FORMATS.values():
        for f in dataclasses.fields(cls):
            if f.name not in FLAT_DEFAULTS and f.name not in out:
                top = next(c for c in reversed(cls.__mro__)
                           if f.name in getattr(c, "__dataclass_fields__", {}))
                out[f.name] = top.__dataclass_fields__[f.name].default
    return out


FLAT_DEFAULTS.update(_format_keys())
_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def preset_flat(name: str) -> dict[str, Any]:
    """Every flat field of preset ``name``."""
    return {**FLAT_DEFAULTS, **PRESET_FIELDS[name]}


def parse_text(text: str) -> tuple[str, dict[str, Any], tuple[LayerRule, ...]]:
    """``text`` as (preset name, overridden fields, rules). Each key may appear once;
    ``keep_fp32`` takes ``+``-joined names or ``none``; booleans true/false/1/0/yes/no."""
    if not isinstance(text, str):
        raise ValueError(f"recipe must be a string or Recipe, got {type(text).__name__}")
    parts = [p.strip() for p in text.split(",")]
    if not text.strip() or any(p == "" for p in parts):
        raise ValueError(f"recipe {text!r}: empty fragment; expected "
                         f"'preset[,key=value...]' with a preset from {preset_names()}")
    base = "fp32"
    if "=" not in parts[0]:
        base = parts.pop(0).lower()
        if base not in PRESET_FIELDS:
            raise ValueError(f"recipe {text!r}: unknown preset {base!r}; "
                             f"valid presets: {', '.join(preset_names())}")
    overrides: dict[str, Any] = {}
    rules: list[LayerRule] = []
    for p in parts:
        if ":" in p.partition("=")[0]:
            rules.append(parse_rule(p))
            continue
        if "=" not in p:
            raise ValueError(f"recipe {text!r}: fragment {p!r} is not key=value (only "
                             "the first fragment may be a preset name)")
        key, _, raw = p.partition("=")
        key, raw = key.strip(), raw.strip()
        if key not in FLAT_DEFAULTS:
            raise ValueError(f"recipe {text!r}: unknown field {key!r}; "
                             f"valid fields: {', '.join(FLAT_DEFAULTS)}")
        if key in overrides:
            raise ValueError(f"recipe {text!r}: field {key!r} given twice")
        overrides[key] = _convert(key, raw)
    return base, overrides, tuple(rules)


def format_text(flat: dict[str, Any], rules: tuple[LayerRule, ...]) -> str:
    """The shortest string for ``flat`` fields and ``rules``: the preset with the fewest
    differences (the first of equals), then those differences, then the rules."""
    best_name, best_diff = "fp32", None
    for name in PRESET_FIELDS:
        p = preset_flat(name)
        diff = [(k, v) for k, v in flat.items() if p[k] != v]
        if best_diff is None or len(diff) < len(best_diff):
            best_name, best_diff = name, diff
    return ",".join([best_name, *(f"{k}={_format(v)}" for k, v in best_diff),
                     *map(str, rules)])


def _convert(key: str, raw: str) -> Any:
    default = FLAT_DEFAULTS[key]
    if isinstance(default, str):  # a name (a choice the config validates)
        return raw.lower()
    if key == "keep_fp32":
        if raw.lower() == "none":
            return ()
        return tuple(x.strip().lower() for x in raw.split("+"))
    if key == "emulate":
        if raw.lower() == "auto":
            return None
        if raw.lower() in _TRUE | _FALSE:
            return raw.lower() in _TRUE
        raise ValueError(f"recipe field 'emulate': {raw!r} is not valid; "
                         "use true, false or auto")
    if isinstance(default, bool):
        if raw.lower() in _TRUE | _FALSE:
            return raw.lower() in _TRUE
        raise ValueError(f"recipe field {key!r}: {raw!r} is not valid; use true or false")
    try:
        return int(raw) if isinstance(default, int) else float(raw)
    except ValueError:
        kind = "an integer" if isinstance(default, int) else "a number"
        raise ValueError(f"recipe field {key!r}: {raw!r} is not {kind}") from None


def _format(v: Any) -> str:
    if v is None:
        return "auto"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, tuple):
        return "+".join(v) if v else "none"
    if isinstance(v, float):
        return repr(v)
    return str(v)
