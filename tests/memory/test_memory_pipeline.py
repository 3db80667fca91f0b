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
    # a CPU without bf16 units emulates the 16-bit path (fp32 working copies): a bare
    # spec is priced as emulated only where the recipe says so
    from mixprec.engine.devices import emulating
    from mixprec.recipe import Recipe

    if emulating(Recipe.coerce(recipe), torch.device("cpu")):
        recipe = f"{recipe},emulate=true"
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


def test_the_guides_llama_3_8b_stages_by_hand():
    """docs/guides/memory.md, "By hand: Llama-3-8B over 4 stages, 8 micro-batches"."""
    spec = TransformerSpec(layers=32, hidden=4096, heads=32, kv_heads=8, ffn_hidden=14336,
                           gated=True, vocab=128256, tied_embeddings=False, norm="rms",
                           seq_len=4096, attention="flash", dropout=False, qkv_linears=3)
    sched = _sched(4, 8)
    assert [stage_params(spec, sched, i) for i in range(4)] == [
        8 * 218_112_000 + 525_336_576, 8 * 218_112_000, 8 * 218_112_000,
        8 * 218_112_000 + 4_096 + 525_336_576]
    stages = stage_estimates(spec, "bf16-master", sched)
    gb = [{k: round(v / 1e9, 3) for k, v in b.items.items()} for b in stages]
    assert [(g["params"], g["grads"], g["master"], g["optimizer"]) for g in gb] == [
        (4.540, 9.081, 9.081, 18.162), (3.490, 6.980, 6.980, 13.959),
        (3.490, 6.980, 6.980, 13.959), (4.540, 9.081, 9.081, 18.162)]
    assert [g["activations"] for g in gb] == [31.693, 23.770, 15.847, 10.192]
    one = 4096 * 4096 * 2
    assert [b["pp_buffers"] for b in stages] == [12 * one, 19 * one, 18 * one, 8 * one]
    assert [round(b.peak / 1e9, 1) for b in (stages[0], stages[3])] == [73.3, 54.5]
    assert round(estimate(spec, "bf16-master", pipeline=_sched(4, 8, "gpipe")).peak / 1e9,
                 1) == 125.9
    assert round(estimate(spec, "bf16-master",
                          pipeline=_sched(4, 8, "interleaved-1f1b", 2)).peak / 1e9, 1) == 86.0


@pytest.mark.long  # one spawn of 2 ranks, three schedules: ~15-30 s on two loaded cores
def test_torchs_schedules_hold_the_planned_micro_batches_and_receive_buffers():
    """Two gloo ranks run the four-block model of the pipeline tests under torch's
    schedules: the micro-batches each rank holds at once, counted as they run (a
    forward's start in, the backward reaching the stage's first weight out), and the
    bytes of the receive buffers its ``PipelineStage`` allocated (fp32: every boundary
    4 bytes a value; under bf16-master the first block's LayerNorm sends fp32, the rest
    bf16)."""
    import os
    import tempfile

    import torch.multiprocessing as mp

    from helpers import pp_memory_workers as w
    from helpers.pp_workers import BATCH, N_MICRO
    from mixprec.memory.pipeline import recv_buffer_bytes

    names = {"ScheduleGPipe": ("gpipe", 1), "Schedule1F1B": ("1f1b", 1),
             "ScheduleInterleaved1F1B": ("interleaved-1f1b", 2)}
    tmp = tempfile.mkdtemp(prefix="mixprec-pp-held-")
    mp.start_processes(w.held, args=(2, tmp, list(names)), nprocs=2, join=True,
                       start_method="forkserver")
    ranks = [torch.load(os.path.join(tmp, f"held{r}.pt"), weights_only=False)
             for r in range(2)]
    # a boundary: the micro-batch's rows of 32 values (s·b·h with s = 1, b = 4, h = 32)
    boundary = TransformerSpec(layers=4, hidden=32, heads=1, seq_len=1,
                               micro_batch=BATCH // N_MICRO)
    for name, (schedule, v) in names.items():
        sched = _sched(2, N_MICRO, schedule, v)
        for rank in range(2):
            got = ranks[rank][name]
            assert got["held"] / v == in_flight(sched, rank), (name, rank)
            width = got["dtype"].itemsize
            assert got["buffers"] == recv_buffer_bytes(boundary, sched, rank, width), (
                name, rank)
