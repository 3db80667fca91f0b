"""The suite's options (``--path``, ``--long``), markers and fixtures, for every test
folder; the shared models and rank functions are in ``helpers/``."""

from __future__ import annotations

import multiprocessing
import os

import pytest
import torch

from mixprec.engine.devices import EMULATE_ENV

# Tests that need other processes (distributed ranks, runs killed with SIGKILL) fork them
# from a forkserver that has imported torch, mixprec and the child functions once. A
# child then starts in ~0.2 s instead of ~6 s of interpreter start and imports (torch's
# optimizers import torch._dynamo on construction, ~3 s), and is still a fresh process
# forked from a server that has run nothing. The server is single-threaded, so the fork
# is safe. The command-line and torchrun tests still start real interpreters.
multiprocessing.set_forkserver_preload(
    ["torch", "torch._dynamo", "torch.distributed.fsdp", "mixprec", "mixprec.workbench.train",
     "helpers.dist_workers", "helpers.tp_workers", "helpers.tp_fp8_workers",
     "helpers.tp_loop_workers", "helpers.pp_workers", "helpers.pp_ckpt_workers",
     "helpers.children"])


def pytest_addoption(parser):
    parser.addoption(
        "--path", choices=("auto", "real", "emulated"), default="auto",
        help="the 16-bit path every emulate=auto choice takes in this run and in the "
             "processes it starts: 'real' bf16/fp16 kernels, 'emulated' on fp32 kernels, "
             "or 'auto' (measured on this CPU). Sets MIXPREC_EMULATE.")
    parser.addoption(
        "--long", action="store_true", default=False,
        help="also run the tests marked `long` (many-step trainings and multi-rank "
             "cases; CI runs them in a pass of their own: `./dev test --long -m long`)")


def pytest_configure(config):
    # before any child process starts (the forkserver inherits the environment)
    path = config.getoption("--path")
    if path != "auto":
        os.environ[EMULATE_ENV] = "off" if path == "real" else "on"


def pytest_report_header(config):
    from mixprec.engine.devices import has_fast_kernels

    pinned = os.environ.get(EMULATE_ENV)
    real = has_fast_kernels("cpu", "bf16")
    return (f"mixprec 16-bit path: {'real kernels' if real else 'emulated'} "
            f"({EMULATE_ENV}={pinned})" if pinned else
            f"mixprec 16-bit path: {'real kernels' if real else 'emulated'} (measured, "
            f"{torch.backends.cpu.get_cpu_capability()})")


#: slow tests whose behaviour a faster test of the default suite also shows (another
#: recipe of the same check, a second compile, a second subprocess): CI's long pass runs
#: them, so ``./dev test`` keeps within about ten minutes
SLOW_DUPLICATES = {
    *(f"tests/engine/test_compile.py::test_inductor_compiles_every_recipe_in_one_graph[{r}]"
      for r in ("fp32", "bf16", "fp16", "fp8-current", "fp8-rowwise", "fp8-block", "mxfp8",
                "nvfp4,nvfp4_sr=false")),
    "tests/engine/test_compile.py::test_compiled_model_trains_like_eager_with_the_islands"
    "[fp8-rowwise]",
    "tests/engine/test_compile.py::test_wgrad_fp32_holds_under_compile",
    "tests/engine/test_compile.py::test_compiled_nvfp4_rounds_gradients_stochastically_in_the"
    "_graph",
    "tests/experts/test_experts_compile.py::test_a_transformers_moe_model_compiles_as_one"
    "_graph[fp8-current]",
    "tests/parallel/test_distributed.py::test_example_script_resumes_across_world_sizes_and"
    "_layouts",
    "tests/optim/test_optim_peak.py::test_the_step_peak_is_at_most_one_byte_per_parameter",
    "tests/optim/test_optim_peak.py::test_the_engines_step_on_an_embedding_stays_within_the"
    "_pieces_scratch",
    "tests/planner/test_plan_cli.py::test_compare_trains_a_plan_file_and_a_plan_made_now",
    "tests/docs/test_quiet_import.py::test_torchao_comes_with_transformers_model_code_not_with"
    "_mixprec",
    "tests/workbench/test_gpu_script.py::test_sigterm_mid_run_leaves_the_summary_and_names"
    "_what_did_not_run",
    "tests/workbench/test_workbench.py::test_bench_compile_times_each_recipe_compiled_and"
    "_torchaos_beside_fp8",
    "tests/workbench/test_workbench.py::test_sigkill_at_random_moments_then_resume_is_bit"
    "_identical[bf16]",
    "tests/workbench/test_workbench.py::test_report_renders_in_headless_chromium",
}


@pytest.hookimpl(tryfirst=True)  # before ``-m`` selects: ``-m long`` sees these marks
def pytest_collection_modifyitems(config, items):
    long = pytest.mark.skip(reason="a long test: run with --long (CI's own pass)")
    cuda = pytest.mark.skip(reason="needs a CUDA GPU; none on this machine")
    for item in items:
        if item.nodeid in SLOW_DUPLICATES:
            item.add_marker(pytest.mark.long)
        if "long" in item.keywords and not config.getoption("--long"):
            item.add_marker(long)
        if "cuda" in item.keywords and not torch.cuda.is_available():
            item.add_marker(cuda)


@pytest.fixture
def measured(monkeypatch):
    """No pinned path (``--path``): for tests of what ``auto`` measures and decides."""
    monkeypatch.delenv(EMULATE_ENV, raising=False)


@pytest.fixture
def gemm_timer(monkeypatch):
    """``gemm_timer(one_thread, loaded)``: the matmul timer of ``mixprec.engine.devices`` reads
    GFLOP/s by torch dtype, ``one_thread[dtype]`` on one thread and ``loaded[dtype]`` on
    two, as a multi-threaded GEMM does on a host whose other core is busy (it waits at
    its barriers). For bf16/fp16, ``one_thread`` may give a list of (rate, fp32's rate)
    rounds instead: each fp32 call reads the round of the dtype timed just before it.
    No path is pinned; the readings' caches are emptied before and after."""
    import itertools

    import mixprec.engine.devices as k

    def clear():
        for cached in (k.matmul_gflops, k._speed_reading, k._route_reading):
            cached.cache_clear()

    monkeypatch.delenv(EMULATE_ENV, raising=False)
    threads = torch.get_num_threads()
    clear()

    def set_rates(one_thread: dict, loaded: dict) -> None:
        fp32 = one_thread[torch.float32]
        rounds = {dt: iter(v) if isinstance(v, list) else itertools.repeat((v, fp32))
                  for dt, v in one_thread.items() if dt != torch.float32}
        last = [(fp32, fp32)]

        def timer(dev, dt, n, seconds):
            if torch.get_num_threads() > 1:
                return loaded[dt]
            if dt == torch.float32:
                return last[0][1]
            last[0] = next(rounds[dt])
            return last[0][0]

        monkeypatch.setattr(k, "_gflops", timer)
        torch.set_num_threads(2)

    yield set_rates
    torch.set_num_threads(threads)
    clear()
