"""Train a small GPT-2 (a config, nothing downloaded) with Hugging Face's Trainer under a
mixprec recipe.

    python examples/hf_trainer_train.py --recipe bf16-master --steps 20
    python examples/hf_trainer_train.py --recipe fp16-master --steps 40 --resume

Needs ``pip install mixprec[transformers]``. Checkpoints go to ``--out`` every 10 steps;
``--resume`` continues from the last one.
"""

from __future__ import annotations

import argparse

import torch
import transformers

from mixprec.integrations.transformers import MixedPrecisionTrainer
from mixprec.workbench.data import load_corpus


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--recipe", default="bf16-master")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--accumulate", type=int, default=1)
    ap.add_argument("--out", default="hf-mixprec-run")
    ap.add_argument("--resume", action="store_true")
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
    trainer = MixedPrecisionTrainer(model=model, args=targs, train_dataset=data,
                                    recipe=args.recipe)
    trainer.train(resume_from_checkpoint=True if args.resume else None)
    e = trainer.engine
    print(f"{args.recipe}: {e.steps} steps, {int(e.skipped_steps)} skipped, "
          f"loss scale {float(e.scale):g}")


if __name__ == "__main__":
    main()
