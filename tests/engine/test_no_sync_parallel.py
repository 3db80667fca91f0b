"""No host read in a training step across processes (DESIGN principle 3): the quantized
Linears' casts on torch's tensor-parallel shards (their amax all-reduces, a
sequence-parallel input gathered as fp8 codes) and FSDP2's gathers of weights as their
casts, with the optimizer step after them.

As in tests/engine/test_no_sync.py, the CPU stands in for ``torch.cuda.set_sync_debug_mode``:
every way a tensor's value reaches Python (``item``, ``bool``, ``float``, ``int``,
``tolist``) is counted, with its caller, while each rank runs forward, backward and
``step()`` (one step of three skipped by an inf in one rank's gradient). The casts and
gathers take the same code on every device (no branch on the device); the one path that
does differ, torch's default AdamW, which the engine fuses on CUDA, runs with the
engine's device check answering CUDA."""

from __future__ import annotations

import pytest

from helpers import no_sync_workers as w
from helpers.ranks import spawn_tp as spawn

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

STEPS = 3
GATHER = ",fp8_all_gather=true"
#: (layout, recipe, optimizer): each layout and scaling family once
FAST = [("tp", "fp8-current", "adamw_for"), ("tp", "mxfp8", "adamw_for"),
        ("sp", "fp8-current", "adamw_for"), ("tp", "bf16-master", "default-cuda"),
        ("fsdp", "fp8-current" + GATHER, "adamw_for"), ("fsdp", "mxfp8" + GATHER, "adamw_for"),
        # the control: torch's default AdamW on the CPU cannot skip a step itself, so the
        # engine reads found_inf once per step (tests/engine/test_no_sync.py)
        ("tp", "bf16-master", "default")]
#: the other formats, with their own casts and agreements
LONG = [("tp", r, "adamw_for") for r in ("fp8", "fp8-rowwise", "fp8-block", "int8-rowwise",
                                          "nvfp4")] + \
       [("fsdp", r + GATHER, "adamw_for") for r in ("fp8", "fp8-rowwise", "nvfp4")]


def _check(ranks, runs):
    for rank in ranks:
        for run in runs:
            got = rank[run]
            assert got["skipped"] == [False, False, True, False], run
            if run[2] == "default":
                assert [name for name, _ in got["mixprec"]] == ["item"] * STEPS, got
                assert all("step.py" in where for _, where in got["mixprec"])
                continue  # torch's for-loop AdamW reads its step counts, CPU tensors
            assert got["mixprec"] == [], (run, got["mixprec"])
            assert got["other"] == [], (run, got["other"])
            assert got["totals"], run  # the collectives the count covered did run


def test_tp_casts_and_fsdp_gathers_read_nothing_on_the_host():
    """Forward, backward and step on 2 ranks under torch's TP plan (GPT block), a
    sequence-parallel norm before a colwise Linear whose input crosses as fp8 codes,
    and FSDP2 gathering fp8 and MX weights as their casts: no value read on the host,
    from mixprec or from torch, a skipped step included; the engine's fused step of
    torch's default AdamW (on CUDA) included. The control, torch's default AdamW on the
    CPU, counts its one documented read per step."""
    _check(spawn(w.run, FAST, STEPS, name="nosync"), FAST)


@pytest.mark.long  # one spawn of 8 engines: about a minute on two cores
def test_every_formats_tp_casts_and_fsdp_gathers_read_nothing_on_the_host():
    """The same count for delayed scaling (its amax history agreed every step),
    rowwise, block, int8 and NVFP4 casts on shards, and FSDP2 gathers of delayed,
    rowwise and NVFP4 casts."""
    _check(spawn(w.run, LONG, STEPS, name="nosync"), LONG)
