"""The fp8 / fp4 Linear formats on torch's tensor-parallel plans (``parallelize_module``,
``mixprec.parallel.tensor_parallel``): gloo ranks spawned by the tests, one group for every
two-rank check and one for the four-rank FSDP x TP one."""

from __future__ import annotations

import math

import pytest
import torch

from helpers import tp_fp8_workers as w
from helpers.ranks import max_rel as _max_rel
from helpers.ranks import spawn_tp as spawn

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

STEPS = 3
#: exact dequantizing GEMM routes where a format has a choice, so that one process and
#: the shards differ only by the order of fp32 sums
PAIRS = ["fp8-current,fp8_gemm=dequant_fp32", "fp8,fp8_gemm=dequant_fp32",
         "fp8-rowwise,fp8_gemm=dequant_fp32", "mxfp8", "nvfp4,bf16_last_layers=0",
         "int8-rowwise"]
#: each format on a GEMM route that rounds its fp32 accumulator to bf16 once, as the
#: fp32 partial sums are (nvfp4: the head alone in 16 bits, the rowwise proj in nvfp4)
TRAINED = ["fp8-current,fp8_gemm=dequant_fp32", "fp8,fp8_gemm=dequant_fp32",
           "fp8-rowwise,fp8_gemm=dequant_fp32", "mxfp8", "nvfp4,bf16_last_layers=1",
           "int8-rowwise"]
#: the recipes as they come: this CPU's ``auto`` route and nvfp4's 16-bit proj
AS_GIVEN = ["fp8-current", "nvfp4"]
RUNS = [*((r, -1) for r in TRAINED + AS_GIVEN), ("fp8", 1), ("fp8-block", -1)]
#: the two reduce dtypes on a bf16 input under bf16 autocast
BF16_PAIRS = ["fp8-current,fp8_gemm=dequant_fp32",
              "fp8-current,fp8_gemm=dequant_fp32,tp_reduce=compute"]
SP_RUNS = [("fp8-current", True), ("fp8-current", False), ("mxfp8", True)]
#: the formats FSDP x TP trains on a 2 x 2 mesh
FSDP_TP = ["fp8-current,fp8_gemm=dequant_fp32", "mxfp8", "fp8-rowwise,fp8_gemm=dequant_fp32",
           "nvfp4"]
#: the local input of the sequence-parallel colwise Linear: 4 sequences, 3 of 6 tokens
SP_LOCAL = 4 * 3 * w.DIM


@pytest.fixture(scope="module")
def two():
    return spawn(w.tp_fp8, PAIRS, BF16_PAIRS, RUNS, SP_RUNS, STEPS, name="tp8")


@pytest.mark.parametrize("recipe", PAIRS)
def test_a_colwise_and_a_rowwise_shard_compute_what_one_process_does(two, recipe):
    """torch's ColwiseParallel then RowwiseParallel on quantized Linears (the plan
    applied first, then ``engine.convert``), one forward and backward in fp32 with an
    outlier in one rank's shard of each weight and one token: every weight and bias
    gradient equals one process's bit for bit, the output and the input's gradient to
    fp32 rounding (the shards sum in another order; measured <= 1.4e-7). Casting with
    each rank's own amaxes instead moves them by 1e-3 to 2e-1 (measured: per tensor,
    rowwise, int8 and NVFP4; MX's 1x32 blocks are local by design)."""
    one = two[0]["pairs"][recipe][1]  # rank 0 draws as one process does (rank 1 apart)
    for rank in two:
        tp = rank["pairs"][recipe][0]
        for key in one:
            if key in ("y", "dx"):
                assert _max_rel([tp[key]], [one[key]]) <= 1e-6, (key, recipe)
            else:
                assert torch.equal(tp[key], one[key]), (key, recipe)


@pytest.mark.parametrize("recipe", TRAINED)
def test_two_tp_ranks_train_the_gpt_block_like_one_process(two, recipe):
    """The GPT-style block (width 64) split by torch's plans trains as one process does
    to within 1e-2 after 3 SGD steps (measured <= 3.1e-7 on this CPU: a rowwise
    Linear's partial sums cross the ranks as fp32 and are rounded to bf16 once, as one
    process rounds its GEMM; summed in bf16 they ended 5.3e-3 (int8-rowwise), 1.3e-2
    (mxfp8) to 6.0e-2 (nvfp4) apart); each rowwise Linear's all-reduce carries fp32
    (2 Linears x 24 tokens x 64 x 4 bytes a step); the clip norms agree with one
    process's to 5e-3 and are the same on both ranks; no step is skipped; per-tensor
    formats all-reduce one fp32 amax per sharded cast (4 colwise Linears: weight,
    gradient; 2 rowwise: input, weight)."""
    ref = w.reference(recipe, STEPS)
    runs = [r["runs"][recipe, -1] for r in two]
    for got in runs:
        assert _max_rel(got["params"], ref["params"]) <= 1e-2, recipe
        assert got["norms"] == pytest.approx(ref["norms"], rel=5e-3)
        assert got["skipped"] == [False] * STEPS
        assert got["kept"] == {"head": "output head: the last Linear"}
        assert got["totals"][("all_reduce", "outputs", torch.float32)] == STEPS * 2 * 24 * 64 * 4
    assert runs[0]["norms"] == runs[1]["norms"]
    amax = runs[0]["totals"].get(("all_reduce", "amax", torch.float32), 0)
    if recipe.startswith(("fp8,", "fp8-current")):
        assert amax == STEPS * 12 * 4
    assert (amax > 0) == (recipe != "mxfp8")  # MX blocks along a cut K are local


@pytest.mark.parametrize("recipe", AS_GIVEN)
def test_two_tp_ranks_train_the_gpt_block_near_one_process_as_recipes_come(two, recipe):
    """The recipes as they come end within 5e-2 of one process (measured 3.0e-2
    fp8-current, 1.3e-2 nvfp4), not 1e-2, for reasons outside the fp32 partial sums:
    this CPU's ``auto`` route for fp8-current is the bf16 dequantizing GEMM, which in
    one process rounds its accumulator to bf16 before the scale and again after, while
    the shards round the fp32 sum once; nvfp4 keeps its last two Linears in 16 bits,
    among them the rowwise proj, whose partial sums torch reduces in bf16."""
    ref = w.reference(recipe, STEPS)
    for rank in two:
        got = rank["runs"][recipe, -1]
        assert _max_rel(got["params"], ref["params"]) <= 5e-2, recipe
        assert got["norms"] == pytest.approx(ref["norms"], rel=5e-3)


def test_a_rowwise_output_and_a_colwise_input_grad_are_summed_in_fp32(two):
    """A bf16 input under bf16 autocast through a colwise then a rowwise fp8 Linear
    (exact fp32 GEMM route): with ``tp_reduce=fp32`` the output and the input's
    gradient equal one process's on all but at most 8 of 4096 elements each (measured
    0: an fp32 sum in another order may land an ulp apart on another chip); the
    rowwise output's all-reduce and the colwise input gradient's carry fp32 (64 x 64 x
    4 bytes each). With ``tp_reduce=compute`` each rank's sum is rounded to bf16 first:
    at least 10% of the elements differ (measured 48% of the outputs, 32% of the
    input's gradient) and the output's all-reduce carries bf16, half the bytes."""
    fp32, compute = BF16_PAIRS
    for rank in two:
        for recipe, most in ((fp32, 8), (compute, None)):
            tp, one = rank["bf16"][recipe]
            for key in ("y", "dx"):
                assert tp[key].dtype == one[key].dtype == torch.bfloat16
                apart = (tp[key] != one[key]).sum().item()
                if most is not None:
                    assert apart <= most, (recipe, key, apart)
                else:
                    assert apart >= 0.1 * tp[key].numel(), (recipe, key, apart)
        totals = rank["bf16"][fp32][0]["totals"]
        assert totals[("all_reduce", "outputs", torch.float32)] == 64 * 64 * 4
        assert totals[("all_reduce", "input_grads", torch.float32)] == 64 * 64 * 4
        totals = rank["bf16"][compute][0]["totals"]
        assert totals[("all_reduce", "outputs", torch.bfloat16)] == 64 * 64 * 2
        assert not [k for k in totals if k[1] in ("input_grads",) or k[2] == torch.float32
                    and k[1] == "outputs"]


def test_a_rowwise_output_split_along_the_tokens_is_reduce_scattered_in_fp32(two):
    """The rowwise Linear's output reduce-scattered along the tokens (``RowwiseParallel(
    output_layouts=Shard(0))``, as before a sequence-parallel norm), bf16 input and
    autocast: each rank's tokens of the output equal one process's on all but at most
    8 elements (measured 0), the bias gradient (added after the sum, a partial sum over
    each rank's tokens) one process's to fp32 rounding, and the reduce-scatter carries
    fp32 (64 x 64 x 4 bytes of partial sums)."""
    for rank in two:
        tp, one = rank["split"]
        assert tp["y"].shape == (32, w.DIM) and tp["y"].dtype == torch.bfloat16
        assert (tp["y"] != one["y"]).sum().item() <= 8
        assert (tp["dx"] != one["dx"]).sum().item() <= 8
        assert _max_rel([tp["bias"]], [one["bias"]]) <= 1e-6
        assert tp["totals"][("reduce_scatter", "outputs", torch.float32)] == 64 * 64 * 4


def test_stochastic_rounding_draws_alike_on_tp_ranks_and_apart_on_dp_ranks(two):
    """NVFP4's stochastic rounding: the two ranks of a tensor-parallel pair, which round
    slices of one gradient, draw the same numbers (those one process draws); the same
    Linear on two ranks outside tensor parallelism (data-parallel replicas) draws
    different ones."""
    tp = [rank["draws"]["tp"] for rank in two]
    dp = [rank["draws"]["dp"] for rank in two]
    assert torch.equal(tp[0], tp[1])
    assert torch.equal(dp[0], tp[0])  # rank 0 draws what one process draws
    assert not torch.equal(dp[0], dp[1])


def test_a_linear_the_plan_leaves_whole_rounds_alike_on_tp_ranks_and_apart_on_dp_ranks(two):
    """NVFP4's stochastic rounding of a Linear the tensor-parallel plan leaves whole
    (after a colwise one whose output is gathered), under the engine: the two ranks see
    the same batch, so they draw the same numbers and its weight gradient is the same
    on both, bit for bit that of one process (rank 0 alone, which draws as one process
    does); the same Linear on two DDP ranks draws apart."""
    tp = [rank["whole"]["tp"] for rank in two]
    dp = [rank["whole"]["dp"] for rank in two]
    one = two[0]["whole"]["one"]
    for got in tp:
        assert torch.equal(got["draws"], one["draws"])
        assert torch.equal(got["grad"], one["grad"])
    assert torch.equal(dp[0]["draws"], one["draws"])
    assert not torch.equal(dp[0]["draws"], dp[1]["draws"])
    assert not torch.equal(two[1]["whole"]["one"]["draws"], one["draws"])  # rank 1's own


def test_an_inf_on_one_tp_rank_skips_the_fp8_step_on_every_rank(two):
    """Delayed fp8 with an inf in rank 1's shard of one gradient at step 1: both ranks
    skip it with a non-finite norm, and train on like one process that skipped it."""
    ref = w.reference("fp8", STEPS, inf_step=1)
    for rank in two:
        got = rank["runs"]["fp8", 1]
        assert got["skipped"] == [False, True, False]
        assert not math.isfinite(got["norms"][1])
        assert _max_rel(got["params"], ref["params"]) <= 5e-2
    assert two[0]["runs"]["fp8", 1]["norms"][2] == two[1]["runs"]["fp8", 1]["norms"][2]


def test_block_fp8_keeps_the_linears_whose_blocks_a_shard_cut_splits(two):
    """fp8-block (128-element blocks) at width 64 over 2 ranks: q, k, v and o, cut at
    32, run in 16 bits, each named with the reason in the report and in one warning;
    fc and proj (cut at 128) run fp8-block; the run trains."""
    got = two[0]["runs"]["fp8-block", -1]
    split = {n for n, why in got["kept"].items() if "128-element blocks" in why}
    assert split == {"q", "k", "v", "o"}
    for name in split:
        said = [m for m in got["warnings"] if m.startswith(f"fp8: {name} is kept in 16 bits")]
        assert len(said) == 1, (name, got["warnings"])
    assert all(math.isfinite(n) for n in got["norms"])


def test_sequence_parallel_gathers_fp8_codes_into_a_colwise_linear(two):
    """SequenceParallel before a colwise Linear: with ``QuantizedColwiseParallel``
    fp8-current gathers e4m3 codes (1 byte per element of each rank's 4 x 3 x 64 rows,
    recorded as an all-gather of activations) and trains bit for bit as torch's
    ColwiseParallel, whose gather of the norm's output the engine does not see; mxfp8
    casts its wgrad input along the tokens, so it gathers the norm's output as it is
    (2 or 4 bytes an element: 2 or 4 times the codes' bytes), with one recorded fallback
    and one warning. Either way the whole input's gradient is reduce-scattered back to
    the rows in fp32 and recorded. Each trains as one process does to 1e-2 (measured 1.1e-3
    fp8-current, 1.0e-7 mxfp8; 2.2e-2 and 7.2e-3 with the rowwise sums in bf16)."""
    for rank in two:
        codes, torch_plan, mx = (rank["sp"][k] for k in SP_RUNS)
        assert all(torch.equal(a, b) for a, b in zip(codes["params"], torch_plan["params"]))
        key = ("all_gather", "activations", torch.float8_e4m3fn)
        assert codes["totals"][key] == STEPS * SP_LOCAL
        assert not [k for k in torch_plan["totals"] if k[0] == "all_gather"]
        (_, _, wide), = [k for k in mx["totals"] if k[:2] == key[:2]]
        assert wide.itemsize in (2, 4)
        assert mx["totals"][(*key[:2], wide)] == wide.itemsize * STEPS * SP_LOCAL
        # the input's gradient, whole on each rank, reduce-scattered back to the rows
        # (in fp32 under tp_reduce=fp32), recorded for either gather
        for run in (codes, mx):
            assert run["totals"][("reduce_scatter", "input_grads", torch.float32)] == \
                4 * STEPS * 2 * SP_LOCAL
        assert [(f.what, f.asked) for f in mx["fallbacks"]] == [("activations:up", "mx")]
        assert sum("activations:up is communicated" in m for m in mx["warnings"]) == 1
        assert codes["fallbacks"] == []
    for recipe, quantized in SP_RUNS:
        ref, norms = w.sp_reference(recipe, STEPS)
        assert _max_rel(two[0]["sp"][recipe, quantized]["params"], ref) <= 1e-2


@pytest.mark.long  # four ranks, four formats: ~35 s on two cores
def test_fsdp_over_fp8_tp_on_a_2x2_mesh_and_a_resume_at_tp_1():
    """FSDP (dp=2) over TP (tp=2) on 4 ranks, fp8-current and fp8-rowwise (exact fp32
    GEMM route), mxfp8 and nvfp4 (stochastic rounding): within 1e-2 of one process
    accumulating the same two halves of each batch (measured <= 2.5e-7; 1.2e-2 mxfp8
    with the rowwise sums in bf16), nvfp4 within 1e-1 (9.2e-2: E2M1's steps are 4x
    E4M3's, its 16-bit proj is reduced in bf16 by torch, and each data-parallel rank
    rounds with its own random numbers, other noise than one process's; 1.25e-1 when
    both drew the same), the clip norm the same on every rank; a reshardable
    checkpoint saved halfway resumes at 2 x 2 bit for bit (nvfp4's rounding streams
    included), and at dp=4 x tp=1 (FSDP alone, another reduction order, batch split
    and rounding streams) within 5e-2 of the uninterrupted run (measured 2.8e-2,
    4.8e-3, 3.2e-4, 4.8e-2). NVFP4's two tensor-parallel ranks of a data-parallel rank
    draw the same rounding numbers, the two data-parallel ranks different ones."""
    ranks = spawn(w.fsdp_tp, FSDP_TP, 4, world=4, name="fsdptp8")
    for recipe in FSDP_TP:
        ref, _ = w.reference_halves(recipe, 4)
        for r in ranks:
            run = r[recipe]
            bound = 1e-1 if recipe.startswith("nvfp4") else 1e-2
            assert _max_rel(run["save"]["params"], ref) <= bound, recipe
            assert run["save"]["norms"] == ranks[0][recipe]["save"]["norms"]
            assert all(torch.equal(a, b) for a, b in zip(run["same"]["params"],
                                                         run["save"]["params"]))
            assert _max_rel(run["tp1"]["params"], run["save"]["params"]) <= 5e-2
    draws = [r["nvfp4"]["save"]["draws"] for r in ranks]  # ranks 2 * dp + tp
    assert torch.equal(draws[0], draws[1]) and torch.equal(draws[2], draws[3])
    assert not torch.equal(draws[0], draws[2])


def test_tp_reduce_is_a_layout_option_fp32_by_default():
    """``tp_reduce`` is a layout option of every recipe with a Linear format
    (``recipe.layout``): fp32 by default, ``compute`` by name in a recipe string
    (written back by ``str``); another value is refused naming it and the valid ones."""
    from mixprec.recipe import Recipe

    assert Recipe.parse("mxfp8").layout.tp_reduce == "fp32"
    r = Recipe.parse("fp8-current,tp_reduce=compute")
    assert r.layout.tp_reduce == "compute" and Recipe.parse(str(r)) == r
    with pytest.raises(ValueError, match=r"'tp_reduce': unknown value 'bf16'; valid: fp32, "
                                         r"compute"):
        Recipe.parse("nvfp4,tp_reduce=bf16")


@pytest.mark.parametrize("dim,cut", [(1, 0), (1, 1), (0, 1)])
def test_a_compiled_sharded_sr_cast_draws_the_whole_tensors_numbers_narrowed(dim, cut):
    """NVFP4's stochastic rounding from the counter stream (what a compiled backward
    draws), compiled (``aot_eager``, one graph): each half of a 32 x 64 gradient cut
    along ``cut`` and cast under its tensor-parallel ``Agreement`` (with the whole
    tensor's amax, as the ranks agree it) has the codes and scales of the whole
    tensor's cast with the same key, narrowed to that half: the draw is by each
    element's place in the whole tensor. Drawn by the place in the half instead, 28%
    to 32% of a half's codes differ (every half but a row cut's first, whose places
    are the whole's). A slice draws only its own numbers: ``counter_uniform`` of a
    16 x 32 block placed at (16, 32) in a 32 x 64 tensor is the whole draw's block."""
    from mixprec.formats.fp4 import cast_nvfp4, counter_uniform
    from mixprec.parallel.tensor_parallel import TPLayout
    from mixprec.parallel.tp_agree import Agreement

    g = torch.Generator().manual_seed(4)
    t = torch.randn(32, 64, generator=g) * torch.rand(32, 1, generator=g) * 10
    key, amax = torch.tensor(12345), t.abs().amax()
    assert torch.equal(counter_uniform(key, (16, 32), ((32, 64), (16, 32))),
                       counter_uniform(key, (32, 64))[16:, 32:])
    cast = torch.compile(lambda x, agree: cast_nvfp4(x, dim, generator=key, amax=amax,
                                                     agree=agree),
                         backend="aot_eager", fullgraph=True)
    whole = cast(t, None)
    size = t.shape[cut] // 2
    for offset in (0, size):
        layout = TPLayout(mesh=None, sharded=cut, offset=offset, full=t.shape[cut])
        got = cast(t.narrow(cut, offset, size), Agreement(layout, cut))
        assert torch.equal(got.codes.view(torch.uint8),
                           whole.codes.narrow(cut, offset, size).view(torch.uint8))
        assert torch.equal(got.scale_inv, whole.scale_inv.narrow(
            cut, offset * got.scale_inv.shape[cut] // size,
            got.scale_inv.shape[cut]))
