"""Expert parallelism beside expert data parallelism on 4 gloo ranks: a 2-D mesh (dp 2 ×
ep 2), the experts cut over ``ep`` and replicated over ``dp``, the rest data-parallel
over all 4 ranks, each rank its own sequence. A tiny Qwen3-MoE trains, clipped, as one
process does on the whole batch (losses and clip norms); the replicas stay equal; every
rank takes the same skip on a NaN in one rank's expert gradient; a routing that sends
no token to one EP rank's experts works; FSDP2 over the expert-data-parallel dim
raises, naming what works."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.multiprocessing as mp

from helpers import ep_dp_workers as w

pytestmark = pytest.mark.filterwarnings("ignore")

#: relative tolerance of a step's loss and clip norm against one process (the EP tests')
TOL = {"bf16-master": 1e-2, "fp8-current": 5e-2, "mxfp8": 5e-2, "nvfp4": 5e-2}
#: the rank whose expert gradient is made NaN (ep rank 1 of dp group 1)
NAN_RANK = 3


@pytest.fixture(scope="module")
def ranks():
    tmp = tempfile.mkdtemp(prefix="mixprec-ep-dp-")
    mp.start_processes(w.training, args=(4, tmp, NAN_RANK), nprocs=4, join=True,
                       start_method="forkserver")
    out = [torch.load(os.path.join(tmp, f"train{r}.pt"), weights_only=False)
           for r in range(4)]
    return out


def _one(ranks, case):
    return next(r[case + ("one",)] for r in ranks if case + ("one",) in r)


def _rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


@pytest.mark.long
@pytest.mark.parametrize("case", w.CASES, ids=["-".join(c[1:]) for c in w.CASES])
def test_ep_by_dp_trains_as_one_process(ranks, case):
    one, ep = _one(ranks, case), ranks[0][case]
    loss, norm = _rel(ep["losses"], one["losses"]), _rel(ep["norms"], one["norms"])
    print(f"{case[1]} {case[2]}: loss {loss:.1e}, clip norm {norm:.1e}")  # the guide's table
    assert loss <= TOL[case[1]], (ep["losses"], one["losses"])
    # the clip norm counts each expert once (summed over ep, not over the dp replicas)
    assert norm <= TOL[case[1]], (ep["norms"], one["norms"])
    # the engine's norm is the float64 one of the averaged gradients, each expert once;
    # counting them once per replica would be sqrt(1 + share) times it: further off
    for got, (want, share) in zip(ep["norms"], ep["norms64"], strict=True):
        assert abs(got - want) <= 1e-5 * want
        assert (1 + share) ** 0.5 - 1 > 1e-4
    assert max(one["norms"]) > w.MAX_NORM  # the clip acted
    for r in ranks:  # every rank the same norm, the same losses
        assert r[case]["norms"] == ep["norms"] and r[case]["losses"] == ep["losses"]
    # the experts' replicas over dp (ranks 0, 2 and 1, 3) and the dense parts over all 4
    # ranks stay bit for bit equal
    for a, b in ((0, 2), (1, 3)):
        for n, t in ranks[a][case]["experts"].items():
            assert torch.equal(t, ranks[b][case]["experts"][n]), (n, a, b)
    for r in ranks[1:]:
        for n, t in ep["dense"].items():
            assert torch.equal(t, r[case]["dense"][n]), n
    # ep ranks hold different experts
    assert not all(torch.equal(t, ranks[1][case]["experts"][n])
                   for n, t in ep["experts"].items())


@pytest.mark.long
@pytest.mark.parametrize("case", w.CASES, ids=["-".join(c[1:]) for c in w.CASES])
def test_a_nan_on_one_rank_skips_the_step_on_every_rank(ranks, case):
    for r in ranks:
        assert r[case]["nan_skipped"] and not r[case]["nan_changed"]
        assert r[case]["nan_norm"] == float("inf")


@pytest.mark.long
def test_a_rank_whose_experts_get_no_token_trains(ranks):
    case = ("qwen3_moe", "bf16-master", "empty")
    # EP rank 1 (global ranks 1, 3) holds experts 2 and 3, which no token reaches: it
    # receives no row and sends no output back (it trains as one process: above)
    def combined(r: int) -> int:  # in the autocast dtype (fp32 on an emulated path)
        return sum(n for (op, what, _), n in ranks[r][case]["totals"].items()
                   if (op, what) == ("all_to_all", "combine"))
    assert combined(1) == combined(3) == 0
    assert combined(0) > 0 and combined(2) > 0


@pytest.mark.long
def test_fsdp2_over_the_expert_data_parallel_dim_raises():
    tmp = tempfile.mkdtemp(prefix="mixprec-ep-dp-refused-")
    mp.start_processes(w.refusal, args=(4, tmp, None), nprocs=4, join=True,
                       start_method="forkserver")
    for r in range(4):
        got = torch.load(os.path.join(tmp, f"refused{r}.pt"), weights_only=False)
        for key in ("engine", "expert_parallel"):
            assert "FSDP2 over the expert-data-parallel dim" in got[key]
            assert "expert_parallel(model, mesh)" in got[key]
        assert "'tp'" in got["dim"] and "('dp', 'ep')" in got["dim"]
