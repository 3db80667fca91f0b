"""Train a small GPT-2 (a config, nothing downloaded) with Hugging Face's Trainer under a
mixprec recipe.

    python examples/hf_trainer_train.py --recipe bf16-master --steps 20
    python examples/hf_trainer_train.py --recipe fp16-master --steps 40 --resume
    torchrun --nproc-per-node 2 examples/hf_trainer_train.py --inject-inf 3:1

Needs ``pip install mixprec[transformers]``. Checkpoints go to ``--out`` every 10 steps;
``--resume`` continues from the last one. Under ``torchrun`` each process trains on its
shard of the data, through the engine's DDP. ``--inject-inf STEP:RANK`` multiplies that
rank's loss by inf at that step (every rank skips it); ``--record PATH`` writes each rank's
skips and a digest of its final fp32 weights as JSON (PATH, PATH.rankN).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json

import torch
import transformers

from mixprec.integrations.transformers import MixedPrecisionTrainer
from mixprec.workbench.data import load_corpus


class PoisonedTrainer(MixedPrecisionTrainer):
    """Multiplies rank ``poison[1]``'s loss by inf at optimizer step ``poison[0]``."""

    poison: tuple[int, int] | None = None

    def compute_loss(self, model, inputs, *args, **kwargs):
        loss = super().compute_loss(model, inputs, *args, **kwargs)
        if self.poison == (self.state.global_step, self.args.process_index):
            loss = loss * float("inf")
        return loss


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--recipe", default="bf16-master")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--accumulate", type=int, default=1)
    ap.add_argument("--out", default="hf-mixprec-run")
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--inject-inf", default=None, metavar="STEP:RANK")
    ap.add_argument("--record", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=256, n_positions=64, n_embd=128, n_layer=2,
                                  n_head=4)
    model = transformers.GPT2LMHeadModel(cfg)
    tokens = load_corpus(max_bytes=300_000).train[: 64 * 2000].long().view(-1, 64)
    data = [{"input_ids": t, "labels": t} for t in tokens]
    targs = transformers.TrainingArguments(
        output_dir=args.out, max_steps=args.steps, per_device_train_batch_size=8,
        gradient_accumulation_steps=args.accumulate, learning_rate=3e-3, max_grad_norm=1.0,
        save_steps=10, logging_steps=5, report_to=[], use_cpu=True)
    trainer = PoisonedTrainer(model=model, args=targs, train_dataset=data,
                              recipe=args.recipe)
    trainer.poison = tuple(map(int, args.inject_inf.split(":"))) if args.inject_inf else None
    trainer.train(resume_from_checkpoint=True if args.resume else None)
    e, rank = trainer.engine, trainer.args.process_index
    if args.record:
        h, state = hashlib.sha256(), e.fp32_state_dict()
        for k in sorted(state):
            h.update(state[k].contiguous().view(torch.uint8).numpy().tobytes())
        with open(args.record if rank == 0 else f"{args.record}.rank{rank}", "w") as f:
            json.dump({"rank": rank, "world": trainer.args.world_size, "steps": e.steps,
                       "skipped": int(e.skipped_steps), "weights": h.hexdigest(),
                       "model": type(trainer.model_wrapped).__name__}, f)
    if rank == 0:
        print(f"{args.recipe}: {e.steps} steps, {int(e.skipped_steps)} skipped, "
              f"loss scale {float(e.scale):g}")
    # release everything that holds the process group (the Trainer, its engine and DDP
    # reducer, through reference cycles) before destroying it, so the group is torn down
    # here and not during interpreter exit, where gloo's threads can abort the process
    del trainer, e
    gc.collect()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
