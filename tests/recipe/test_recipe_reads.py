"""mixprec's own code reads a recipe through its configs (``recipe.precision.compute``,
``recipe.loss.init_scale``, ``recipe.optim.states``); the flat read-only conveniences
(``recipe.compute``, ``recipe.loss_scale``, ...) are for users.

Two checks: engines built and stepped under a spread of recipes with every convenience
recording who reads it (a reader in a ``mixprec.`` module outside ``mixprec.recipe`` is a
violation), and a scan of the source for ``<recipe name>.<convenience>``.
"""

from __future__ import annotations

import ast
import dataclasses
import io
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import mixprec
import mixprec.optim
from helpers.models import mlp
from mixprec import MixedPrecision, Recipe
from mixprec.memory import estimate
from mixprec.recipe.configs import LossScale, OptimStates, Precision

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

#: every flat convenience and the composed path it stands for
FLAT = {**{f.name: f"precision.{f.name}" for f in dataclasses.fields(Precision)},
        **{f.name: f"loss.{f.name}" for f in dataclasses.fields(LossScale)
           if f.name != "kind"},
        **{f.name: f"optim.{f.name}" for f in dataclasses.fields(OptimStates)},
        "loss_scale": "loss.kind"}

#: the names mixprec's code conventionally gives a recipe
RECIPE_NAMES = {"recipe", "r", "rec", "base", "held", "saved", "self.recipe",
                "engine.recipe", "self.engine.recipe", "param_state.recipe",
                "self.param_state.recipe", "parts.recipe"}

SRC = Path(mixprec.__file__).parent


def test_the_conveniences_are_the_configs_fields():
    """Each flat convenience reads the field it names, on a recipe where every one of
    them differs from its default."""
    r = Recipe.parse("fp16-master,grad_accum=kahan,wgrad=fp32,grads=fp32,comm=fp16,"
                     "keep_fp32=softmax,emulate=true,init_scale=512,growth_factor=4,"
                     "backoff_factor=0.25,growth_interval=7,hysteresis=3,min_scale=2,"
                     "max_scale=4096,skip_limit=9,on_skip_limit=raise")
    expect = {"compute": "fp16", "params": "fp16", "master": "fp32", "grads": "fp32",
              "grad_accum": "kahan", "wgrad": "fp32", "comm": "fp16",
              "keep_fp32": ("softmax",), "emulate": True, "loss_scale": "dynamic",
              "init_scale": 512.0, "growth_factor": 4.0, "backoff_factor": 0.25,
              "growth_interval": 7, "hysteresis": 3, "min_scale": 2.0, "max_scale": 4096.0,
              "skip_limit": 9, "on_skip_limit": "raise", "states": "fp32",
              "write": "nearest"}
    assert set(expect) == set(FLAT)
    for name, path in FLAT.items():
        config, field = path.split(".")
        assert getattr(r, name) == getattr(getattr(r, config), field) == expect[name], name
        assert isinstance(getattr(Recipe, name), property)
        assert "convenience" in getattr(Recipe, name).__doc__


@pytest.fixture
def readers(monkeypatch):
    """Every flat convenience of Recipe patched to record the module, file and line of
    each reader in mixprec outside mixprec.recipe; the records."""
    seen: list[tuple[str, str, int, str]] = []

    def recording(name: str, original: property) -> property:
        def get(self):
            caller = sys._getframe(1)
            module = caller.f_globals.get("__name__", "")
            if module.startswith("mixprec.") and not (
                    module == "mixprec.recipe" or module.startswith("mixprec.recipe.")):
                seen.append((module, caller.f_code.co_filename, caller.f_lineno, name))
            return original.fget(self)
        return property(get)

    for name in FLAT:
        monkeypatch.setattr(Recipe, name, recording(name, getattr(Recipe, name)))
    return seen


def _train(recipe: str, steps: int = 2, parallel: str | None = None) -> None:
    """An engine under ``recipe`` built, stepped, saved, restored and estimated."""
    r = Recipe.parse(recipe)
    model = mlp()
    opt = (mixprec.optim.adamw_for(r, model.named_parameters(), lr=1e-3)
           if r.needs_mixprec_optim else torch.optim.AdamW(model.parameters(), lr=1e-3))
    engine = MixedPrecision(model, opt, r, grad_accum_steps=2, max_grad_norm=1.0,
                            parallel=parallel)
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        for _ in range(2):
            x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)
            with engine.autocast():
                loss = nn.functional.mse_loss(engine.model(x).float(), y)
            engine.backward(loss)
        engine.step()
    str(engine.coverage)
    buf = io.BytesIO()
    torch.save(engine.state_dict(), buf)
    buf.seek(0)
    engine.load_state_dict(torch.load(buf, weights_only=False))
    engine.fp32_state_dict()
    engine.close()
    estimate(mlp(), r)
    estimate("1B", r, zero_stage=1, world_size=2)


@pytest.mark.parametrize("recipe", [
    "bf16-master",
    "fp16-master,init_scale=1024,growth_interval=1",
    "fp16,grad_accum=kahan",
    "fp8",
    "fp8-rowwise",
    "bf16,params=bf16,write=stochastic,states=int8,states:0=fp32",
    "bf16,wgrad=fp32,keep_fp32=layer_norm+attention_backward",
])
def test_engine_steps_read_the_recipe_through_its_configs(readers, recipe):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _train(recipe)
    assert not readers, "flat recipe conveniences read inside mixprec:\n" + "\n".join(
        f"{f}:{line} ({m}) reads .{name}" for m, f, line, name in sorted(set(readers)))


def test_a_ddp_engine_reads_the_recipe_through_its_configs(readers):
    """One rank of gloo data parallel: the comm hook and its dtypes."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _train("bf16-master,comm=bf16", parallel="ddp")
            _train("bf16,params=bf16,write=stochastic,states=int8", parallel="ddp")
    finally:
        dist.destroy_process_group()
    assert not readers, "flat recipe conveniences read inside mixprec:\n" + "\n".join(
        f"{f}:{line} ({m}) reads .{name}" for m, f, line, name in sorted(set(readers)))


def test_the_recorder_sees_a_reader_in_mixprec(readers):
    """The recording catches what it is meant to: a flat read from a mixprec module."""
    code = compile("def read(r):\n    return r.compute\n", "<mixprec.fake>", "exec")
    space = {"__name__": "mixprec.engine.fake"}
    exec(code, space)
    assert space["read"](Recipe.parse("bf16")) == "bf16"
    Recipe.parse("bf16").compute  # noqa: B018  (a user's read is not recorded)
    assert [(m, n) for m, _, _, n in readers] == [("mixprec.engine.fake", "compute")]


def _flat_reads(tree: ast.AST) -> list[tuple[int, str]]:
    """``(line, "<name>.<convenience>")`` for each read of a convenience on a
    conventional recipe name, except where a loop, comprehension or lambda binds that
    name to something else (``for r in self.rows``: a table's rows)."""
    rebound = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.For):
            names, scope = _bound(node.target), node.body
        elif isinstance(node, (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)):
            names = set().union(*(_bound(g.target) for g in node.generators))
            scope = [node]
        elif isinstance(node, ast.Lambda):
            names, scope = {a.arg for a in node.args.args}, [node.body]
        else:
            continue
        rebound |= {id(n) for s in scope for n in ast.walk(s)
                    if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
                    and n.value.id in names}
    return [(n.lineno, f"{ast.unparse(n.value)}.{n.attr}") for n in ast.walk(tree)
            if isinstance(n, ast.Attribute) and n.attr in FLAT and id(n) not in rebound
            and ast.unparse(n.value) in RECIPE_NAMES]


def _bound(target: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}


def test_the_scan_finds_flat_reads():
    found = _flat_reads(ast.parse("a = recipe.compute + r.loss_scale\n"
                                  "b = self.recipe.precision.compute, x.compute, r.kind\n"
                                  "c = sum(r.params for r in rows), self.recipe.states\n"
                                  "for r in rows:\n    print(r.params)\n"
                                  "d = sorted(rows, key=lambda r: r.params)\n"))
    assert sorted(found) == [(1, "r.loss_scale"), (1, "recipe.compute"),
                             (3, "self.recipe.states")]


def test_no_flat_recipe_reads_in_the_source():
    """No module outside mixprec/recipe reads ``<recipe>.<convenience>``; inside it, only
    the rule checks on a LossScale (``check_loss_numbers``'s ``r``) do."""
    bad = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        if rel == "recipe/configs.py":  # the configs' own fields
            continue
        for line, text in _flat_reads(ast.parse(path.read_text())):
            if rel == "recipe/rules.py" and _in_function(path, line, "check_loss_numbers"):
                continue
            base, attr = text.rsplit(".", 1)
            bad.append(f"src/mixprec/{rel}:{line}: {text} (read {base}.{FLAT[attr]})")
    assert not bad, "flat recipe conveniences read in mixprec's source:\n" + "\n".join(bad)


def _in_function(path: Path, line: int, name: str) -> bool:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return node.lineno <= line <= node.end_lineno
    return False
