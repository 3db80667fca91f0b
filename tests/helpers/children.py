"""Functions that tests run in child processes forked from the preloaded forkserver
(see conftest.py), for what must happen in another process: a run killed with SIGKILL."""

from __future__ import annotations

import time
import warnings

import torch


def workbench_run(out: str, recipe: str, steps: int, resume: bool) -> None:
    """A tiny workbench run that checkpoints every 2 steps (tests/workbench/test_workbench.py kills
    it at random moments and resumes it)."""
    from mixprec.engine.facade import MixedPrecision
    from mixprec.workbench.train import TrainConfig, train

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    # at least 15 ms a step, so a kill up to 0.3 s after a checkpoint lands mid-run on
    # any CPU (real bf16 on an AMX chip runs a tiny step in a few ms); numerics untouched
    step = MixedPrecision.step

    def paced_step(self, *args, **kwargs):
        time.sleep(0.015)
        return step(self, *args, **kwargs)

    MixedPrecision.step = paced_step
    cfg = TrainConfig(recipe=recipe, size="tiny", batch=4, steps=steps, eval_every=10,
                      ckpt_every=2, corpus_bytes=300_000)
    train(cfg, out, resume=resume, progress=False)
