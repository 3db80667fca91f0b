"""Multi-rank (gloo, CPU) workers of the memory planner's tests: what an FSDP2 engine
holds per rank, counted on the autograd graph, against ``estimate``."""

from __future__ import annotations

import gc
import os
import warnings

import torch
import torch.distributed as dist

from mixprec import MixedPrecision
from mixprec.engine.devices import EMULATE_ENV

warnings.simplefilter("ignore")

#: the model of ``fsdp_casts``: 3 blocks of width 96, 16-token sequences, 2 per rank (32
#: tokens: no activation has a weight's shape)
LAYERS, WIDTH, HEADS, SEQ, BATCH, VOCAB = 3, 96, 4, 16, 2, 64


def graph_weight_copies(loss: torch.Tensor, weights: list[torch.Tensor]) -> int:
    """Bytes of the copies of ``weights`` in another dtype that the autograd graph of
    ``loss`` keeps for its backward: every node's saved tensors (a custom Function's
    ``saved_tensors``, a built-in node's ``_saved_*``) with a weight's shape or its
    transpose and not its dtype, by storage, as they are after the forward."""
    shapes = {(tuple(w.shape), w.dtype) for w in weights}
    shapes |= {(s[::-1], d) for s, d in shapes}
    wanted = {s for s, _ in shapes}
    seen: dict[int, int] = {}
    todo, done = [loss.grad_fn], set()
    while todo:
        node = todo.pop()
        if node is None or id(node) in done:
            continue
        done.add(id(node))
        saved = []
        if hasattr(node, "saved_tensors"):
            saved += [t for t in node.saved_tensors if isinstance(t, torch.Tensor)]
        for name in dir(node):
            if name.startswith("_saved_"):
                t = getattr(node, name, None)
                if isinstance(t, torch.Tensor):
                    saved.append(t)
        for t in saved:
            if tuple(t.shape) in wanted and (tuple(t.shape), t.dtype) not in shapes:
                st = t.untyped_storage()
                seen[st.data_ptr()] = st.nbytes()
        todo += [f for f, _ in node.next_functions]
    return sum(seen.values())


def fsdp_casts(rank: int, world: int, tmp: str, recipes: list[str]) -> None:
    """The workbench GPT under FSDP2 with each of ``recipes``: the weight copies its
    graph keeps after one forward (``graph_weight_copies``), ``measure``'s and
    ``estimate``'s ``weight_casts`` (of the sharded module and of the bare spec)."""
    from mixprec.memory import TransformerSpec, estimate, measure
    from mixprec.workbench import GPT, GPTConfig

    # the real 16-bit kernels' copies (emulated, the layers around fp8 stay fp32 and the
    # head keeps no bf16 copy)
    os.environ[EMULATE_ENV] = "off"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank,
                            world_size=world)
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, VOCAB, (BATCH * world, SEQ + 1), generator=g).chunk(world)[rank]
    spec = TransformerSpec(layers=LAYERS, hidden=WIDTH, heads=HEADS, seq_len=SEQ,
                           micro_batch=BATCH, vocab=VOCAB, attention="flash", dropout=False)
    out = {}
    for recipe in recipes:
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab=VOCAB, seq_len=SEQ, n_layers=LAYERS, d_model=WIDTH,
                              n_heads=HEADS))
        engine = MixedPrecision(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                                recipe, parallel="fsdp")
        weights = [p.to_local() if hasattr(p, "to_local") else p
                   for p in engine.model.parameters()]
        full = [torch.empty(p.shape, dtype=w.dtype, device="meta")
                for p, w in zip(engine.model.parameters(), weights)]
        with engine.autocast():
            loss = engine.model(idx[:, :-1], idx[:, 1:])
        held = graph_weight_copies(loss, full)
        del loss
        out[recipe] = {
            "graph": held,
            "measured": measure(engine.model, engine, (idx[:, :-1], idx[:, 1:]))[
                "weight_casts"],
            "module": estimate(engine.model, recipe, zero_stage=3, world_size=world,
                               activations=spec)["weight_casts"],
            "spec": estimate(spec, recipe, zero_stage=3, world_size=world)["weight_casts"],
        }
        del engine, model
        gc.collect()
    torch.save(out, os.path.join(tmp, f"casts_rank{rank}.pt"))
    gc.collect()
    dist.destroy_process_group()
