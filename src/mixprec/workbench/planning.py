"""The planner on the workbench GPT: the model and batches training uses, planned.

``plan_workbench(size=..., batch=..., seq=..., seed=...)`` builds the GPT exactly as
``train`` does (``torch.manual_seed(seed)``, then ``GPT``) and draws its first training
batches from the same corpus and sampler, so the plan is made for the run that follows.
``resolve_entry`` turns one ``mixprec compare`` entry (a recipe, a plan file, or
``plan``) into a label, a recipe and the plan behind it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from mixprec.planner import Plan, plan
from mixprec.planner.numerics import linear_names
from mixprec.workbench.data import load_corpus, sample_batch
from mixprec.workbench.model import GPT, SIZES

__all__ = ["plan_workbench", "workbench_model", "workbench_batches", "resolve_entry",
           "check_plan_fits", "PLAN_ENTRY"]

#: the ``mixprec compare`` entry that plans the workbench model before training it
PLAN_ENTRY = "plan"


def _seq(size: str, seq: int | None) -> int:
    if size not in SIZES:
        raise ValueError(f"size {size!r}; valid: {', '.join(SIZES)}")
    return seq or SIZES[size].seq_len


def workbench_model(size: str, seq: int | None = None, seed: int = 0) -> GPT:
    """The GPT ``train`` starts from for these settings (same seed, same weights)."""
    mcfg = dataclasses.replace(SIZES[size], seq_len=_seq(size, seq))
    torch.manual_seed(seed)
    return GPT(mcfg)


def workbench_batches(n: int, *, size: str, batch: int, seq: int | None = None,
                      seed: int = 0, corpus_bytes: int = 2_000_000
                      ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The first ``n`` training batches ``train`` draws for these settings (rank 0)."""
    corpus = load_corpus(max_bytes=corpus_bytes, seed=seed)
    g = torch.Generator().manual_seed(seed * 1000)
    return [sample_batch(corpus.train, batch, _seq(size, seq), g) for _ in range(n)]


def plan_workbench(*, size: str = "medium", batch: int = 16, seq: int | None = None,
                   seed: int = 0, calibration: int = 3, **kwargs: Any) -> Plan:
    """``mixprec.plan`` for the workbench GPT of ``size``: the first training batch is
    the sample batch, the first ``calibration`` batches calibrate the numerics.
    ``kwargs`` go to ``mixprec.plan`` (goal, memory, max_loss, min_sqnr, formats...).

    >>> p = plan_workbench(size="tiny", batch=4)   # doctest: +SKIP
    >>> print(p.recipe)                            # doctest: +SKIP
    """
    if calibration < 1:
        raise ValueError(f"calibration={calibration}; at least 1 batch (2-4 is usual)")
    model = workbench_model(size, seq, seed)
    batches = workbench_batches(calibration, size=size, batch=batch, seq=seq, seed=seed)
    return plan(model, batches[0], calibration=batches, **kwargs)


def check_plan_fits(p: Plan, size: str, seq: int | None = None, where: str = "plan"
                    ) -> None:
    """Raise if ``p`` was made for another model than the workbench GPT of ``size``:
    its layers or their shapes differ."""
    with torch.random.fork_rng():
        model = workbench_model(size, seq)
    have = {n: tuple(model.get_submodule(n).weight.shape[::-1]) for n in linear_names(model)}
    want = {r.layer: tuple(r.shape) for r in p.rows}
    if want != have:
        diff = sorted(n for n in set(have) | set(want) if have.get(n) != want.get(n))
        raise ValueError(
            f"{where} was made for another model: layers {diff[:4]} differ from the "
            f"workbench GPT of size {size!r}; re-plan with `mixprec plan --size {size}` "
            "(and the same --seq), or compare with the plan's size")


def resolve_entry(entry: str, *, size: str, batch: int, seq: int | None = None,
                  seed: int = 0) -> tuple[str, str, Plan | None]:
    """``(label, recipe string, plan or None)`` for one ``mixprec compare`` entry: a
    recipe (its own label), a plan file ending in ``.json`` (``Plan.load``; labelled
    by the file's stem), or ``plan``: a plan made now for this model (goal fastest,
    max_loss 1%)."""
    if entry == PLAN_ENTRY:
        p = plan_workbench(size=size, batch=batch, seq=seq, seed=seed, goal="fastest",
                           max_loss=0.01)
        return PLAN_ENTRY, str(p.recipe), p
    if entry.endswith(".json"):
        path = Path(entry)
        if not path.exists():
            raise FileNotFoundError(f"plan file {entry!r} does not exist; write one with "
                                    "`mixprec plan --out FILE`, or use the entry 'plan' to "
                                    "plan now")
        p = Plan.load(path)
        check_plan_fits(p, size, seq, where=f"plan file {entry!r}")
        return path.stem, str(p.recipe), p
    return entry, entry, None
