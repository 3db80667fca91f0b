"""Rank functions for tests/experts/test_experts_hf_ep.py: a tiny Qwen3-MoE loaded by
``from_pretrained(dir, distributed_config=DistributedConfig(ep_size=2, ...))`` on gloo
ranks (transformers shards its experts: its expert parallelism, FSDP2 or its tensor
parallelism over the rest), a ``MixedPrecision`` engine built over it, and one experts
module run forward and backward on seeded tokens; beside it, in the same process, the
same module of the model loaded whole, with and without an engine (the references).
"""

from __future__ import annotations

import datetime
import os
import warnings

import torch
import torch.distributed as dist
import transformers

import mixprec.experts.hook as hook
from mixprec import MixedPrecision

__all__ = ["TOKENS", "MODULE", "experts_under_ep"]

warnings.simplefilter("ignore")

#: tokens in the global batch (each data-parallel rank takes its half)
TOKENS = 24
#: the experts module run on the tokens
MODULE = "model.layers.0.mlp.experts"


def _tokens(hidden: int, experts: int) -> tuple[torch.Tensor, ...]:
    """The global batch: hidden states, each token's 2 experts (the model's ids) and
    their routing weights, and the output gradient."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(TOKENS, hidden, generator=g)
    logits = torch.randn(TOKENS, experts, generator=g)
    w, idx = logits.softmax(-1).topk(2, dim=-1)
    gy = torch.randn(TOKENS, hidden, generator=g)
    return x, idx, w / w.sum(-1, keepdim=True), gy


def _run(module, rows: slice, batch) -> dict:
    """``module`` on ``rows`` of the batch with grad on (transformers' training path):
    its output and the hidden states' gradient."""
    x, idx, w, gy = batch
    x = x[rows].clone().requires_grad_(True)
    y = module(x, idx[rows], w[rows])
    y.backward(gy[rows])
    return {"y": y.detach().clone(), "dx": x.grad.clone()}


def _experts_rows(engine) -> list[tuple]:
    return [(r.name, r.kind, r.params, r.format, r.reason) for r in engine.coverage.rows
            if r.kind == "experts"]


def _one(model_dir: str, layout: dict, recipe: str, rank: int, world: int) -> dict:
    cfg = transformers.DistributedConfig(**layout)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, distributed_config=cfg, dtype=torch.float32)
    engine = MixedPrecision(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                            recipe=recipe)
    module = model.get_submodule(MODULE)
    batch = _tokens(model.config.hidden_size, model.config.num_experts)
    per = TOKENS // world
    # data parallel (FSDP): each rank its half; tensor parallel: the ranks share it
    rows = slice(rank * per, (rank + 1) * per) if cfg.tp_size == 1 else slice(None)
    calls = []
    counted = hook.grouped_mm

    def grouped_mm(x, w, offsets, fmt, **kw):
        calls.append((tuple(w.shape), type(w).__name__, fmt.format_name))
        return counted(x, w, offsets, fmt, **kw)

    hook.grouped_mm = grouped_mm
    try:
        got = _run(module, rows, batch)
    finally:
        hook.grouped_mm = counted
    record = {"rows": _experts_rows(engine), "calls": calls, "class": type(module).__name__,
              "run": got}
    engine.close()
    del engine, model
    # the references: the model whole in this process, with the engine and without
    whole = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    engine = MixedPrecision(whole, torch.optim.AdamW(whole.parameters(), lr=1e-2),
                            recipe=recipe)
    record["one_rows"] = _experts_rows(engine)
    one = _run(whole.get_submodule(MODULE), slice(None), batch)
    record["one"] = {k: v[rows] for k, v in one.items()}
    engine.close()
    plain = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    hp = _run(plain.get_submodule(MODULE), slice(None), batch)
    record["high"] = {k: v[rows] for k, v in hp.items()}
    return record


def experts_under_ep(rank: int, world: int, tmp: str, model_dir: str,
                     runs: list[tuple[dict, str]]) -> None:
    """Each ``(DistributedConfig keywords, recipe)`` of ``runs`` in turn (``_one``);
    writes ``tmp/hfep_rank<r>.pt`` with the records in the order of ``runs``."""
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=600))
    out = [_one(model_dir, layout, recipe, rank, world) for layout, recipe in runs]
    torch.save(out, os.path.join(tmp, f"hfep_rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()
