"""The named recipes: the one preset list, as the fields each sets in the flat string
syntax (``mixprec.recipe.syntax``); every unnamed field keeps its default."""

from __future__ import annotations

__all__ = ["PRESET_FIELDS", "LINEAR_PRESETS", "SHELL_PRESET", "preset_names"]

PRESET_FIELDS: dict[str, dict[str, object]] = {
    "fp32": {},
    "tf32": {"compute": "tf32"},
    "bf16": {"compute": "bf16"},
    "bf16-master": {"compute": "bf16", "params": "bf16", "master": "fp32"},
    "fp16": {"compute": "fp16", "loss_scale": "dynamic"},
    "fp16-master": {"compute": "fp16", "params": "fp16", "master": "fp32",
                    "loss_scale": "dynamic"},
    "fp8": {"compute": "fp8"},
    "fp8-current": {"compute": "fp8", "fp8_scaling": "current"},
    "fp8-rowwise": {"compute": "fp8", "fp8_scaling": "rowwise"},
    # block scales, e4m3 everywhere: DeepSeek-V3's recipe, and OCP MXFP8
    "fp8-block": {"compute": "fp8", "fp8_scaling": "block", "fp8_format": "e4m3"},
    "mxfp8": {"compute": "fp8", "fp8_scaling": "mx", "fp8_format": "e4m3"},
    # OCP MXFP6: e3m2 elements, MX's 1x32 e8m0 scales; the exact dequantizing GEMM
    "mxfp6": {"compute": "fp8", "fp8_scaling": "mxfp6"},
    # NVIDIA's NVFP4 pretraining recipe; the last two Linears stay in bf16
    "nvfp4": {"compute": "fp8", "fp8_scaling": "nvfp4", "bf16_last_layers": 2},
    # int8 forward and dgrad GEMMs, rowwise scales, wgrad in bf16 (mixprec.formats.gemm.int8)
    "int8-rowwise": {"compute": "fp8", "fp8_scaling": "int8"},
    # bf16 weights without an fp32 master, kept accurate by the write rule
    "bf16-sr": {"compute": "bf16", "params": "bf16", "write": "stochastic"},
    "bf16-kahan": {"compute": "bf16", "params": "bf16", "write": "kahan"},
    "bf16-remainder": {"compute": "bf16", "params": "bf16", "write": "remainder"},
    # the fewest bytes: bf16 weights and gradients, int8 moments (6 bytes per parameter)
    "bf16-lean": {"compute": "bf16", "params": "bf16", "grads": "bf16",
                  "write": "stochastic", "states": "int8"},
}

#: the presets with a Linear format (what a ``layer:`` rule may name besides bf16)
LINEAR_PRESETS: tuple[str, ...] = tuple(n for n, f in PRESET_FIELDS.items()
                                        if f.get("compute") == "fp8")

#: the preset whose layers around the Linears the planner measures a model in (per-tensor
#: current scaling: no state, the cheapest cast)
SHELL_PRESET = "fp8-current"


def preset_names() -> list[str]:
    """Names accepted by ``Recipe.parse`` as the first field (fp32, bf16, ...)."""
    return list(PRESET_FIELDS)
