"""A plain Accelerate training loop under a mixprec recipe.

    python examples/accelerate_train.py --recipe bf16-master
    accelerate launch --num_processes 2 --cpu examples/accelerate_train.py --accum 2
    accelerate launch --num_processes 2 --cpu examples/accelerate_train.py \\
        --recipe fp16-master --inject-inf 3:1 --out run.json
    accelerate launch --config_file ds.yaml examples/accelerate_train.py \
        --recipe fp8-current --out run.json          # DeepSpeed ZeRO (below)

The loop is Accelerate's own (``accumulate``, ``backward``, ``step``, ``save_state``);
``mixprec.integrations.accelerate.prepare`` replaces ``accelerator.prepare``. The
workbench GPT trains on the built-in corpus (nothing is downloaded), each process on its
shard of the batches. ``--inject-inf STEP:RANK`` multiplies that rank's loss by inf at
that optimizer step: every rank skips the step together. ``--out`` writes each rank's
losses, skips, learning rates and final weights digest as JSON (rank 0's file is PATH,
others PATH.rankN). ``--save-state DIR`` saves at the end; ``--resume DIR`` continues
from such a save.

Under an ``accelerate launch`` DeepSpeed config (``distributed_type: DEEPSPEED`` with a
``deepspeed_config``), ``prepare`` swaps the recipe's Linear formats in and DeepSpeed's
engine runs the rest (docs/guides/deepspeed.md); the JSON then also holds the coverage
(each matmul's format) and the digest is of DeepSpeed's fp32 masters.
"""

import argparse
import hashlib
import json

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType

from mixprec.integrations.accelerate import prepare
from mixprec.workbench import GPT, GPTConfig
from mixprec.workbench.data import load_corpus, sample_batch


def weights_digest(state: dict) -> str:
    """sha256 over every tensor's bytes, in key order (equal digests: equal weights)."""
    h = hashlib.sha256()
    for k in sorted(state):
        h.update(state[k].detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def masters(engine: torch.nn.Module) -> dict:
    """DeepSpeed's fp32 masters, whole (ZeRO-3: a gather every rank joins)."""
    from deepspeed.utils import safe_get_full_fp32_param

    return {n: safe_get_full_fp32_param(p) for n, p in engine.module.named_parameters()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--recipe", default="bf16-master")
    ap.add_argument("--steps", type=int, default=10, help="optimizer steps")
    ap.add_argument("--accum", type=int, default=1, help="gradient_accumulation_steps")
    ap.add_argument("--batch", type=int, default=4, help="sequences per micro-batch")
    ap.add_argument("--parallel", choices=["ddp", "fsdp"], default="ddp",
                    help="how a multi-process launch splits the model")
    ap.add_argument("--inject-inf", default=None, metavar="STEP:RANK")
    ap.add_argument("--out", default=None)
    ap.add_argument("--save-state", default=None)
    ap.add_argument("--resume", default=None)
    ap.add_argument("--export", default=None, metavar="DIR",
                    help="accelerator.save_model(model, DIR) at the end (every rank)")
    args = ap.parse_args()

    accelerator = Accelerator(gradient_accumulation_steps=args.accum)
    deepspeed = accelerator.distributed_type == DistributedType.DEEPSPEED
    # DeepSpeed's launch always has a process group (Accelerate's state counts one
    # process there on a machine without GPUs until prepare corrects it)
    world = torch.distributed.get_world_size() if deepspeed else accelerator.num_processes
    torch.manual_seed(0)  # the same initial weights on every rank
    cfg = GPTConfig(vocab=256, seq_len=64, n_layers=2, d_model=64, n_heads=4)
    model = GPT(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + 0.1 * s))
    corpus = load_corpus(max_bytes=200_000)
    g = torch.Generator().manual_seed(1)
    n = args.steps * args.accum * world * args.batch  # every rank: steps * accum batches
    data, targets = sample_batch(corpus.train, n, cfg.seq_len, g)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data, targets),
                                         batch_size=args.batch)
    model, optimizer, loader, scheduler = prepare(
        accelerator, model, optimizer, loader, scheduler, recipe=args.recipe,
        parallel=args.parallel, max_grad_norm=1.0)
    engine = None if deepspeed else optimizer.engine  # under DeepSpeed: its engine steps
    rank = accelerator.process_index
    if args.resume:
        accelerator.load_state(args.resume)
    poison = tuple(map(int, args.inject_inf.split(":"))) if args.inject_inf else None

    log = {"rank": rank, "world": world, "losses": [], "skipped": [], "lrs": []}
    steps = 0  # optimizer steps taken (skipped ones included)
    for x, y in loader:
        with accelerator.accumulate(model):
            loss = model(x, y)
            log["losses"].append(loss.item())
            if poison == (steps, rank):
                loss = loss * float("inf")
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            steps += 1
            log["skipped"].append(bool(optimizer.step_was_skipped))
            log["lrs"].append(scheduler.get_last_lr()[0])
            if rank == 0 and steps % 5 == 0:
                scale = f"  scale {float(engine.scale):g}" if engine else ""
                print(f"step {steps:3d}  loss {loss.item():.4f}{scale}")
    if args.save_state:
        accelerator.save_state(args.save_state)
    # the fp32 masters, whole (under FSDP or ZeRO-3 a gather: every rank calls it)
    log["weights"] = weights_digest(masters(model) if deepspeed
                                    else engine.fp32_state_dict(full=True))
    log["steps"] = engine.steps if engine else steps
    if deepspeed:
        from mixprec.integrations.deepspeed import coverage

        cov = coverage(model)
        log["coverage"] = {r.name: r.format for r in cov.rows}
        log["low_precision_share"] = cov.low_precision_share
        if rank == 0:
            print(cov)
    if args.export:  # Accelerate's own export calls, on every rank as its docs say
        log["get_state_dict"] = weights_digest(accelerator.get_state_dict(model))
        accelerator.save_model(model, args.export)
        accelerator.wait_for_everyone()
        from safetensors.torch import load_file

        log["save_model"] = weights_digest(load_file(f"{args.export}/model.safetensors"))
    if args.out:
        path = args.out if rank == 0 else f"{args.out}.rank{rank}"
        with open(path, "w") as f:
            json.dump(log, f)
    accelerator.end_training()


if __name__ == "__main__":
    main()
