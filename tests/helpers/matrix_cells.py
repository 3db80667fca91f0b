"""The composition matrix: which number format trains (or is refused) on which layout,
built by which builder, on which model. ``CELLS`` is the one list: tests/parallel/
test_matrix.py runs every cell, and docs/gen_matrix.py writes it as the table of
docs/guides/compositions.md (tests/docs/test_compositions_page.py keeps the page equal).

A cell is one line: ``trains(layout, format, measured)`` (6 AdamW steps within the
format's tolerance of one process, the ranks agreeing on skips and grad norms, the
coverage one process has, and a resume from step 3 repeating steps 4 to 6 exactly) or
``refuses(layout, format, "fragment of the error")``. A builder with ``runner=None`` is
declared for its cells to come: its engineers add the runner and its cells' lines. A
builder with ``tested_in`` has its cells run by that test module, which takes its
parametrization from ``cells_of(its module)`` (tests/parallel/test_matrix.py checks that
every such cell is parametrized there).
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Format", "Layout", "Builder", "Cell", "FORMATS", "LAYOUTS", "BUILDERS",
           "CELLS", "trains", "refuses", "cells_of"]


@dataclass(frozen=True, kw_only=True)
class Format:
    """A column of the matrix."""

    #: the recipe string the engine is built with
    recipe: str
    #: the bound on the largest relative difference of a step's loss from one process's
    tol: float
    #: the bound on the largest relative difference of a step's grad norm from one
    #: process's (a norm that missed a shard's squares or counted a replica twice is off
    #: by 30% to 40%)
    norm_tol: float
    #: whether the recipe swaps Linears for quantized ones (the coverage must show it)
    quantized: bool = False


@dataclass(frozen=True, kw_only=True)
class Layout:
    """A row family of the matrix: how the model is laid out over the ranks."""

    #: the processes it runs on
    world: int
    #: who lays the model out: ``engine`` (tests/helpers/matrix_workers.py), or
    #: ``transformers`` (``from_pretrained(distributed_config=...)``,
    #: tests/helpers/hf_distcfg_workers.py), ``deepspeed`` (tests/integrations/
    #: test_deepspeed.py), ``fsdp-plugin`` (tests/integrations/test_fsdp_plugin.py),
    #: ``lightning`` (Lightning's strategies, tests/integrations/test_lightning_matrix.py)
    family: str
    #: what the docs table says it is
    what: str
    #: ``DistributedConfig``'s keywords (the ``transformers`` family)
    config: dict = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class Builder:
    """Who builds the engine over the laid-out model."""

    #: what the docs table says it is
    what: str
    #: the test's runner for its cells (None: declared, its cells still to come, or run
    #: by the module ``tested_in`` names)
    runner: str | None
    #: the test module that runs its cells (its path from the repository root), taking
    #: them from ``cells_of``; None: tests/parallel/test_matrix.py runs them
    tested_in: str | None = None


@dataclass(frozen=True, kw_only=True)
class Cell:
    """One composition and its outcome: ``tol`` set (trains) or ``refuses`` set."""

    builder: str
    layout: str
    fmt: str
    model: str
    #: trains: the bound on the loss's relative difference from one process
    tol: float | None = None
    #: the largest relative loss difference measured (AMD EPYC, 2 cores, gloo)
    measured: float | None = None
    #: trains: the bound on the grad norms' relative difference (None: the format's)
    norm_tol: float | None = None
    #: refuses: a fragment of the error the build or the first step raises
    refuses: str | None = None
    #: trains, but saving the engine's state for the resume fails: a fragment of the
    #: error (the test expects it, so the cell is told when it starts working)
    no_resume: str | None = None
    #: trains, with some of the Linears one process quantizes kept in 16 bits for a
    #: reason the coverage gives (a fragment of it): a limit of the layout
    kept: str | None = None
    #: trains, but a check fails for a known defect, said here: the test is an
    #: expected failure (strict, so a fix shows) until the defect is fixed
    defect: str | None = None
    #: in the fast pass (else under ``long``)
    fast: bool = False

    @property
    def recipe(self) -> str:
        return FORMATS[self.fmt].recipe

    @property
    def id(self) -> str:
        return f"{self.builder}-{self.layout}-{self.model}-{self.fmt}"


FORMATS: dict[str, Format] = {
    # fp32: float rounding of the partial sums; 16-bit: FSDP's distributed tolerance
    # (tests/parallel/test_distributed.py); the Linear formats: the tensor-parallel one
    # of the recipes as they come (tests/parallel/test_tensor_parallel_fp8.py). The norms
    # wander further (measured: bf16-master 2.4e-2 to 6.9e-2, fp8-current to 1.9e-1).
    "fp32": Format(recipe="fp32", tol=1e-5, norm_tol=5e-5),
    "bf16": Format(recipe="bf16", tol=1e-2, norm_tol=0.1),
    "bf16-master": Format(recipe="bf16-master", tol=1e-2, norm_tol=0.1),
    "fp16-master": Format(recipe="fp16-master", tol=1e-2, norm_tol=0.1),
    "fp8-current": Format(recipe="fp8-current", tol=5e-2, norm_tol=0.25, quantized=True),
    "fp8-block": Format(recipe="fp8-block", tol=5e-2, norm_tol=0.25, quantized=True),
    # mxfp8: measured up to 8.1e-3 (llama, transformers' TP), norms to 0.15 (0.41 where
    # TP keeps Linears in 16 bits: that cell's own bound)
    "mxfp8": Format(recipe="mxfp8", tol=2e-2, norm_tol=0.25, quantized=True),
    # nvfp4 (stochastic rounding, each data-parallel rank its own draws): measured up to
    # 2.2e-2 (llama, transformers' FSDP), norms to 0.37
    "nvfp4": Format(recipe="nvfp4", tol=5e-2, norm_tol=0.4, quantized=True),
    "int8": Format(recipe="int8-rowwise", tol=5e-2, norm_tol=0.25, quantized=True),
}

_ENGINE = "tests/helpers/matrix_workers.py's 128-wide MLP"
LAYOUTS: dict[str, Layout] = {
    "one": Layout(world=1, family="engine", what="one process (the reference)"),
    "ddp": Layout(world=2, family="engine", what="`parallel=\"ddp\"`, 2 ranks"),
    "fsdp": Layout(world=2, family="engine", what="`parallel=\"fsdp\"` (FSDP2), 2 ranks"),
    "user-fsdp": Layout(world=2, family="engine",
                        what="`fully_shard` by the user on each block and the root, "
                             "the engine without `parallel=`, 2 ranks"),
    "user-fsdp-linear": Layout(world=2, family="engine",
                               what="`fully_shard` by the user on each Linear itself, "
                                    "2 ranks"),
    "tp": Layout(world=2, family="engine",
                 what="torch's `parallelize_module` colwise/rowwise plan, 2 ranks"),
    "tp-ddp": Layout(world=2, family="engine",
                     what="torch's TP plan, then `parallel=\"ddp\"`, 2 ranks"),
    "fsdp-tp": Layout(world=4, family="engine",
                      what="torch's TP plan on a 2 x 2 mesh's `tp` dim, "
                           "`parallel=\"fsdp\"` on its `dp` dim, 4 ranks"),
    "hf-fsdp": Layout(world=2, family="transformers", config={"fsdp_size": 2},
                      what="`DistributedConfig(fsdp_size=2)`"),
    "hf-tp": Layout(world=2, family="transformers", config={"tp_size": 2},
                    what="`DistributedConfig(tp_size=2)`"),
    "hf-ep-fsdp": Layout(world=2, family="transformers",
                         config={"ep_size": 2, "fsdp_size": 2},
                         what="`DistributedConfig(ep_size=2, fsdp_size=2)`"),
    "hf-ep-tp": Layout(world=2, family="transformers", config={"ep_size": 2, "tp_size": 2},
                       what="`DistributedConfig(ep_size=2, tp_size=2)`"),
    "hf-hsdp": Layout(world=2, family="transformers", config={"dp_replicate_size": 2},
                      what="`DistributedConfig(dp_replicate_size=2)`"),
    "hf-tp-fsdp": Layout(world=4, family="transformers",
                         config={"tp_size": 2, "fsdp_size": 2},
                         what="`DistributedConfig(tp_size=2, fsdp_size=2)`, 4 ranks"),
    "ds-accelerate": Layout(world=2, family="deepspeed",
                            what="Accelerate's loop with `Accelerator(deepspeed_plugin=...)` "
                                 "and mixprec's `prepare`, bf16, 2 ranks"),
    "ds-trainer": Layout(world=2, family="deepspeed",
                         what="`MixedPrecisionTrainer` with `TrainingArguments(deepspeed="
                              "{...})`, bf16, 2 ranks"),
    "fsdp2-plugin": Layout(world=2, family="fsdp-plugin",
                           what="Accelerate's `FullyShardedDataParallelPlugin(fsdp_version=2)`"
                                " (the Trainer's `fsdp_config={\"fsdp_version\": 2}`), "
                                "2 ranks"),
    "fsdp2-plugin-env": Layout(world=2, family="fsdp-plugin",
                               what="the FSDP2 plugin from `accelerate launch --use_fsdp "
                                    "--fsdp_version 2`'s environment, 2 ranks"),
    "fsdp1-plugin": Layout(world=2, family="fsdp-plugin",
                           what="FSDP version 1 (`fsdp_version=1`, or `FSDP_VERSION=1` in "
                                "the environment)"),
    # Lightning's strategies (tests/integrations/test_lightning_matrix.py)
    "lit-ddp": Layout(world=2, family="lightning",
                      what="Lightning's `Trainer(strategy=\"ddp\")`, 2 ranks"),
    "lit-fsdp": Layout(world=2, family="lightning",
                       what="Lightning's `ModelParallelStrategy(data_parallel_size=2)` "
                            "(the engine shards, FSDP2), its distributed checkpoint, "
                            "2 ranks"),
    "lit-fsdp-file": Layout(world=2, family="lightning",
                            what="`ModelParallelStrategy(data_parallel_size=2, "
                                 "save_distributed_checkpoint=False)`: one checkpoint "
                                 "file, 2 ranks"),
    "lit-user-fsdp": Layout(world=2, family="lightning",
                            what="`ModelParallelStrategy` with a `configure_model` that "
                                 "calls `fully_shard` itself, 2 ranks"),
    "lit-tp": Layout(world=2, family="lightning",
                     what="`ModelParallelStrategy(tensor_parallel_size=2)`, 2 ranks"),
    "lit-fsdp1": Layout(world=2, family="lightning",
                        what="Lightning's `FSDPStrategy` (FSDP1; it builds on a GPU only)"),
}

_DEEPSPEED = "tests/integrations/test_deepspeed.py"
_FSDP_PLUGIN = "tests/integrations/test_fsdp_plugin.py"
_LIGHTNING = "tests/integrations/test_lightning_matrix.py"
BUILDERS: dict[str, Builder] = {
    "engine": Builder(what="`mixprec.MixedPrecision(model, opt, recipe=...)`",
                      runner="engine"),
    "hf-trainer": Builder(what="Hugging Face `Trainer` with its FSDP2 plugin", runner=None,
                          tested_in=_FSDP_PLUGIN),
    "accelerate-fsdp2": Builder(what="Accelerate's FSDP2 plugin", runner=None,
                                tested_in=_FSDP_PLUGIN),
    "deepspeed-zero1": Builder(what="DeepSpeed ZeRO stage 1", runner=None,
                               tested_in=_DEEPSPEED),
    "deepspeed-zero2": Builder(what="DeepSpeed ZeRO stage 2", runner=None,
                               tested_in=_DEEPSPEED),
    "deepspeed-zero3": Builder(what="DeepSpeed ZeRO stage 3", runner=None,
                               tested_in=_DEEPSPEED),
    "lightning": Builder(what="Lightning's `Trainer` with `MixedPrecisionPlugin`",
                         runner=None, tested_in=_LIGHTNING),
}

#: the models: the engine layouts' MLP, transformers' tiny Qwen3-MoE and Llama
MODELS = {"mlp": _ENGINE, "qwen3_moe": "a tiny Qwen3-MoE (2 layers, hidden 64, 4 experts)",
          "llama": "a tiny Llama (2 layers, hidden 64, 4 heads, 2 key/value)"}


def trains(layout: str, fmt: str, measured: float, *, model: str | None = None,
           builder: str = "engine", tol: float | None = None, fast: bool = False,
           no_resume: str | None = None, kept: str | None = None,
           defect: str | None = None, norm_tol: float | None = None) -> Cell:
    """A cell that trains like one process within ``tol`` (the format's by default)."""
    model = model or ("mlp" if LAYOUTS[layout].family == "engine" else "qwen3_moe")
    return Cell(builder=builder, layout=layout, fmt=fmt, model=model,
                tol=FORMATS[fmt].tol if tol is None else tol, measured=measured, fast=fast,
                no_resume=no_resume, kept=kept, defect=defect, norm_tol=norm_tol)


def refuses(layout: str, fmt: str, reason: str, *, model: str | None = None,
            builder: str = "engine", fast: bool = False) -> Cell:
    """A cell whose build or first step raises an error containing ``reason``."""
    model = model or ("mlp" if LAYOUTS[layout].family == "engine" else "qwen3_moe")
    return Cell(builder=builder, layout=layout, fmt=fmt, model=model, refuses=reason,
                fast=fast)


_SWAP_REFUSED = "is a Linear subclass whose owner may use its weight directly"
_DDP_OVER_TP = "DDP does not take DTensors"
#: torch.save of the state of a model transformers sharded, after a step, on rank 1
#: (also without mixprec: docs/not-there-yet.md); real bf16 working weights save
_NO_SAVE = "invalid python storage"
_BLOCK_CUT = "cut at multiples of"
_NO_EP_PLAN = "has no `ep_plan`"
#: the DeepSpeed cells' bf16 config computes in bf16: a recipe computing in fp16 is
#: refused, the error naming DeepSpeed's fp16 config, which trains it (tests/integrations/
#: test_deepspeed_resume.py)
_DS_FP16 = "compute='fp16'"
_FSDP1_PREPARE = "fsdp_version=1"
_FSDP1_TRAINER = "FSDP2 only (valid: 2)"
_LIT_TP = "mixprec shards data parallel only"
_LIT_SELF_SHARDED = "Remove the fully_shard calls"
#: Lightning's own refusal: its FSDPStrategy takes only its FSDPPrecision
_LIT_FSDP1 = "can only work with the `FSDPPrecision` plugin"
_LIT_FILE_BUFFERS = ("resuming from ModelParallelStrategy's one checkpoint file fails where "
                     "the swapped Linears hold buffers (nvfp4's stochastic rounding "
                     "stream): the file's weights are the plain model's, which Lightning "
                     "loads strictly into the swapped module")

CELLS: list[Cell] = [
    # --- the engine's own layouts, on the MLP (the fast pass: each format once, each
    # layout once)
    trains("one", "fp32", 0.0, fast=True),
    trains("one", "bf16", 0.0, fast=True),
    trains("one", "bf16-master", 0.0),
    trains("one", "fp16-master", 0.0),
    trains("one", "fp8-current", 0.0),
    trains("one", "fp8-block", 0.0),
    trains("one", "mxfp8", 0.0),
    trains("one", "nvfp4", 0.0, fast=True),
    trains("one", "int8", 0.0),
    trains("ddp", "fp32", 1.7e-7),
    trains("ddp", "bf16", 4.0e-4),
    trains("ddp", "bf16-master", 1.3e-3),
    trains("ddp", "fp16-master", 1.2e-4, fast=True),
    trains("ddp", "fp8-current", 5.4e-3),
    trains("ddp", "fp8-block", 1.1e-2),
    trains("ddp", "mxfp8", 2.1e-3),
    trains("ddp", "nvfp4", 4.9e-3),
    trains("ddp", "int8", 9.5e-4),
    trains("fsdp", "fp32", 1.7e-7),
    trains("fsdp", "bf16", 3.9e-4),
    trains("fsdp", "bf16-master", 1.3e-3),
    trains("fsdp", "fp16-master", 1.6e-4),
    trains("fsdp", "fp8-current", 5.4e-3),
    trains("fsdp", "fp8-block", 1.1e-2),
    trains("fsdp", "mxfp8", 2.1e-3),
    trains("fsdp", "nvfp4", 4.9e-3),
    trains("fsdp", "int8", 9.5e-4, fast=True),
    trains("user-fsdp", "fp32", 1.7e-7),
    trains("user-fsdp", "bf16", 3.9e-4),
    trains("user-fsdp", "bf16-master", 9.6e-4),
    trains("user-fsdp", "fp16-master", 1.3e-4),
    trains("user-fsdp", "fp8-current", 5.4e-3),
    trains("user-fsdp", "fp8-block", 1.1e-2, fast=True),
    trains("user-fsdp", "mxfp8", 2.1e-3),
    trains("user-fsdp", "nvfp4", 4.9e-3),
    trains("user-fsdp", "int8", 9.5e-4),
    refuses("user-fsdp-linear", "fp8-current", _SWAP_REFUSED, fast=True),
    trains("user-fsdp-linear", "bf16-master", 9.6e-4),
    trains("tp", "fp32", 3.4e-7),
    trains("tp", "bf16", 4.3e-4),
    trains("tp", "bf16-master", 4.5e-4),
    trains("tp", "fp16-master", 3.4e-4),
    trains("tp", "fp8-current", 3.4e-3),
    trains("tp", "fp8-block", 0.0),
    trains("tp", "mxfp8", 0.0, fast=True),
    trains("tp", "nvfp4", 1.5e-2),
    trains("tp", "int8", 5.1e-4),
    refuses("tp-ddp", "bf16-master", _DDP_OVER_TP, fast=True),
    trains("fsdp-tp", "fp32", 5.9e-7),
    trains("fsdp-tp", "bf16", 4.0e-4),
    trains("fsdp-tp", "bf16-master", 1.4e-3),
    trains("fsdp-tp", "fp16-master", 3.2e-4),
    trains("fsdp-tp", "fp8-current", 1.3e-3),
    trains("fsdp-tp", "fp8-block", 1.1e-2),
    trains("fsdp-tp", "mxfp8", 2.1e-3),
    trains("fsdp-tp", "nvfp4", 1.2e-2),
    trains("fsdp-tp", "int8", 9.4e-4),
    # --- transformers' DistributedConfig, the engine built over its shards (the new
    # figures measured after the swap stopped giving FSDP2's whole weights a
    # tensor-parallel layout; the older ones, marked *, before it)
    trains("hf-tp", "bf16-master", 3.6e-3, fast=True),
    trains("hf-fsdp", "fp8-current", 1.0e-2, fast=True, no_resume=_NO_SAVE),
    trains("hf-fsdp", "fp32", 2e-7, no_resume=_NO_SAVE),  # *
    trains("hf-fsdp", "bf16-master", 3.3e-4),
    trains("hf-fsdp", "fp16-master", 6.8e-4, no_resume=_NO_SAVE),
    # 128 x 128 blocks: FSDP2 gathers the weights whole, so no shard cut refuses them
    trains("hf-fsdp", "fp8-block", 2.2e-3, no_resume=_NO_SAVE),  # *
    trains("hf-fsdp", "mxfp8", 1.1e-3, no_resume=_NO_SAVE),
    trains("hf-fsdp", "nvfp4", 9.1e-3, no_resume=_NO_SAVE),
    trains("hf-tp", "fp32", 2e-7, no_resume=_NO_SAVE),  # *
    trains("hf-tp", "fp16-master", 6.8e-4, no_resume=_NO_SAVE),
    trains("hf-tp", "fp8-current", 1.5e-3, no_resume=_NO_SAVE),
    trains("hf-tp", "mxfp8", 2.6e-3, no_resume=_NO_SAVE, kept=_BLOCK_CUT),
    trains("hf-tp", "nvfp4", 4.8e-3, no_resume=_NO_SAVE),
    # (the experts in the recipe's format under transformers' expert parallelism: the
    # figures measured since FSDP2's wrapping stopped hiding them)
    trains("hf-ep-fsdp", "bf16-master", 1.0e-3),
    trains("hf-ep-fsdp", "fp16-master", 6.8e-4, no_resume=_NO_SAVE),
    trains("hf-ep-fsdp", "fp8-current", 1.6e-2, no_resume=_NO_SAVE,
           norm_tol=0.4),  # norms measured to 0.19 (0.29 on an emulated 16-bit path)
    trains("hf-ep-fsdp", "mxfp8", 2.7e-3, no_resume=_NO_SAVE),
    trains("hf-ep-fsdp", "nvfp4", 6.9e-3, no_resume=_NO_SAVE),
    trains("hf-ep-tp", "fp8-current", 8.6e-3, no_resume=_NO_SAVE),
    trains("hf-hsdp", "bf16-master", 3.0e-4),  # *
    trains("hf-tp-fsdp", "bf16-master", 2.8e-3),
    # FSDP2 over transformers' plan: each Linear judged by the plan's shard its forward
    # sees (FSDP2 gathers the fsdp dim), the ranks of a TP group drawing alike
    trains("hf-tp-fsdp", "fp8-current", 6.9e-3, no_resume=_NO_SAVE),
    trains("hf-tp-fsdp", "nvfp4", 1.2e-2, no_resume=_NO_SAVE),
    trains("hf-fsdp", "bf16-master", 2.8e-4, model="llama"),
    trains("hf-fsdp", "fp16-master", 1.0e-3, model="llama", no_resume=_NO_SAVE),
    trains("hf-fsdp", "fp8-current", 2.2e-2, model="llama", no_resume=_NO_SAVE,
           norm_tol=0.4),  # norms measured to 0.35
    trains("hf-fsdp", "mxfp8", 1.1e-3, model="llama", no_resume=_NO_SAVE),
    trains("hf-fsdp", "nvfp4", 2.2e-2, model="llama", no_resume=_NO_SAVE),
    trains("hf-tp", "bf16-master", 2.1e-3, model="llama"),
    trains("hf-tp", "fp16-master", 4.8e-4, model="llama", no_resume=_NO_SAVE),
    trains("hf-tp", "fp8-current", 6.9e-3, model="llama", no_resume=_NO_SAVE),
    trains("hf-tp", "mxfp8", 8.1e-3, model="llama", no_resume=_NO_SAVE, kept=_BLOCK_CUT,
           norm_tol=0.5),  # norms measured to 0.41
    trains("hf-tp", "nvfp4", 5.6e-3, model="llama", no_resume=_NO_SAVE),
    refuses("hf-ep-fsdp", "bf16-master", _NO_EP_PLAN, model="llama"),
    refuses("hf-ep-fsdp", "fp16-master", _NO_EP_PLAN, model="llama"),
    refuses("hf-ep-fsdp", "fp8-current", _NO_EP_PLAN, model="llama"),
    refuses("hf-ep-fsdp", "mxfp8", _NO_EP_PLAN, model="llama"),
    refuses("hf-ep-fsdp", "nvfp4", _NO_EP_PLAN, model="llama"),
    trains("hf-tp-fsdp", "bf16-master", 3.1e-3, model="llama"),
    trains("hf-tp-fsdp", "fp8-current", 6.6e-3, model="llama", no_resume=_NO_SAVE,
           norm_tol=0.4),  # norms measured to 0.28
    trains("hf-tp-fsdp", "mxfp8", 8.0e-3, model="llama", no_resume=_NO_SAVE,
           kept=_BLOCK_CUT, norm_tol=0.5),  # norms measured to 0.41
    # --- DeepSpeed ZeRO (tests/integrations/test_deepspeed.py): bf16 with the
    # fp8-current Linears, the global loss against one process; fp16 compute refused
    trains("ds-accelerate", "fp8-current", 6.76e-3, model="llama", builder="deepspeed-zero1"),
    refuses("ds-accelerate", "fp16-master", _DS_FP16, model="llama",
            builder="deepspeed-zero1", fast=True),
    trains("ds-accelerate", "fp8-current", 6.76e-3, model="llama", builder="deepspeed-zero2"),
    refuses("ds-accelerate", "fp16-master", _DS_FP16, model="llama",
            builder="deepspeed-zero2", fast=True),
    trains("ds-accelerate", "fp8-current", 6.76e-3, model="llama", builder="deepspeed-zero3"),
    refuses("ds-accelerate", "fp16-master", _DS_FP16, model="llama",
            builder="deepspeed-zero3", fast=True),
    trains("ds-trainer", "fp8-current", 6.94e-3, model="llama", builder="deepspeed-zero2"),
    refuses("ds-trainer", "fp16-master", _DS_FP16, model="llama",
            builder="deepspeed-zero2", fast=True),
    trains("ds-trainer", "fp8-current", 6.94e-3, model="llama", builder="deepspeed-zero3"),
    refuses("ds-trainer", "fp16-master", _DS_FP16, model="llama",
            builder="deepspeed-zero3", fast=True),
    # --- Accelerate's FSDP2 plugin (tests/integrations/test_fsdp_plugin.py): Accelerate's
    # loop over the sharding it applies; the Trainer takes the plugin over
    trains("fsdp2-plugin", "bf16-master", 1.8e-3, model="llama", builder="accelerate-fsdp2"),
    trains("fsdp2-plugin", "fp8-current", 8.8e-3, model="llama", builder="accelerate-fsdp2"),
    refuses("fsdp1-plugin", "bf16-master", _FSDP1_PREPARE, model="llama",
            builder="accelerate-fsdp2", fast=True),
    trains("fsdp2-plugin", "bf16-master", 1.2e-3, model="llama", builder="hf-trainer"),
    trains("fsdp2-plugin", "fp8-current", 1.6e-2, model="llama", builder="hf-trainer"),
    trains("fsdp2-plugin-env", "bf16-master", 1.2e-3, model="llama", builder="hf-trainer"),
    refuses("fsdp1-plugin", "bf16-master", _FSDP1_TRAINER, model="llama",
            builder="hf-trainer", fast=True),
    # --- Lightning's Trainer with mixprec's plugin (tests/integrations/
    # test_lightning_matrix.py): Lightning's strategy, gradient_clip_val, ModelCheckpoint
    # and fit(ckpt_path=...) on the MLP; the larger of the figures measured natively and
    # on the emulated 16-bit path (ONEDNN_MAX_CPU_ISA=AVX2)
    trains("lit-ddp", "fp32", 1.7e-7, model="mlp", builder="lightning"),
    trains("lit-ddp", "bf16-master", 1.7e-3, model="mlp", builder="lightning"),
    trains("lit-ddp", "fp16-master", 1.2e-4, model="mlp", builder="lightning"),
    trains("lit-ddp", "fp8-current", 5.4e-3, model="mlp", builder="lightning"),
    trains("lit-ddp", "mxfp8", 2.1e-3, model="mlp", builder="lightning"),
    trains("lit-ddp", "nvfp4", 8.5e-3, model="mlp", builder="lightning"),
    trains("lit-fsdp", "fp32", 1.7e-7, model="mlp", builder="lightning"),
    trains("lit-fsdp", "bf16-master", 1.6e-3, model="mlp", builder="lightning"),
    trains("lit-fsdp", "fp16-master", 1.6e-4, model="mlp", builder="lightning"),
    trains("lit-fsdp", "fp8-current", 5.4e-3, model="mlp", builder="lightning"),
    trains("lit-fsdp", "mxfp8", 2.1e-3, model="mlp", builder="lightning"),
    trains("lit-fsdp", "nvfp4", 8.5e-3, model="mlp", builder="lightning"),
    trains("lit-fsdp-file", "nvfp4", 8.5e-3, model="mlp", builder="lightning",
           defect=_LIT_FILE_BUFFERS),
    refuses("lit-user-fsdp", "bf16-master", _LIT_SELF_SHARDED, model="mlp",
            builder="lightning"),
    refuses("lit-tp", "bf16-master", _LIT_TP, model="mlp", builder="lightning"),
    refuses("lit-fsdp1", "bf16-master", _LIT_FSDP1, model="mlp", builder="lightning",
            fast=True),
]


def cells_of(module: str) -> list[Cell]:
    """The cells whose builder's ``tested_in`` is ``module`` (a path from the
    repository root), in the list's order."""
    return [c for c in CELLS if BUILDERS[c.builder].tested_in == module]
