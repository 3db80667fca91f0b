"""The manual in docs/: its generated references match the code, its API page covers
every public name, the troubleshooting page has an entry per doctor finding code, and
the tree speaks of the product only."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.paths import DOCS, ROOT
from helpers.source import modules_with_all


def _api_modules() -> list[str]:
    return re.findall(r"(?m)^::: (\S+)", (DOCS / "reference" / "api.md").read_text())


def test_generated_reference_pages_match_the_code():
    sys.path.insert(0, str(DOCS))
    try:
        gen = importlib.import_module("gen_reference")
    finally:
        sys.path.remove(str(DOCS))
    for name, make in gen.PAGES.items():
        have = (DOCS / "reference" / name).read_text()
        assert have == make(), (f"docs/reference/{name} is stale: run "
                                "python docs/gen_reference.py")


def test_every_public_module_is_on_the_api_page():
    listed = set(_api_modules())
    missing = [m for m in modules_with_all() if m not in listed]
    assert not missing, f"add '::: NAME' to docs/reference/api.md for {missing}"


def test_the_api_page_renders_every_public_name(tmp_path):
    """mkdocs build --strict, then each module's ``__all__`` names are anchors on the
    API page (re-exports under their home module's name)."""
    import os

    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings")
    built = os.environ.get("MIXPREC_DOCS_SITE")  # .ci/run built it --strict already
    site = Path(built) if built and (Path(built) / "reference").is_dir() else None
    if site is None:
        site = tmp_path / "site"
        run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q",
                              "-d", str(site)], cwd=ROOT, capture_output=True, text=True,
                             timeout=300, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
        assert run.returncode == 0, run.stderr[-3000:]
    html = (site / "reference" / "api" / "index.html").read_text()
    ids = set(re.findall(r'id="(mixprec[\w.]*)"', html))
    missing = []
    for m in _api_modules():
        mod = importlib.import_module(m)
        for n in getattr(mod, "__all__", []):
            if n.startswith("__"):
                continue
            obj = getattr(mod, n)
            home = getattr(obj, "__name__", None) if isinstance(obj, type(mod)) else None
            where = {f"{m}.{n}", home, f"{getattr(obj, '__module__', '')}.{n}"}
            # a package's lazy re-export, rendered where a page module exports it
            where |= {f"{o}.{n}" for o in _api_modules()
                      if n in getattr(importlib.import_module(o), "__all__", ())}
            if not where & ids:
                missing.append(f"{m}.{n}")
    assert not missing, f"not on the API page: {missing}"


def test_every_doctor_finding_code_has_a_troubleshooting_entry():
    from mixprec.diagnostics.findings import CODES

    page = (DOCS / "troubleshooting.md").read_text()
    entries = re.findall(r"(?m)^### `([a-z0-9-]+)`", page)
    assert sorted(entries) == sorted(CODES), (set(CODES) ^ set(entries))
    for code in entries:  # each entry: symptom, cause, what to change, the command
        body = page.split(f"### `{code}`", 1)[1].split("\n### ", 1)[0]
        for part in ("**Symptom:**", "**Cause:**", "**Change:**", "**Shows it:**"):
            assert part in body, (code, part)
    # every code the source emits is registered (Finding() also refuses others)
    used = set()
    for p in (ROOT / "src" / "mixprec").rglob("*.py"):
        used |= set(re.findall(r'Finding\(\s*(?:"\w+"|sev)\s*,\s*"([a-z0-9-]+)"',
                               p.read_text()))
    assert used and used <= set(CODES), used - set(CODES)


def test_a_finding_with_an_unknown_code_is_refused():
    from mixprec.diagnostics.findings import Finding

    with pytest.raises(ValueError, match="'no-such-code' is not in .*CODES"):
        Finding("warning", "no-such-code", "t", "e", "a")


# words about how the project was made, which users cannot follow (split so that this
# file does not match itself)
_HISTORY = re.compile("|".join([
    r"\bsess" r"ions?\b", r"\biss" r"ues? ?#?\d", r"\biss" r"ue's", r"\bthe iss" r"ue\b",
    r"\bse" r"ed 0\d\d", r"\bse" r"eds'", r"\bthe se" r"ed's", r"\bse" r"ed documents?",
]), re.I)


def test_the_tree_speaks_of_the_product_only():
    files = subprocess.run(["git", "ls-files", "--cached", "--others",
                            "--exclude-standard"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.split()
    hits = []
    for f in files:
        p = ROOT / f
        if not p.is_file() or p.suffix in (".png", ".svg", ".pt") or "egg-info" in f:
            continue
        for i, line in enumerate(p.read_text(errors="replace").splitlines(), 1):
            if _HISTORY.search(line):
                hits.append(f"{f}:{i}: {line.strip()[:100]}")
    assert not hits, "\n".join(hits)
