"""The Python examples of the README and the manual (docs/) run as written, and the
values their comments state are the values they return. The blocks are fragments, each
page's in one namespace in reading order, so the test supplies what they leave to the
reader (a model, batches, ``x``)."""

from __future__ import annotations

import ast
import math
import os
import re
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from helpers.paths import ROOT

#: the README, then the manual's pages in reading order; a page's blocks run in one
#: namespace, in order (a later block uses what an earlier one defined)
PAGES = ["README.md", "docs/index.md", "docs/getting-started.md", "docs/concepts/fp32.md",
         "docs/concepts/formats.md", "docs/concepts/recipes.md", "docs/guides/your-loop.md",
         "docs/concepts/fp8.md", "docs/guides/memory.md", "docs/concepts/optimizer-states.md",
         "docs/guides/any-cpu.md", "docs/guides/distributed.md",
         "docs/guides/checkpoints.md", "docs/guides/schedules.md", "docs/guides/doctor.md",
         "docs/guides/plan.md",
         "docs/guides/workbench.md", "docs/benchmarks.md", "docs/guides/trainers.md",
         "docs/guides/lightning.md", "docs/guides/hf-trainer.md", "docs/guides/accelerate.md",
         "docs/guides/serve.md", "docs/guides/deepspeed.md", "docs/guides/compositions.md",
         "docs/troubleshooting.md",
         "docs/not-there-yet.md", "docs/development.md",
         "docs/reference/recipes.md", "docs/reference/formats.md", "docs/reference/cli.md",
         "docs/reference/api.md", "docs/changelog.md"]
PAGE_BLOCKS = {page: re.findall(r"```python\n(.*?)```", (ROOT / page).read_text(), re.S)
               for page in PAGES}
BLOCKS = [b for page in PAGES for b in PAGE_BLOCKS[page]]
# "expr   # 1.875", "expr  # tensor([inf, 0.])", "expr  # spacing there: tensor([2.])"
CLAIM = re.compile(r"^(?P<expr>\S.*?)\s{2,}# (?:[a-z ]+: )?"
                   r"(?P<value>tensor\(.*\)|[-+]?\d[\d.e+-]*)$")

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _namespace() -> dict:
    """What the fragments leave to the reader: a classifier, its batches, a tensor."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g))
               for _ in range(8)]

    def model_factory():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))

    def batch_fn(model, step):
        x, y = batches[step % len(batches)]
        return F.cross_entropy(model(x), y)

    return {"torch": torch, "F": F, "nn": nn, "mixprec": mixprec, "model": model_factory(),
            "MixedPrecision": mixprec.MixedPrecision,
            "batches": batches,
            "x": torch.randn(64, generator=g) * 300, "g": g, "sample_batch": batches[0][0],
            "model_factory": model_factory, "batch_fn": batch_fn}


def _trainer_block(b: str) -> bool:
    """A fragment for a trainer of the reader's own (a LightningModule and its loader, a
    Hugging Face model and dataset): compiled, not run here;
    tests/integrations/test_lightning.py and tests/integrations/test_hf_trainer.py run
    the integrations."""
    return "mixprec.integrations" in b


def _loads_sharded(block: str) -> bool:
    """A block that loads a model transformers shards across ranks as it loads
    (``distributed_config=``): tests/integrations/test_transformers_distributed.py runs
    those calls on two ranks."""
    return "distributed_config=" in block


def _single_process_blocks() -> list[str]:
    return [b for b in BLOCKS if "init_process_group" not in b and not _trainer_block(b)
            and not _loads_sharded(b)]


#: pages whose examples their own tests run (the MoE module of one's own in
#: tests/experts/test_experts.py) or that need several processes (the tensor-parallel
#: script; the expert-parallel one, in tests/experts/test_expert_parallel.py; the pipeline
#: script, which tests/parallel/test_pipeline.py runs under torchrun)
OWN_TESTS = ["docs/guides/moe.md", "docs/guides/tensor-parallel.md",
             "docs/guides/expert-parallel.md", "docs/guides/pipeline.md"]


def test_every_page_of_the_manual_is_read():
    pages = {str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md")}
    read = set(PAGES + OWN_TESTS) - {"README.md"}
    assert pages == read, pages ^ read


def test_the_readme_has_python_examples():
    trainer = [b for b in BLOCKS if _trainer_block(b)]
    sharded = [b for b in BLOCKS if _loads_sharded(b)]
    assert len(BLOCKS) >= 5 and len(_single_process_blocks()) == (
        len(BLOCKS) - 1 - len(trainer) - len(sharded))
    for b in trainer + sharded:
        compile(b, "README.md", "exec")  # at least valid Python


@pytest.mark.paths
def test_readme_examples_run_and_their_comments_hold(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the examples save checkpoints where they run
    checked = 0
    trained = None  # the engine of the training example (recipe="bf16-master")
    runnable = set(_single_process_blocks())
    for page, block in [(p, b) for p in PAGES for b in PAGE_BLOCKS[p]]:
        if block not in runnable:
            continue
        if block is PAGE_BLOCKS[page][0] or block == PAGE_BLOCKS[page][0]:
            ns = _namespace()  # each page starts from the reader's own model and data
        exec(compile(block, page, "exec"), ns)  # noqa: S102 - our own docs
        if trained is None and 'recipe="bf16-master"' in block:
            trained = ns["engine"]
        for line in block.splitlines():
            m = CLAIM.match(line)
            if m is None:
                continue
            got = eval(m["expr"], ns)  # noqa: S307 - our own README
            want = m["value"]
            if want.startswith("tensor("):
                assert str(got) == want, line
            else:
                assert math.isclose(float(got), float(want), rel_tol=1e-12), line
            checked += 1
    assert checked >= 4  # bf16's max, fp16 overflow/underflow, fp16's spacing, ZeRO-3 GB
    # the training example ran its recipe: fp32 masters of bf16 weights (real bf16
    # tensors, or under emulation fp32 tensors that hold bf16 values)
    assert str(trained.recipe) == "bf16-master" and trained.steps > 0
    assert trained.master_params[0].dtype == torch.float32
    w = trained.param_state.working[0].detach()
    assert w.dtype == (torch.float32 if trained.emulating else torch.bfloat16)
    assert torch.equal(w.float(), w.bfloat16().float())


def test_readme_data_parallel_example_runs_in_a_process_group():
    """The torchrun fragment, in a one-rank gloo group in a child process."""
    (block,) = [b for b in BLOCKS if "init_process_group" in b and not _loads_sharded(b)]
    script = textwrap.dedent("""
        import torch, torch.nn.functional as F
        import torch.distributed as dist
        from torch import nn
        import mixprec, mixprec.parallel.distributed
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
        x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    """) + block + textwrap.dedent("""
        assert engine.world_size == 1 and engine.steps == 1
        dist.destroy_process_group()
        print("ok")
    """)
    with socket.socket() as s:  # a free port for the rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0",
           "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


# --- the README as written: its blocks in a namespace of their own, then its one-liners

README = (ROOT / "README.md").read_text()


def _one_liners() -> list[str]:
    """The README's inline code that is one Python call (``mixprec.plan(model, ...)``),
    outside its code blocks, a span's line breaks taken as spaces."""
    prose = re.sub(r"```.*?```", "", README, flags=re.S)
    calls = []
    for span in re.findall(r"`([^`]+)`", prose):
        span = " ".join(span.split())
        try:
            (stmt,) = ast.parse(span).body
        except (SyntaxError, ValueError):
            continue
        if isinstance(getattr(stmt, "value", None), ast.Call):
            calls.append(span)
    return calls


def _quick_start_names() -> set[str]:
    """What the quick start binds (its imports, assignments and loop targets)."""
    tree = ast.parse("\n".join(PAGE_BLOCKS["README.md"]))
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)
             and isinstance(n.ctx, ast.Store)}
    return names | {a.asname or a.name.split(".")[0] for n in ast.walk(tree)
                    if isinstance(n, ast.Import | ast.ImportFrom) for a in n.names}


def _self_contained(span: str) -> bool:
    """A one-liner that runs after the quick start: every name it reads the quick start
    binds, and no ``...`` stands for an argument of the reader's own."""
    tree = ast.parse(span)
    read = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)
            and isinstance(n.ctx, ast.Load)}
    dots = any(isinstance(n, ast.Constant) and n.value is Ellipsis for n in ast.walk(tree))
    return not dots and read <= _quick_start_names()


ONE_LINERS = [s for s in _one_liners() if _self_contained(s)]
#: what each runnable one-liner returns, by the function it calls
RETURNS = {"mixprec.plan": lambda v: isinstance(v, mixprec.Plan),
           "mixprec.optim.adamw_for": lambda v: isinstance(v, torch.optim.Optimizer)}
#: the planner measures for real (about a minute on 2 cores): CI's long pass runs it, and
#: tests/planner/test_plan_progress.py runs the same call on faked timings in the fast pass
PLAN_MEASURES = pytest.mark.long


def _assigned(name: str):
    """The code of the quick start's expression assigned to ``name``, compiled."""
    tree = ast.parse(PAGE_BLOCKS["README.md"][0])
    value = next(n.value for n in tree.body if isinstance(n, ast.Assign)
                 and any(isinstance(t, ast.Name) and t.id == name for t in n.targets))
    return compile(ast.Expression(value), "README.md", "eval")


def _run_readme(tmp_path: Path) -> dict:
    """The README's blocks in order, in one namespace that starts empty, where they save."""
    ns: dict = {"__name__": "readme"}
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        for block in PAGE_BLOCKS["README.md"]:
            exec(compile(block, "README.md", "exec"), ns)  # noqa: S102 - our own README
    finally:
        os.chdir(cwd)
    return ns


def test_the_readme_runs_as_written(tmp_path):
    """The quick start needs nothing from the reader: its model, data and loop run, one
    update per batch, and what it saves and exports is there."""
    ns = _run_readme(tmp_path)
    engine, model = ns["engine"], ns["model"]
    assert engine.steps == len(ns["batches"]) == 10 and engine.skipped_steps == 0
    assert (tmp_path / "ckpt.pt").is_file()
    want = {k: v.shape for k, v in model.state_dict().items()}
    assert {k: v.shape for k, v in ns["weights"].items()} == want
    assert all(v.dtype == torch.float32 for v in ns["weights"].values())


def test_the_readme_one_liners_are_found():
    """Every call the README writes inline is either run below or leaves an argument to
    the reader (``...``, a trainer's objects), and the two library calls are run."""
    called = {ast.unparse(ast.parse(s).body[0].value.func) for s in ONE_LINERS}
    assert {"mixprec.plan", "mixprec.optim.adamw_for"} <= called, ONE_LINERS
    for span in _one_liners():
        compile(span, "README.md", "exec")


@pytest.mark.slow
@pytest.mark.parametrize("span", [pytest.param(s, marks=PLAN_MEASURES) if "mixprec.plan(" in s
                                  else s for s in ONE_LINERS])
def test_each_readme_one_liner_runs_after_the_quick_start(span, tmp_path):
    ns = _run_readme(tmp_path)
    if "mixprec.plan(" in span:  # "or let mixprec choose": the model as the README builds it,
        ns["model"] = eval(_assigned("model"), ns)  # noqa: S307 - before any engine owns it
    call = ast.parse(span).body[0]
    value = eval(compile(ast.Expression(call.value), "README.md", "eval"), ns)  # noqa: S307
    assert RETURNS[ast.unparse(call.value.func)](value), span
