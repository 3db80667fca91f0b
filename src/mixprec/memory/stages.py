"""Every pipeline stage's breakdown (``stage_estimates``), and the worst of them
(``worst``), as ``estimate(spec, recipe, pipeline=...)`` returns it; what a stage holds
is ``mixprec.memory.pipeline``'s."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from mixprec.memory.breakdown import Breakdown
from mixprec.memory.pipeline import (
    PipelineSchedule,
    boundary_bytes,
    in_flight,
    stage_params,
    stage_spec,
    stage_tensors,
    worst_stage,
)
from mixprec.memory.spec import TransformerSpec
from mixprec.recipe import Recipe

__all__ = ["stage_breakdowns", "worst"]


def stage_breakdowns(params: TransformerSpec, recipe: Recipe | str,
                     pipeline: PipelineSchedule, *, estimate: Callable[..., Breakdown],
                     states: dict, optimizer: str = "adamw", zero_stage: int = 0,
                     world_size: int = 1, activations: TransformerSpec | None = None,
                     expert_parallel: int = 1) -> list[Breakdown]:
    """``mixprec.memory.plan.stage_estimates`` given the planner's ``estimate`` and its
    optimizers' ``states`` table (passed in: the planner imports this module).
    Each stage's (rank's) bytes under ``pipeline``: its parameters, gradients,
    masters and optimizer states (a step count per tensor included), one micro-batch's
    activations times its micro-batches in flight, its boundary buffers
    (``pp_buffers``), and the peak of its step (``mixprec.memory.pipeline``).
    ``zero_stage`` and ``world_size`` describe each stage's data-parallel dimension,
    ``expert_parallel`` its experts' (``estimate``)."""
    if not isinstance(pipeline, PipelineSchedule):
        raise TypeError(f"pipeline={pipeline!r}: a mixprec.memory.PipelineSchedule("
                        "stages=, microbatches=, schedule=)")
    spec = params if isinstance(params, TransformerSpec) else None
    if spec is None or (activations is not None and activations is not spec):
        raise ValueError("pipeline= splits a TransformerSpec's layers over the stages: "
                         f"pass the spec as params (got {type(params).__name__}"
                         + (" and a separate activations spec" if activations is not None
                            else "") + "); for a stage's own module, estimate the module "
                         "and measure its activations")
    r = Recipe.coerce(recipe)
    width = 4.0 if r.precision.emulate or r.precision.compute in ("fp32", "tf32") else 2.0
    steps = states.get(optimizer.lower().replace("-", "_"), (0, 0))[1]
    shard = world_size if zero_stage >= 1 else 1
    out = []
    for i in range(pipeline.stages):
        part = stage_spec(spec, pipeline, i)
        b = estimate(stage_params(spec, pipeline, i), r, optimizer=optimizer,
                     zero_stage=zero_stage, world_size=world_size, activations=part,
                     expert_parallel=expert_parallel)
        k = in_flight(pipeline, i)
        one = b["activations"]
        items = dict(b.items)
        counters = 4.0 * stage_tensors(spec, pipeline, i) * steps / shard
        items["optimizer"] = items.get("optimizer", 0.0) + counters
        items["activations"] = one * k
        items["pp_buffers"] = boundary_bytes(spec, pipeline, i, width)
        peak = (None if b.peak is None
                else b.peak + one * (k - 1) + counters + items["pp_buffers"])
        note = (f"pipeline stage {i} of {pipeline.stages}: {part.layers} layers"
                + (", the embedding" if i == 0 else "")
                + (", the head" if i == pipeline.stages - 1 else "")
                + f"; {k:g} micro-batches' activations in flight under {pipeline.schedule}"
                + (f" (v={pipeline.virtual})" if pipeline.virtual > 1 else "")
                + f" of {pipeline.microbatches}; pp_buffers: torch's PipelineStage "
                "boundary buffers (mixprec.memory.pipeline)")
        out.append(Breakdown(items, b.recipe, (note, *b.notes), peak=peak))
    return out


def worst(stages: list[Breakdown]) -> Breakdown:
    """The stage with the most bytes at its peak, noted as the worst."""
    i = worst_stage(stages)
    b = stages[i]
    note = f"the worst of {len(stages)} pipeline stages: stage {i}"
    return dataclasses.replace(b, notes=(note, *b.notes))
