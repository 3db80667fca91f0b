"""A pipeline-parallel stage's bytes: its share of the layers' weights and states, the
activations of the micro-batches it holds at once under its schedule, and the buffers at
its boundaries (``estimate(..., pipeline=PipelineSchedule(...))`` prices the worst stage,
``stage_estimates`` every one).

Stage ``i`` of ``p`` (a rank ``i`` holding ``v`` virtual stages under the interleaved
schedule) holds:

- ``layers / p`` of the layers (the first ``layers % p`` stages one more; dense layers
  of a mixture of experts first), the embedding on the first stage, the final norm and
  the head on the last (a tied head is a copy of the embedding there, as ``parallel="pp"``
  trains it with ``tied=``), each with its gradients, masters and optimizer states;
- the saved activations of one micro-batch of its layers (the head's input and the
  loss's logits on the last stage), times the micro-batches in flight at its peak
  (``in_flight``): ``m`` under GPipe, ``min(p − i, m)`` under 1F1B, and under the
  interleaved 1F1B ``min(w + 1, m·v) / v`` with ``w = (v − 1)·r + 2·(p − 1 − i)`` virtual
  micro-batches of warm-up (``r`` the micro-batches per round: ``m // (m // p)``, ``p``
  where ``m`` is a multiple of ``p``; the memory guide derives it);
- ``pp_buffers``: what torch's ``PipelineStage`` allocates at the boundaries, one
  micro-batch's boundary activation (``s·b·h`` values in the activations' width) per
  micro-batch of the step: a receive buffer for the input (all stages but the first),
  one for the output's gradient (all but the last), and the output itself, held for the
  backward of each micro-batch in flight (all but the last). The first layer's saved
  input may be the receive buffer itself: counted in both, a stage's ``s·b·h`` a
  micro-batch at most.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from mixprec.memory.breakdown import Breakdown
from mixprec.memory.shapes import param_count, spec_linears
from mixprec.memory.spec import TransformerSpec

__all__ = ["PipelineSchedule", "SCHEDULES", "in_flight", "stage_layers", "stage_params",
           "stage_tensors", "stage_spec", "recv_buffer_bytes", "boundary_bytes",
           "worst_stage"]

#: the schedules priced (torch's ``ScheduleGPipe``, ``Schedule1F1B``,
#: ``ScheduleInterleaved1F1B``)
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")


@dataclass(frozen=True, kw_only=True)
class PipelineSchedule:
    """A pipeline of ``stages`` ranks running ``microbatches`` per step under
    ``schedule``; ``virtual``: stages per rank (the interleaved schedule's, else 1)."""

    stages: int
    microbatches: int
    schedule: Literal["gpipe", "1f1b", "interleaved-1f1b"] = "1f1b"
    virtual: int = 1

    def __post_init__(self) -> None:
        for name in ("stages", "microbatches", "virtual"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"PipelineSchedule {name}={v!r}: an integer >= 1")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"PipelineSchedule schedule={self.schedule!r}; valid: "
                             f"{', '.join(SCHEDULES)}")
        if self.virtual != 1 and self.schedule != "interleaved-1f1b":
            raise ValueError(f"PipelineSchedule virtual={self.virtual} with schedule="
                             f"{self.schedule!r}: several stages per rank are the "
                             "interleaved schedule's; use schedule='interleaved-1f1b' "
                             "or virtual=1")
        rounds = max(1, self.microbatches // self.stages)
        if self.schedule == "interleaved-1f1b" and self.microbatches % rounds:
            raise ValueError(f"PipelineSchedule microbatches={self.microbatches}: the "
                             f"interleaved schedule needs a multiple of its rounds "
                             f"({rounds} = microbatches // stages); use e.g. "
                             f"{rounds * self.stages}")


def in_flight(sched: PipelineSchedule, stage: int) -> float:
    """Micro-batches whose activations stage (rank) ``stage`` holds at once, at its
    peak, in whole-stage micro-batches (the interleaved schedule's virtual stages hold
    ``1/v`` of the rank's layers each; see the module doc).

    >>> [in_flight(PipelineSchedule(stages=4, microbatches=8), i) for i in range(4)]
    [4, 3, 2, 1]
    """
    p, m, v = sched.stages, sched.microbatches, sched.virtual
    if not 0 <= stage < p:
        raise ValueError(f"stage={stage!r}: between 0 and {p - 1} (stages={p})")
    if sched.schedule == "gpipe":
        return m
    if sched.schedule == "1f1b":
        return min(p - stage, m)
    per_round = m // max(1, m // p)
    warmup = (v - 1) * per_round + 2 * (p - 1 - stage)
    held = min(warmup + 1, m * v)
    return held // v if held % v == 0 else held / v


def stage_layers(spec: TransformerSpec, sched: PipelineSchedule, stage: int
                 ) -> tuple[int, int]:
    """``(layers, dense layers)`` rank ``stage`` holds: ``layers / p`` each (the first
    ``layers % p`` ranks one more), the dense layers of a mixture of experts first."""
    p = sched.stages
    if spec.layers < p * sched.virtual:
        raise ValueError(f"{spec.layers} layers over {p} stages x {sched.virtual} "
                         "virtual: each virtual stage needs a layer; use fewer stages")
    sizes = [spec.layers // p + (1 if i < spec.layers % p else 0) for i in range(p)]
    first = sum(sizes[:stage])
    dense = max(0, min(spec.dense_layers - first, sizes[stage])) if spec.experts else 0
    return sizes[stage], dense


def stage_spec(spec: TransformerSpec, sched: PipelineSchedule, stage: int,
               head: bool | None = None) -> TransformerSpec:
    """The spec of rank ``stage``'s layers; ``vocab`` (the head and the loss) kept on
    the last stage only unless ``head`` says."""
    n, dense = stage_layers(spec, sched, stage)
    last = stage == sched.stages - 1 if head is None else head
    return dataclasses.replace(spec, layers=n, dense_layers=dense,
                               vocab=spec.vocab if last else None)


def _outside(spec: TransformerSpec) -> tuple[int, int, int]:
    """``(embedding, head, final norm)`` parameters."""
    h, v = spec.hidden, spec.vocab or 0
    norm = h if spec.norm == "rms" else 2 * h
    return v * h, v * h, norm


def stage_params(spec: TransformerSpec, sched: PipelineSchedule, stage: int) -> int:
    """Parameters rank ``stage`` holds: its layers', the embedding on the first, the
    final norm and the head on the last (a tied head a copy of the embedding there,
    where the pipeline has more than one stage)."""
    emb, head, norm = _outside(spec)
    layers = stage_spec(spec, sched, stage, head=False)
    own = param_count(layers) - norm  # no vocab there: the layers and a final norm
    p = sched.stages
    total = own + (emb if stage == 0 else 0)
    if stage == p - 1:
        total += norm + (head if (not spec.tied_embeddings or p > 1) else 0)
    return total


def stage_tensors(spec: TransformerSpec, sched: PipelineSchedule, stage: int) -> int:
    """Parameter tensors rank ``stage`` holds (an optimizer keeps a step count per
    tensor): a weight per Linear and per norm (and a bias per LayerNorm), the
    embedding, the final norm and the head as ``stage_params`` places them."""
    layers = stage_spec(spec, sched, stage, head=False)
    per_norm = 1 if spec.norm == "rms" else 2
    count = sum(c for _, _, role, c in spec_linears(layers) if role != "head")
    count += 2 * layers.layers * per_norm + (2 * layers.layers if spec.qk_norm else 0)
    p = sched.stages
    if spec.vocab and stage == 0:
        count += 1
    if stage == p - 1:
        count += per_norm + (1 if spec.vocab and (not spec.tied_embeddings or p > 1) else 0)
    return count


def recv_buffer_bytes(spec: TransformerSpec, sched: PipelineSchedule, stage: int,
                      act_bytes: float) -> float:
    """The receive buffers torch's ``PipelineStage`` allocates for rank ``stage``: per
    virtual stage it holds, one per micro-batch for its input (not the pipeline's first
    stage) and one for its output's gradient (not the last), ``s·b·h`` values of
    ``act_bytes`` each."""
    p, v, m = sched.stages, sched.virtual, sched.microbatches
    one = spec.seq_len * spec.micro_batch * spec.hidden * act_bytes
    return sum(m * one * ((j * p + stage > 0) + (j * p + stage < p * v - 1))
               for j in range(v))


def boundary_bytes(spec: TransformerSpec, sched: PipelineSchedule, stage: int,
                   act_bytes: float) -> float:
    """``pp_buffers`` of rank ``stage`` (module doc): its receive buffers
    (``recv_buffer_bytes``) and its outputs held for the micro-batches in flight (not
    on the pipeline's last stage), ``s·b·h`` values of ``act_bytes`` each."""
    p, v = sched.stages, sched.virtual
    one = spec.seq_len * spec.micro_batch * spec.hidden * act_bytes
    # each virtual micro-batch in flight holds its output, but on the last stage
    chunks = v if stage < p - 1 else v - 1
    return (recv_buffer_bytes(spec, sched, stage, act_bytes)
            + one * in_flight(sched, stage) * chunks)


def worst_stage(stages: list[Breakdown]) -> int:
    """The stage with the most bytes at its peak (its total where no peak is known)."""
    def key(i: int) -> float:
        b = stages[i]
        return b.peak if b.peak is not None else b.total
    return max(range(len(stages)), key=key)
