"""Accelerate's FSDP plugin (``FullyShardedDataParallelPlugin(fsdp_version=2)``,
``accelerate launch --use_fsdp``) under a mixprec recipe: what each integration does
with it, and what it refuses.

- **Accelerate loops** (``mixprec.integrations.accelerate.prepare``): mixprec works
  *over* Accelerate's sharding. ``accelerator.prepare(model, optimizer)`` runs first:
  Accelerate applies ``fully_shard`` to the model's blocks (its wrap policy), then the
  model, and points the optimizer at the sharded parameters
  (``fsdp2_switch_optimizer_parameters``). The engine is then built over that model as
  over any model FSDP2 sharded before it (``mixprec.parallel.presharded``): the Linear
  swap reuses the sharded Parameters and points FSDP2's records at the quantized
  modules, so the optimizer, FSDP and the engine hold the same parameters. The other
  order (swap, then ``fully_shard``) would leave Accelerate's plugin casting and
  loading a state dict into modules it did not build, and its optimizer switch mapping
  parameters by name across the swap.
- **Hugging Face Trainer** (``MixedPrecisionTrainer``): mixprec *takes over* the
  plugin. Its settings (``TrainingArguments(fsdp=..., fsdp_config=...)`` or the
  ``accelerate launch --use_fsdp`` environment) become the engine's own FSDP2
  (``parallel="fsdp"``, the recipe's policy), and Trainer's Accelerator is built
  without the plugin.

Each says which in one log line (``logging.getLogger("mixprec.integrations")``, level
INFO, the main process). What neither can honour is refused, naming the setting, the
values that work and the fix.
"""

from __future__ import annotations

import contextlib
import logging

import torch
from accelerate import Accelerator
from accelerate.utils import FullyShardedDataParallelPlugin
from torch import nn

__all__ = ["LOG", "check_accelerate_plugin", "shard_with_accelerate",
           "plugin_args_from_env", "say"]

LOG = logging.getLogger("mixprec.integrations")

#: the plugin's settings mixprec does not run over -> (the value that works, the fix)
_FIXES = {
    "cpu_offload": ("False", "the engine keeps its fp32 masters and optimizer state on "
                    "the training device; drop cpu_offload (--fsdp_offload_params false)"),
    "activation_checkpointing": (
        "False", "drop it from the plugin (--fsdp_activation_checkpointing false)"),
    "cpu_ram_efficient_loading": (
        "False", "load the model on every rank and drop it "
        "(--fsdp_cpu_ram_efficient_loading false)"),
    "ignored_modules": ("None", "FSDP2 then leaves those modules' parameters unreduced "
                        "across ranks; shard the whole model (drop ignored_modules)"),
}


def say(line: str) -> None:
    """The one line an integration logs about the plugin (INFO, main process only)."""
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        LOG.info(line)


def _conflicting_policy(policy) -> str | None:
    """What of a ``MixedPrecisionPolicy`` would cast on top of the recipe (None: no
    cast: every dtype unset or float32)."""
    if policy is None:
        return None
    bad = [f"{k}={getattr(policy, k)}" for k in ("param_dtype", "reduce_dtype",
                                                  "output_dtype")
           if getattr(policy, k, None) not in (None, torch.float32)]
    return ", ".join(bad) or None


def check_accelerate_plugin(plugin: FullyShardedDataParallelPlugin, where: str) -> None:
    """Refuse what mixprec cannot honour of Accelerate's FSDP ``plugin``
    (``accelerator.state.fsdp_plugin``), naming the setting, the valid values and the
    fix; ``where`` names the caller in the message."""
    version = int(getattr(plugin, "fsdp_version", 1) or 1)
    if version != 2:
        raise NotImplementedError(
            f"{where} under Accelerate's FSDP plugin with fsdp_version={version}: mixprec "
            "runs over FSDP2 only (valid: 2). Build FullyShardedDataParallelPlugin("
            "fsdp_version=2), or launch with accelerate launch --use_fsdp "
            "--fsdp_version 2")
    refused = []
    offload = getattr(plugin, "cpu_offload", None)
    if offload is not None and type(offload).__name__ == "CPUOffloadPolicy":
        refused.append(("cpu_offload", "CPUOffloadPolicy()"))
    for key in ("activation_checkpointing", "cpu_ram_efficient_loading",
                "ignored_modules"):
        if getattr(plugin, key, None):
            refused.append((key, repr(getattr(plugin, key))))
    if refused:
        key, value = refused[0]
        valid, fix = _FIXES[key]
        raise NotImplementedError(
            f"{where} under Accelerate's FSDP plugin with {key}={value}: mixprec does not "
            f"run over it (valid: {valid}); {fix}")
    policy = _conflicting_policy(getattr(plugin, "mixed_precision_policy", None))
    if policy is not None:
        raise NotImplementedError(
            f"{where} under Accelerate's FSDP plugin with mixed_precision_policy "
            f"({policy}): FSDP would cast the weights and gradients on top of the "
            "recipe, which sets the precision (valid: None, or a MixedPrecisionPolicy "
            "whose dtypes are unset or float32). Drop mixed_precision_policy and keep "
            "Accelerator(mixed_precision='no')")


def plugin_args_from_env() -> dict:
    """The plugin ``accelerate launch --use_fsdp`` describes (its ``FSDP_*``
    environment), as ``TrainingArguments.fsdp_plugin_args`` would give it."""
    plugin = FullyShardedDataParallelPlugin()
    names = plugin.transformer_cls_names_to_wrap
    policy = getattr(plugin.auto_wrap_policy, "__name__", None)
    args = {
        "fsdp_version": plugin.fsdp_version,
        "cpu_offload": type(plugin.cpu_offload).__name__ == "CPUOffloadPolicy",
        "auto_wrap_policy": {"transformer_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                             "size_based_auto_wrap_policy": "SIZE_BASED_WRAP",
                             None: "NO_WRAP"}.get(policy, str(policy)),
        "state_dict_type": str(getattr(plugin.state_dict_type, "name",
                                       plugin.state_dict_type)),
        "activation_checkpointing": bool(plugin.activation_checkpointing),
        "cpu_ram_efficient_loading": bool(plugin.cpu_ram_efficient_loading),
        "reshard_after_forward": plugin.reshard_after_forward,
    }
    if names:
        args["transformer_cls_names_to_wrap"] = ",".join(names)
    return args


def shard_with_accelerate(accelerator: Accelerator, model: nn.Module,
                          optimizer: torch.optim.Optimizer
                          ) -> tuple[nn.Module, torch.optim.Optimizer]:
    """``accelerator.prepare(model, optimizer)`` under Accelerate's FSDP2 plugin (the
    order the module docstring gives): the model ``fully_shard`` sharded and the
    optimizer, now over its sharded parameters. Accelerate then forgets both (the
    engine's checkpoint holds them, and its export the fp32 masters), and its
    ``accumulate`` leaves FSDP's gradient sync on: each micro-batch's gradient is
    reduce-scattered and the engine adds the shard to its fp32 buffer, as over any
    model FSDP2 sharded before the engine."""
    model, wrapped = accelerator.prepare(model, optimizer)
    accelerator._models[:] = [m for m in accelerator._models if m is not model]
    accelerator._optimizers[:] = [o for o in accelerator._optimizers if o is not wrapped]
    inner_no_sync = accelerator.no_sync

    def no_sync(m):
        return contextlib.nullcontext() if m is model else inner_no_sync(m)

    accelerator.no_sync = no_sync
    plugin = accelerator.state.fsdp_plugin
    say("mixprec works over Accelerate's FSDP2 plugin: Accelerate sharded the model "
        f"(fully_shard, reshard_after_forward={plugin.reshard_after_forward}), the "
        "engine swaps its Linears on those shards and trains them; checkpoints and "
        "exports are the engine's (whole fp32), whatever state_dict_type says")
    return model, getattr(wrapped, "optimizer", wrapped)
