"""Importing mixprec prints nothing, and pulls in no peer it does not use: ``import
mixprec`` and each integration, each in a fresh interpreter, write nothing to stdout or
stderr and leave torchao unimported (transformers' own model code imports it where it
is installed: there the import stays quiet, and torchao is transformers' doing, as a
process that imports only transformers shows)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

#: each import path, and the framework it needs installed
#: (the Lightning integration imports the Fabric one)
PATHS = {"mixprec": None, "mixprec.workbench": None,
         "mixprec.integrations.lightning": "lightning",
         "mixprec.integrations.accelerate": "accelerate",
         "mixprec.integrations.transformers": "transformers"}


def _import(name: str, tmp_path) -> tuple[subprocess.CompletedProcess, list[str]]:
    """``import name`` in a fresh interpreter: what it printed, and which of torchao and
    transformers it left in ``sys.modules`` (written to a file, not printed)."""
    seen = tmp_path / "modules.json"
    code = (f"import {name}\nimport json, sys\n"
            f"open({str(seen)!r}, 'w').write(json.dumps(sorted(k for k in "
            "('torchao', 'transformers') if k in sys.modules)))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    return run, json.loads(seen.read_text())


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PATHS))
def test_an_import_of_mixprec_prints_nothing(name, tmp_path):
    if PATHS[name]:
        pytest.importorskip(PATHS[name])
    run, modules = _import(name, tmp_path)
    assert (run.stdout, run.stderr) == ("", ""), run.stderr[-2000:]
    if name != "mixprec.integrations.transformers":
        assert "torchao" not in modules
    if PATHS[name] is None:  # the core and its rooms: no framework at all
        assert modules == []


@pytest.mark.slow
def test_torchao_comes_with_transformers_model_code_not_with_mixprec(tmp_path):
    """Where torchao is installed, importing transformers' model code alone imports it
    (and, where its kernels do not load, logs so); mixprec's Trainer import brings no
    more than that, and prints none of it."""
    pytest.importorskip("transformers")
    if importlib.util.find_spec("torchao") is None:
        pytest.skip("torchao is not installed: nothing for transformers to import")
    alone, modules_alone = _import("transformers.modeling_utils", tmp_path)
    ours, modules_ours = _import("mixprec.integrations.transformers", tmp_path)
    assert "torchao" in modules_alone and modules_ours == modules_alone
    assert (ours.stdout, ours.stderr) == ("", "")
