"""Rank functions for the composition matrix's transformers cells (tests/parallel/
test_matrix.py): a tiny transformers causal LM saved to a folder, loaded on each gloo
rank by ``from_pretrained(dir, distributed_config=DistributedConfig(...))``
(transformers shards it: FSDP2, its tensor-parallel plan, expert parallelism), then trained by a
``MixedPrecision`` engine built over the sharded model as the README says, with torch's
AdamW, and resumed from its state after half the steps (``train_many``: one spawn
trains several layouts and recipes in turn). ``reference`` trains the same model on
the same data in one process.

Two families: ``qwen3_moe`` (tests/helpers/moe_models.py's tiny Qwen3-MoE: 2 layers,
hidden 64, 4 experts) and ``llama`` (2 layers, hidden 64, 4 heads, 2 of them key/value).
"""

from __future__ import annotations

import datetime
import gc
import io
import os
import traceback
import warnings

import torch
import torch.distributed as dist
import transformers

from helpers import moe_models
from helpers.matrix_workers import saved_state
from mixprec import MixedPrecision
from mixprec.modules.linear import Float8Linear

__all__ = ["KINDS", "save_model", "batches", "train_many", "reference", "LR"]

warnings.simplefilter("ignore")

KINDS = ("qwen3_moe", "llama")
#: AdamW's learning rate: large enough that 6 steps move every weight
LR = 1e-2
#: sequences in a step's global batch (each data-parallel rank takes its share)
GLOBAL_BATCH = 8


def _config(kind: str):
    if kind == "llama":
        return transformers.LlamaConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, vocab_size=moe_models.VOCAB,
            max_position_embeddings=64, head_dim=16)
    return moe_models.config(kind)


def save_model(kind: str, path: str) -> str:
    """Family ``kind``'s tiny model (seed 0, float32) saved to ``path``; the path."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_config(kind), dtype=torch.float32)
    model.save_pretrained(path)
    return path


def batches(steps: int) -> list[torch.Tensor]:
    """The global batches (GLOBAL_BATCH sequences of 16 tokens of a Markov chain)."""
    return moe_models.markov_batches(steps, batch=GLOBAL_BATCH, seq=16)


def _run(model, engine, data, dp_rank: int, dp_size: int, group) -> dict:
    """Train one step per batch, this rank on its share; the global losses, the grad
    norms and the skips of every step."""
    losses, norms, skipped = [], [], []
    per = GLOBAL_BATCH // dp_size
    for ids in data:
        ids = ids[dp_rank * per:(dp_rank + 1) * per]
        with engine.autocast():
            loss = model(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        result = engine.step()
        engine.zero_grad()
        seen = loss.detach().float().clone()
        if group is not None:  # every rank's tokens count alike: the mean of the means
            dist.all_reduce(seen, group=group)
            seen /= dp_size
        losses.append(float(seen))
        norms.append(float(result.grad_norm))
        skipped.append(bool(result.skipped))
    return {"losses": losses, "norms": norms, "skipped": skipped}


def _quantized(model) -> list[str]:
    """The names of the Linears the engine swapped for quantized ones."""
    return sorted(n for n, m in model.named_modules() if isinstance(m, Float8Linear))


def _data_parallel(cfg, rank: int, world: int):
    """(dp rank, dp size, the group the losses are averaged over) of transformers'
    mesh (pp, dp_replicate, fsdp, tp: tp innermost); every rank makes every group."""
    tp = cfg.tp_size or 1
    dp_size = cfg.dp_size
    if dp_size == 1:
        return 0, 1, None
    if dp_size == world:
        return rank, world, dist.group.WORLD
    groups = [dist.new_group(list(range(t, world, tp))) for t in range(tp)]
    return rank // tp, dp_size, groups[rank % tp]


def _resumed(model_dir: str, cfg, recipe: str, data, state: bytes, dp) -> dict:
    """A fresh load and engine that takes ``state`` (``engine.state_dict()``) and trains
    ``data``: its record."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, distributed_config=cfg, dtype=torch.float32)
    engine = MixedPrecision(model, torch.optim.AdamW(model.parameters(), lr=LR),
                            recipe=recipe, max_grad_norm=1.0)
    engine.load_state_dict(torch.load(io.BytesIO(state), weights_only=True))
    record = _run(model, engine, data, *dp)
    engine.close()
    return record


def _train_resume(model_dir: str, layout: dict, recipe: str, steps: int, rank: int,
                  world: int) -> dict:
    """``train``'s record of one run on this rank, and its resume: a fresh load takes
    the engine's state after half the steps and trains the rest (``resumed``)."""
    cfg = transformers.DistributedConfig(**layout)
    dp = _data_parallel(cfg, rank, world)
    data = batches(steps)
    half = steps // 2
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, distributed_config=cfg, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    refused = None
    if cfg.dp_size > 1:  # FSDP over FSDP2's shards: refused before the model is touched
        try:
            MixedPrecision(model, opt, recipe=recipe, parallel="fsdp")
        except ValueError as e:
            refused = str(e)
    engine = MixedPrecision(model, opt, recipe=recipe, max_grad_norm=1.0)
    head = _run(model, engine, data[:half], *dp)
    state, saved = saved_state(engine)
    tail = _run(model, engine, data[half:], *dp)
    record = {k: head[k] + tail[k] for k in head}
    record.update(parallel=engine.parallelism.name, quantized=_quantized(model),
                  coverage=sorted((r.name, r.format) for r in engine.coverage.rows),
                  kept=sorted({r.reason for r in engine.coverage.rows if r.reason}),
                  refused_fsdp=refused)
    engine.close()
    del engine, model, opt
    gc.collect()
    record["resumed"] = (_resumed(model_dir, cfg, recipe, data[half:], state, dp)
                         if saved else {"error": state})
    return record


def train_many(rank: int, world: int, tmp: str, runs: list[tuple[str, dict, str]],
               steps: int) -> None:
    """Each run ``(model_dir, layout, recipe)`` of ``runs`` in turn (``_train_resume``);
    writes ``tmp/hfdist_rank<r>.pt`` with the records in the order of ``runs`` (or
    ``{"error": "Type: message", "trace": ...}`` for a run that raised)."""
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    # a rank whose run raised waits at the barrier while another may wait in a
    # collective: the timeout ends that spawn with an error rather than a hang
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=1200))
    out = []
    for model_dir, layout, recipe in runs:
        try:
            out.append(_train_resume(model_dir, layout, recipe, steps, rank, world))
        except Exception as e:  # noqa: BLE001  the test reads what was raised
            out.append({"error": f"{type(e).__name__}: {e}",
                        "trace": traceback.format_exc()})
        # saved after each run: a spawn a later run breaks still shows the earlier ones
        torch.save(out, os.path.join(tmp, f"hfdist_rank{rank}.pt"))
        gc.collect()
        dist.barrier()
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def reference(model_dir: str, recipe: str, steps: int) -> dict:
    """The same model, recipe and data in one process (the whole batch each step)."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    engine = MixedPrecision(model, opt, recipe=recipe, max_grad_norm=1.0)
    record = _run(model, engine, batches(steps), 0, 1, None)
    record["quantized"] = _quantized(model)
    record["coverage"] = sorted((r.name, r.format) for r in engine.coverage.rows)
    engine.close()
    return record
