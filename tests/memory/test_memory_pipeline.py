"""The planner's pipeline stages: the micro-batches in flight against the memory guide's
hand counts (GPipe, 1F1B) and torch's own interleaved 1F1B action lists, each stage's
parameters, gradients, masters and optimizer states against a transformers Llama cut
into real stage modules (to the byte), and the API's and the command's options."""

from __future__ import annotations

import types

import pytest
import torch
from torch import nn

from mixprec import MixedPrecision
from mixprec.cli import main
from mixprec.memory import PipelineSchedule, TransformerSpec, estimate, measure, stage_estimates
from mixprec.memory.hf_config import spec_from_config
from mixprec.memory.pipeline import in_flight, stage_params

transformers = pytest.importorskip("transformers")


def _sched(p, m, schedule="1f1b", v=1):
    return PipelineSchedule(stages=p, microbatches=m, schedule=schedule, virtual=v)


# --- micro-batches in flight: the memory guide's hand counts ---------------------------

@pytest.mark.parametrize("p,m,schedule,expected", [
    (4, 8, "gpipe", [8, 8, 8, 8]),    # every micro-batch's forward before any backward
    (4, 8, "1f1b", [4, 3, 2, 1]),     # stage i warms up p - i forwards, then 1B1F
    (4, 2, "1f1b", [2, 2, 2, 1]),     # fewer micro-batches than stages: min(p - i, m)
    (2, 8, "1f1b", [2, 1]),
    (1, 8, "1f1b", [1]),
])
def test_micro_batches_in_flight_are_the_hand_counts(p, m, schedule, expected):
    assert [in_flight(_sched(p, m, schedule), i) for i in range(p)] == expected


def _torch_interleaved_peak(p: int, m: int, v: int, rank: int) -> float:
    """The most virtual micro-batches rank ``rank`` holds (forwards run, backwards not
    yet) along torch's own ScheduleInterleaved1F1B action list, in whole-rank units."""
    from torch.distributed.pipelining.schedules import (
        ScheduleInterleaved1F1B,
        _ComputationType,
    )

    rounds = max(1, m // p)
    fake = types.SimpleNamespace(n_local_stages=v, pp_group_size=p, _n_microbatches=m,
                                 microbatches_per_round=m // rounds)
    ops = ScheduleInterleaved1F1B._calculate_single_rank_operations(fake, rank)
    held = peak = 0
    for op in ops:
        if op is None:
            continue
        if op.computation_type == _ComputationType.FORWARD:
            held += 1
        else:
            held -= 1
        peak = max(peak, held)
    return peak / v


@pytest.mark.parametrize("p,m,v", [(4, 8, 2), (2, 4, 2), (4, 4, 3), (2, 8, 4), (4, 12, 2)])
def test_interleaved_in_flight_is_torchs_action_list(p, m, v):
    got = [in_flight(_sched(p, m, "interleaved-1f1b", v), i) for i in range(p)]
    assert got == [_torch_interleaved_peak(p, m, v, i) for i in range(p)]
    # the first rank holds the most: more than 1F1B's p at v > 1, p + (p - 1) / v where
    # m is a multiple of p (at most all m)
    assert got[0] == max(got)
    if m % p == 0:
        assert got[0] == min(p + (p - 1) / v, m)


def test_the_guides_interleaved_hand_count():
    # 4 ranks, 8 micro-batches, 2 virtual stages: r = 4; rank 0 warms up
    # (2 - 1)·4 + 2·3 = 10 virtual micro-batches, holds 11 = 5.5 whole-rank ones
    assert [in_flight(_sched(4, 8, "interleaved-1f1b", 2), i) for i in range(4)] == [
        5.5, 4.5, 3.5, 2.5]


# --- each stage's weights and states against real stage modules ------------------------

class _Stage(nn.Module):
    """Stage ``i`` of a transformers Llama: its decoder layers, the embedding on the
    first stage, the final norm and the head on the last (a tied head: a copy)."""

    def __init__(self, model, layers: range, first: bool, last: bool, tied: bool):
        super().__init__()
        inner = model.model
        self.embed = inner.embed_tokens if first else None
        self.layers = nn.ModuleList(inner.layers[j] for j in layers)
        self.norm = inner.norm if last else None
        self.head = None
        if last:
            self.head = nn.Linear(inner.embed_tokens.embedding_dim,
                                  inner.embed_tokens.num_embeddings, bias=False)
            src = inner.embed_tokens.weight if tied else model.lm_head.weight
            with torch.no_grad():
                self.head.weight.copy_(src)


def _cut(model, spec, sched):
    stages, start = [], 0
    p = sched.stages
    for i in range(p):
        n = spec.layers // p + (1 if i < spec.layers % p else 0)
        stages.append(_Stage(model, range(start, start + n), i == 0, i == p - 1,
                             spec.tied_embeddings))
        start += n
    return stages


def _step(stage, recipe):
    engine = MixedPrecision(stage, torch.optim.AdamW(stage.parameters()), recipe)
    for i in range(2):  # optimizer states after step 1; gradients after backward 2
        with engine.autocast():
            loss = sum(p.float().square().sum() for p in stage.parameters())
        engine.backward(loss)
        if i == 0:
            engine.step()
    return engine


@pytest.mark.parametrize("tied,p,layers", [(False, 2, 4), (True, 2, 3), (False, 3, 4)],
                         ids=["untied-2", "tied-uneven", "untied-3"])
@pytest.mark.parametrize("recipe", ["bf16-master", "fp32"])
def test_each_stages_weights_and_states_are_its_modules_to_the_byte(tied, p, layers,
                                                                      recipe):
    cfg = transformers.LlamaConfig(hidden_size=64, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=96, vocab_size=100,
                                   tie_word_embeddings=tied)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    spec = spec_from_config(cfg, seq_len=16)
    sched = _sched(p, 4)
    planned = stage_estimates(spec, recipe, sched)
    for i, stage in enumerate(_cut(model, spec, sched)):
        own = sum(q.numel() for q in stage.parameters())
        assert stage_params(spec, sched, i) == own
        got = measure(stage, _step(stage, recipe))
        for item in ("params", "grads", "master", "optimizer"):
            assert planned[i][item] == got[item], (i, item)


# --- the API and the command --------------------------------------------------------------

SPEC = TransformerSpec(layers=8, hidden=256, heads=4, seq_len=128, micro_batch=2,
                       vocab=1000, attention="flash", dropout=False)


def test_activations_are_one_micro_batch_times_those_in_flight_and_the_worst_is_reported():
    sched = _sched(4, 8, "gpipe")
    stages = stage_estimates(SPEC, "bf16-master", sched)
    whole = estimate(SPEC, "bf16-master")  # the last stage: 2 layers, the head and loss
    two = estimate(1, "bf16-master", activations=TransformerSpec(
        layers=2, hidden=256, heads=4, seq_len=128, micro_batch=2, attention="flash",
        dropout=False))
    assert stages[0]["activations"] == 8 * two["activations"]
    assert stages[3]["activations"] > stages[0]["activations"]  # the logits
    assert whole["activations"] > stages[3]["activations"] / 8
    # pp_buffers: s·b·h bf16 values per micro-batch, as torch's PipelineStage holds them
    one = 128 * 2 * 256 * 2
    assert [s["pp_buffers"] for s in stages] == [
        8 * one + 8 * one, 2 * 8 * one + 8 * one, 2 * 8 * one + 8 * one, 8 * one]
    worst = estimate(SPEC, "bf16-master", pipeline=sched)
    assert worst.peak == max(s.peak for s in stages) and "stage 3" in worst.notes[0]
    f1b = estimate(SPEC, "bf16-master", pipeline=_sched(4, 8))
    assert f1b.peak < worst.peak and "stage 0" in f1b.notes[0]


def test_bad_pipeline_settings_are_refused_with_the_fix():
    with pytest.raises(ValueError, match="pipeline=mixprec.memory.PipelineSchedule"):
        TransformerSpec(layers=2, hidden=8, heads=2, seq_len=4, pipeline_parallel=2)
    with pytest.raises(ValueError, match="valid: gpipe, 1f1b, interleaved-1f1b"):
        _sched(2, 4, "zb")
    with pytest.raises(ValueError, match="interleaved schedule"):
        _sched(2, 4, "1f1b", 2)
    with pytest.raises(ValueError, match="multiple of its rounds"):
        _sched(4, 9, "interleaved-1f1b", 2)
    with pytest.raises(ValueError, match="pass the spec as params"):
        estimate("7B", "bf16-master", pipeline=_sched(2, 4))
    with pytest.raises(ValueError, match="each virtual stage needs a layer"):
        stage_estimates(SPEC, "bf16-master", _sched(8, 8, "interleaved-1f1b", 2))


def test_the_command_prices_the_worst_stage(capsys):
    args = ["memory", "--layers", "8", "--hidden", "256", "--heads", "4", "--seq", "128",
            "--batch", "2", "--vocab", "1000", "--recipe", "bf16-master"]
    assert main(args + ["--pp", "4", "--microbatches", "8", "--schedule", "gpipe"]) == 0
    out = capsys.readouterr().out
    assert "pp_buffers" in out and "the worst of 4 pipeline stages: stage 3" in out
    worst = estimate(SPEC, "bf16-master", pipeline=_sched(4, 8, "gpipe"))
    assert f"{worst.total / 1e9:,.2f}" in out
    assert main(args + ["--pp", "4", "--microbatches", "8", "--schedule",
                        "interleaved-1f1b", "--virtual-stages", "2"]) == 0
    assert "micro-batches in flight 5.5, 4.5, 3.5, 2.5" in capsys.readouterr().out
    assert main(["memory", "--params", "7B", "--pp", "2"]) != 0
    assert "pass the spec as params" in capsys.readouterr().err
