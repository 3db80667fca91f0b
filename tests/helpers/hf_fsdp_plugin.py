"""Accelerate's FSDP2 plugin under mixprec, on a tiny Llama (tests/helpers/
hf_distcfg_workers.py's): an Accelerate loop (``Accelerator(fsdp_plugin=
FullyShardedDataParallelPlugin(fsdp_version=2))``, ``prepare``, ``accelerator.backward``,
``clip_grad_norm_``, ``optimizer.step``) and ``MixedPrecisionTrainer`` with
``TrainingArguments(fsdp="full_shard", fsdp_config={"fsdp_version": 2})`` and under the
plugin ``accelerate launch --use_fsdp`` puts in the environment. For
tests/integrations/test_fsdp_plugin.py, under ``torchrun --nproc-per-node 2``; each rank
writes every scenario's record to OUT_DIR/records_rank<r>.pt:

    torchrun --nproc-per-node 2 tests/helpers/hf_fsdp_plugin.py OUT_DIR MODEL_DIR RECIPE...

Accelerate sets ``DistributedType.FSDP`` on accelerator devices only (on CPU processes it
drops the plugin): the Accelerate run sets the state it would build on a GPU. One process
(``accelerate_loop(..., world=1)``, ``trainer_run(..., fsdp=False)``) is the reference."""

from __future__ import annotations

import gc
import logging
import os
import sys
import warnings

import torch
import torch.distributed as dist
import transformers
from accelerate import Accelerator, FullyShardedDataParallelPlugin
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import DistributedType

from helpers import hf_distcfg_workers as w
from mixprec.integrations.accelerate import prepare
from mixprec.integrations.transformers import MixedPrecisionTrainer
from mixprec.modules.linear import Float8Linear
from mixprec.parallel.presharded import _fsdp_param_records, _fsdp_units

__all__ = ["accelerate_loop", "trainer_run", "STEPS", "ACCUM"]

STEPS = 6
#: micro-batches per optimizer step in the Accelerate loop
ACCUM = 2


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _listen() -> _Lines:
    """A fresh handler on mixprec's integrations logger (the last one taken off)."""
    log = logging.getLogger("mixprec.integrations")
    for old in [x for x in log.handlers if isinstance(x, _Lines)]:
        log.removeHandler(old)
    h = _Lines()
    log.setLevel(logging.INFO)
    log.addHandler(h)
    return h


def _reset():
    AcceleratorState._reset_state()
    GradientState._reset_state()


def _same_parameters(model, opt, engine) -> bool:
    """Whether the optimizer, the engine and FSDP point at the same parameters: the
    engine's working copy is the model's parameters, the optimizer steps the engine's
    fp32 masters, and each FSDP2 record holds the parameter its module (the quantized
    Linear after the swap) holds."""
    state = engine.param_state
    records = _fsdp_param_records(model) if _fsdp_units(model) else []
    fsdp_ok = all(getattr(fp._module_info.module, fp._module_info.param_name)
                  is fp.sharded_param for fp in records)
    swapped = {n for n, m in model.named_modules() if isinstance(m, Float8Linear)}
    rebound = sum(isinstance(fp._module_info.module, Float8Linear) for fp in records)
    opt_params = [p for g in opt.param_groups for p in g["params"]]
    return (fsdp_ok and rebound == (len(swapped) if records else 0)
            and [id(p) for p in state.working] == [id(p) for p in model.parameters()]
            and [id(p) for p in opt_params] == [id(p) for p in state.opt_params])


def accelerate_loop(model_dir: str, recipe: str, world: int, out: str | None = None
                    ) -> dict:
    """Accelerate's documented loop under the FSDP2 plugin (``world`` 2) or plain
    (``world`` 1, the reference), each rank on its share of every global batch, in
    ``ACCUM`` micro-batches (``Accelerator(gradient_accumulation_steps=ACCUM)``)."""
    _reset()
    lines = _listen()
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["LlamaDecoderLayer"])
    acc = Accelerator(fsdp_plugin=plugin if world > 1 else None,
                      gradient_accumulation_steps=ACCUM)
    if world > 1:  # what Accelerate builds on a GPU; on CPU it drops the plugin
        acc.state.distributed_type = DistributedType.FSDP
        acc.state.fsdp_plugin = plugin
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=w.LR)
    model, opt = prepare(acc, model, opt, recipe=recipe)
    engine, rank = opt.engine, acc.process_index
    same = _same_parameters(model, opt, engine)
    per = w.GLOBAL_BATCH // world
    losses, norms, skipped = [], [], []
    for batch in w.batches(STEPS):
        mine = batch[rank * per:(rank + 1) * per]
        seen = torch.zeros(())
        for ids in mine.chunk(ACCUM):
            with acc.accumulate(model):
                loss = model(input_ids=ids, labels=ids).loss
                acc.backward(loss)
                if acc.sync_gradients:
                    norms.append(float(acc.clip_grad_norm_(model.parameters(), 1.0)))
                opt.step()
                opt.zero_grad()
            seen += loss.detach().float() / ACCUM
        if world > 1:  # every rank's tokens count alike: the mean of the means
            dist.all_reduce(seen)
            seen /= world
        losses.append(float(seen))
        skipped.append(opt.step_was_skipped)
    rec = {"losses": losses, "norms": norms, "skipped": skipped,
           "quantized": sorted(n for n, m in model.named_modules()
                               if isinstance(m, Float8Linear)),
           "coverage": engine.coverage.shares(), "lines": lines.lines,
           "fsdp_units": sorted({type(m).__name__ for m in model.modules()
                                 if type(m).__name__.startswith("FSDP")}),
           "weights": acc.get_state_dict(model), "same_parameters": same}
    if out is not None:  # save_state, one more step, load_state: back where it saved
        acc.save_state(out)
        ids = w.batches(1)[0][rank * per:(rank + 1) * per]
        for part in ids.chunk(ACCUM):
            with acc.accumulate(model):
                acc.backward(model(input_ids=part, labels=part).loss)
                opt.step()
        moved = acc.get_state_dict(model)
        acc.load_state(out)
        back = acc.get_state_dict(model)
        rec["resumed"] = (any(not torch.equal(moved[k], v) for k, v in back.items())
                          and all(torch.equal(rec["weights"][k], v)
                                  for k, v in back.items()))
    engine.close()
    _reset()
    return rec


def trainer_run(model_dir: str, recipe: str, out: str, fsdp: str = "args") -> dict:
    """``MixedPrecisionTrainer.train()`` then ``save_model`` (every rank); ``fsdp``:
    "args" (``TrainingArguments(fsdp=..., fsdp_config=...)``), "env" (the plugin
    ``accelerate launch --use_fsdp --fsdp_version 2`` puts in the environment) or ""
    (no sharding: the one-process reference)."""
    warnings.simplefilter("ignore")
    lines = _listen()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if fsdp == "env":
        os.environ.update(ACCELERATE_USE_FSDP="true", FSDP_VERSION="2",
                          FSDP_AUTO_WRAP_POLICY="TRANSFORMER_BASED_WRAP",
                          FSDP_TRANSFORMER_CLS_TO_WRAP="LlamaDecoderLayer",
                          FSDP_STATE_DICT_TYPE="FULL_STATE_DICT")
    data = [{"input_ids": t, "labels": t.clone()}
            for b in w.batches(STEPS) for t in b]
    args = transformers.TrainingArguments(
        output_dir=out, max_steps=STEPS, per_device_train_batch_size=w.GLOBAL_BATCH // world,
        learning_rate=w.LR, optim="adamw_torch", lr_scheduler_type="constant",
        weight_decay=0.0, max_grad_norm=1.0, logging_steps=1, report_to=[],
        save_strategy="no", use_cpu=True, seed=0, data_seed=0, disable_tqdm=True,
        fsdp="full_shard" if fsdp == "args" else "",
        fsdp_config={"fsdp_version": 2} if fsdp == "args" else None)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)

    class InOrder(MixedPrecisionTrainer):
        def _get_train_sampler(self, *a, **k):
            return torch.utils.data.SequentialSampler(self.train_dataset)

    t = InOrder(model=model, args=args, train_dataset=data, recipe=recipe)
    t.train()
    t.save_model(os.path.join(out, "exported"))
    engine = t.engine
    logs = [h for h in t.state.log_history if "grad_norm" in h]
    rec = {"losses": [h["loss"] for h in logs], "norms": [h["grad_norm"] for h in logs],
           "skipped": int(engine.skipped_steps), "parallel": engine.parallel,
           "coverage": engine.coverage.shares(), "lines": lines.lines,
           "quantized": sorted(n for n, m in engine.module.named_modules()
                               if isinstance(m, Float8Linear)),
           "weights": engine.export_state_dict(), "exported": os.path.join(out, "exported")}
    if fsdp == "env":
        for k in ("ACCELERATE_USE_FSDP", "FSDP_VERSION", "FSDP_AUTO_WRAP_POLICY",
                  "FSDP_TRANSFORMER_CLS_TO_WRAP", "FSDP_STATE_DICT_TYPE"):
            os.environ.pop(k, None)
    del t
    _reset()
    return rec


def main(out: str, model_dir: str, *recipes: str) -> None:
    torch.set_num_threads(1)
    os.environ["ACCELERATE_USE_CPU"] = "1"
    records = {}
    for recipe in recipes:
        records[("accelerate", recipe)] = accelerate_loop(
            model_dir, recipe, 2, os.path.join(out, f"state-{recipe}"))
        records[("trainer", recipe)] = trainer_run(model_dir, recipe,
                                                   os.path.join(out, f"tr-{recipe}"))
    records[("trainer-env", recipes[0])] = trainer_run(
        model_dir, recipes[0], os.path.join(out, "tr-env"), fsdp="env")
    torch.save(records, os.path.join(out, f"records_rank{os.environ['RANK']}.pt"))
    records.clear()
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
