"""Predict and measure every byte a recipe costs.

``estimate(params, recipe, ...)`` predicts bytes per rank, item by item:

| item | bytes per parameter |
|---|---|
| ``params`` (the working copy) | size of ``recipe.params`` |
| ``grads`` (accumulation buffers) | size of ``recipe.grads``, twice with ``grad_accum=kahan`` |
| ``master`` | 4 with ``master=fp32`` |
| ``optimizer`` | per state: 4 with masters, else the size of ``params`` |

AdamW keeps 2 states per parameter, SGD with momentum 1, plain SGD 0; Adagrad and
RMSprop 1, Adadelta, Adamax, NAdam and RAdam 2 (torch's defaults).

Plus ``fp8`` (amax histories and scales of each Float8Linear), ``buffers`` (BatchNorm
statistics and the like) and ``activations`` (a transformer spec, or a figure you
measured). For a module the count is exact: shared parameters are counted once, and the
optimizer's per-tensor ``step`` counters are included.

ZeRO stages (Rajbhandari et al. 2020) divide by ``world_size``: stage 1 shards the
optimizer states **and the fp32 masters** (they are optimizer state in ZeRO's
accounting, K = 12 bytes for mixed-precision Adam), stage 2 also the gradients, and stage
3 also the working parameters. FSDP2's ``fully_shard`` is stage 3. A tensor-parallel
model (DTensor parameters from ``parallelize_module``) is counted per rank: each
shard's local elements, replicated parameters whole; ``zero_stage`` and ``world_size``
then describe its data-parallel dimension, and ``TransformerSpec(tensor_parallel=t)``
its activations. A module FSDP2 already sharded (``engine.model`` under
``parallel="fsdp"``) is counted as each rank holds it, with ``zero_stage=3`` and
``world_size`` its data-parallel size (``mixprec.memory.fsdp``). A transformers
mixture-of-experts model's activations and peak come from its own modules
(``mixprec.memory.moe``).

Today's decoder shapes (grouped-query attention, SwiGLU, mixtures of experts with
shared experts) go in the ``TransformerSpec`` (``spec_from_config`` reads them off a
transformers config), whose parameters ``param_count`` counts; ``estimate(spec, ...)``
prices the model from the spec alone. Under ZeRO-3 the fp8 weight casts are whole on
every rank: each Linear keeps the cast of its gathered weight from its forward to its
backward.

``measure(model, engine_or_optimizer, sample_batch)`` counts the bytes that actually
exist, by storage (a storage shared by two tensors counts once). It also counts the
bytes saved for backward in one forward pass, through
``torch.autograd.graph.saved_tensors_hooks``, split into activations and low-precision
weight copies made by autocast or fp8 casts.

A pipeline-parallel stage (``estimate(spec, recipe, pipeline=PipelineSchedule(stages=p,
microbatches=m, schedule="1f1b"))``) holds its share of the layers and their states,
one micro-batch's activations times the micro-batches its schedule keeps in flight, and
the boundary buffers (``mixprec.memory.pipeline``); ``estimate`` returns the worst
stage, ``stage_estimates`` every one. ``expert_parallel=e`` divides the routed experts'
weights and states over ``e`` ranks and adds the dispatch and combine buffers
(``mixprec.memory.expert_dispatch``).

Units: ``GB`` means 10^9 bytes, as published memory tables and the ZeRO paper use.
"""

from mixprec.memory.breakdown import GB, ITEMS, Breakdown
from mixprec.memory.hf_config import spec_from_config
from mixprec.memory.ledger import high_water, measure
from mixprec.memory.pipeline import PipelineSchedule
from mixprec.memory.plan import estimate, stage_estimates
from mixprec.memory.shapes import param_count
from mixprec.memory.spec import TransformerSpec, activation_bytes
from mixprec.memory.units import parse_bytes, parse_count

__all__ = ["Breakdown", "TransformerSpec", "estimate", "measure", "high_water",
           "parse_count", "parse_bytes", "param_count", "spec_from_config",
           "activation_bytes", "ITEMS", "GB", "PipelineSchedule", "stage_estimates"]
