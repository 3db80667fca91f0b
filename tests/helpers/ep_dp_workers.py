"""Rank functions for tests/experts/test_expert_data_parallel.py: a tiny MoE trained on a
2-D mesh of expert data parallel × EP (2 × 2 gloo ranks, each rank its own sequence),
then one step with a non-finite expert gradient on one rank; after the process group
is gone each rank trains one case in one process on the whole batch."""

from __future__ import annotations

import os
import warnings

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from helpers.moe_models import markov_batches, model
from mixprec import MixedPrecision
from mixprec.experts.expert_parallel import expert_parallel

warnings.simplefilter("ignore")

STEPS, LR, BATCH, MAX_NORM = 3, 5e-3, 4, 0.5
#: (model kind, recipe, routing): "empty" routes every token to experts 0 and 1, so
#: the EP ranks holding experts 2 and 3 receive no token
CASES = [("qwen3_moe", "bf16-master", "routed"), ("qwen3_moe", "fp8-current", "routed"),
         ("qwen3_moe", "bf16-master", "empty"), ("qwen3_moe", "mxfp8", "routed"),
         ("qwen3_moe", "nvfp4", "routed")]


def _route_to_first_two(m: torch.nn.Module) -> None:
    """Every router's top-2 indices become experts 0 and 1 (its weights kept)."""
    def hook(mod, args, out):
        logits, scores, idx = out
        return logits, scores, torch.arange(idx.shape[-1]).expand_as(idx).contiguous()
    for name, mod in m.named_modules():
        if name.endswith("mlp.gate"):
            mod.register_forward_hook(hook)


def _norm64(state, shards, scale: float) -> tuple[float, float]:
    """The float64 norm of the averaged, unscaled gradients, each expert counted once
    (their squares summed over ep), and the experts' share of its square."""
    sq = {n: (g.double() / scale).square().sum() for n, g in zip(state.names, state.grads)
          if g is not None}
    experts = sum(v for n, v in sq.items() if n in shards.params).reshape(1)
    dist.all_reduce(experts, group=shards.group)
    total = experts[0] + sum(v for n, v in sq.items() if n not in shards.params)
    return float(total.sqrt()), float(experts[0] / total)


def _train(case, mesh, rank: int, nan_rank: int | None = None) -> dict:
    """``STEPS`` AdamW steps clipped to ``MAX_NORM``: on ``mesh`` with this rank's
    sequence of each batch, or (no mesh) one process on the whole batch. On the mesh,
    one more step with ``nan_rank``'s first expert gradient made NaN."""
    kind, recipe, routing = case
    m = model(kind, seed=0)
    if routing == "empty":
        _route_to_first_two(m)
    shards = expert_parallel(m, mesh) if mesh is not None else None
    engine = MixedPrecision(m, torch.optim.AdamW(m.parameters(), lr=LR), recipe,
                            max_grad_norm=MAX_NORM)
    state = engine.param_state
    world = 1 if mesh is None else mesh.size()
    losses, norms, norms64 = [], [], []
    batches = markov_batches(STEPS + 1, batch=BATCH)
    for i, ids in enumerate(batches):
        last = i == STEPS
        if last and mesh is None:
            break
        share = ids[rank::world] if mesh is not None else ids
        with engine.autocast():
            loss = engine.model(input_ids=share, labels=share).loss
        engine.backward(loss)
        if shards is not None:
            shards.average_grads(zip(state.names, state.grads))
            if not last:
                scale = float(engine.scaler.scale) if engine.scaler.scaled else 1.0
                norms64.append(_norm64(state, shards, scale))
        if last:  # a fault in one rank's expert gradient, after the averaging
            before = [p.detach().clone() for p in m.parameters()]
            if rank == nan_rank:
                name = shards.params[0]
                state.grads[state.names.index(name)].view(-1)[0] = float("nan")
        result = engine.step()
        if last:
            changed = any(not torch.equal(a, p.detach()) for a, p in zip(before, m.parameters()))
            return {"losses": losses, "norms": norms, "norms64": norms64,
                    "nan_skipped": bool(result.skipped),
                    "nan_changed": changed, "nan_norm": float(result.grad_norm),
                    "experts": {n: p.detach().clone() for n, p in m.named_parameters()
                                if n in shards.params},
                    "dense": {n: p.detach().clone() for n, p in m.named_parameters()
                              if n not in shards.params},
                    "totals": shards.stats.totals()}
        detached = loss.detach()
        if mesh is not None:
            dist.all_reduce(detached)
            detached /= world
        losses.append(detached.item())
        norms.append(float(result.grad_norm))
        assert not bool(result.skipped)
    return {"losses": losses, "norms": norms}


def training(rank, world, tmp, nan_rank):
    """Every case on the (dp, ep) mesh; then this rank's one case in one process."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank,
                            world_size=world)
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "ep"))
    out = {case: _train(case, mesh, rank, nan_rank) for case in CASES}
    dist.barrier()
    dist.destroy_process_group()
    for case in CASES[rank::world]:
        out[case + ("one",)] = _train(case, None, 0)
    torch.save(out, os.path.join(tmp, f"train{rank}.pt"))


def refusal(rank, world, tmp, _):
    """FSDP2 over the expert-data-parallel dim, after and before ``expert_parallel``, and
    a 2-D mesh without the EP dim named: each error, saved per rank."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank,
                            world_size=world)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
    out = {}
    m = model("mixtral")
    expert_parallel(m, mesh)
    for name, mod in m.named_modules():
        if name.endswith("mlp.experts"):
            fully_shard(mod, mesh=mesh["dp"])
    try:
        MixedPrecision(m, torch.optim.SGD(m.parameters(), lr=0.1), "bf16-master")
    except NotImplementedError as e:
        out["engine"] = str(e)
    m = model("mixtral")
    fully_shard(m.model.layers[0].mlp.experts, mesh=mesh["dp"])
    try:
        expert_parallel(m, mesh)
    except NotImplementedError as e:
        out["expert_parallel"] = str(e)
    try:
        expert_parallel(model("mixtral"), mesh["dp", "ep"], ep_dim="tp")
    except ValueError as e:
        out["dim"] = str(e)
    dist.barrier()
    dist.destroy_process_group()
    torch.save(out, os.path.join(tmp, f"refused{rank}.pt"))
