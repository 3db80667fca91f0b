"""Functions that tests run in child processes forked from the preloaded forkserver
(see conftest.py), for what must happen in another process: a run killed with SIGKILL."""

from __future__ import annotations

import warnings

import torch


def workbench_run(out: str, recipe: str, steps: int, resume: bool) -> None:
    """A tiny workbench run that checkpoints every 2 steps (tests/test_workbench.py kills
    it at random moments and resumes it)."""
    from mixprec.workbench.train import TrainConfig, train

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    cfg = TrainConfig(recipe=recipe, size="tiny", batch=4, steps=steps, eval_every=10,
                      ckpt_every=2, corpus_bytes=300_000)
    train(cfg, out, resume=resume, progress=False)
