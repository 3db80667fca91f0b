"""Data parallel on torch.distributed with gloo: ranks spawned by the tests themselves."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from helpers import dist_workers as w
from helpers.paths import ROOT
from helpers.ranks import spawn
from mixprec import MixedPrecision

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _max_rel(a, b):
    return max(((x - y).abs().max() / y.abs().max()).item() for x, y in zip(a, b))


@pytest.mark.parametrize("parallel,recipe,accum,tol", [
    ("ddp", "fp32", 1, 1e-5),
    # bf16 working grads: per-rank rounding
    pytest.param("ddp", "bf16-master", 2, 1e-2, marks=pytest.mark.paths),
    # fp32 grads (fp32 summation order only); over 20 steps the bf16 working copy can
    # round the other way where two masters differ in their last bits: 5e-5 measured
    pytest.param("ddp", "bf16-master,wgrad=fp32", 2, 1e-4, marks=pytest.mark.paths),
    ("ddp", "fp32,comm=bf16", 1, 5e-3),    # documented bound for bf16 communication
    ("fsdp", "fp32", 1, 1e-5),
    pytest.param("fsdp", "bf16-master", 1, 1e-2, marks=pytest.mark.paths),
])
def test_two_ranks_of_8_equal_one_rank_of_16(parallel, recipe, accum, tol):
    ranks = spawn(w.equivalence, recipe, parallel, 20, accum)
    ref = w.train_reference(recipe.split(",comm")[0], 20)
    for r in ranks:
        assert _max_rel(r["params"], ref) <= tol, (_max_rel(r["params"], ref), tol)
    for p, q in zip(ranks[0]["params"], ranks[1]["params"]):
        assert torch.equal(p, q)  # replicas identical


@pytest.mark.paths
@pytest.mark.parametrize("parallel,recipe", [
    ("ddp", "fp8"), ("fsdp", "fp8"),
    # weights gathered as e4m3 bytes: the same codes as casting the gathered fp32 weight
    ("fsdp", "fp8,fp8_all_gather=true"),
])
def test_fp8_two_ranks_of_8_equal_one_process_of_the_same_micro_batches(parallel, recipe):
    """fp8 on 2 ranks of 8 equals, bit for bit, one process that back-propagates the same
    two halves with the same magnitudes (2 micro-batches, each loss x2, lr / 2): the
    ranks' agreed amaxes give the reference's scales at every step, and the reduction is
    its accumulation.

    Against one process of 16 samples in one micro-batch fp8 is no test of the ranks: a
    batch split alone moves the fp8 weights ~5% (max relative difference per tensor after
    20 steps; one process accumulating 8 + 8 reads the same). Around the fp8 Linears in
    bf16, the head's weight gradient is rounded to bf16 per backward, so a sum over 8 + 8
    rows differs from one over 16 by an ulp, and fp8's 1/8 steps turn that into flipped
    codes: 13 of 3,328 at step 2, 442 at step 20. With fp32 around them the first step's
    scale of 1 puts 9% of the batch of 16's e5m2 gradients in the subnormals against 2%
    of a rank's 8. Over 8 data seeds the split moves the weights 0.021 to 0.055 (bf16
    around) and up to 0.033 (fp32 around), and one process of 16 is itself 0.05 from an
    exact fp8 training in float64."""
    ranks = spawn(w.equivalence, recipe, parallel, 20, 1)
    ref = w.train_reference(recipe, 20, world=2)
    for r in ranks:
        for p, q in zip(r["params"], ref, strict=True):
            assert torch.equal(p, q), _max_rel(r["params"], ref)


@pytest.mark.parametrize("parallel,recipe", [("ddp", "bf16-master"), ("fsdp", "bf16")])
def test_inf_on_one_rank_makes_every_rank_skip(parallel, recipe):
    ranks = spawn(w.rank_local_inf, recipe, parallel)
    assert ranks[0]["skipped"] == ranks[1]["skipped"] == [False, True, True, False]
    for p, q in zip(ranks[0]["params"], ranks[1]["params"]):
        assert torch.equal(p, q)


def test_fp8_outlier_on_one_rank_gives_identical_scales():
    ranks = spawn(w.fp8_outlier)
    for a, b in zip(ranks[0]["scales"], ranks[1]["scales"]):
        assert torch.equal(a, b)
    for a, b in zip(ranks[0]["hist"], ranks[1]["hist"]):
        assert torch.equal(a, b)
    assert ranks[0]["hist"][0][0].max() >= 1000.0  # rank 1's outlier reached rank 0


def test_fp16_comm_pre_division_never_overflows_where_sum_first_does():
    ranks = spawn(w.fp16_comm)
    for r in ranks:
        assert torch.isinf(r["naive"]).all()                  # 40000 + 40000 > 65504
        assert torch.equal(r["pre"], torch.full((16, 16), 40000.0))  # 20000 + 20000


@pytest.mark.paths
@pytest.mark.parametrize("recipe", ["bf16", "fp16-master"])
def test_two_rank_checkpoint_resumes_bit_identically(recipe):
    ranks = spawn(w.resume, recipe)
    for r in ranks:
        assert r["a"] == r["b"] and r["same"]


@pytest.mark.paths
@pytest.mark.parametrize("recipe", ["bf16-master", "fp16-master"])
def test_two_rank_dropout_resumes_bit_for_bit_with_each_ranks_streams(recipe):
    ranks = spawn(w.resume_dropout, recipe)
    for r in ranks:
        assert r["b"] == r["a"] and r["same"], r
        assert r["c"] != r["a"]  # without the streams: not vacuous


def test_data_parallel_engines_are_freed():
    """DDP's C++ reducer holds the comm hook's state. When that state held the engine
    (which holds the DDP module), the cycle was invisible to Python's collector: every
    DDP engine, its model, masters and optimizer state leaked, and gloo's threads
    outlived destroy_process_group (the process then aborted at exit now and then:
    "terminate called without an active exception")."""
    for r in spawn(w.freed):
        for case, alive in zip(w.FREED_CASES, r["alive"]):
            assert alive == [False, False, False], (case, alive)


@pytest.mark.parametrize("units,expect", [("default", []), ("class", [1, 2]),
                                          ("callable", [0, 3])])
def test_fsdp_units_choose_which_modules_shard_apart(units, expect):
    """Blocks in an nn.Sequential are no FSDP units by default (no ModuleList); a class
    or a callable picks them. Training is unchanged: 2 ranks x 8 = 1 process x 16."""
    model = w.make_sequential(seed=0)
    ref = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp32")
    for x, y in w.make_data(5):
        with ref.autocast():
            loss = F.cross_entropy(model(x), y)
        ref.backward(loss)
        ref.step()
    for r in spawn(w.fsdp_units, units, 5):
        assert r["units"] == expect and r["root"]
        assert _max_rel(r["params"], [p.detach() for p in model.parameters()]) <= 1e-5


def test_fsdp_units_are_checked_before_anything_changes():
    m = w.make_mlp()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="fsdp_units given with parallel=None"):
        MixedPrecision(m, opt, "bf16", fsdp_units=nn.Linear)
    with pytest.raises(ValueError, match=r"no module of these classes.*'Linear'"):
        MixedPrecision(m, opt, "bf16", parallel="fsdp", fsdp_units=(nn.Conv2d,))
    with pytest.raises(TypeError, match="fsdp_units='blocks'.*callable"):
        MixedPrecision(m, opt, "bf16", parallel="fsdp", fsdp_units="blocks")
    assert all(p.dtype == torch.float32 for p in m.parameters())


def test_parallel_without_process_group_is_an_error():
    m = w.make_mlp()
    with pytest.raises(ValueError, match="needs an initialised process group.*torchrun"):
        MixedPrecision(m, torch.optim.SGD(m.parameters(), lr=0.1), "bf16", parallel="ddp")
    with pytest.raises(ValueError, match="parallel='zero'"):
        MixedPrecision(m, torch.optim.SGD(m.parameters(), lr=0.1), "bf16", parallel="zero")


@pytest.mark.paths
@pytest.mark.parametrize("recipe,tol", [("fp32", 1e-5), ("bf16-master", 1e-2)])
def test_checkpoints_resume_on_another_world_size_and_layout(recipe, tol):
    """Saved by 2 ranks (DDP; FSDP with full=True), resumed by one process, and the
    reverse; FSDP's per-rank shards resumed by FSDP, bit for bit. Each other continuation
    equals the run that saved it, to the tolerance of 2 ranks x 8 against 1 x 16 (the
    engines that load start from other weights, so a state that did not load, masters or
    momentum included, misses by far more). Masters cross layouts: FSDP's fp32 shards
    <-> a -master recipe's fp32 masters beside bf16 weights."""
    for r in spawn(w.reshard, recipe):
        for way in ("down", "up"):
            for parallel, (want, got) in r[way].items():
                assert want.keys() == got.keys()
                err = max(((got[k] - want[k]).abs().max() / want[k].abs().max()).item()
                          for k in want)
                assert err <= tol, (way, parallel, err)
        want, got = r["sharded"]  # FSDP -> FSDP, same world size: bit for bit
        assert all(torch.equal(want[k], got[k]) for k in want)
        assert r["extra_ddp"] == r["extra_fsdp"] == {"step": 3}
        assert "rank 0 could not write" in r["failed_write"]
        assert "FileNotFoundError" in r["failed_write"]
        assert "FSDP shards of 2 rank(s)" in r["refused"]
        assert "full=True" in r["refused"]


@pytest.mark.paths
@pytest.mark.parametrize("recipe,tol", [("fp32", 1e-5), ("bf16-master", 1e-2)])
def test_reshardable_fsdp_checkpoint_resumes_on_1_and_2_ranks(recipe, tol, tmp_path):
    """save(dir, reshardable=True) by FSDP on 2 ranks (written twice: the second
    replaces the first); FSDP on 2 ranks resumes it bit for bit, on 1 rank to the
    tolerance of 2 x 8 against 1 x 16, without anything gathered."""
    ckpt = str(tmp_path / "ck")
    want = spawn(w.reshardable_save, recipe, ckpt)[0]["want"]
    assert sorted(os.listdir(tmp_path)) == ["ck"]  # no .partial / .old left behind
    for world in (2, 1):
        for r in spawn(w.reshardable_load, recipe, ckpt, world=world):
            assert r["extra"] == {"step": 3} and r["steps"] == 6
            # another model: refused before anything was read into it
            assert "does not match this model" in r["refused"]
            assert r["unchanged"] and r["opt_state"] == 0
            err = max(((r["got"][k] - want[k]).abs().max() / want[k].abs().max()).item()
                      for k in want)
            assert err == 0.0 if world == 2 else err <= tol, (world, err)


def test_fsdp_shards_from_another_world_size_are_refused_and_whole_states_load():
    m = w.make_mlp()
    e = MixedPrecision(m, torch.optim.SGD(m.parameters(), lr=0.1), "bf16")
    state = e.state_dict()
    assert state["layout"] == "full" and state["parallel"] is None
    before = [p.clone() for p in m.parameters()]
    with pytest.raises(ValueError, match=r"FSDP shards of 2 rank\(s\).*parallel=None.*"
                                         r"nproc-per-node 2.*full=True"):
        e.load_state_dict({**state, "world_size": 2, "parallel": "fsdp",
                           "layout": "sharded"})
    # a checkpoint from before layouts were recorded, of 2 ranks: possibly shards
    legacy = {k: v for k, v in state.items() if k not in ("layout", "parallel")}
    with pytest.raises(ValueError, match="FSDP shards of 2"):
        e.load_state_dict({**legacy, "world_size": 2})
    assert all(torch.equal(p, q) for p, q in zip(before, m.parameters()))
    e.load_state_dict({**state, "world_size": 2, "parallel": "ddp"})  # DDP: whole


@pytest.mark.parametrize("recipe", ["fp8", pytest.param("fp8-rowwise", marks=pytest.mark.long)])
def test_fp8_with_fsdp_trains_like_fp8_with_ddp(recipe):
    """FSDP2 shards the weights that Float8Linear casts: the swap to Float8Linear happens
    before fully_shard, so FSDP unshards the fp8 modules' own parameters."""
    fsdp = spawn(w.equivalence, recipe, "fsdp", 20, 1)
    ddp = spawn(w.equivalence, recipe, "ddp", 20, 1)
    ref = w.train_reference(recipe, 20)
    for p, q in zip(fsdp[0]["params"], fsdp[1]["params"]):
        assert torch.equal(p, q)
    # two programs, each measuring its kernels: another route or rest format would move
    # the weights ~6%, so both must have decided alike first
    assert fsdp[0]["kernels"] == ddp[0]["kernels"]
    assert _max_rel(fsdp[0]["params"], ddp[0]["params"]) <= 1e-6
    # against one process of 16: each rank rounds its weight-gradient partial sum (8
    # samples) to low precision where one process rounds the sum over 16, and 20 steps
    # amplify that: 5e-4 after one step, 5e-2 after 20 (bf16 alone: 2e-4, 3e-3 after 10)
    assert _max_rel(fsdp[0]["params"], ref) <= 0.1


@pytest.mark.parametrize("parallel,recipe,tol", [
    ("ddp", "fp32", 1e-5), ("fsdp", "fp32", 1e-5),
    # emulated where this CPU has no fast bf16 (auto). With bf16 gradients, Adagrad's
    # normalized step (about ±lr where a gradient is near zero) turns each rank's bf16
    # rounding into 14% of a bias after 10 steps, on real kernels as under emulation;
    # fp32 weight gradients leave 2 ranks equal to 1
    ("ddp", "bf16-master,wgrad=fp32", 1e-4),
])
def test_frozen_parameters_and_optimizer_state_built_in_init(parallel, recipe, tol):
    """Adagrad's state exists before the engine; under FSDP it is sharded like its
    parameter. A frozen Linear sits in the optimizer. Two ranks of 8 = one rank of 16."""
    ranks = spawn(w.frozen_stateful, parallel, 10, recipe)
    model, opt = w.make_frozen_adagrad(seed=0)
    engine = MixedPrecision(model, opt, recipe)
    for x, y in w.make_data(10):
        with engine.autocast():
            loss = F.cross_entropy(model(x), y)
        engine.backward(loss)
        engine.step()
    ref = [p.detach() for p in model.parameters()]
    for r in ranks:
        assert _max_rel([p.float() for p in r["params"]], [p.float() for p in ref]) <= tol
    assert torch.equal(ranks[0]["params"][0], w.make_mlp(0)[0].weight)  # frozen: as built


@pytest.mark.parametrize("recipe,tol", [("fp32", 1e-5), ("bf16-master", 1e-2),
                                        ("bf16-master,wgrad=fp32", 1e-4)])
def test_parallel_kwargs_reach_ddp_for_a_model_with_unused_parameters(recipe, tol):
    """parallel_kwargs={"find_unused_parameters": True} reaches DDP: each step trains one
    of two heads, and two ranks of 8 equal one rank of 16."""
    ranks = spawn(w.unused_head, recipe, 10)
    model = w.TwoHeads(seed=0)
    engine = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), recipe)
    for i, (x, y) in enumerate(w.make_data(10)):
        with engine.autocast():
            loss = F.cross_entropy(model(x, i % 2), y)
        engine.backward(loss)
        engine.step()
    ref = [p.detach() for p in engine.master_params]
    for r in ranks:
        assert _max_rel(r["params"], ref) <= tol, _max_rel(r["params"], ref)


def test_parallel_kwargs_are_checked():
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="without parallel"):
        MixedPrecision(model, opt, "bf16", parallel_kwargs={"find_unused_parameters": True})
    with pytest.raises(ValueError, match=r"\['mp_policy'\]: set by mixprec"):
        MixedPrecision(model, opt, "bf16", parallel="fsdp", parallel_kwargs={"mp_policy": 1})


@pytest.mark.parametrize("recipe,tol", [("fp32", 1e-5), ("bf16-master", 2e-2)])
def test_fsdp_shards_each_block_then_the_root(recipe, tol):
    """Every element of a ModuleList (the GPT's blocks) is its own FSDP unit, so only one
    block's full weights exist at a time; training equals one rank of the whole batch."""
    ranks = spawn(w.gpt_fsdp, recipe, 6)
    assert all(u.startswith("FSDP") for u in ranks[0]["units"]), ranks[0]["units"]
    model = w.make_gpt(seed=0)
    engine = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.5), recipe)
    for idx in w.gpt_tokens(6):
        with engine.autocast():
            loss = model(idx[:, :-1], idx[:, 1:])
        engine.backward(loss)
        engine.step()
    ref = [p.detach() for p in engine.master_params]
    for r in ranks:
        assert _max_rel(r["params"], ref) <= tol, _max_rel(r["params"], ref)


def test_example_script_resumes_across_world_sizes_and_layouts(tmp_path):
    """examples/ddp_train.py under torchrun: DDP on 2 ranks saves, FSDP on 2 ranks
    resumes and saves, one rank resumes that."""
    import subprocess
    import sys

    root = str(ROOT)
    ckpt = str(tmp_path / "ck.pt")
    outputs = []
    for nproc, parallel in ((2, "ddp"), (2, "fsdp"), (1, "ddp")):
        run = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone",
             f"--nproc-per-node={nproc}", os.path.join(root, "examples", "ddp_train.py"),
             "--steps", "3", "--parallel", parallel, "--checkpoint", ckpt],
            capture_output=True, text=True, timeout=300, cwd=root)
        assert run.returncode == 0, run.stderr[-3000:]
        outputs.append(run.stdout)
    assert "resumed" not in outputs[0]
    assert "resumed at step 3" in outputs[1] and "resumed at step 6" in outputs[2]
    state = torch.load(ckpt, weights_only=True)
    assert state["extra"] == {"step": 9} and state["engine"]["layout"] == "full"


@pytest.mark.paths
@pytest.mark.parametrize("recipe", ["bf16-lean"])  # stochastic writes and int8 states
def test_lean_optimizers_under_ddp_agree_and_resume_on_2_and_1_ranks(recipe, tmp_path):
    """Stochastic writes draw the same stream on every replica, so the replicas stay
    bitwise equal; a checkpoint of 2 ranks resumes on 2 bit for bit, and on 1."""
    ckpt = str(tmp_path / "lean.pt")
    ranks = spawn(w.lean_ddp, recipe, ckpt, False)
    for p, q in zip(ranks[0]["params"], ranks[1]["params"]):
        assert torch.equal(p, q)  # replicas identical after 20 steps
    resumed = spawn(w.lean_ddp, recipe, ckpt, True)
    for p, q in zip(ranks[0]["params"], resumed[0]["params"]):
        assert torch.equal(p, q)
    for a, b in zip(ranks[0]["states"], resumed[0]["states"]):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    one = w._lean_engine(recipe, seed=5, parallel=None)  # one process, whole batches
    one.load(ckpt)
    w._lean_steps(one, w.make_data(20)[10:], 0, 1)
    for p, q in zip(one.param_state.working, ranks[0]["params"]):
        assert (p - q).abs().max() < 0.05  # same run, other reduction order


@pytest.mark.paths
def test_quantized_states_under_fsdp_shard_with_their_rows_and_resume_anywhere(tmp_path):
    """int8 momentum under FSDP on 2 ranks (a 257-row weight, sharded 129 + 128): the
    states are DTensors sharded like their parameters; a reshardable directory resumes on
    2 ranks bit for bit and on 1 rank within the tolerance below; the whole file resumes
    on 2 ranks bit for bit. Against one process, 2 ranks differ by their bf16 rounding
    and reduction order, which int8 codes amplify where a value sits at a rounding
    boundary: at most twice the difference with fp32 states (measured 1.6x), which is
    itself within the FSDP tolerance (1e-2; measured 0.0095)."""
    base = _off_one_process("bf16-master", spawn(w.lean_fsdp, "bf16-master",
                                                 str(tmp_path / "base"), "save"))
    assert base <= 1e-2
    recipe = "bf16-master,states=int8"
    ckpt = str(tmp_path / "ck")
    saved = spawn(w.lean_fsdp, recipe, ckpt, "save")
    assert saved[0]["placements"] == ["(Shard(dim=0),)"]
    assert any("momentum_buffer.q" in st for st in saved[0]["states"])  # quantized
    assert _off_one_process(recipe, saved) <= 2 * base
    _resumes_anywhere(recipe, ckpt, saved, 2 * base)


def _off_one_process(recipe, saved):
    """How far 2 ranks' final fp32 weights are from one process of 16 (relative)."""
    one = w.lean_engine(recipe, parallel=None)  # one process, whole batches
    w._lean_steps(one, w.make_data(20), 0, 1)
    ref = one.fp32_state_dict()
    return _max_rel([saved[0]["params"][k] for k in ref], list(ref.values()))


def _resumes_anywhere(recipe, ckpt, saved, tol):
    """``lean_fsdp``'s step-10 saves: the directory and the whole file resume on 2 ranks
    bit for bit (weights and states), the directory on 1 rank within ``tol``."""
    want = saved[0]["params"]
    for mode, world, exact in (("dir", 2, True), ("file", 2, True), ("dir", 1, False)):
        got = spawn(w.lean_fsdp, recipe, ckpt, mode, world=world)[0]
        if exact:
            assert all(torch.equal(got["params"][k], want[k]) for k in want), mode
            for a, b in zip(got["states"], saved[0]["states"], strict=True):
                assert all(torch.equal(a[k], b[k]) for k in a)
        else:
            rel = _max_rel([got["params"][k] for k in want], list(want.values()))
            assert rel <= tol, rel


@pytest.mark.paths
@pytest.mark.parametrize("recipe", [
    "bf16-sr", "bf16-lean",  # Kahan's and remainder's: one process resumes them (test_resume)
    *(pytest.param(r, marks=pytest.mark.long) for r in ("bf16-kahan", "bf16-remainder"))])
def test_write_rules_under_fsdp_shard_16_bit_weights_and_resume_anywhere(tmp_path, recipe):
    """A write rule (no fp32 master) under FSDP on 2 ranks: the shards are the 16-bit
    weights (bf16 tensors on real kernels, bf16 values in fp32 tensors under
    emulation: every element a bf16 value either way), updated by the rule, with Kahan's and
    remainder's buffers sharded like them and stochastic writes drawing each shard's
    rows of the whole tensor's counter-based bits. Against one process of 16 within
    0.05 relative (measured after 20 steps: sr 0.036, kahan 0.018, remainder 0.017,
    lean 0.029; bf16-master's fp32 masters 0.0095: without a master each rank's bf16
    rounding and reduction order land in the weights themselves); a reshardable
    directory and a whole file resume on 2 ranks bit for bit, the directory on 1 rank
    within the same bound (measured 0.006 to 0.022). Resumes are checked for the rules
    whose checkpoints hold something new: stochastic writes' stream counter (which dcp
    drops from the optimizer's state dict) and remainder's states, built before the
    first step (which a dcp load must complete); Kahan's and lean's resumed too when
    measured (0.022, 0.013 on 1 rank)."""
    ckpt = str(tmp_path / "ck")
    saved = spawn(w.lean_fsdp, recipe, ckpt, "save")
    for r in saved:
        assert r["bf16_share"] == 1.0, r["bf16_share"]
        if not r["emulating"]:  # the memory the rules exist to save: 2 bytes a weight
            assert r["shard_dtypes"] == ["torch.bfloat16"], r["shard_dtypes"]
            # storage, FSDP's padding of uneven shards included (5,418 B for 2,692)
            assert r["shard_bytes"] <= 2.05 * r["shard_numel"], r["shard_bytes"]
    off = _off_one_process(recipe, saved)
    assert off <= 0.05, off
    # the rules whose checkpoints hold something new everywhere: the stream counter,
    # remainder's partial state; with real bf16 shards, every rule
    if recipe in ("bf16-sr", "bf16-remainder") or not saved[0]["emulating"]:
        _resumes_anywhere(recipe, ckpt, saved, 0.05)


@pytest.mark.parametrize("states,write", [("int8", "nearest"), ("fp8", "nearest"),
                                          ("int8", "stochastic"), ("fp8", "kahan"),
                                          ("int8", "remainder"), ("int4", "nearest")])
def test_sharded_states_equal_the_whole_tensors_bit_for_bit(states, write):
    """mixprec.optim on dim-0 DTensor shards (2 ranks; 257 rows split 129 + 128, rows
    of 700 in blocks of 256 + 444 (int4: 4 x 128 + 188), a 1-D tensor) given the same
    gradients: weights and states equal one process's on the whole tensors bit for
    bit, because blocks lie along rows and the format is chosen on the whole shape.
    With a write rule the weights are bf16: stochastic writes draw, on each shard, the
    counter-based bits of its rows of the whole tensor; Kahan's and remainder's buffers
    shard with the rows. The shards step in pieces of at most 64 elements, the first
    step included, the whole tensors in one."""
    ranks = spawn(w.sharded_optimizer, states, write, 64)
    torch.manual_seed(0)
    full = [torch.randn(s) for s in w.SHARDED_SHAPES]
    one = w.sharded_steps(full, states, write=write)

    def raw(t):
        return t.view(torch.uint8) if t.dtype.itemsize == 1 else t

    for r in ranks:
        for got, want in zip(r, one, strict=True):  # AdamW, then SGD
            assert all(torch.equal(a, b) for a, b in zip(got["params"], want["params"]))
            assert f"{'exp_avg' if 'exp_avg.q' in want['states'][0] else 'momentum_buffer'}.q" \
                in want["states"][0]  # the 257 x 16 weight's states are quantized
            assert "exp_avg.q" not in want["states"][2]  # 1-D: fp32
            for a, b in zip(got["states"], want["states"], strict=True):
                assert a.keys() == b.keys()
                assert all(torch.equal(raw(a[k]), raw(b[k])) for k in a)


@pytest.mark.parametrize("recipe,world", [("fp8", 2), ("fp8-current", 2), ("fp8", 3)])
def test_fsdp_fp8_all_gather_sends_a_quarter_of_the_bytes_and_trains_the_same(recipe,
                                                                                world):
    """FSDP2, 2 gloo ranks, every parameter a Float8Linear weight. With
    ``fp8_all_gather=true`` the weights cross as e4m3 bytes: at most 0.26x the bytes of
    the fp32 gather (1 byte of 4, plus nothing: the scales are known on every rank), with
    the same number of all-reduces per step under delayed scaling (the weights' amaxes
    ride on the histories' all-reduce) and one more under current scaling, which keeps no
    history and so all-reduces no amax at all without the fp8 gather. The weights are
    gathered in fp32 here, so both runs cast the same codes with the same scales: the
    trained weights are equal bit for bit. On 3
    ranks the 64 rows shard 22 + 22 + 20, so the last shard's codes are padded."""
    plain = spawn(w.fp8_gather, recipe, world=world)
    fp8 = spawn(w.fp8_gather, recipe + ",fp8_all_gather=true", world=world)
    assert fp8[0]["fp8_modules"] == 3 and fp8[0]["hooked"] == 3 and plain[0]["hooked"] == 0
    ratio = fp8[0]["per_step"]["gathered"] / plain[0]["per_step"]["gathered"]
    assert ratio <= 0.26, ratio
    assert fp8[0]["per_step"]["all_reduces"] == plain[0]["per_step"]["all_reduces"] + (
        recipe == "fp8-current")
    for a, b in zip(fp8[0]["params"], plain[0]["params"]):
        assert torch.equal(a, b)
    for a, b in zip(fp8[0]["params"], fp8[1]["params"]):
        assert torch.equal(a, b)
    for a, b in zip(fp8[0]["scales"] + fp8[0]["hist"], plain[0]["scales"] + plain[0]["hist"]):
        assert torch.equal(a, b)
    assert fp8[0]["state_keys"] == plain[0]["state_keys"]  # nothing new in checkpoints


@pytest.mark.parametrize("recipe", ["fp8", pytest.param("mxfp8", marks=pytest.mark.long),
                                    "nvfp4"])
def test_fp8_all_gather_on_a_gpt_whose_blocks_regather_for_the_backward(recipe):
    """The workbench GPT, each block an FSDP unit resharded after its forward: its
    weights are gathered as codes again for the backward, and every later gather
    refills the same buffers (FSDP's ``out=`` path). Losses and fp32 weights equal FSDP
    without the fp8 all-gather bit for bit (MX and NVFP4: every Linear's rows shard
    on a multiple of 32, so all are gathered as their casts)."""
    plain = spawn(w.gpt_fp8_gather, recipe)
    fp8 = spawn(w.gpt_fp8_gather, recipe + ",fp8_all_gather=true")
    assert fp8[0]["fp8"] == plain[0]["fp8"] > 0
    assert fp8[0]["hooked"] == fp8[0]["fp8"] and plain[0]["hooked"] == 0
    for a, b in zip(fp8, plain):
        assert a["losses"] == b["losses"]
        assert all(torch.equal(a["params"][k], b["params"][k]) for k in b["params"])


@pytest.mark.parametrize("parallel,recipe", [("ddp", "bf16"), ("fsdp", "fp8")])
@pytest.mark.parametrize("fast_rank", [0, 1])
def test_every_rank_takes_rank_0s_kernel_choices(parallel, recipe, fast_rank):
    """The two ranks measure opposite speeds (monkeypatched: one has bf16 units, the
    other none). Rank 0 decides: both emulate or neither, both run the same fp8 GEMM
    route and the same autocast around it, both checkpoints record rank 0's choices,
    and the replicas stay identical."""
    ranks = spawn(w.disagreeing_choices, recipe, parallel, fast_rank)
    fast = fast_rank == 0  # what rank 0 measured
    k0, k1 = ranks[0]["kernels"], ranks[1]["kernels"]
    assert k0.as_dict() == k1.as_dict()
    assert k0.source == "measured" and k1.source == "rank 0 (measured)"
    if recipe == "bf16":
        assert k0.emulate is (not fast)
    else:
        assert (k0.fp8_rest, k0.fp8_gemm) == (("bf16", "dequant") if fast
                                             else ("fp32", "dequant_fp32"))
        assert ranks[0]["routes"] == ranks[1]["routes"] == [k0.fp8_gemm]
    assert ranks[0]["autocast"] == ranks[1]["autocast"]
    assert ranks[0]["checkpoint"] == ranks[1]["checkpoint"] == k0.as_dict()
    for p, q in zip(ranks[0]["params"], ranks[1]["params"]):
        assert torch.equal(p, q)


def _one_process_windows(recipe, ends, world=2):
    """One process on the same micro-batches as ``accum_windows``' ranks: each window's
    rank-0 then rank-1 micro-batches, losses times ``world``, learning rate over
    ``world``, ``grad_accum_steps`` 4 x ``world`` (see ``train_reference``), on one
    thread as the ranks run."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _windows_on_one_thread(recipe, ends, world)
    finally:
        torch.set_num_threads(threads)  # the tests after this one run as they would alone


def _windows_on_one_thread(recipe, ends, world):
    model = w.make_mlp(seed=0)
    engine = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1 / world),
                            recipe, grad_accum_steps=4 * world)
    for (x, y), end in zip(w.make_data(len(ends)), ends):
        micro = [(xm, ym) for xs, ys in zip(x.chunk(world), y.chunk(world))
                 for xm, ym in list(zip(xs.chunk(4), ys.chunk(4)))[:end]]
        for i, (xm, ym) in enumerate(micro):
            with engine.autocast():
                loss = F.cross_entropy(model(xm), ym) * world
            engine.backward(loss, last=True if i == len(micro) - 1 < 7 else None)
            engine.step()
    return [p.detach().clone() for p in engine.master_params]


# fp32 keeps its gradients in .grad (no buffers): there the reducer, run on every
# micro-batch, rewrote the .grad in place, which the engine read as gradients cleared
# between micro-batches and refused; the buffered recipe compares with that behaviour.
# FSDP2 decides in its backward hooks: one reduce-scatter per window already
@pytest.mark.parametrize("parallel,recipe,tol,compare_old", [
    ("ddp", "fp32", 1e-5, False),
    ("ddp", "bf16-master", 1e-2, True),
    ("fsdp", "fp32", 1e-5, False),
])
def test_data_parallel_reduces_once_per_accumulation_window_and_at_an_early_end(
        parallel, recipe, tol, compare_old):
    # grad_accum_steps=4; the third window ends after 2 micro-batches (last=True)
    ends = [4, 4, 2, 4]
    new = spawn(w.accum_windows, recipe, parallel, ends)
    ref = _one_process_windows(recipe, ends)
    for r in new:
        # reductions after each micro-batch: one at each window's end
        assert r["calls"] == [0, 0, 0, 1, 1, 1, 1, 2, 2, 3, 3, 3, 3, 4]
        if parallel == "ddp":
            assert r["bytes"] == 4 * r["numel"] * r["dtype"].itemsize
        assert _max_rel(r["params"], ref) <= tol, _max_rel(r["params"], ref)
    if compare_old:  # every forward outside no_sync(): every micro-batch reduced
        old = spawn(w.accum_windows, recipe, parallel, ends, True)
        assert old[0]["calls"] == list(range(1, 15))
        assert _max_rel(new[0]["params"], old[0]["params"]) <= 1e-3, \
            _max_rel(new[0]["params"], old[0]["params"])
    for p, q in zip(new[0]["params"], new[1]["params"]):
        assert torch.equal(p, q)  # the early end reduced: replicas identical
