"""mixprec's fp8-current Linears inside DeepSpeed (CPU accelerator, gloo), for
tests/integrations/test_deepspeed.py. One launch runs every scenario named on the
command line, each from the same tiny Llama (2 layers, hidden 64, seed 0) and the same
6 global batches of 8 sequences, and rank 0 writes their records to OUT_DIR/records.pt:

    DS_ACCELERATOR=cpu torchrun --nproc-per-node 2 tests/helpers/ds_workers.py OUT_DIR \
        accelerate:2 trainer:3 ...

``accelerate:S``: Accelerate's own loop (``Accelerator(deepspeed_plugin=...)``, mixprec's
``prepare``, ``accelerator.backward``, ``optimizer.step()``) under ZeRO-S;
``trainer:S``: ``MixedPrecisionTrainer.train()`` with ``TrainingArguments(deepspeed=
{...})`` under ZeRO-S (the model loaded after the arguments, so ZeRO-3 partitions it at
load). Both under bf16, ``max_grad_norm`` 1.0. A record holds the global loss of each
step and the coverage's formats. The same launch on one process (each rank's batch the
whole global one) is the reference."""

from __future__ import annotations

import gc
import os
import sys
import tempfile
import warnings

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before DeepSpeed picks its accelerator

import deepspeed.comm.torch  # noqa: E402, F401
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import transformers  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402
from accelerate.utils import DeepSpeedPlugin  # noqa: E402
from transformers.integrations.deepspeed import unset_hf_deepspeed_config  # noqa: E402

from helpers import moe_models  # noqa: E402
from mixprec import MixedPrecision  # noqa: E402
from mixprec.integrations import deepspeed as mp_ds  # noqa: E402
from mixprec.integrations.accelerate import prepare  # noqa: E402
from mixprec.integrations.transformers import MixedPrecisionTrainer  # noqa: E402

warnings.simplefilter("ignore")
# DeepSpeed's shared-memory allreduce is a C++ op it compiles on first use (minutes,
# and a compiler); the ranks reduce over gloo instead
sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None

RECIPE = "fp8-current"
STEPS = 6
GLOBAL_BATCH = 8
LR = 1e-2


def _config(stage: int, micro, accum) -> dict:
    return {"bf16": {"enabled": "auto" if micro == "auto" else True},
            "zero_optimization": {"stage": stage},
            "train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": accum,
            "gradient_clipping": "auto"}


def save_model(path: str) -> str:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=moe_models.VOCAB, max_position_embeddings=64,
        head_dim=16)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def _coverage(model) -> dict:
    cov = mp_ds.coverage(model)
    return {"formats": {r.name: r.format for r in cov.rows},
            "low": cov.low_precision_share, "total": cov.total}


def accelerate_run(stage: int, path: str, rank: int, world: int,
                   recipe: str = RECIPE) -> dict:
    """Accelerate's documented DeepSpeed loop, with mixprec's prepare."""
    micro = GLOBAL_BATCH // world
    acc = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=_config(stage, micro, 1)))
    model = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    model, opt = prepare(acc, model, opt, recipe=recipe, max_grad_norm=1.0)
    losses = []
    for ids in moe_models.markov_batches(STEPS, batch=GLOBAL_BATCH, seq=16):
        mine = ids[rank * micro:(rank + 1) * micro]
        loss = model(input_ids=mine, labels=mine).loss
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        whole = loss.detach().float().clone()
        dist.all_reduce(whole)
        losses.append(whole.item() / world)
    return {"losses": losses, "engine": type(model).__name__, **_coverage(model)}


class _InOrder(MixedPrecisionTrainer):
    def _get_train_sampler(self, *args, **kwargs):
        return torch.utils.data.SequentialSampler(self.train_dataset)


def trainer_run(stage: int, path: str, rank: int, world: int,
                recipe: str = RECIPE) -> dict:
    """``MixedPrecisionTrainer.train()`` with a DeepSpeed dict config; a recipe DeepSpeed
    cannot run: the message ``MixedPrecisionTrainer`` raises."""
    data = [{"input_ids": t, "labels": t.clone()} for b in
            moe_models.markov_batches(STEPS, batch=GLOBAL_BATCH, seq=16) for t in b]
    args = transformers.TrainingArguments(
        tempfile.mkdtemp(), deepspeed=_config(stage, "auto", "auto"), bf16=True,
        per_device_train_batch_size=GLOBAL_BATCH // world, max_steps=STEPS,
        learning_rate=LR, lr_scheduler_type="constant", logging_steps=1, report_to=[],
        save_strategy="no", max_grad_norm=1.0, dataloader_drop_last=True, use_cpu=True)
    model = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32)
    try:
        trainer = _InOrder(model=model, args=args, train_dataset=data, recipe=recipe)
    except ValueError as e:
        unset_hf_deepspeed_config()
        return {"error": str(e)}
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    out = {"losses": losses, "engine": type(trainer.model_wrapped).__name__,
           "mixprec_engine": trainer.engine is not None, **_coverage(trainer.model)}
    unset_hf_deepspeed_config()
    return out


def mixprec_run(path: str) -> dict:
    """The same training without DeepSpeed, on one process: mixprec's own engine with
    bf16 working weights, fp32 masters and the fp8-current Linears, AdamW, clip 1.0."""
    model = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    engine = MixedPrecision(model, opt, f"{RECIPE},params=bf16,master=fp32",
                            max_grad_norm=1.0)
    losses = []
    for ids in moe_models.markov_batches(STEPS, batch=GLOBAL_BATCH, seq=16):
        with engine.autocast():
            loss = model(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return {"losses": losses}


def main(out_dir: str, scenarios: list[str]) -> None:
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    path = os.path.join(out_dir, "model")  # save_model's, before the launch
    records = {}
    for name in scenarios:
        if name == "mixprec":
            records[name] = mixprec_run(path)
            continue
        kind, stage, *recipe = name.split(":")
        if dist.is_initialized():
            dist.barrier()
        run = accelerate_run if kind == "accelerate" else trainer_run
        records[name] = run(int(stage), path, rank, world, *recipe)
        AcceleratorState._reset_state(reset_partial_state=False)
        GradientState._reset_state()
        gc.collect()
    if rank == 0:
        records["world"] = world
        torch.save(records, os.path.join(out_dir, f"records{world}.pt"))
    dist.barrier()


if __name__ == "__main__":
    if not os.path.exists(os.path.join(sys.argv[1], "model")):
        save_model(os.path.join(sys.argv[1], "model"))  # a launch by hand: one process
    main(sys.argv[1], sys.argv[2:])
