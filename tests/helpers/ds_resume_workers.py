"""Checkpoints and fp16 under DeepSpeed (CPU accelerator, gloo) with mixprec's
quantized Linears, for tests/integrations/test_deepspeed_resume.py. One launch runs
every scenario named on the command line, from tests/helpers/ds_workers.py's tiny Llama
and 6 global batches of 8 sequences; rank 0 writes OUT_DIR/resume{WORLD}.pt:

    DS_ACCELERATOR=cpu torchrun --nproc-per-node 2 tests/helpers/ds_resume_workers.py \
        OUT_DIR trainer:2:fp8-current accelerate:3:fp8 fp16:2:fp8-current:2:1 ...

``trainer:S:RECIPE``: ``MixedPrecisionTrainer`` under ZeRO-S and bf16, 6 steps with
``save_steps=3``, then a fresh Trainer ``train(resume_from_checkpoint=.../checkpoint-3)``.
``accelerate:S:RECIPE``: Accelerate's loop, ``accelerator.save_state`` after step 3, then
a fresh Accelerator and model, ``load_state`` and steps 4 to 6. Each records the straight
and the resumed run's losses, fp32 masters (whole) and each rank's fp8 scaling state.
``fp16:S:RECIPE:K:R``: Accelerate's loop under DeepSpeed's ``fp16`` (dynamic loss scale,
initial 2^8, hysteresis 1), the loss of step K multiplied by inf on rank R (on one
process: the whole batch's); each rank's skips and loss scales, the global losses.
"""

from __future__ import annotations

import gc
import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before DeepSpeed picks its accelerator

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import transformers  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402
from accelerate.utils import DeepSpeedPlugin  # noqa: E402
from deepspeed.accelerator import get_accelerator  # noqa: E402
from deepspeed.utils import safe_get_full_fp32_param  # noqa: E402
from transformers.integrations.deepspeed import unset_hf_deepspeed_config  # noqa: E402

from helpers import moe_models  # noqa: E402
from helpers.ds_workers import GLOBAL_BATCH, LR, STEPS, _config, _InOrder, save_model  # noqa: E402, I001
from mixprec.integrations import deepspeed as mp_ds  # noqa: E402
from mixprec.integrations.accelerate import prepare  # noqa: E402

# DeepSpeed's CPU accelerator takes fp16 only where oneDNN has fp16 kernels (AVX512-FP16
# or AMX-FP16; DeepSpeed raises "Type fp16 is not supported on your device" elsewhere);
# torch computes fp16 on any CPU, so the fp16 scenarios lift that gate
_CPU = type(get_accelerator())
if not get_accelerator().is_fp16_supported():
    _CPU.is_fp16_supported = lambda self: True
    _CPU.supported_dtypes = lambda self: [torch.float, torch.bfloat16, torch.float16]

SAVE_AT = 3  # the checkpoint: after this many steps


def _batches() -> list[torch.Tensor]:
    return moe_models.markov_batches(STEPS, batch=GLOBAL_BATCH, seq=16)


def _reset() -> None:
    AcceleratorState._reset_state(reset_partial_state=False)
    GradientState._reset_state()
    gc.collect()


def _weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The fp32 masters, whole (ZeRO-3: a gather every rank joins)."""
    out = {}
    for n, p in module.named_parameters():
        w = safe_get_full_fp32_param(p)
        out[n] = (w if w is not None else p.detach()).float().cpu().clone()
    return out


def _scaling(module: torch.nn.Module) -> list[dict[str, torch.Tensor]]:
    """Each rank's fp8 scaling state (rank order)."""
    mine = {k: v.detach().float().cpu().clone() for k, v in mp_ds._scaling(module).items()}
    if not dist.is_initialized():
        return [mine]
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return every


def _record(out_dir: str) -> dict:
    import json

    with open(os.path.join(out_dir, mp_ds.RECORD_FILE)) as f:
        return {"record": json.load(f), "files": sorted(os.listdir(out_dir))}


def trainer_resume(stage: int, path: str, rank: int, world: int, recipe: str,
                   out: str) -> dict:
    data = [{"input_ids": t, "labels": t.clone()} for b in _batches() for t in b]

    def run(output_dir: str, resume: str | None = None) -> dict:
        args = transformers.TrainingArguments(
            output_dir, deepspeed=_config(stage, "auto", "auto"), bf16=True,
            per_device_train_batch_size=GLOBAL_BATCH // world, max_steps=STEPS,
            learning_rate=LR, lr_scheduler_type="constant", logging_steps=1,
            report_to=[], save_strategy="steps", save_steps=SAVE_AT, max_grad_norm=1.0,
            dataloader_drop_last=True, use_cpu=True)
        model = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32)
        trainer = _InOrder(model=model, args=args, train_dataset=data, recipe=recipe)
        trainer.train(resume_from_checkpoint=resume)
        rec = {"losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
               "weights": _weights(trainer.model), "scaling": _scaling(trainer.model),
               "step": trainer.state.global_step}
        unset_hf_deepspeed_config()
        _reset()
        return rec

    straight = run(os.path.join(out, "straight"))
    ckpt = os.path.join(out, "straight", f"checkpoint-{SAVE_AT}")
    files = _record(ckpt)
    resumed = run(os.path.join(out, "resumed"), resume=ckpt)
    return {"straight": straight, "resumed": resumed, **files}


def _accelerate_model(stage: int, path: str, world: int, recipe: str, config=None):
    micro = GLOBAL_BATCH // world
    acc = Accelerator(deepspeed_plugin=DeepSpeedPlugin(
        hf_ds_config=config or _config(stage, micro, 1)))
    model = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    model, opt = prepare(acc, model, opt, recipe=recipe,
                         max_grad_norm=None if config else 1.0)
    return acc, model, opt, micro


def _global(loss: torch.Tensor, world: int) -> float:
    whole = loss.detach().float().clone()
    if dist.is_initialized():
        dist.all_reduce(whole)
    return whole.item() / world


def accelerate_resume(stage: int, path: str, rank: int, world: int, recipe: str,
                      out: str) -> dict:
    ckpt = os.path.join(out, "state")

    def run(resume: bool) -> dict:
        acc, model, opt, micro = _accelerate_model(stage, path, world, recipe)
        if resume:
            acc.load_state(ckpt)
        losses = []
        for i, ids in enumerate(_batches()):
            if resume and i < SAVE_AT:
                continue
            mine = ids[rank * micro:(rank + 1) * micro]
            loss = model(input_ids=mine, labels=mine).loss
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(_global(loss, world))
            if not resume and i + 1 == SAVE_AT:
                acc.save_state(ckpt)
        rec = {"losses": losses, "weights": _weights(model.module),
               "scaling": _scaling(model.module), "step": model.global_steps}
        _reset()
        return rec

    straight = run(False)
    files = _record(ckpt)
    return {"straight": straight, "resumed": run(True), **files}


def fp16_run(stage: int, path: str, rank: int, world: int, recipe: str, at: str,
             who: str) -> dict:
    micro = GLOBAL_BATCH // world
    config = {"fp16": {"enabled": True, "initial_scale_power": 8, "hysteresis": 1,
                       "loss_scale_window": 1000, "min_loss_scale": 1},
              "zero_optimization": {"stage": stage}, "gradient_clipping": 1.0,
              "train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1}
    acc, model, opt, micro = _accelerate_model(stage, path, world, recipe, config)
    losses, skipped, scales = [], [], []
    for i, ids in enumerate(_batches()):
        mine = ids[rank * micro:(rank + 1) * micro]
        loss = model(input_ids=mine, labels=mine).loss
        back = loss * float("inf") if i == int(at) and (world == 1 or rank == int(who)) \
            else loss
        acc.backward(back)
        opt.step()
        opt.zero_grad()
        losses.append(_global(loss, world))
        skipped.append(bool(opt.step_was_skipped))
        scales.append(float(model.optimizer.loss_scale))
    every: list = [None] * world
    mine = {"skipped": skipped, "scales": scales}
    if dist.is_initialized():
        dist.all_gather_object(every, mine)
    else:
        every = [mine]
    rec = {"losses": losses, "ranks": every, "skipped_steps": model.skipped_steps,
           "dtype": str(next(model.module.parameters()).dtype),
           "formats": {r.name: r.format for r in mp_ds.coverage(model).rows}}
    _reset()
    return rec


def main(out_dir: str, scenarios: list[str]) -> None:
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    path = os.path.join(out_dir, "model")
    records = {}
    for name in scenarios:
        kind, stage, recipe, *rest = name.split(":")
        if dist.is_initialized():
            dist.barrier()
        where = os.path.join(out_dir, f"{world}-{name.replace(':', '-')}")
        if kind == "fp16":
            records[name] = fp16_run(int(stage), path, rank, world, recipe, *rest)
        else:
            run = trainer_resume if kind == "trainer" else accelerate_resume
            records[name] = run(int(stage), path, rank, world, recipe, where)
    if rank == 0:
        records["world"] = world
        torch.save(records, os.path.join(out_dir, f"resume{world}.pt"))
    if dist.is_initialized():
        dist.barrier()


if __name__ == "__main__":
    if not os.path.exists(os.path.join(sys.argv[1], "model")):
        save_model(os.path.join(sys.argv[1], "model"))  # a launch by hand
    main(sys.argv[1], sys.argv[2:])
