"""torch.compile on the user's model, under the engine's precision context.

The context's FP32 islands are a TorchFunctionMode, which dynamo traces into the graph.
These tests use the ``aot_eager`` backend (dynamo + AOTAutograd, no code generation),
which is what the modes and autograd Functions interact with; inductor adds kernels.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers.models import mlp, tiny_gpt
from mixprec import MixedPrecision, Recipe

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


FRAMES: dict[str, int] = {}  # frames dynamo compiled in the last compiled run


@pytest.fixture(scope="module", autouse=True)
def _own_inductor_cache(tmp_path_factory):
    """These tests compile into a cache of their own. Inductor's on-disk cache is shared
    by every process of the machine, and code it cached under other CPU-capability
    settings (``ATEN_CPU_CAPABILITY``, ``ONEDNN_MAX_CPU_ISA``, which CI uses to mimic an
    AVX2 chip) was loaded under these and gave wrong losses."""
    mp = pytest.MonkeyPatch()
    mp.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path_factory.mktemp("inductor")))
    yield
    mp.undo()


def _losses(recipe, compiled, steps=3, islands=True, gpt=True):
    """Losses of a few steps: the tiny GPT, or an MLP whose LayerNorm gets bf16 input
    (there the islands change the numbers under every recipe)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    torch.manual_seed(0)
    idx = torch.randint(0, 64, (8, 33))
    x, y = torch.randn(16, 16), torch.randint(0, 4, (16,))
    model = tiny_gpt(seed=1) if gpt else mlp(seed=1)
    r = recipe if islands else recipe + ",keep_fp32=none"
    engine = MixedPrecision(model, torch.optim.AdamW(model.parameters(), lr=1e-3), r)
    f = torch.compile(model, backend=counter) if compiled else model
    out = []
    for _ in range(steps):
        with engine.autocast():
            loss = f(idx[:, :-1], idx[:, 1:]) if gpt else F.cross_entropy(f(x), y)
        engine.backward(loss)
        engine.step()
        out.append(loss.item())
    if compiled:
        FRAMES["frames"], FRAMES["emulating"] = counter.frame_count, engine.emulating
    return out


@pytest.mark.parametrize("recipe", ["bf16", "bf16-master", "fp8", "fp8-rowwise"])
def test_compiled_model_trains_like_eager_with_the_islands(recipe):
    """Before the islands kept only strings on the mode, dynamo failed building its
    guards (NameError: ___get_torch_function_mode_stack_at) for every recipe."""
    eager, compiled = _losses(recipe, False), _losses(recipe, True)
    assert compiled == pytest.approx(eager, rel=1e-5)
    # frames really were compiled (under emulation, whose dispatch mode dynamo does not
    # trace, none are: the run is eager, as the manual's not-there-yet page says)
    if FRAMES["emulating"]:
        assert FRAMES["frames"] == 0
    else:
        assert FRAMES["frames"] >= 1
    from mixprec.engine.context import autocast_dtype

    if autocast_dtype(Recipe.parse(recipe), "cpu") is None:
        return  # fp8 on a chip without fast bf16: its other layers run in fp32, no islands
    # the islands are in the compiled graph: without them the losses move by more
    eager, compiled = _losses(recipe, False, gpt=False), _losses(recipe, True, gpt=False)
    without = _losses(recipe, False, islands=False, gpt=False)
    assert max(abs(a - b) for a, b in zip(without, eager)) > 10 * max(
        abs(a - b) for a, b in zip(compiled, eager))


def test_wgrad_fp32_holds_under_compile():
    """The fp32 weight-gradient Functions run eagerly (graph breaks) under compile, so
    4 micro-batches of 2 still equal one batch of 8 to fp32 tolerance."""
    idx = torch.randint(0, 64, (8, 33))
    x, y = idx[:, :-1], idx[:, 1:]

    def grads(accum):
        torch._dynamo.reset()
        model = tiny_gpt(seed=3)
        engine = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.0),
                                "bf16-master,wgrad=fp32", grad_accum_steps=accum)
        f = torch.compile(model, backend="aot_eager")
        n = 8 // accum
        for i in range(0, 8, n):
            with engine.autocast():
                loss = f(x[i:i + n], y[i:i + n])
            engine.backward(loss)
        names = [k for k, _ in model.named_parameters()]
        return dict(zip(names, (g.clone() for g in engine.param_state.gradients()), strict=True))

    a, b = grads(4), grads(1)
    del a["pos.weight"], b["pos.weight"]  # reduced over the batch in bf16 by the model
    for k in a:
        assert ((a[k] - b[k]).norm() / b[k].norm()) < 1e-6, k


# --- inductor: the real kernels, fused -------------------------------------------------

#: every recipe with real kernels (``emulate=false`` pins them on any chip). NVFP4's
#: stochastic rounding of the gradients has its own test below.
INDUCTOR_RECIPES = ["fp32", "bf16", "bf16-master", "fp16", "fp8", "fp8-current",
                    "fp8-rowwise", "fp8-block", "mxfp8", "nvfp4,nvfp4_sr=false"]


def _stack(seed: int = 1) -> torch.nn.Module:
    """Three Linears with a LayerNorm: fp8 recipes convert the first two (the head stays),
    nvfp4 the first one (its last two stay in bf16)."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.LayerNorm(64),
                               torch.nn.GELU(), torch.nn.Linear(64, 32), torch.nn.GELU(),
                               torch.nn.Linear(32, 16))


def _inductor_losses(recipe: str, compiled: bool, steps: int = 3):
    """Losses of ``steps`` steps on 30 tokens (not a multiple of 16), and what dynamo
    counted: graph breaks by reason, graphs compiled."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(30, 32, generator=g), torch.randint(0, 16, (30,), generator=g)
    model = _stack()
    engine = MixedPrecision(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                            recipe + ",emulate=false")
    f = torch.compile(model) if compiled else model
    out = []
    for _ in range(steps):
        with engine.autocast():
            loss = F.cross_entropy(f(x).float(), y)
        engine.backward(loss)
        engine.step()
        out.append(loss.item())
    converted = sum(type(m).__name__ == "Float8Linear" for m in model.modules())
    FRAMES["model"] = model
    return out, dict(counters["graph_break"]), counters["stats"]["unique_graphs"], converted


@pytest.mark.slow
@pytest.mark.parametrize("recipe", INDUCTOR_RECIPES)
def test_inductor_compiles_every_recipe_in_one_graph(recipe):
    """Forward and backward (the quantizers' amax, scale and cast, the GEMM routes) are
    one graph with no break, and 3 steps stay within 1e-5 of eager. Inductor is asked to
    round where eager rounds (``emulate_precision_casts``); without it, fusing the bf16
    roundings of neighbouring ops away moves bf16-master's loss by ~2e-5."""
    import torch._inductor.config as inductor

    with inductor.patch(emulate_precision_casts=True):
        eager, _, _, converted = _inductor_losses(recipe, False)
        compiled, breaks, graphs, _ = _inductor_losses(recipe, True)
    assert breaks == {}
    assert graphs == 1  # frames were compiled: one graph holds the whole forward
    assert converted == (0 if recipe.startswith(("fp32", "bf16", "fp16")) else
                         1 if recipe.startswith("nvfp4") else 2)
    assert compiled == pytest.approx(eager, rel=1e-5)


def test_compiled_exact_routes_warn_once_when_fp32_matmul_is_not_ieee(monkeypatch):
    """A graph cannot switch the fp32 matmul precision: under "medium" the exact routes
    say, once, that compiled GEMMs follow it; under "highest" nothing is said."""
    import warnings

    from mixprec.engine import fp32_precision
    from mixprec.modules.linear import Float8Linear

    monkeypatch.setattr(fp32_precision, "_WARNED_COMPILE", [])
    lin = Float8Linear.from_linear(torch.nn.Linear(32, 32), "fp8-block")
    x = torch.randn(16, 32, requires_grad=True)

    def run(precision):
        torch._dynamo.reset()
        saved = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision(precision)
        try:
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                f = torch.compile(lin, backend="aot_eager")
                for _ in range(2):
                    f(x).sum().backward()
        finally:
            torch.set_float32_matmul_precision(saved)
        return [w for w in seen if "matmul precision" in str(w.message)]

    assert run("highest") == []
    assert len(run("medium")) == 1
    assert run("medium") == []  # once per process


def test_compile_under_emulation_warns_once_that_it_compiles_nothing(monkeypatch):
    """Dynamo runs code under a dispatch mode eagerly: the user is told once, not left
    to wonder why the compiled model is no faster."""
    import warnings

    from mixprec.engine import emulate

    monkeypatch.setattr(emulate, "_WARNED_COMPILE", [])
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    counter = CompileCounter()
    model = tiny_gpt(seed=1)
    engine = MixedPrecision(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                            "bf16,emulate=true")
    f = torch.compile(model, backend=counter)
    idx = torch.randint(0, 64, (4, 17))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(2):
            with engine.autocast():
                loss = f(idx[:, :-1], idx[:, 1:])
            engine.backward(loss)
            engine.step()
    said = [w for w in seen if "compiles nothing under emulation" in str(w.message)]
    assert counter.frame_count == 0 and len(said) == 1
    # eager under emulation says nothing
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        emulate._WARNED_COMPILE.clear()
        with engine.autocast():
            loss = model(idx[:, :-1], idx[:, 1:])
    assert not [w for w in seen if "compiles nothing" in str(w.message)]


def _counter_generator(self, device):
    """Eager twin of the compiled stream: the key ``_compiled_sr_key`` makes."""
    rng = self.nvfp4_rng
    key = rng[0] * 1_000_003 + rng[1]
    rng[1:] += 1
    return key


@pytest.mark.slow
def test_compiled_nvfp4_rounds_gradients_stochastically_in_the_graph(monkeypatch):
    """A compiled backward cannot make a generator: NVFP4's stochastic rounding draws
    from the counter stream keyed by ``nvfp4_rng``, in the one graph, and advances the
    count there. Eager on the same stream gives the same 3 steps (1e-5), and the buffer
    advances by one per backward in both, so a checkpoint resumes either way."""
    import torch._inductor.config as inductor

    from mixprec.modules.linear import Float8Linear

    def rng():
        return [m.nvfp4_rng.tolist() for m in FRAMES["model"].modules()
                if hasattr(m, "nvfp4_rng")]

    with inductor.patch(emulate_precision_casts=True):
        compiled, breaks, graphs, _ = _inductor_losses("nvfp4", True)
        compiled_rng = rng()
        monkeypatch.setattr(Float8Linear, "_sr_generator", _counter_generator)
        eager, _, _, converted = _inductor_losses("nvfp4", False)
    assert breaks == {} and graphs == 1 and converted == 1
    assert compiled == pytest.approx(eager, rel=1e-5)
    assert compiled_rng == rng() and compiled_rng[0][1] == 3  # one per backward
    monkeypatch.undo()
    generator = _inductor_losses("nvfp4", False)[0]  # eager's own stream: other bits
    assert generator[0] == eager[0] and generator[1:] != eager[1:]
