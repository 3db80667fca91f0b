"""A GPT2LMHeadModel (a small config, nothing downloaded) under ``MixedPrecisionTrainer``
with ``TrainingArguments(fsdp="full_shard")``: the engine shards, Trainer drives. For
tests/integrations/test_hf_trainer.py, under ``torchrun --nproc-per-node 2``; one launch runs every
scenario and rank 0 writes their records to OUT_DIR/records.pt:

    torchrun --nproc-per-node 2 tests/helpers/hf_sharded.py OUT_DIR

``train(fsdp=False, ...)`` on one process is the reference, run in the test's process."""

from __future__ import annotations

import gc
import os
import sys
import warnings

import torch
import transformers

from mixprec.integrations.transformers import MixedPrecisionTrainer

GLOBAL_BATCH = 8


def model():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=64, n_layer=2,
                                  n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
                                  attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(cfg)


def data(n: int):
    g = torch.Generator().manual_seed(1)
    return [{"input_ids": t, "labels": t.clone()}
            for t in torch.randint(0, 64, (n, 32), generator=g)]


class Poisoned(MixedPrecisionTrainer):
    """Data in order; rank ``poison[1]``'s loss times inf at step ``poison[0]``."""

    poison: tuple[int, int] | None = None

    def _get_train_sampler(self, *args, **kwargs):
        return torch.utils.data.SequentialSampler(self.train_dataset)

    def compute_loss(self, model, inputs, *args, **kwargs):
        loss = super().compute_loss(model, inputs, *args, **kwargs)
        if self.poison == (self.state.global_step, self.args.process_index):
            loss = loss * float("inf")
        return loss


def train(recipe: str, steps: int, out: str, fsdp: bool = True, save_steps=None,
          resume=None, poison=None, save_model=None) -> dict:
    """One ``trainer.train()``; what it trained (every rank calls it)."""
    warnings.simplefilter("ignore")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    args = transformers.TrainingArguments(
        output_dir=out, max_steps=steps, per_device_train_batch_size=GLOBAL_BATCH // world,
        learning_rate=0.5, optim="sgd", lr_scheduler_type="linear", warmup_steps=0,
        weight_decay=0.0, max_grad_norm=1.0, logging_steps=1, report_to=[],
        save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500,
        use_cpu=True, seed=0, data_seed=0, disable_tqdm=True,
        fsdp="full_shard" if fsdp else "",
        fsdp_config={"transformer_layer_cls_to_wrap": ["GPT2Block"]} if fsdp else None)
    t = Poisoned(model=model(), args=args, train_dataset=data(GLOBAL_BATCH * 6),
                 recipe=recipe)
    t.poison = poison
    t.train(resume_from_checkpoint=resume)
    if save_model:
        t.save_model(save_model)  # every rank, as Trainer's docs call it
    engine = t.engine
    logs = [h for h in t.state.log_history if "learning_rate" in h]
    rec = {"weights": engine.export_state_dict(),  # a collective under FSDP
           "lrs": [h["learning_rate"] for h in logs],
           "grad_norms": [h["grad_norm"] for h in logs], "steps": engine.steps,
           "skipped": int(engine.skipped_steps), "parallel": engine.parallel,
           "units": sorted({type(m).__name__ for m in engine.model.modules()
                            if type(m).__name__.startswith("FSDP")}),
           "wrapped": type(t.model_wrapped).__name__}
    del t
    return rec


def main(out: str) -> None:
    records = {"fp32": train("fp32", 6, os.path.join(out, "fp32")),
               "fp16-master": train("fp16-master", 6, os.path.join(out, "fp16"),
                                    save_steps=3, poison=(2, 1),
                                    save_model=os.path.join(out, "exported"))}
    records["resumed"] = train("fp16-master", 6, os.path.join(out, "fp16"),
                               resume=os.path.join(out, "fp16", "checkpoint-3"),
                               poison=(2, 1))
    if int(os.environ.get("RANK", "0")) == 0:
        torch.save(records, os.path.join(out, "records.pt"))
    # free what still holds the process group (engines, FSDP modules, reference cycles)
    # before destroying it, so it is torn down here, in order, and not during interpreter
    # exit, where a rank can abort ("terminate called without an active exception")
    records.clear()
    gc.collect()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
